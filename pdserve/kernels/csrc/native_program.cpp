// A model's forward pass as a short program of native ops, replayed in one call per step.
//
// The program is not written here: pdserve/model/native_program.py records it once at load by running the model's
// one Python definition with a recording ops backend, and this file only executes what was recorded (no
// architecture knowledge). A batch-1 decode step then pays one Python call for the whole stack instead of ~10 per
// layer, and a new architecture needs only its Python modules (plus a new op here if it brings one).
//
// Values are the tensors of a step: 0 the token ids [T], 1 the positions [T], then one per recorded result, each a
// float32 [T, width] matrix or a column slice of one (kNarrow). In-place ops (kAddRmsNorm, kHeadRmsNorm, kRotary,
// kScale) write values already defined. Outputs the executor allocates live in slots (one [T, width] buffer per
// slot and step, shared by values whose lifetimes do not overlap, as the recorder assigned them); every value is
// released after its last use, so a long prefill holds a layer's activations, not the whole stack's.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"
#include "moe.h"
#include "packed_weight.h"
#include "registry.h"

namespace pdserve {
namespace {

enum class Op : int64_t {
  kNarrow,       // in [x]; ints [col, cols] -> view x[:, col:col + cols]
  kEmbedding,    // in [ids]; ints [weight] -> rows of the weight
  kRmsNorm,      // in [x]; ints [w const]; floats [eps] -> new (slot)
  kAddRmsNorm,   // in [x, residual]; ints [w const]; floats [eps]: residual += x; x = rms_norm(residual) (in place)
  kHeadRmsNorm,  // in [x]; ints [w const]; floats [eps]: each head of x rms-normed in place
  kRotary,       // in [positions, q, k]; ints [cos const, sin const, head_dim]: q and k rotated in place
  kAttention,    // in [q, k, v]; ints [cache index, Hq, Hkv, D, sliding window, KV group]; floats [scale,
                 // softcap] -> new (slot): KV write + paged attention with the group's slot_mapping / block_table
  kSiluMul,      // in [x]; -> new (slot) silu(x[:, :I]) * x[:, I:]
  kGeluMul,      // in [x]; -> new (slot) gelu_tanh(x[:, :I]) * x[:, I:]
  kScale,        // in [x]; floats [factor]: x *= factor in place
  kLinear,       // in [x]; ints [weight, bias const or -1] -> new (slot) x @ W.T (+ bias)
  kMoe,          // in [x, router logits]; ints [experts] -> new (slot) the sparse MLP's output (moe.h)
  kGatedMlp,     // in [x]; ints [gate_up weight, its bias const or -1, down weight, its bias or -1, act (0 silu,
                 // 1 gelu_tanh), gate_up scratch slot, a slot with room no live value uses here or -1] -> new (slot)
                 // down(act(gate_up(x))), run in row chunks, so the [T, 2I] intermediate never exists for a long
                 // prefill (gated_mlp)
  kNumOps
};

const std::map<std::string, Op>& op_names() {
  static const std::map<std::string, Op> names = {
      {"narrow", Op::kNarrow},         {"embedding", Op::kEmbedding}, {"rms_norm", Op::kRmsNorm},
      {"add_rms_norm", Op::kAddRmsNorm}, {"head_rms_norm", Op::kHeadRmsNorm}, {"rotary", Op::kRotary},
      {"attention", Op::kAttention},   {"silu_and_mul", Op::kSiluMul}, {"linear", Op::kLinear},
      {"gelu_tanh_and_mul", Op::kGeluMul}, {"scale", Op::kScale}, {"moe", Op::kMoe},
      {"gated_mlp", Op::kGatedMlp}};
  return names;
}

// How many inputs / ints / floats each op takes, for the checks in append().
struct Arity {
  size_t in, ints, floats;
  bool out;
};
Arity arity(Op op) {
  switch (op) {
    case Op::kNarrow: return {1, 2, 0, true};
    case Op::kEmbedding: return {1, 1, 0, true};
    case Op::kRmsNorm: return {1, 1, 1, true};
    case Op::kAddRmsNorm: return {2, 1, 1, false};
    case Op::kHeadRmsNorm: return {1, 1, 1, false};
    case Op::kRotary: return {3, 3, 0, false};
    case Op::kAttention: return {3, 6, 2, true};
    case Op::kSiluMul: return {1, 0, 0, true};
    case Op::kGeluMul: return {1, 0, 0, true};
    case Op::kScale: return {1, 0, 1, false};
    case Op::kLinear: return {1, 2, 0, true};
    case Op::kMoe: return {2, 1, 0, true};
    case Op::kGatedMlp: return {1, 7, 0, true};
    default: break;
  }
  TORCH_CHECK(false, "unknown op ", static_cast<int64_t>(op));
  return {};
}

struct Instr {
  Op op;
  std::vector<int64_t> in;
  int64_t out, slot;  // value written (-1: none); slot of an executor-allocated output (-1: none)
  int64_t width;      // columns of that output: its [T, width] lie contiguous at the start of the slot's buffer
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<int64_t> frees;  // values whose last use this is
};

class NativeProgram {
 public:
  int64_t add_const(at::Tensor t) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "program constants must be contiguous float32 CPU tensors");
    consts_.push_back(std::move(t));
    return static_cast<int64_t>(consts_.size()) - 1;
  }
  // A weight matrix as the Linear/Embedding modules hold it on the native path (model/packed_weights.py).
  int64_t add_packed(std::shared_ptr<PackedWeight> w) {
    TORCH_CHECK(w != nullptr, "packed weight is None");
    weights_.push_back(std::move(w));
    return static_cast<int64_t>(weights_.size()) - 1;
  }
  // A sparse MLP's experts (MoeExperts, moe.h).
  int64_t add_moe(std::shared_ptr<MoeExperts> m) {
    TORCH_CHECK(m != nullptr, "experts are None");
    moes_.push_back(std::move(m));
    return static_cast<int64_t>(moes_.size()) - 1;
  }

