// Python bindings of paged attention and reshape_and_cache: argument checks, work split, ISA choice.
//
// Batch invariance: a query row's output depends only on its sequence's keys, its position, its query and whether
// it is a prompt row (position < the sequence's prompt length, when prompt_lens is given), never on the other rows
// of the step, how many rows its sequence has (decode, speculative verification, prefill chunk) or the thread
// count. Every row's keys are cut into partitions at fixed offsets (0, kPartition, 2 kPartition, ...);
// each partition is an online softmax of its own (a kernel call with AttnItem::part set) and the partitions are
// folded left to right by fold_partition, then normalised. Which thread computes a partition and whether the
// partitions of a group run as separate tasks (flash-decoding, when there are too few groups to keep the threads
// busy) or one after the other in one task changes nothing in that sequence of operations. Within a partition
// the kernels walk keys in tiles at fixed offsets, and a row's arithmetic does not depend on the rows beside it.
//
// Work: groups (sequence, KV head, tile of query tokens; generated rows' groups span several KV heads where their
// kernel takes them: AttnItem::nkvh); tasks are claimed dynamically from an atomic counter, largest first, by the
// threads of parallel_for (parallel.h); the last partition of a split group to finish folds them all. A thread
// starting task i asks for the first K tile of task i + threads (likely its next) into L2 (KvRowsAhead).
//
// Sliding window (Gemma 3's local layers, sliding_window = W > 0): the row at position p sees keys p - W < j <= p.
// Its group holds that one token (its G query heads), so the window's first key is the group's k0 and no kernel
// needs a per-row lower bound; partitions still sit at multiples of kPartition (the first starts at k0), so a
// row's arithmetic stays independent of the batch.
//
// Soft-capping (Gemma 2, softcap = c > 0): each score s (scale included) becomes c * tanh(s / c) before the softmax,
// in the fp32 kernels (generic, avx2, avx512); a soft-capped call never takes the bf16 dot-product kernels.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "parallel.h"
#include "attention_kernels.h"
#include "dispatch.h"
#include "ops.h"
#include "registry.h"

