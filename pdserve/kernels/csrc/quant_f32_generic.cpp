// Portable fp32-activation quantized linear (see quant_f32_kernels.h): the reference the vector paths must match.
#include <vector>

#include "quant_f32_kernels.h"

namespace pdserve::quant {

void gemm_f32_generic(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const float* x, int64_t ldx,
                      int64_t m, const float* bias, float* y, int64_t ldy) {
  const int64_t nb = k / QK, bb = block_bytes(qtype), rb = nb * bb;
  const int q4off = qtype == static_cast<int>(QType::kQ4_1) ? 4 : 2;
  std::vector<float> xs(static_cast<size_t>(m * nb));
  block_sums(x, ldx, m, k, xs.data());
  float q[QK];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < m; ++r) y[r * ldy + n] = bias ? bias[n] : 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + n * rb + b * bb;
      float d, c;
      block_scales(blk, qtype, d, c);
      if (qtype == static_cast<int>(QType::kQ8_0)) {
        for (int j = 0; j < QK; ++j) q[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j]));
      } else {
        for (int j = 0; j < QK / 2; ++j) {
          q[j] = static_cast<float>(blk[q4off + j] & 0x0F);
          q[j + QK / 2] = static_cast<float>(blk[q4off + j] >> 4);
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * ldx + b * QK;
        float s = 0.0f;
        for (int j = 0; j < QK; ++j) s += xr[j] * q[j];
        y[r * ldy + n] += d * s + c * xs[r * nb + b];
      }
    }
  }
}

}  // namespace pdserve::quant