  // width: the columns of a slot output, at most the slot's (a slot serves outputs of any width up to its own, one
  // live value at a time); -1: the slot's.
  void append(const std::string& name, std::vector<int64_t> in, int64_t out, int64_t slot, std::vector<int64_t> ints,
              std::vector<double> floats, std::vector<int64_t> frees, int64_t width) {
    const auto it = op_names().find(name);
    TORCH_CHECK(it != op_names().end(), "unknown native program op '", name, "'");
    const Arity a = arity(it->second);
    TORCH_CHECK(in.size() == a.in && ints.size() == a.ints && floats.size() == a.floats && (out >= 0) == a.out,
                name, ": wrong number of operands");
    for (int64_t v : in) TORCH_CHECK(v >= 0 && v < num_values_ && defined_[v], name, " reads undefined value ", v);
    if (out >= 0) {
      TORCH_CHECK(out == num_values_, name, " must define the next value ", num_values_, ", got ", out);
      ++num_values_;
      defined_.push_back(true);
    }
    const bool owns = it->second == Op::kRmsNorm || it->second == Op::kAttention || it->second == Op::kSiluMul ||
                      it->second == Op::kGeluMul || it->second == Op::kLinear || it->second == Op::kMoe ||
                      it->second == Op::kGatedMlp;
    TORCH_CHECK(owns == (slot >= 0) && slot < static_cast<int64_t>(slot_widths_.size()), name,
                ": bad slot ", slot);
    if (it->second == Op::kGatedMlp)
      TORCH_CHECK(ints[5] >= 0 && ints[5] < static_cast<int64_t>(slot_widths_.size()) && ints[5] != slot &&
                      ints[6] >= -1 && ints[6] < static_cast<int64_t>(slot_widths_.size()) && ints[6] != slot &&
                      ints[6] != ints[5],
                  name, ": bad scratch slots ", ints[5], ", ", ints[6]);
    for (int64_t v : frees) TORCH_CHECK(v >= 0 && v < num_values_, name, " frees unknown value ", v);
    if (slot >= 0 && width < 0) width = slot_widths_[slot];
    TORCH_CHECK(slot < 0 || (width > 0 && width <= slot_widths_[slot]), name, ": width ", width,
                " does not fit slot ", slot);
    instrs_.push_back(Instr{it->second, std::move(in), out, slot, width, std::move(ints), std::move(floats),
                            std::move(frees)});
  }