namespace pdserve {
namespace {

struct Group {
  AttnItem whole;   // the group's rows against all their keys [whole.k0, whole.k1)
  bool prompt;      // its rows are prompt rows (position < the sequence's prompt length): prompt_kernel
  int nparts;       // key partitions: those of [0, whole.k1) that hold a key >= whole.k0
  bool split;       // partitions run as separate tasks into part
  float* part;      // split groups: nparts partial results of part_floats each
  int64_t part_floats;
};

struct Task {
  AttnItem item;
  int32_t group;
  int64_t cost;
};

// Generated rows (decode, speculative verification) of bf16 caches take the bf16 dot-product kernels (levels
// avx512_bf16 and amx) from this many query heads per KV head on; below it the fp32 kernel (avx512), which reads bf16
// rows in place and walks several KV heads per item (AttnItem::nkvh). 0: the level's own threshold. AMX multiplies
// blocks of 16 rows, so a decode item (G rows) pays for 16: below G = 4 the fp32 kernel is faster there
// (Sapphire Rapids), except at G = 1, where the avx512_bf16 rows kernel is (with the level's own threshold; it
// measured faster than the fp32 kernel at G = 1 only, BENCHMARKS.md). At
// avx512_bf16 generated rows take vdpbf16ps at every G: below kDotTileMinGroup in the fp32 kernel's walk
// (attention_avx512bf16_rows.cpp: rows as stored, several KV heads per item), from it in transposed key tiles shared
// by the G rows (attention_avx512bf16.cpp); on Zen 4 the transposing kernel lost to the fp32 one at
// G = 1-7 and the rows kernel beat both (BENCHMARKS.md). Prompt rows (pick_prompt_kernel) run the tile kernel of
// either level at every G. The choice depends on the model's shape and the CPU only, so every row of a model still
// runs one arithmetic; change it only before serving (a row's bits depend on it).
std::atomic<int64_t> g_bf16_min_group{0};
constexpr int64_t kDotTileMinGroup = 8;

int64_t bf16_min_group(Isa level) {
  const int64_t g = g_bf16_min_group.load(std::memory_order_relaxed);
  if (g > 0) return g;
  return level == Isa::kAmx ? 4 : 1;
}

// Quantized caches (int8, fp8) run the fp32 kernels (rows dequantized per key tile): the bf16 dot-product levels
// (avx512_bf16, amx) take bf16 caches only, so on those CPUs int8/fp8 dispatch to the avx512 kernel.
AttnFn pick_kernel(int64_t d, KVFormat fmt, int64_t group, bool softcap) {
  static const IsaTable<AttnFn> f32 = {
      {Isa::kGeneric, attn_item_generic},
      PDSERVE_X86({Isa::kAvx2, attn_item_avx2}, {Isa::kAvx512, attn_item_avx512})};
  static const IsaTable<AttnFn> bf16 = {
      {Isa::kGeneric, attn_item_generic},
      PDSERVE_X86({Isa::kAvx2, attn_item_avx2}, {Isa::kAvx512, attn_item_avx512},
                  {Isa::kAvx512Bf16, attn_item_avx512bf16}, {Isa::kAmx, attn_item_amx})};
  if (d == 256) return f32.pick();                     // Gemma: the fp32 kernels (bf16 caches widened per tile)
  if (d != 64 && d != 128) return attn_item_generic;  // the vector kernels take these head sizes
  // soft-capped scores (Gemma 2): the fp32 kernels, which apply the cap to each tile's scores
  if (fmt != KVFormat::kBF16 || softcap) return f32.pick();
  const AttnFn fn = bf16.pick();
  if (group < bf16_min_group(bf16.level())) {
#if defined(__x86_64__)
    if (fn == attn_item_amx && group == 1 && g_bf16_min_group.load(std::memory_order_relaxed) == 0)
      return attn_item_avx512bf16_rows;
#endif
    return f32.pick();
  }
#if defined(__x86_64__)
  if (fn == attn_item_avx512bf16 && group < kDotTileMinGroup) return attn_item_avx512bf16_rows;
#endif
  return fn;
}

// The kernel of prompt rows (a row whose position is below its sequence's prompt length, paged_attention's
// prompt_lens): the bf16 dot-product kernel of the level (AMX tiles, vdpbf16ps) wherever the CPU has one and the
// cache is bf16 (prefill rows come in blocks of 16 and more: ~2-3x the fp32 kernels at every G, BENCHMARKS.md);
// vdpbf16ps on AMX CPUs too for int8/fp8 caches, whose key tiles it converts to bf16 once; from avx512 up, every
// other cache (f32 ones, and all of them below avx512_bf16) takes the same tiles with fp32 FMAs
// (attention_avx512_tiles.cpp), except where scores are soft-capped or a sliding window makes every prompt group one
// token (`windowed`): those keep every other row's kernel. Generated rows (decode, speculative verification, and
// generated tokens recomputed after a preemption, whose positions are past the prompt) keep pick_kernel's: a row's
// kernel follows from its position, never from the batch around it. A threshold set with
// set_attention_bf16_min_group above G sends bf16 prompt rows to the fp32 tiles as well.
AttnFn pick_prompt_kernel(int64_t d, KVFormat fmt, int64_t group, bool softcap, bool windowed) {
#if defined(__x86_64__)
  const Isa level = active_isa();
  if ((level == Isa::kAmx || level == Isa::kAvx512Bf16) && (fmt == KVFormat::kBF16 || kv_quantized(fmt)) &&
      !softcap && (d == 64 || d == 128) && group >= g_bf16_min_group.load(std::memory_order_relaxed))
    return level == Isa::kAmx && fmt == KVFormat::kBF16 ? attn_item_amx : attn_item_avx512bf16;
  if (level >= Isa::kAvx512 && !softcap && !windowed && (d == 64 || d == 128)) return attn_item_avx512_tiles;
#endif
  return pick_kernel(d, fmt, group, softcap);
}

// The ISA level a kernel of pick_kernel / pick_prompt_kernel belongs to (for the start-up log).
const char* kernel_level(AttnFn fn) {
#if defined(__x86_64__)
  if (fn == attn_item_amx) return "amx";
  if (fn == attn_item_avx512bf16) return "avx512_bf16";
  if (fn == attn_item_avx512bf16_rows) return "avx512_bf16_rows";
  if (fn == attn_item_avx512) return "avx512";
  if (fn == attn_item_avx512_tiles) return "avx512_tiles";
  if (fn == attn_item_avx2) return "avx2";
#endif
  return "generic";
}

// The cache's storage format, from its dtype (model/kv_cache_dtype.py allocates it so): float32, bfloat16, int8
// (int8 codes + scale), float8_e4m3fn / float8_e5m2 (fp8 codes + scale; the tensor is bytes, not fp8 values).
KVFormat kv_format(const at::Tensor& kv) {
  switch (kv.scalar_type()) {
    case at::kFloat: return KVFormat::kF32;
    case at::kBFloat16: return KVFormat::kBF16;
    case at::kChar: return KVFormat::kInt8;
    case at::kFloat8_e4m3fn: return KVFormat::kFp8E4M3;
    case at::kFloat8_e5m2: return KVFormat::kFp8E5M2;
    default: TORCH_CHECK(false, "kv_layer must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2, got ",
                         kv.scalar_type());
  }
}

// The cache holds rows of head_dim d; returns its format.
KVFormat check_kv(const at::Tensor& kv, int64_t d) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2, "kv_layer must be [2, num_blocks, block_size, Hkv, row], got ",
              kv.sizes());
  TORCH_CHECK(kv.is_contiguous() && kv.device().is_cpu(), "kv_layer must be a contiguous CPU tensor");
  const KVFormat fmt = kv_format(kv);
  TORCH_CHECK(kv.size(4) * kv.element_size() == kv_row_bytes(fmt, d), "kv_layer rows of ", kv.size(4), " ",
              kv.scalar_type(), " do not hold head_dim ", d, kv_quantized(fmt) ? " codes and a 2-byte scale" : "");
  return fmt;
}

