// A weight matrix W [N, K] packed once at load into the layout its kernels stream best, multiplied as
// y[M, N] = x[M, K] @ W^T (+ bias) with float32 activations x and outputs y.
//
// Every implementation keeps one contract, batch invariance: y[r][j] depends only on x[r], W[j] and bias[j], never
// on M, on the other rows, on the thread count or on which kernel path (GEMV, register-tiled GEMM, AMX) or ISA level
// ran. Every path computes it by the same sequence of fp32 operations: exact integer partial sums where the
// activations are quantized, then one fixed-order fp32 accumulation over K per output. Work is split over output
// columns only, never over K. This is what lets speculative verification, padded and mixed batches and PD hand-offs
// reproduce a plain decode bit for bit.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>

#include "fused_kernels.h"

namespace pdserve {

class PackedWeight {
 public:
  PackedWeight(int64_t n, int64_t k) : n_(n), k_(k) {}
  virtual ~PackedWeight() = default;
  PackedWeight(const PackedWeight&) = delete;
  PackedWeight& operator=(const PackedWeight&) = delete;

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  // The stored type, as GGUF names it where it has a name: "Q4_K", "Q8_0", "BF16", "F32", ...
  virtual std::string type_name() const = 0;
  // Bytes one pass over W reads (what a batch-1 decode step streams for this matrix).
  virtual int64_t nbytes() const = 0;
  // y[r * ldy + j] = sum_k x[r * ldx + k] * W[j, k] (+ bias[j]) for r < m, j < n; bias may be null. Threads: the
  // implementation splits the columns over the threads (pdserve::parallel_for, parallel.h).
  virtual void forward(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias) const = 0;
  // As forward, with the rows' kinds: prompt_rows[r] != 0 marks a prompt row (position below its sequence's prompt
  // length), which a format may multiply by another fixed sequence of operations (GGUF blocks on AMX: bf16 tiles
  // over the dequantized weights). A row's result then depends on x[r], W, bias and its kind only: batch invariance
  // holds per kind, and a token computed again (preemption, chunking, speculation) has the same kind.
  virtual void forward_rows(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias,
                            const uint8_t* prompt_rows) const {
    (void)prompt_rows;
    forward(x, ldx, m, y, ldy, bias);
  }
  // Slabs of the product, for an op that computes a long matrix product in pieces (a gated MLP slab by slab of I):
  // y[r * ldy + j] = (accumulate ? y[r * ldy + j] : 0) + sum over k0 <= k < k0 + kn of x[r * ldx + k - k0] * W[c0 + j, k]
  // (+ bias[j]) for r < m, j < nc, where the sum continues the fp32 accumulation over K that an earlier call over
  // the K range before k0 left in y (accumulate), so calls over consecutive K ranges, bias in the last, give
  // forward's bits. c0 a multiple of 16 and nc too (or reaching n), k0 and kn multiples of the format's block.
  // takes_slabs: whether forward_slab computes them (false: it returns false; it also does for a misaligned slab,
  // y then unspecified). x_reuse: kXOnce, or, for calls that multiply one x by several column slabs, kXKeep (the
  // format keeps the calling thread's quantized x) then kXKept (x unchanged since: the kept quantization serves,
  // where it was made for the same x, shape and format).
  enum XReuse : int { kXOnce = 0, kXKeep = 1, kXKept = 2 };
  virtual bool takes_slabs() const { return false; }
  virtual bool forward_slab(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias,
                            int64_t c0, int64_t nc, int64_t k0, int64_t kn, bool accumulate, XReuse x_reuse) const {
    (void)x, (void)ldx, (void)m, (void)y, (void)ldy, (void)bias, (void)c0, (void)nc, (void)k0, (void)kn, (void)accumulate;
    (void)x_reuse;
    return false;
  }
  // A gated MLP's gate/up projection (W = [gate; up], n = 2I): act[r * ld_act + j] = gated(y[r, :I], y[r, I:])[j]
  // for j < I, without writing y, when the format has a fused path for these rows (GGUF blocks on AMX, every row a
  // prompt row, I a multiple of 16); false (nothing written) otherwise. The same bits as forward_rows then gated.
  virtual bool forward_gated(const float* x, int64_t ldx, int64_t m, float* act, int64_t ld_act, GatedMulFn gated,
                             const uint8_t* prompt_rows) const {
    (void)x, (void)ldx, (void)m, (void)act, (void)ld_act, (void)gated, (void)prompt_rows;
    return false;
  }
  // W as float32 [n, k]: the values the kernels multiply by (tests, reference paths).
  virtual at::Tensor dequantize() const = 0;
  // out[i * k + c] = W[ids[i], c] for i < t (W read as an embedding table). Ids are checked by the caller.
  virtual void rows(const int64_t* ids, int64_t t, float* out) const;

 private:
  int64_t n_, k_;
};

using PackedWeightPtr = std::shared_ptr<const PackedWeight>;

// Tensor-level entry points (argument checks included), for C++ callers and the Python bindings.
// prompt_rows: uint8 or bool [M], the rows' kinds (forward_rows); none: every row a generated one.
at::Tensor packed_linear(const PackedWeight& w, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& prompt_rows = std::nullopt);
// The same into y [M, N] (rows y.stride(0) apart): the native program's buffers, reused from step to step.
void packed_linear_into(const PackedWeight& w, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                        at::Tensor& y, const std::optional<at::Tensor>& prompt_rows = std::nullopt);
at::Tensor packed_rows(const PackedWeight& w, const at::Tensor& ids);
// act [M, N/2] (rows act.stride(0) apart) = silu (gelu: gelu_tanh) of the gate half times the up half of x @ W.T
// where the format fuses it (forward_gated); false, nothing written, otherwise.
bool packed_gated_into(const PackedWeight& w, const at::Tensor& x, at::Tensor& act, bool gelu,
                       const std::optional<at::Tensor>& prompt_rows);

}  // namespace pdserve