  int64_t add_slot(int64_t width) {
    TORCH_CHECK(width > 0, "slot width must be positive");
    slot_widths_.push_back(width);
    return static_cast<int64_t>(slot_widths_.size()) - 1;
  }

  void set_output(int64_t value) {
    TORCH_CHECK(value >= 0 && value < num_values_, "output ", value, " is not a value");
    output_ = value;
  }

  // ids, positions: long [T]; kv_cache [layers, 2, NB, BS, Hkv, D]; the attention metadata of the step (varlen
  // form, model/attention.py; with KV cache groups, slot_mapping [G, T] and block_table [G, S, W]); prompt_rows: the linears' row kinds (uint8 [T], NativeOps.prompt_rows) or none.
  // Returns the recorded output (the final hidden states [T, hidden]).
  at::Tensor run(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& query_start_loc,
                 const at::Tensor& seq_lens, const std::optional<at::Tensor>& prompt_lens,
                 const std::optional<at::Tensor>& prompt_rows) const {
    TORCH_CHECK(output_ >= 0, "the program has no output");
    const int64_t t = ids.size(0);
    // The slot buffers stay from run to run (grown to the largest step seen): a fresh [512, 3072] buffer per
    // linear per step came from mmap and went back with munmap, page faults and TLB shootdowns included. A run
    // started while another holds them (another thread) allocates its own.
    std::unique_lock<std::mutex> hold(cache_mu_, std::try_to_lock);
    std::vector<at::Tensor> local;
    std::vector<at::Tensor>& slots = hold.owns_lock() ? slot_cache_ : local;
    slots.resize(slot_widths_.size());
    std::vector<at::Tensor> v(num_values_);
    v[0] = ids, v[1] = positions;
    const Step step{kv_cache, slot_mapping, block_table, query_start_loc, seq_lens, prompt_lens, prompt_rows};
    for (const Instr& I : instrs_) {
      at::Tensor out;
      if (I.slot >= 0) {
        at::Tensor& s = slots[I.slot];
        if (!s.defined() || s.size(0) < t) s = at::empty({t, slot_widths_[I.slot]}, at::kFloat);
        out = s.as_strided({t, I.width}, {I.width, 1});  // one view, as cheap as the narrow it replaced
      }
      if (profiling_.load(std::memory_order_relaxed)) {
        const auto t0 = std::chrono::steady_clock::now();
        exec(I, v, out, step, slots);
        const auto dt = std::chrono::steady_clock::now() - t0;
        const auto k = static_cast<size_t>(I.op);
        op_ns_[k] += std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count();
        op_calls_[k] += 1;
      } else {
        exec(I, v, out, step, slots);
      }
      if (I.out >= 0) v[I.out] = std::move(out);
      for (int64_t f : I.frees) v[f] = at::Tensor();
    }
    // the caller keeps the output past this run; the cached buffers are the next run's
    return hold.owns_lock() ? v[output_].clone() : v[output_];
  }

  std::vector<std::string> ops() const {
    std::vector<std::string> out;
    for (const Instr& I : instrs_)
      for (const auto& [name, op] : op_names())
        if (op == I.op) out.push_back(name);
    return out;
  }
  int64_t num_slots() const { return static_cast<int64_t>(slot_widths_.size()); }
  void set_mlp_scratch_bytes(int64_t bytes) {
    TORCH_CHECK(bytes > 0, "scratch bytes must be positive");
    mlp_scratch_bytes_ = bytes;
  }
  int64_t mlp_spare_calls() const { return mlp_spare_calls_.load(std::memory_order_relaxed); }
  int64_t mlp_slab_calls() const { return mlp_slab_calls_.load(std::memory_order_relaxed); }