// [T, H, D] f32 with heads adjacent and head_dim contiguous; the token stride is free.
void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t heads, int64_t d) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(1) == heads && t.size(2) == d, name, " must be [",
              tokens, ", ", heads, ", ", d, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be a float32 CPU tensor");
  TORCH_CHECK((t.stride(2) == 1 || d == 1) && (t.stride(1) == d || heads == 1), name,
              " must have contiguous heads and head_dim (only the token stride may differ)");
}

void check_i32(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must be 1-D of size ", n, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), name, " must be contiguous int32");
}

// Sequence s's rows, key count and block ids are consistent with the cache; returns its q_len.
int64_t check_sequence(const AttnArgs& a, int64_t s, const int32_t* qsl, const int32_t* sl, int64_t t,
                       int64_t width) {
  const int64_t q0 = qsl[s], q1 = qsl[s + 1], len = sl[s];
  TORCH_CHECK(0 <= q0 && q0 <= q1 && q1 <= t, "query_start_loc must be nondecreasing within [0, T]; sequence ", s,
              " has rows [", q0, ", ", q1, ")");
  TORCH_CHECK(q1 - q0 <= len, "sequence ", s, ": q_len ", q1 - q0, " exceeds seq_len ", len);
  TORCH_CHECK(len <= width * a.block_size, "sequence ", s, ": seq_len ", len, " needs more blocks than block_table has");
  const int32_t* bt = a.block_table + s * a.bt_stride;
  for (int64_t b = 0; b < (len + a.block_size - 1) / a.block_size; ++b)
    TORCH_CHECK(bt[b] >= 0 && bt[b] < a.num_blocks, "block_table[", s, ", ", b, "] = ", bt[b], " is not a block");
  return q1 - q0;
}

