// Portable scalar quantized-linear kernels: the reference every SIMD level is tested against, and ggml's reference
// weight quantization. Products and sums are never contracted into FMAs (dequantize and quantize must be bitwise
// equal to gguf-py's numpy, which rounds each operation).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant_kernels.h"

#pragma GCC optimize("fp-contract=off")

namespace pdserve::quant {
namespace {

// Activation row: q int8[k], d float[nb], s int32[nb] (s = sum of the block's q).
size_t act_row_bytes(int64_t k, int /*qtype*/) {
  const int64_t nb = k / QK;
  return static_cast<size_t>((k + 8 * nb + 63) / 64 * 64);
}

void quantize_act(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, int qtype, uint8_t* xq) {
  const int64_t nb = k / QK;
  const size_t stride = act_row_bytes(k, qtype);
  for (int64_t r = m0; r < m1; ++r) {
    const float* xr = x + r * ldx;
    uint8_t* row = xq + r * stride;
    int8_t* q = reinterpret_cast<int8_t*>(row);
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.0f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xr[b * QK + j]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t s = 0;
      for (int j = 0; j < QK; ++j) {
        const int v = static_cast<int>(std::nearbyint(xr[b * QK + j] * id));  // round half to even
        q[b * QK + j] = static_cast<int8_t>(v);
        s += v;
      }
      std::memcpy(row + k + 4 * b, &d, 4);
      std::memcpy(row + k + 4 * nb + 4 * b, &s, 4);
    }
  }
}

// Weight block b of a row as signed ints w = (q - zero) with scale dw and (Q4_1) min m: w_real = dw * w + m.
int32_t block_dot(const uint8_t* blk, int qtype, const int8_t* qx) {
  int32_t acc = 0;
  if (qtype == static_cast<int>(QType::kQ8_0)) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < QK; ++j) acc += qs[j] * qx[j];
    return acc;
  }
  const uint8_t* qs = blk + (qtype == static_cast<int>(QType::kQ4_1) ? 4 : 2);
  const int zero = qtype == static_cast<int>(QType::kQ4_0) ? 8 : 0;
  for (int j = 0; j < QK / 2; ++j) {
    acc += ((qs[j] & 0xF) - zero) * qx[j];
    acc += ((qs[j] >> 4) - zero) * qx[j + QK / 2];
  }
  return acc;
}

void gemm(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const uint8_t* xq, int64_t m,
          const float* bias, float* y, int64_t ldy) {
  const int64_t nb = k / QK, bb = block_bytes(qtype), stride = static_cast<int64_t>(act_row_bytes(k, qtype));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = w + n * nb * bb;
    for (int64_t r = 0; r < m; ++r) {
      const uint8_t* row = xq + r * stride;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wrow + b * bb;
        float dx;
        int32_t sx;
        std::memcpy(&dx, row + k + 4 * b, 4);
        std::memcpy(&sx, row + k + 4 * nb + 4 * b, 4);
        const int32_t dot = block_dot(blk, qtype, reinterpret_cast<const int8_t*>(row) + b * QK);
        acc += fp16_to_fp32(load_u16(blk)) * dx * static_cast<float>(dot);
        if (qtype == static_cast<int>(QType::kQ4_1)) acc += fp16_to_fp32(load_u16(blk + 2)) * dx * static_cast<float>(sx);
      }
      y[r * ldy + n] = bias ? acc + bias[n] : acc;
    }
  }
}

void dequant(const uint8_t* w, int64_t r0, int64_t r1, int64_t k, int qtype, float* out) {
  const int64_t nb = k / QK, bb = block_bytes(qtype);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + (r * nb + b) * bb;
      float* o = out + (r - r0) * k + b * QK;
      const float d = fp16_to_fp32(load_u16(blk));
      if (qtype == static_cast<int>(QType::kQ8_0)) {
        for (int j = 0; j < QK; ++j) o[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
      } else if (qtype == static_cast<int>(QType::kQ4_0)) {
        for (int j = 0; j < QK / 2; ++j) {
          o[j] = d * static_cast<float>((blk[2 + j] & 0xF) - 8);
          o[j + QK / 2] = d * static_cast<float>((blk[2 + j] >> 4) - 8);
        }
      } else {
        const float mn = fp16_to_fp32(load_u16(blk + 2));
        for (int j = 0; j < QK / 2; ++j) {
          o[j] = d * static_cast<float>(blk[4 + j] & 0xF) + mn;
          o[j + QK / 2] = d * static_cast<float>(blk[4 + j] >> 4) + mn;
        }
      }
    }
  }
}

// ggml quantize_row_q4_0_ref: d = max / -8 where max is the signed value of largest magnitude (first one).
void quantize_block_q4_0(const float* x, uint8_t* blk) {
  float amax = 0.0f, mx = 0.0f;
  for (int j = 0; j < QK; ++j)
    if (amax < std::fabs(x[j])) { amax = std::fabs(x[j]); mx = x[j]; }
  const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const uint16_t dh = fp32_to_fp16(d);
  std::memcpy(blk, &dh, 2);
  for (int j = 0; j < QK / 2; ++j) {
    const int lo = std::min(15, static_cast<int>(std::trunc(x[j] * id + 8.5f)));
    const int hi = std::min(15, static_cast<int>(std::trunc(x[j + QK / 2] * id + 8.5f)));
    blk[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

// ggml quantize_row_q4_1_ref: d = (max - min) / 15, m = min.
void quantize_block_q4_1(const float* x, uint8_t* blk) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < QK; ++j) { mn = std::min(mn, x[j]); mx = std::max(mx, x[j]); }
  const float d = (mx - mn) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const uint16_t dh = fp32_to_fp16(d), mh = fp32_to_fp16(mn);
  std::memcpy(blk, &dh, 2);
  std::memcpy(blk + 2, &mh, 2);
  for (int j = 0; j < QK / 2; ++j) {
    const int lo = std::min(15, static_cast<int>(std::trunc((x[j] - mn) * id + 0.5f)));
    const int hi = std::min(15, static_cast<int>(std::trunc((x[j + QK / 2] - mn) * id + 0.5f)));
    blk[4 + j] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

// ggml quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) (half away from zero).
void quantize_block_q8_0(const float* x, uint8_t* blk) {
  float amax = 0.0f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const uint16_t dh = fp32_to_fp16(d);
  std::memcpy(blk, &dh, 2);
  for (int j = 0; j < QK; ++j) blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id)));
}

}  // namespace

void quantize_ref(const float* x, int64_t r0, int64_t r1, int64_t k, int qtype, uint8_t* out) {
  const int64_t nb = k / QK, bb = block_bytes(qtype);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * QK;
      uint8_t* blk = out + ((r - r0) * nb + b) * bb;
      if (qtype == static_cast<int>(QType::kQ4_0)) quantize_block_q4_0(xb, blk);
      else if (qtype == static_cast<int>(QType::kQ4_1)) quantize_block_q4_1(xb, blk);
      else quantize_block_q8_0(xb, blk);
    }
  }
}

const QuantOps kGenericOps = {act_row_bytes, quantize_act, gemm, dequant};

}  // namespace pdserve::quant