  // Profiling (benchmarks, `pdserve profile`): wall time and calls per op kind while on; turning it on resets.
  void set_profiling(bool on) {
    if (on)
      for (size_t k = 0; k < op_ns_.size(); ++k) op_ns_[k] = 0, op_calls_[k] = 0;
    profiling_.store(on);
  }
  std::map<std::string, std::pair<int64_t, double>> op_times() const {
    std::map<std::string, std::pair<int64_t, double>> out;
    for (const auto& [name, op] : op_names()) {
      const auto k = static_cast<size_t>(op);
      if (op_calls_[k] > 0) out[name] = {op_calls_[k].load(), 1e-9 * static_cast<double>(op_ns_[k].load())};
    }
    return out;
  }

 private:
  const at::Tensor& c(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(consts_.size()), "constant ", i, " out of range");
    return consts_[i];
  }
  const PackedWeight& w(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(weights_.size()), "weight ", i, " out of range");
    return *weights_[i];
  }

  // What a run's instructions read besides their values.
  struct Step {
    const at::Tensor &kv_cache, &slot_mapping, &block_table, &query_start_loc, &seq_lens;
    const std::optional<at::Tensor>& prompt_lens;
    const std::optional<at::Tensor>& prompt_rows;  // uint8 [T]: the linears' row kinds (packed_weight.h), or none
  };

  // Rows of one chunk of a gated MLP: as many as a 6 MiB [rows, 2I] scratch holds, within 64-512 (512 up to
  // I = 1536: a 135M model's 512-token prompt in one chunk; 96 at I = 8192, a 1.7B model's; 64 from I = 12288), or
  // as many as the spare room of another slot's buffer holds (the
  // recorder names the slot: a dead value's, or the input's own when the input is narrower than its slot; a 1.7B
  // model's input [T, 2048] in its qkv output's [T, 6144] buffer leaves 128 rows of 2I at T = 512), whichever is
  // more: more rows at no memory. A large MLP's int8 / fp32 GEMM tiles run at 64 rows as fast as at 512 (1.7B
  // shape), but prompt rows on AMX decode the panels once per call, so each chunk more decodes them again: fewer,
  // larger chunks measured faster on both model sizes (BENCHMARKS.md).
  static constexpr int64_t kMlpMaxChunkRows = 512;

  // The gated MLP slab by slab of I where row chunks would decode every weight panel again for each chunk (and the
  // weights take slabs, PackedWeight::forward_slab): per slab of S intermediate columns (a multiple of 256, as many as
  // a [T, 2S] scratch within the MLP's budget holds), the slab's gate and up columns for every row, act over its gate
  // half, then the down projection over the slab's K range, its fp32 accumulators carried in out from slab to slab.
  // Each panel is decoded once; every element's operations are the row chunks' (the same bits). False: not taken.
  bool gated_mlp_slabs(const Instr& I, const at::Tensor& x, at::Tensor& out, std::vector<at::Tensor>& slots,
                       const at::Tensor* spare, int64_t start) const {
    const auto& n = I.ints;
    const PackedWeight &gate_up = w(n[0]), &down = w(n[2]);
    const int64_t t = x.size(0), inter = slot_widths_[n[5]] / 2, hidden = gate_up.k();
    const int64_t room = spare ? (spare->numel() - start) * static_cast<int64_t>(sizeof(float)) : 0;
    const bool borrow = room > mlp_scratch_bytes_;  // the spare room of another buffer, as the row chunks borrow it
    const int64_t budget = borrow ? room : mlp_scratch_bytes_;
    const int64_t width = std::min(inter, budget / (t * 2 * static_cast<int64_t>(sizeof(float))) / 256 * 256);
    if (width < 256 || inter % 256 != 0 || !gate_up.takes_slabs() || !down.takes_slabs()) return false;
    TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && out.size(1) == down.n(), "gated_mlp: strided columns");
    at::Tensor gu_all;
    if (borrow) {
      gu_all = spare->as_strided({t, 2 * width}, {2 * width, 1}, spare->storage_offset() + start);
      mlp_spare_calls_.fetch_add(1, std::memory_order_relaxed);
    } else {
      at::Tensor& own = slots[n[5]];  // [rows, 2I] as the row chunks keep it: as many rows as [t, 2 width] takes
      const int64_t two_i = 2 * inter, own_rows = (t * 2 * width + two_i - 1) / two_i;
      if (!own.defined() || own.size(0) < own_rows) own = at::empty({own_rows, two_i}, at::kFloat);
      gu_all = own.view(-1).narrow(0, 0, t * 2 * width).view({t, 2 * width});
    }
    const float* gb = n[1] >= 0 ? c(n[1]).data_ptr<float>() : nullptr;
    const float* db = n[3] >= 0 ? c(n[3]).data_ptr<float>() : nullptr;
    const float* xp = x.data_ptr<float>();
    float* g = gu_all.data_ptr<float>();
    for (int64_t j0 = 0; j0 < inter; j0 += width) {
      const int64_t s = std::min(width, inter - j0), ld = 2 * width;
      // x is quantized once for every slab (kept by the first call, x unchanged until the op's end)
      bool ok = gate_up.forward_slab(xp, x.stride(0), t, g, ld, gb ? gb + j0 : nullptr, j0, s, 0, hidden, false,
                                     j0 == 0 ? PackedWeight::kXKeep : PackedWeight::kXKept) &&
                gate_up.forward_slab(xp, x.stride(0), t, g + s, ld, gb ? gb + inter + j0 : nullptr, inter + j0, s, 0,
                                     hidden, false, PackedWeight::kXKept);
      at::Tensor act = gu_all.narrow(1, 0, s);
      gated_and_mul(act, gu_all.narrow(1, 0, 2 * s), n[4] != 0);
      ok = ok && down.forward_slab(g, ld, t, out.data_ptr<float>(), out.stride(0), j0 + s == inter ? db : nullptr, 0,
                                   down.n(), j0, s, j0 > 0, PackedWeight::kXOnce);
      TORCH_CHECK(ok, "gated_mlp: a weight refused a slab it takes");  // alignment holds by construction
    }
    mlp_slab_calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // The gated MLP in row chunks of equal size (more than half of the cap each), its [rows, 2I] scratch in its own
  // slot or in the spare room (past the input when the input lives in that buffer, contiguous at its start, as a
  // slot's value does). act(g) * u is written over g (each element reads only its own g and u), and the
  // down projection reads those first I columns with the scratch's row stride: no second buffer. A chunk of prompt
  // rows only, where the weight's format fuses it (GGUF blocks on AMX), gets act from the projection directly
  // (packed_gated_into: same bits, no [rows, 2I] written and read back). A row's bits do not depend on the chunking.
  void gated_mlp(const Instr& I, const at::Tensor& x, at::Tensor& out, const Step& st,
                 std::vector<at::Tensor>& slots) const {
    const auto& n = I.ints;
    const int64_t two_i = slot_widths_[n[5]], inter = two_i / 2, t = x.size(0);
    int64_t cap = std::clamp<int64_t>(mlp_scratch_bytes_ / (two_i * static_cast<int64_t>(sizeof(float))), 64,
                                      kMlpMaxChunkRows);
    const at::Tensor* spare = n[6] >= 0 && slots[n[6]].defined() ? &slots[n[6]] : nullptr;
    int64_t start = 0, spare_rows = 0;  // the room's first element in the spare buffer, its rows of 2I
    if (spare && x.data_ptr() == spare->data_ptr()) start = x.is_contiguous() ? x.numel() : spare->numel();
    if (spare) spare_rows = std::min(kMlpMaxChunkRows, (spare->numel() - start) / two_i);
    const bool borrow = t > cap && spare_rows > cap;
    if (borrow) cap = spare_rows;
    const int64_t chunks = (t + cap - 1) / cap, rows = chunks > 0 ? (t + chunks - 1) / chunks : 0;
    if (chunks > 1 && gated_mlp_slabs(I, x, out, slots, spare, start)) return;
    if (borrow) mlp_spare_calls_.fetch_add(1, std::memory_order_relaxed);
    at::Tensor& own = slots[n[5]];
    if (!borrow && (!own.defined() || own.size(0) < rows)) own = at::empty({rows, two_i}, at::kFloat);
    const at::Tensor gu_buf =
        borrow ? spare->as_strided({rows, two_i}, {two_i, 1}, spare->storage_offset() + start) : own;
    const auto bias = [&](int64_t i) { return i >= 0 ? std::optional<at::Tensor>(c(i)) : std::nullopt; };
    for (int64_t r0 = 0; r0 < t; r0 += rows) {
      const int64_t m = std::min(rows, t - r0);
      const std::optional<at::Tensor> kinds =
          st.prompt_rows ? std::optional<at::Tensor>(st.prompt_rows->narrow(0, r0, m)) : std::nullopt;
      at::Tensor gu = gu_buf.narrow(0, 0, m), y = out.narrow(0, r0, m);
      at::Tensor act = gu.narrow(1, 0, inter);
      const at::Tensor xc = x.narrow(0, r0, m);
      if (n[1] >= 0 || !packed_gated_into(w(n[0]), xc, act, n[4] != 0, kinds)) {  // fused: no [m, 2I] pass
        packed_linear_into(w(n[0]), xc, bias(n[1]), gu, kinds);
        gated_and_mul(act, gu, n[4] != 0);
      }
      packed_linear_into(w(n[2]), act, bias(n[3]), y, kinds);
    }
  }

  // One instruction; `out` is the slot buffer of an executor-allocated output, and receives the result otherwise.
  void exec(const Instr& I, std::vector<at::Tensor>& v, at::Tensor& out, const Step& st,
            std::vector<at::Tensor>& slots) const {
    const auto& n = I.ints;
    switch (I.op) {
      case Op::kNarrow: out = v[I.in[0]].narrow(1, n[0], n[1]); break;
      case Op::kEmbedding: out = packed_rows(w(n[0]), v[I.in[0]]); break;
      case Op::kRmsNorm: rms_norm(out, v[I.in[0]], c(n[0]), I.floats[0]); break;
      case Op::kAddRmsNorm: fused_add_rms_norm(v[I.in[0]], v[I.in[1]], c(n[0]), I.floats[0]); break;
      case Op::kHeadRmsNorm: rms_norm_heads(v[I.in[0]], c(n[0]), I.floats[0]); break;
      case Op::kRotary: rotary_embedding(v[I.in[0]], v[I.in[1]], v[I.in[2]], c(n[0]), c(n[1]), n[2]); break;
      case Op::kAttention: {
        const int64_t t = v[I.in[0]].size(0), hq = n[1], hkv = n[2], d = n[3];
        TORCH_CHECK(n[0] >= 0 && n[0] < st.kv_cache.size(0), "layer ", n[0], " is not in the KV cache");
        at::Tensor layer_cache = st.kv_cache.select(0, n[0]);
        // one group: slot_mapping [T], block_table [S, W]; KV cache groups: [G, T] and [G, S, W]
        const bool grouped = st.slot_mapping.dim() == 2;
        TORCH_CHECK(grouped ? n[5] < st.slot_mapping.size(0) : n[5] == 0, "KV group ", n[5], " has no block table");
        const at::Tensor slots = grouped ? st.slot_mapping.select(0, n[5]) : st.slot_mapping;
        const at::Tensor table = grouped ? st.block_table.select(0, n[5]) : st.block_table;
        reshape_and_cache(v[I.in[1]].view({t, hkv, d}), v[I.in[2]].view({t, hkv, d}), layer_cache, slots);
        at::Tensor o = out.view({t, hq, d});
        paged_attention(o, v[I.in[0]].view({t, hq, d}), layer_cache, table, st.query_start_loc, st.seq_lens,
                        I.floats[0], n[4], I.floats[1], st.prompt_lens);
        break;
      }
      case Op::kSiluMul: silu_and_mul(out, v[I.in[0]]); break;
      case Op::kGeluMul: gelu_tanh_and_mul(out, v[I.in[0]]); break;
      case Op::kScale: v[I.in[0]].mul_(I.floats[0]); break;
      case Op::kLinear:  // always a slot (append() checks): written in place
        packed_linear_into(w(n[0]), v[I.in[0]], n[1] >= 0 ? std::optional<at::Tensor>(c(n[1])) : std::nullopt, out,
                           st.prompt_rows);
        break;
      case Op::kMoe:
        TORCH_CHECK(n[0] >= 0 && n[0] < static_cast<int64_t>(moes_.size()), "experts ", n[0], " out of range");
        moes_[n[0]]->forward_into(v[I.in[0]], v[I.in[1]], out, st.prompt_rows);
        break;
      case Op::kGatedMlp: gated_mlp(I, v[I.in[0]], out, st, slots); break;
      default: TORCH_CHECK(false, "unknown op");
    }
  }

  std::vector<at::Tensor> consts_;
  std::vector<PackedWeightPtr> weights_;
  std::vector<std::shared_ptr<const MoeExperts>> moes_;
  std::vector<Instr> instrs_;
  std::vector<int64_t> slot_widths_;
  std::vector<bool> defined_ = {true, true};  // ids, positions
  int64_t num_values_ = 2, output_ = -1;
  std::atomic<bool> profiling_{false};
  mutable std::mutex cache_mu_;
  int64_t mlp_scratch_bytes_ = int64_t{6} << 20;  // the gated MLPs' own scratch (tests lower it)
  mutable std::atomic<int64_t> mlp_spare_calls_{0};  // gated MLP calls whose scratch was another buffer's room
  mutable std::atomic<int64_t> mlp_slab_calls_{0};   // gated MLP calls computed slab by slab of I
  mutable std::vector<at::Tensor> slot_cache_;  // per slot, [rows >= the step's T, width]
  mutable std::array<std::atomic<int64_t>, static_cast<size_t>(Op::kNumOps)> op_ns_{}, op_calls_{};
};

