// Row kernels of a transformer layer (RMSNorm, residual add + RMSNorm, rotary embedding, SiLU/GELU-and-mul), one set
// per ISA level. Each works on rows [r0, r1) of row-strided f32 matrices (the last dimension contiguous), so the
// dispatcher (fused_ops.cpp) can split rows across threads. No torch here: the ISA files include only this.
#pragma once

#include <cstdint>

#include "common.h"

namespace pdserve {

// out[r, :i] = act(x[r, :i]) * x[r, i:2i] for rows [r0, r1): FusedKernels' silu_mul and gelu_tanh_mul.
using GatedMulFn = void (*)(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t i, int64_t r0,
                            int64_t r1);

struct FusedKernels {
  // out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
  void (*rms_norm)(float* out, int64_t out_stride, const float* x, int64_t x_stride, const float* w, int64_t h,
                   float eps, int64_t r0, int64_t r1);
  // res[r] += x[r]; x[r] = rms_norm(res[r]) * w
  void (*add_rms_norm)(float* x, int64_t x_stride, float* res, int64_t res_stride, const float* w, int64_t h,
                       float eps, int64_t r0, int64_t r1);
  // Rotate-half rotary on nq heads of q and nk heads of k of token r, angles row pos[r] of cos/sin [P, d/2].
  void (*rotary)(const int64_t* pos, float* q, int64_t q_stride, int64_t nq, float* k, int64_t k_stride,
                 int64_t nk, const float* cos, const float* sin, int64_t d, int64_t r0, int64_t r1);
  // out[r, :i] = silu(x[r, :i]) * x[r, i:2i]
  GatedMulFn silu_mul;
  // out[r, :i] = gelu_tanh(x[r, :i]) * x[r, i:2i], as x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3)
  GatedMulFn gelu_tanh_mul;
};

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)): the -2u of each kernel's exp.
constexpr float kGeluTanhK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluTanhC = 0.044715f;

const FusedKernels& fused_kernels_generic();
#if defined(__x86_64__)
const FusedKernels& fused_kernels_avx2();
const FusedKernels& fused_kernels_avx512();
#endif

}  // namespace pdserve
