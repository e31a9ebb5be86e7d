// Paged attention work items, one kernel per ISA level. No torch here: the ISA files include only this.
//
// The KV cache of a layer is kv[2 (K | V)][num_blocks][block_size][hkv][row], contiguous: rows of d f32 or bf16
// values, or of d one-byte codes and their scale (int8, fp8; kv_quant.h). Key i of sequence s lives in slot
// block_table[s][i / block_size] * block_size + i % block_size.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "common.h"
#include "kv_quant.h"

namespace pdserve {

struct AttnArgs {
  const float* q;       // [T][hq][d]: token rows q_stride apart, heads adjacent, head_dim contiguous
  int64_t q_stride;
  float* out;           // same layout as q, out_stride apart
  int64_t out_stride;
  const void* kv;       // the layer's cache, in kv_format (kv_bf16: kv_format == kBF16)
  bool kv_bf16;
  KVFormat kv_format;
  int64_t num_blocks, block_size, hkv, hq, d;
  const int32_t* block_table;  // [S][bt_stride]
  int64_t bt_stride;
  float scale;
  float softcap;  // > 0: every score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)
};

// Attention logit soft-capping of n scores in place (softcap_scores(s, n, a.softcap) when a.softcap > 0). The
// bf16 dot-product kernels do not apply it: pick_kernel (attention.cpp) sends soft-capped calls to the fp32 ones.
inline void softcap_scores(float* s, int n, float cap) {
  for (int i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// One unit of work: the query rows [t0, t1) of one sequence against its keys [k0, k1) for the query heads of one
// KV head (G = hq / hkv of them; row (t, g) is token t, query head kvh * G + g). Row t0 sits at position pos0 and
// row t sees keys <= pos0 + (t - t0). With part == nullptr the normalised output goes to out; otherwise the
// unnormalised accumulator [rows][d], the running max m[rows] and the sum l[rows] (rows = (t1 - t0) * G) go to part,
// to be merged with the other key partitions of the same rows by merge_partitions.
//
// Items of generated rows may span nkvh consecutive KV heads (kvh .. kvh + nkvh - 1; the fp32 kernels generic, avx2
// and avx512 take them): the kernel walks the key tiles once and, per tile, every head in turn, so a decode step
// reads each token's K/V rows of all heads together (they are adjacent in a block) instead of one head's rows a
// whole row of heads apart (4 KiB for 32 heads of 64 bf16: each touches a new page, which the hardware prefetchers
// do not follow). Each head's rows keep their own state and arithmetic. Rows are head-major: with R = (t1 - t0) * G
// rows per head, row r is head kvh + r / R and, within it, row r % R as above (item_row_offset).
struct AttnItem {
  int32_t seq, kvh, t0, t1, pos0, k0, k1;
  float* part;
  int32_t nkvh = 1;
};

// Offset of an item's row r in q or out (token stride `stride`, head_dim d, G query heads per KV head).
inline int64_t item_row_offset(const AttnItem& it, int64_t r, int64_t g, int64_t d, int64_t stride) {
  const int64_t per_head = (it.t1 - it.t0) * g, h = it.kvh + r / per_head, rr = r % per_head;
  return (it.t0 + rr / g) * stride + (h * g + rr % g) * d;
}

// Row r of an item's `rows` (head_dim d), its accumulator acc[d], running max m and sum l: acc / l into out, or, for
// an item of one key partition (it.part), acc, m and l for attention.cpp's fold. Every kernel ends its rows here.
// `static`: the kernel files are compiled for different ISA targets, and each keeps its own copy.
static inline void finish_row(const AttnArgs& a, const AttnItem& it, int64_t rows, int64_t r, const float* acc,
                              float m, float l) {
  const int64_t d = a.d;
  if (it.part != nullptr) {
    std::copy(acc, acc + d, it.part + r * d);
    it.part[rows * d + r] = m;
    it.part[rows * d + rows + r] = l;
    return;
  }
  float* dst = a.out + item_row_offset(it, r, a.hq / a.hkv, d, a.out_stride);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t i = 0; i < d; ++i) dst[i] = acc[i] * inv;
}

// Software prefetch of K/V rows into L2 for the kernels that walk an item's key tiles. A decode step streams its KV
// from memory with little arithmetic between the loads; its blocks lie wherever the allocator put them (a new
// 16-token block every few KiB), and the hardware prefetchers alone left the cores waiting on misses. A kernel
// locates the 16 keys ahead of its tile once (KvRowsAhead), then asks for one KV head's rows at a time as it reaches
// that head on the current tile: a whole tile of many heads at once (64 KiB at 32 heads) held up the loads behind it,
// as the GEMVs' prefetch bursts did (BENCHMARKS.md, "decode attention prefetches the next key tile").
// PDSERVE_ATTN_PREFETCH=0 turns it off at start-up; set_attention_prefetch (benchmarks, tests) between calls.
// always_inline: GCC finds a function whose only effects are prefetches pure and deletes its calls (an out-of-line
// copy compiled to nothing).
inline bool g_attn_prefetch = [] {
  const char* v = std::getenv("PDSERVE_ATTN_PREFETCH");
  return v == nullptr || std::atoi(v) != 0;
}();

// The keys [k, k + 16) of an item (none past its last key, none with the prefetch off): where KV head 0's row of each
// lies in the K plane (`rb` bytes a row); `prefetch` asks for one head's rows of them.
struct KvRowsAhead {
  const char* row[16];
  int64_t n = 0, rb = 0, plane = 0;

  KvRowsAhead(const AttnArgs& a, const AttnItem& it, int64_t k, int64_t row_bytes) : rb(row_bytes) {
    n = g_attn_prefetch ? std::clamp<int64_t>(it.k1 - k, 0, 16) : 0;
    if (n == 0) return;
    const int32_t* bt = a.block_table + it.seq * a.bt_stride;
    const int64_t stride = a.hkv * rb;
    plane = a.num_blocks * a.block_size * stride;
    int64_t b = k / a.block_size, o = k % a.block_size;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = static_cast<const char*>(a.kv) + (static_cast<int64_t>(bt[b]) * a.block_size + o) * stride;
      if (++o == a.block_size) o = 0, ++b;
    }
  }

  // KV head `head`'s rows into L2: of the K plane (planes bit 0), the V plane (bit 1) or both.
  __attribute__((always_inline)) void prefetch(int64_t head, int planes) const {
    for (int64_t i = 0; i < n; ++i) {
      const char* r = row[i] + head * rb;
      for (int64_t x = 0; x < rb; x += 64) {
        if (planes & 1) __builtin_prefetch(r + x, 0, 2);
        if (planes & 2) __builtin_prefetch(r + plane + x, 0, 2);
      }
    }
  }

  // One plane's rows of the item's first heads, heads kvh .. kvh + nkvh - 1 in walk order, up to kFirstTileBytes:
  // the start of a walk that nothing prefetched. A bigger burst held up the demand loads behind it.
  static constexpr int64_t kFirstTileBytes = 6144;
  __attribute__((always_inline)) void prefetch_first(const AttnItem& it, int planes) const {
    const int64_t heads = std::min<int64_t>(it.nkvh, std::max<int64_t>(1, kFirstTileBytes / (16 * rb)));
    for (int64_t h = 0; h < heads; ++h) prefetch(it.kvh + h, planes);
  }
};

using AttnFn = void (*)(const AttnArgs&, const AttnItem&);

// A sequence's query rows [q0, q1) over seq_len keys: rows [q0, split) are prompt rows (position < prompt_len),
// [split, q1) generated ones. The one definition of a prompt row (attention kernels, the linears' row kinds).
inline int64_t prompt_split(int64_t q0, int64_t q1, int64_t seq_len, int64_t prompt_len) {
  const int64_t qlen = q1 - q0, ctx = seq_len - qlen;
  return q0 + std::min<int64_t>(std::max<int64_t>(prompt_len - ctx, 0), qlen);
}

// Keys per tile of the vector kernels. Every kernel walks an item's keys in tiles at fixed offsets from k0.
constexpr int kKeyTile = 16;

// The rows of one KV head of an item (r0 .. r0 + nt * g, a token's g rows adjacent) that see key tile kt .. kt + n - 1,
// as blocks f(R, r, nvalid) of R = 1..3 rows (std::integral_constant, R <= block) from row r, all seeing nvalid keys:
// tokens before t_first see none; t_first .. t_full - 1 see part of the tile (the diagonal), each token's rows apart;
// from t_full on every token sees all n keys and their rows run as one stretch. One call site per R keeps each
// kernel template inlined.
template <class F>
inline void for_tile_rows(const AttnItem& it, int64_t kt, int n, int64_t g, int64_t r0, int64_t block, F&& f) {
  const int64_t nt = it.t1 - it.t0, t_first = std::max<int64_t>(0, kt - it.pos0);
  const int64_t t_full = std::clamp<int64_t>(kt + n - 1 - it.pos0, t_first, nt);
  for (int64_t t = t_first; t <= t_full; ++t) {
    const bool stretch = t == t_full;
    const int nvalid = stretch ? n : static_cast<int>(it.pos0 + t - kt + 1);
    for (int64_t r = r0 + t * g, e = stretch ? r0 + nt * g : r + g, rr; r < e; r += rr) {
      rr = std::min<int64_t>(block, e - r);
      if (rr >= 3) {
        f(std::integral_constant<int, 3>(), r, nvalid);
        rr = 3;
      } else if (rr == 2) {
        f(std::integral_constant<int, 2>(), r, nvalid);
      } else {
        f(std::integral_constant<int, 1>(), r, nvalid);
      }
    }
  }
}

// f(std::integral_constant<int, D>{}) with D the head size d among Ds, the sizes a kernel is compiled for (attention.cpp
// admits only those): each kernel's entry point picks its template this way.
template <int... Ds, class F>
inline void with_head_dim(int64_t d, F&& f) {
  (void)((d == Ds && (f(std::integral_constant<int, Ds>{}), true)) || ...);
}

// Keys per partition (attention.cpp): partitions start at multiples of this in every sequence, so a row's
// arithmetic is the same whatever the batch (a multiple of every kernel's key tile).
constexpr int64_t kPartition = 256;

void attn_item_generic(const AttnArgs& a, const AttnItem& it);
#if defined(__x86_64__)
// d in {64, 128, 256}; every format (quantized rows are dequantized once per key tile into L1, shared by its rows;
// avx512 reads int8 codes in place for items of few rows and scales the scores and probabilities instead)
void attn_item_avx2(const AttnArgs& a, const AttnItem& it);
void attn_item_avx512(const AttnArgs& a, const AttnItem& it);
// bf16 caches only, d in {64, 128}: bf16 dot products (attention_bf16.h)
void attn_item_avx512bf16(const AttnArgs& a, const AttnItem& it);
// bf16 caches only, d in {64, 128}, generated rows: the avx512 walk with vdpbf16ps (attention_avx512bf16_rows.cpp);
// takes items spanning several KV heads
void attn_item_avx512bf16_rows(const AttnArgs& a, const AttnItem& it);
void attn_item_amx(const AttnArgs& a, const AttnItem& it);
// every format, d in {64, 128}, prompt rows: fp32 FMAs in the GEMM-shaped tiles of attention_tiles.h
// (attention_avx512_tiles.cpp)
void attn_item_avx512_tiles(const AttnArgs& a, const AttnItem& it);
#endif

}  // namespace pdserve
