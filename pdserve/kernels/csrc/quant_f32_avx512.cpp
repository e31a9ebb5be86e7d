// AVX-512 fp32-activation quantized linear (see quant_f32_kernels.h). A register tile of MR activation rows x NC
// weight rows: each block of a weight row is unpacked to 2 x 16 floats once and used by all MR rows; each row keeps
// one vector accumulator per weight row (d * (x . q) summed over blocks) and a scalar for the xs terms.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quant_f32_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

namespace pdserve::quant {
namespace {

constexpr int kQ41 = 3, kQ80 = 8;

template <int QT>
inline void unpack(const uint8_t* blk, __m512& lo, __m512& hi) {
  if constexpr (QT == kQ80) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
  } else {
    // one byte -> int32 expansion (the shuffle port's only op here), then both nibbles from each 32-bit lane
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ41 ? 4 : 2))));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
}

// Scales (and Q4_1 mins) of up to 16 consecutive blocks, one gather: a block starts with d (then m for Q4_1).
template <int QT>
inline void load_scales(const uint8_t* blk0, int64_t nblk, __m512& d, __m512& m) {
  constexpr int bb = QT == kQ80 ? 34 : QT == kQ41 ? 20 : 18;
  const __m512i offs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(bb));
  const __mmask16 mask = static_cast<__mmask16>((1u << nblk) - 1u);
  const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offs, blk0, 1);
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
  m = QT == kQ41 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                 : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));  // Q4_0's zero point; unused for Q8_0
}

// Blocks go 16 at a time: their scales in one gather per weight row; each block's weights are unpacked and scaled
// (d * q) once per weight row and used by the MR rows (2 FMAs per row and block); the xs terms (Q4_0/Q4_1) are
// one 16-lane FMA per row and 16 blocks.
template <int QT, int MR, int NC>
void tile(const uint8_t* w, int64_t rb, int64_t nb, const float* x, int64_t ldx, const float* xs, float* out) {
  constexpr int bb = QT == kQ80 ? 34 : QT == kQ41 ? 20 : 18;
  __m512 acc[MR][NC], sc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = sc[r][c] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int64_t nblk = std::min<int64_t>(16, nb - b0);
    __m512 d16[NC], m16[NC];
    alignas(64) float dv[NC][16];  // broadcast from memory below: a load-port op, not a shuffle
    for (int c = 0; c < NC; ++c) {
      load_scales<QT>(w + c * rb + b0 * bb, nblk, d16[c], m16[c]);
      _mm512_store_ps(dv[c], d16[c]);
    }
    if constexpr (QT != kQ80) {
      const __mmask16 mask = static_cast<__mmask16>((1u << nblk) - 1u);
      for (int r = 0; r < MR; ++r) {
        const __m512 s = _mm512_maskz_loadu_ps(mask, xs + r * nb + b0);
        for (int c = 0; c < NC; ++c) sc[r][c] = _mm512_fmadd_ps(m16[c], s, sc[r][c]);
      }
    }
    for (int64_t b = b0; b < b0 + nblk; ++b) {
      __m512 lo[NC], hi[NC];
      for (int c = 0; c < NC; ++c) {
        unpack<QT>(w + c * rb + b * bb, lo[c], hi[c]);
        const __m512 d = _mm512_set1_ps(dv[c][b - b0]);
        lo[c] = _mm512_mul_ps(lo[c], d);
        hi[c] = _mm512_mul_ps(hi[c], d);
      }
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + b * QK;
        const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(x1, hi[c], _mm512_fmadd_ps(x0, lo[c], acc[r][c]));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c], sc[r][c]));
}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, const float*, float*);

// Few rows (decode): several weight rows per tile so the FMA chains are independent; more rows: 4 x 2 tiles.
template <int QT>
TileFn pick(int64_t mr, int nc) {
  if (nc == 4) return mr == 1 ? tile<QT, 1, 4> : tile<QT, 2, 4>;
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
  const int nc = m <= 2 ? 4 : 2;
  float out[4 * 4];
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const int64_t mr = std::min<int64_t>(4, m - r0);
    for (int64_t n = n0; n < n1;) {
      const int c = n + nc <= n1 ? nc : 1;
      pick<QT>(mr, c)(w + n * rb, rb, nb, x + r0 * ldx, ldx, xs.data() + r0 * nb, out);
      for (int64_t r = 0; r < mr; ++r)
        for (int j = 0; j < c; ++j) y[(r0 + r) * ldy + n + j] = out[r * c + j] + (bias ? bias[n + j] : 0.0f);
      n += c;
    }
  }
}

}  // namespace

void gemm_f32_avx512(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const float* x, int64_t ldx,
                     int64_t m, const float* bias, float* y, int64_t ldy) {
  if (qtype == kQ80) gemm_t<kQ80>(w, n0, n1, k, x, ldx, m, bias, y, ldy);
  else if (qtype == kQ41) gemm_t<kQ41>(w, n0, n1, k, x, ldx, m, bias, y, ldy);
  else gemm_t<2>(w, n0, n1, k, x, ldx, m, bias, y, ldy);
}

}  // namespace pdserve::quant

#pragma GCC pop_options
#endif  // __x86_64__
