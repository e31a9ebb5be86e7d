// AVX2 fp32-activation quantized linear (see quant_f32_kernels.h and quant_f32_avx512.cpp, which this mirrors with
// 8-float vectors: a block is 4 vectors of 8 weights).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quant_f32_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "vec_avx2.h"

namespace pdserve::quant {
namespace {

using vec::hsum;

constexpr int kQ41 = 3, kQ80 = 8;

inline __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// The 32 weights of a block as 4 x 8 floats, in order (Q4: low nibbles are weights 0..15, high 16..31).
template <int QT>
inline void unpack(const uint8_t* blk, __m256 q[4]) {
  if constexpr (QT == kQ80) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    q[0] = i8x8(a), q[1] = i8x8(_mm_srli_si128(a, 8)), q[2] = i8x8(b), q[3] = i8x8(_mm_srli_si128(b, 8));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ41 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    q[0] = u8x8(lo), q[1] = u8x8(_mm_srli_si128(lo, 8)), q[2] = u8x8(hi), q[3] = u8x8(_mm_srli_si128(hi, 8));
  }
}

template <int QT, int MR, int NC>
void tile(const uint8_t* w, int64_t rb, int64_t nb, const float* x, int64_t ldx, const float* xs, float* out) {
  constexpr int bb = QT == kQ80 ? 34 : QT == kQ41 ? 20 : 18;
  __m256 acc[MR][NC];
  float sc[MR][NC] = {};
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 q[NC][4], d[NC];
    float coef[NC];
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = w + c * rb + b * bb;
      unpack<QT>(blk, q[c]);
      const float dv = _cvtsh_ss(load_u16(blk));
      d[c] = _mm256_set1_ps(dv);
      coef[c] = QT == kQ41 ? _cvtsh_ss(load_u16(blk + 2)) : QT == kQ80 ? 0.0f : -8.0f * dv;
    }
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * ldx + b * QK;
      const __m256 x0 = _mm256_loadu_ps(xr), x1 = _mm256_loadu_ps(xr + 8);
      const __m256 x2 = _mm256_loadu_ps(xr + 16), x3 = _mm256_loadu_ps(xr + 24);
      const float s = xs[r * nb + b];
      for (int c = 0; c < NC; ++c) {
        __m256 p = _mm256_fmadd_ps(x1, q[c][1], _mm256_mul_ps(x0, q[c][0]));
        p = _mm256_fmadd_ps(x3, q[c][3], _mm256_fmadd_ps(x2, q[c][2], p));
        acc[r][c] = _mm256_fmadd_ps(d[c], p, acc[r][c]);
        if constexpr (QT != kQ80) sc[r][c] += coef[c] * s;
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = hsum(acc[r][c]) + sc[r][c];
}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, const float*, float*);

template <int QT>
TileFn pick(int64_t mr, int nc) {
  if (nc == 2) {
    static constexpr TileFn t2[4] = {tile<QT, 1, 2>, tile<QT, 2, 2>, tile<QT, 3, 2>, tile<QT, 4, 2>};
    return t2[mr - 1];
  }
  static constexpr TileFn t1[4] = {tile<QT, 1, 1>, tile<QT, 2, 1>, tile<QT, 3, 1>, tile<QT, 4, 1>};
  return t1[mr - 1];
}

template <int QT>
void gemm_t(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, const float* x, int64_t ldx, int64_t m,
            const float* bias, float* y, int64_t ldy) {
  const int64_t nb = k / QK, rb = row_bytes(k, QT);
  std::vector<float> xs(static_cast<size_t>(m * nb));
  block_sums(x, ldx, m, k, xs.data());
  float out[4 * 2];
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const int64_t mr = std::min<int64_t>(4, m - r0);
    for (int64_t n = n0; n < n1;) {
      const int c = n + 2 <= n1 ? 2 : 1;
      pick<QT>(mr, c)(w + n * rb, rb, nb, x + r0 * ldx, ldx, xs.data() + r0 * nb, out);
      for (int64_t r = 0; r < mr; ++r)
        for (int j = 0; j < c; ++j) y[(r0 + r) * ldy + n + j] = out[r * c + j] + (bias ? bias[n + j] : 0.0f);
      n += c;
    }
  }
}

}  // namespace

void gemm_f32_avx2(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const float* x, int64_t ldx,
                   int64_t m, const float* bias, float* y, int64_t ldy) {
  if (qtype == kQ80) gemm_t<kQ80>(w, n0, n1, k, x, ldx, m, bias, y, ldy);
  else if (qtype == kQ41) gemm_t<kQ41>(w, n0, n1, k, x, ldx, m, bias, y, ldy);
  else gemm_t<2>(w, n0, n1, k, x, ldx, m, bias, y, ldy);
}

}  // namespace pdserve::quant

#pragma GCC pop_options
#endif  // __x86_64__