// Partition p of a group: keys [max(k0, (first + p) kPartition), min(k1, (first + p + 1) kPartition)), first =
// k0 / kPartition.
AttnItem partition(const AttnItem& whole, int p) {
  AttnItem it = whole;
  const int64_t first = whole.k0 / kPartition;
  it.k0 = int32_t(std::max<int64_t>(whole.k0, (first + p) * kPartition));
  it.k1 = int32_t(std::min<int64_t>(whole.k1, (first + p + 1) * kPartition));
  return it;
}

// The kernels that take items spanning several KV heads (AttnItem::nkvh).
bool takes_head_spans(AttnFn fn) {
#if defined(__x86_64__)
  if (fn == attn_item_avx512 || fn == attn_item_avx2 || fn == attn_item_avx512bf16_rows) return true;
#endif
  return fn == attn_item_generic;
}

// Rows (all heads) of a generated-row group spanning several KV heads: heads are added while the group stays
// within this many rows, so its state (acc, m, l per row) stays in L1/L2.
constexpr int64_t kHeadSpanRows = 64;

// The most KV heads a generated-row group may span: all of them, unless the call has fewer token groups (of `tile`
// tokens) than threads; then each token group's heads are cut into as many spans as it takes to give every thread
// one (a decode of one sequence otherwise ran all its heads on one thread: 1.8x slower at 32 KV heads and ~200 keys
// on 2 threads). Further cuts read each token's rows in smaller pieces and measured slower. Which heads share an
// item never changes a row's arithmetic.
int64_t max_head_span(const AttnArgs& a, const int32_t* qsl, const int32_t* sl, const int32_t* prompt_lens,
                      int64_t nseq, int64_t tile, int64_t nthreads) {
  int64_t token_groups = 0;
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t split = prompt_split(qsl[s], qsl[s + 1], sl[s], prompt_lens ? prompt_lens[s] : 0);
    token_groups += (qsl[s + 1] - split + tile - 1) / tile;
  }
  if (token_groups == 0 || token_groups >= nthreads) return a.hkv;
  const int64_t cuts = (nthreads + token_groups - 1) / token_groups;
  return std::max<int64_t>(1, (a.hkv + cuts - 1) / cuts);
}

// `head_spans`: generated rows' groups may span several KV heads (their kernel takes them), up to max_head_span.
std::vector<Group> make_groups(const AttnArgs& a, const int32_t* qsl, const int32_t* sl, const int32_t* prompt_lens,
                               int64_t nseq, int64_t t, int64_t width, int64_t window, bool head_spans,
                               int64_t nthreads) {
  const int64_t g = a.hq / a.hkv;
  // query tokens per group: ~48 rows; one token with a sliding window (its keys start where its window does).
  // Prompt groups: ~256 rows (64 for d 128) in whole 16-token steps: a key tile's K/V preparation is shared by
  // more rows (the AMX kernel's row blocks of 16), and a prefill has rows enough for every thread (256 measured
  // faster than 128 and 384 at 512 tokens, BENCHMARKS.md).
  const int64_t tile = window > 0 ? 1 : std::max<int64_t>(1, (a.d <= 64 ? 48 : 24) / g);
  const int64_t prompt_tile = window > 0 ? 1 : std::max<int64_t>(16, (a.d <= 64 ? 256 : 64) / g / 16 * 16);
  for (int64_t s = 0; s < nseq; ++s) check_sequence(a, s, qsl, sl, t, width);
  const int64_t span_cap = head_spans ? max_head_span(a, qsl, sl, prompt_lens, nseq, tile, nthreads) : 1;
  std::vector<Group> groups;
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t qlen = qsl[s + 1] - qsl[s], ctx = sl[s] - qlen;
    // rows [qsl[s], split) are prompt rows, [split, qsl[s + 1]) generated ones; no group spans both
    const int64_t split = prompt_split(qsl[s], qsl[s + 1], sl[s], prompt_lens ? prompt_lens[s] : 0);
    for (int64_t t0 = qsl[s], t1; t0 < qsl[s + 1]; t0 = t1) {
      t1 = t0 < split ? std::min<int64_t>(split, t0 + prompt_tile) : std::min<int64_t>(qsl[s + 1], t0 + tile);
      const int64_t span = t0 >= split ? std::clamp<int64_t>(kHeadSpanRows / ((t1 - t0) * g), 1, span_cap) : 1;
      for (int64_t h = 0; h < a.hkv; h += span) {
        const int64_t pos0 = ctx + (t0 - qsl[s]);
        const int64_t k0 = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
        const AttnItem it{int32_t(s), int32_t(h), int32_t(t0), int32_t(t1), int32_t(pos0), int32_t(k0),
                          int32_t(pos0 + (t1 - t0)), nullptr, int32_t(std::min(span, a.hkv - h))};
        const int64_t nparts = (it.k1 + kPartition - 1) / kPartition - k0 / kPartition;
        groups.push_back({it, t0 < split, static_cast<int>(nparts), false, nullptr, 0});
      }
    }
  }
  return groups;
}