void register_native_program(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<NativeProgram>(m, "NativeProgram",
                            "a model's forward as recorded native ops, run in one call (model/native_program.py)")
      .def(py::init<>())
      .def("add_const", &NativeProgram::add_const, py::arg("t"))
      .def("add_packed", &NativeProgram::add_packed, py::arg("w"))
      .def("add_moe", &NativeProgram::add_moe, py::arg("experts"))
      .def("add_slot", &NativeProgram::add_slot, py::arg("width"))
      .def("append", &NativeProgram::append, py::arg("op"), py::arg("inputs"), py::arg("out"), py::arg("slot"),
           py::arg("ints"), py::arg("floats"), py::arg("frees"), py::arg("width") = -1)
      .def("set_output", &NativeProgram::set_output, py::arg("value"))
      .def("run", &NativeProgram::run, py::arg("ids"), py::arg("positions"), py::arg("kv_cache"),
           py::arg("slot_mapping"), py::arg("block_table"), py::arg("query_start_loc"), py::arg("seq_lens"),
           py::arg("prompt_lens") = py::none(), py::arg("prompt_rows") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_profiling", &NativeProgram::set_profiling, py::arg("on"),
           "time each op kind of the following runs (turning it on resets the totals)")
      .def("op_times", &NativeProgram::op_times, "op kind -> (calls, seconds) since profiling was turned on")
      .def("ops", &NativeProgram::ops, "the op name of each instruction, in order")
      .def_property_readonly("num_slots", &NativeProgram::num_slots)
      .def("set_mlp_scratch_bytes", &NativeProgram::set_mlp_scratch_bytes, py::arg("bytes"),
           "the gated MLPs' own scratch budget (6 MiB; tests lower it to exercise the chunking)")
      .def_property_readonly("mlp_spare_calls", &NativeProgram::mlp_spare_calls,
                             "gated MLP calls whose scratch was spare room in another slot's buffer")
      .def_property_readonly("mlp_slab_calls", &NativeProgram::mlp_slab_calls,
                             "gated MLP calls computed slab by slab of the intermediate size");
}

}  // namespace
PDSERVE_REGISTER(register_native_program);
}  // namespace pdserve
