// Quantized linear with float32 activations: the GGUF blocks are dequantized in registers and multiplied with the
// activations in fp32, so the result is x @ dequantize(w).T up to float summation order (no activation rounding).
// Per block of 32 weights and activation row r, with s = sum_j x_j * q_j and xs = sum_j x_j:
//   Q8_0: d * s      Q4_0: d * (s - 8 * xs)      Q4_1: d * s + m * xs
// No torch here (the ISA files include this, common.h, quant_kernels.h and <immintrin.h> only).
#pragma once

#include <cstdint>

#include "quant_kernels.h"

namespace pdserve::quant {

// y[r * ldy + n] = sum_k x[r * ldx + k] * w[n, k] (+ bias[n]) for r < m, n in n0..n1 (bias may be null).
using GemmF32Fn = void (*)(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const float* x,
                           int64_t ldx, int64_t m, const float* bias, float* y, int64_t ldy);

void gemm_f32_generic(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const float* x, int64_t ldx,
                      int64_t m, const float* bias, float* y, int64_t ldy);
#if defined(__x86_64__)
void gemm_f32_avx2(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const float* x, int64_t ldx,
                   int64_t m, const float* bias, float* y, int64_t ldy);
void gemm_f32_avx512(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const float* x, int64_t ldx,
                     int64_t m, const float* bias, float* y, int64_t ldy);
#endif

// Per-block activation sums xs[r * nb + b] = sum of x[r, 32b .. 32b + 31], rows 0..m (shared by all ISA levels).
inline void block_sums(const float* x, int64_t ldx, int64_t m, int64_t k, float* xs) {
  const int64_t nb = k / QK;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int j = 0; j < QK; ++j) s += x[r * ldx + b * QK + j];
      xs[r * nb + b] = s;
    }
}

// The per-block scalar terms: d, and the coefficient of xs (Q4_1: m; Q4_0: -8d; Q8_0: 0).
inline void block_scales(const uint8_t* blk, int qtype, float& d, float& c) {
  d = fp16_to_fp32(load_u16(blk));
  if (qtype == static_cast<int>(QType::kQ4_1)) c = fp16_to_fp32(load_u16(blk + 2));
  else if (qtype == static_cast<int>(QType::kQ4_0)) c = -8.0f * d;
  else c = 0.0f;
}

}  // namespace pdserve::quant