// Split groups into their key partitions when there are fewer groups than ~4 per thread; returns the tasks.
std::vector<Task> make_tasks(std::vector<Group>& groups, std::vector<float>& parts, int64_t nthreads, int64_t hq_per_kv,
                             int64_t d) {
  const bool split = nthreads > 1 && static_cast<int64_t>(groups.size()) < 4 * nthreads;
  int64_t total = 0;
  for (Group& gr : groups) {
    gr.part_floats = (gr.whole.t1 - gr.whole.t0) * hq_per_kv * gr.whole.nkvh * (d + 2);
    gr.split = split && gr.nparts > 1;
    if (gr.split) total += gr.nparts * gr.part_floats;
  }
  parts.resize(total);
  std::vector<Task> tasks;
  float* next = parts.data();
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& gr = groups[gi];
    const int64_t rows = (gr.whole.t1 - gr.whole.t0) * hq_per_kv * gr.whole.nkvh, keys = gr.whole.k1 - gr.whole.k0;
    if (!gr.split) {
      tasks.push_back({gr.whole, int32_t(gi), rows * keys});
      continue;
    }
    gr.part = next;
    next += gr.nparts * gr.part_floats;
    for (int p = 0; p < gr.nparts; ++p) {
      AttnItem it = partition(gr.whole, p);
      it.part = gr.part + p * gr.part_floats;
      tasks.push_back({it, int32_t(gi), rows * (it.k1 - it.k0)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return tasks;
}

// state = state (+) partial, row by row, for the partial layout of AttnItem::part ([rows][d] acc, m[rows], l[rows]).
// An empty state row (l = 0) takes the partial as it is; a partial row without keys (l = 0) changes nothing;
// otherwise acc = ws * acc + wp * acc_p, l = ws * l + wp * l_p with w = exp(m - max(m, m_p)).
void fold_partition(float* state, const float* part, int64_t rows, int64_t d) {
  float *sm = state + rows * d, *sl = sm + rows;
  const float *pm = part + rows * d, *pl = pm + rows;
  for (int64_t r = 0; r < rows; ++r) {
    if (pl[r] == 0.f) continue;
    float* acc = state + r * d;
    const float* pacc = part + r * d;
    if (sl[r] == 0.f) {
      std::copy(pacc, pacc + d, acc);
      sm[r] = pm[r], sl[r] = pl[r];
      continue;
    }
    const float mx = std::max(sm[r], pm[r]), ws = std::exp(sm[r] - mx), wp = std::exp(pm[r] - mx);
    for (int64_t i = 0; i < d; ++i) acc[i] = ws * acc[i] + wp * pacc[i];
    sl[r] = ws * sl[r] + wp * pl[r];
    sm[r] = mx;
  }
}

// out rows of a group = acc / l of the folded state (the same multiply by 1 / l as the kernels' direct output).
void write_state(const AttnArgs& a, const Group& gr, const float* state) {
  const int64_t g = a.hq / a.hkv, d = a.d, rows = (gr.whole.t1 - gr.whole.t0) * g * gr.whole.nkvh;
  const float* l = state + rows * d + rows;
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = a.out + item_row_offset(gr.whole, r, g, d, a.out_stride);
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t i = 0; i < d; ++i) dst[i] = state[r * d + i] * inv;
  }
}

// A group's partitions in order: computed here one after another (not split) or already by their tasks (split).
void finish_group(const AttnArgs& a, AttnFn fn, const Group& gr) {
  thread_local std::vector<float> buf;
  buf.assign(2 * gr.part_floats, 0.f);  // the state (l = 0: empty) and, unsplit, the current partition
  float *state = buf.data(), *cur = state + gr.part_floats;
  const int64_t rows = (gr.whole.t1 - gr.whole.t0) * (a.hq / a.hkv) * gr.whole.nkvh;
  for (int p = 0; p < gr.nparts; ++p) {
    if (!gr.split) {
      AttnItem it = partition(gr.whole, p);
      it.part = cur;
      fn(a, it);
    }
    fold_partition(state, gr.split ? gr.part + p * gr.part_floats : cur, rows, a.d);
  }
  write_state(a, gr, state);
}

void run_tasks(const AttnArgs& a, const std::vector<Group>& groups, const std::vector<Task>& tasks,
               int64_t nthreads, bool windowed) {
  const int64_t g = a.hq / a.hkv;
  const bool cap = a.softcap > 0.f;
  const AttnFn fns[2] = {pick_kernel(a.d, a.kv_format, g, cap),
                         pick_prompt_kernel(a.d, a.kv_format, g, cap, windowed)};
  std::unique_ptr<std::atomic<int>[]> left(new std::atomic<int>[groups.size()]);
  for (size_t i = 0; i < groups.size(); ++i) left[i].store(groups[i].nparts, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  auto worker = [&] {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const Task& tk = tasks[i];
      const Group& gr = groups[tk.group];
      if (i + nthreads < n) {  // likely this thread's next task: its first K tile, while this one runs
        const AttnItem& next_item = tasks[i + nthreads].item;
        KvRowsAhead(a, next_item, next_item.k0, kv_row_bytes(a.kv_format, a.d)).prefetch_first(next_item, 1);
      }
      const AttnFn fn = fns[gr.prompt];
      if (gr.nparts == 1) {
        fn(a, tk.item);  // one partition: the kernel writes the normalised output
      } else if (!gr.split) {
        finish_group(a, fn, gr);
      } else {
        fn(a, tk.item);
        // the last partition to finish sees the others' writes (acq_rel) and folds them
        if (left[tk.group].fetch_sub(1, std::memory_order_acq_rel) == 1) finish_group(a, fn, gr);
      }
    }
  };
  if (n <= 1 || nthreads <= 1) {
    worker();
  } else {
    parallel_for(0, std::min(nthreads, n), 1, [&](int64_t, int64_t) { worker(); });
  }
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t sliding_window, double softcap, const std::optional<at::Tensor>& prompt_lens) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.dim() == 3, "q must be [T, Hq, D], got ", q.sizes());
  const int64_t t = q.size(0), hkv = kv.dim() == 5 ? kv.size(3) : 1, d = q.size(2), hq = q.size(1);
  const KVFormat fmt = check_kv(kv, d);
  TORCH_CHECK(hq > 0 && hq % hkv == 0, "query heads (", hq, ") must be a multiple of KV heads (", hkv, ")");
  check_heads(q, "q", t, hq, d);
  check_heads(out, "out", t, hq, d);
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt &&
                  (block_table.stride(1) == 1 || block_table.size(1) <= 1),
              "block_table must be a 2-D int32 tensor with contiguous rows");
  const int64_t nseq = block_table.size(0);
  check_i32(query_start_loc, "query_start_loc", nseq + 1);
  check_i32(seq_lens, "seq_lens", nseq);
  if (prompt_lens) check_i32(*prompt_lens, "prompt_lens", nseq);
  const AttnArgs a{q.data_ptr<float>(), q.stride(0), out.data_ptr<float>(), out.stride(0), kv.data_ptr(),
                   fmt == KVFormat::kBF16, fmt, kv.size(1), kv.size(2), hkv, hq, d,
                   block_table.data_ptr<int32_t>(), block_table.stride(0), static_cast<float>(scale),
                   static_cast<float>(softcap)};
  const bool head_spans = takes_head_spans(pick_kernel(d, fmt, hq / hkv, softcap > 0));
  const int64_t nthreads = num_threads();
  std::vector<Group> groups = make_groups(a, query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                                          prompt_lens ? prompt_lens->data_ptr<int32_t>() : nullptr, nseq, t,
                                          block_table.size(1), sliding_window, head_spans, nthreads);
  std::vector<float> parts;
  const std::vector<Task> tasks = make_tasks(groups, parts, nthreads, hq / hkv, d);
  run_tasks(a, groups, tasks, nthreads, sliding_window > 0);
}

