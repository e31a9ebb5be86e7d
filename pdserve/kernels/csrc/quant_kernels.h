// Quantized linear kernels over GGUF blocks (Q4_0, Q4_1, Q8_0), one table of plain functions per ISA level.
// No torch here: the ISA files include only this header, common.h, <immintrin.h> and std headers.
//
// Weight tensor: N rows, each row is the K/32 GGUF blocks of that output row, exactly as stored in the file
// (row stride = (K/32) * block_bytes). Activations are quantized per row, per block of 32, to int8 with an fp32
// scale d = amax/127 and q = round_half_even(x * (1/d)) (llama.cpp's Q8 activation scheme, fp32 scale); the
// layout of a quantized activation row is private to each ISA level (act_row_bytes/quantize_act/gemm agree).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace pdserve::quant {

inline int block_bytes(int qtype) {
  switch (qtype) {
    case static_cast<int>(QType::kQ4_0): return static_cast<int>(sizeof(BlockQ4_0));
    case static_cast<int>(QType::kQ4_1): return static_cast<int>(sizeof(BlockQ4_1));
    case static_cast<int>(QType::kQ8_0): return static_cast<int>(sizeof(BlockQ8_0));
    default: return 0;  // unsupported
  }
}

inline int64_t row_bytes(int64_t k, int qtype) { return k / QK * block_bytes(qtype); }

struct QuantOps {
  // Bytes of one quantized activation row of length k (a multiple of 64).
  size_t (*act_row_bytes)(int64_t k, int qtype);
  // Quantize activation rows m0..m1 (x row r at x + r*ldx) into xq + r*act_row_bytes.
  void (*quantize_act)(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, int qtype, uint8_t* xq);
  // y[r*ldy + n] = sum_k w[n, k] * xq[r, k] (+ bias[n]) for r < m, n in n0..n1. bias may be null.
  void (*gemm)(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const uint8_t* xq, int64_t m,
               const float* bias, float* y, int64_t ldy);
  // out[(r - r0)*k + j] = w[r, j] for rows r0..r1, bitwise equal to gguf.quants.dequantize.
  void (*dequant)(const uint8_t* w, int64_t r0, int64_t r1, int64_t k, int qtype, float* out);
};

extern const QuantOps kGenericOps;
#if defined(__x86_64__)
extern const QuantOps kAvx2Ops;
extern const QuantOps kAvx512Ops;
#endif

// ggml's reference quantization (quantize_row_q*_ref), rows r0..r1 of x [*, k] into out + (r - r0)*row_bytes:
// byte for byte equal to gguf.quants.quantize. Scalar on purpose: the rounding is the contract.
void quantize_ref(const float* x, int64_t r0, int64_t r1, int64_t k, int qtype, uint8_t* out);

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace pdserve::quant