at::Tensor prompt_row_mask(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& prompt_lens) {
  const int64_t nseq = seq_lens.numel();
  check_i32(query_start_loc, "query_start_loc", nseq + 1);
  check_i32(seq_lens, "seq_lens", nseq);
  check_i32(prompt_lens, "prompt_lens", nseq);
  const int32_t *qsl = query_start_loc.data_ptr<int32_t>(), *sl = seq_lens.data_ptr<int32_t>();
  const int32_t* pl = prompt_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0, "query_start_loc must start at 0");
  for (int64_t s = 0; s < nseq; ++s)
    TORCH_CHECK(qsl[s] <= qsl[s + 1] && qsl[s + 1] - qsl[s] <= sl[s], "sequence ", s, ": bad query_start_loc ",
                "or seq_len");
  at::Tensor mask = at::zeros({qsl[nseq]}, at::kByte);
  uint8_t* m = mask.data_ptr<uint8_t>();
  for (int64_t s = 0; s < nseq; ++s)
    std::fill(m + qsl[s], m + prompt_split(qsl[s], qsl[s + 1], sl[s], pl[s]), uint8_t{1});
  return mask;
}

// kv_quantize_row per ISA level (the same bits on every level).
const IsaTable<KvQuantizeRowFn> kQuantizeRow = {
    {Isa::kGeneric, kv_quantize_row},
    PDSERVE_X86({Isa::kAvx2, kv_quantize_row_avx2}, {Isa::kAvx512, kv_quantize_row_avx512})};

// One token's K or V rows [hkv][d] (src, heads adjacent) into its slot's row of a cache in format fmt (dst);
// quantized formats through `quantize` (kQuantizeRow's pick).
void write_slot(KVFormat fmt, const float* src, int64_t hkv, int64_t d, void* dst, KvQuantizeRowFn quantize) {
  if (fmt == KVFormat::kF32) {
    std::memcpy(dst, src, hkv * d * sizeof(float));
  } else if (fmt == KVFormat::kBF16) {
    uint16_t* out = static_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < hkv * d; ++j) out[j] = fp32_to_bf16(src[j]);
  } else {
    const int64_t rb = kv_row_bytes(fmt, d);
    for (int64_t h = 0; h < hkv; ++h) quantize(fmt, src + h * d, d, static_cast<uint8_t*>(dst) + h * rb);
  }
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3, "k must be [T, Hkv, D], got ", k.sizes());
  const int64_t t = k.size(0), d = k.size(2);
  const KVFormat fmt = check_kv(kv, d);
  const int64_t hkv = kv.size(3), slots = kv.size(1) * kv.size(2);
  check_heads(k, "k", t, hkv, d);
  check_heads(v, "v", t, hkv, d);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64 [T]");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slot[i] < slots, "slot_mapping[", i, "] = ", slot[i], " is past the cache (", slots, " slots)");
  const int64_t row = hkv * kv_row_bytes(fmt, d), plane = slots * row, ks = k.stride(0), vs = v.stride(0);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  uint8_t* base = static_cast<uint8_t*>(kv.data_ptr());
  const KvQuantizeRowFn quantize = kQuantizeRow.pick();
  parallel_for(0, t, std::max<int64_t>(1, 8192 / (hkv * d)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (slot[i] < 0) continue;  // padding token: no slot
      write_slot(fmt, kp + i * ks, hkv, d, base + slot[i] * row, quantize);
      write_slot(fmt, vp + i * vs, hkv, d, base + plane + slot[i] * row, quantize);
    }
  });
}

namespace {

void register_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("paged_attention", &paged_attention,
        "causal attention of the step's query rows over the paged KV cache, written into out [T, Hq, D]; "
        "sliding_window > 0: the row at position p sees keys p - sliding_window < j <= p only; softcap > 0: "
        "each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)",
        py::arg("out"), py::arg("q"), py::arg("kv_layer"), py::arg("block_table"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0, py::arg("softcap") = 0.0,
        py::arg("prompt_lens") = py::none());
  m.def("prompt_row_mask", &prompt_row_mask, py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("prompt_lens"),
        "uint8 [T]: 1 where a step's row is a prompt row (position below its sequence's prompt length)");
  m.def("attention_bf16_min_group", [] { return g_bf16_min_group.load(); },
        "query heads per KV head from which bf16 caches use bf16 dot products (avx512_bf16, amx levels); "
        "0: each level's own for generated rows (amx 4, avx512_bf16 1; prompt rows from 1)");
  m.def("effective_attention_bf16_min_group", [] { return bf16_min_group(active_isa()); },
        "the threshold the active ISA level uses");
  m.def("attention_kernels", [](int64_t head_dim, const std::string& kv_storage, int64_t group, bool softcap,
                                 bool windowed) {
          static const std::pair<const char*, KVFormat> kFormats[] = {
              {"float32", KVFormat::kF32}, {"bfloat16", KVFormat::kBF16}, {"int8", KVFormat::kInt8},
              {"float8_e4m3fn", KVFormat::kFp8E4M3}, {"float8_e5m2", KVFormat::kFp8E5M2}};
          const auto* f = std::find_if(std::begin(kFormats), std::end(kFormats),
                                       [&](const auto& x) { return kv_storage == x.first; });
          TORCH_CHECK(f != std::end(kFormats), "kv_storage must be float32, bfloat16, int8, float8_e4m3fn or "
                      "float8_e5m2, got ", kv_storage);
          const AttnFn prompt = pick_prompt_kernel(head_dim, f->second, group, softcap, windowed);
          return std::make_pair(std::string(kernel_level(prompt)),
                                std::string(kernel_level(pick_kernel(head_dim, f->second, group, softcap))));
        }, py::arg("head_dim"), py::arg("kv_storage"), py::arg("group"), py::arg("softcap") = false,
        py::arg("windowed") = false,
        "(prompt rows' kernel, generated rows' kernel) by ISA level for a cache stored as kv_storage: amx, "
        "avx512_bf16 (transposed tiles) and avx512_bf16_rows (rows as stored) are the bf16 dot-product kernels, "
        "avx512_tiles fp32 FMAs in transposed tiles, the others fp32 dot products; windowed: a sliding-window layer");
  m.def("set_attention_bf16_min_group", [](int64_t g) {
          TORCH_CHECK(g >= 0, "group must be >= 0 (0: each level's own)");
          g_bf16_min_group.store(g);
        }, py::arg("group"), "change it (tests, benchmarks; before serving only: a row's bits depend on it)");
  m.def("set_attention_prefetch", [](bool on) { g_attn_prefetch = on; }, py::arg("on"),
        "turn the decode kernels' K/V prefetch (KvRowsAhead) on or off (benchmarks, tests; outputs never depend "
        "on it); returns nothing");
  m.def("attention_prefetch", [] { return g_attn_prefetch; }, "whether the decode kernels prefetch K/V rows");
  m.def("reshape_and_cache", &reshape_and_cache,
        "write K/V rows [T, Hkv, D] into their cache slots (slot < 0: skip); int8/fp8 caches: quantized per (token, "
        "head) row with its scale (kv_quant.h)",
        py::arg("k"), py::arg("v"), py::arg("kv_layer"), py::arg("slot_mapping"));
}

PDSERVE_REGISTER(register_attention);

}  // namespace
}  // namespace pdserve
