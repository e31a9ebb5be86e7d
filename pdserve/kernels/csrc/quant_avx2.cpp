// AVX2 (+FMA, F16C) quantized-linear kernels: one weight block (32 weights) per ymm, dot products with
// _mm256_maddubs_epi16 (u8 x s8, pairs summed to int16) + _mm256_madd_epi16 (to int32), as in ggml's AVX2 path.
//
// Activation row layout (nb = k/32 blocks, natural order, signed q):
//   s8  q[nb*32]
//   f32 dx[nb*8]     the block scale in each of the 8 int32 lanes
//   ext[nb*8]        Q4_0: int32 -sum(q) per lane (8 lanes sum to the -8*sum(q) of the q-8 offset);
//                    Q4_1: f32 dx*sum(q)/8 per lane (times the block min m); Q8_0: absent
// Q4 nibbles (0..15) are the unsigned operand: |pair sum| <= 2*15*127 fits int16. Q8_0 weights use the sign
// trick (|w| x sign(x, w)): |pair sum| <= 2*128*127 fits int16, so maddubs never saturates.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quant_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdserve::quant {
namespace {

constexpr int kQ40 = 2, kQ41 = 3, kQ80 = 8;
constexpr int kMaxRows = 4;

size_t act_row_bytes(int64_t k, int qtype) {
  return static_cast<size_t>((k * (qtype == kQ80 ? 2 : 3) + 63) / 64 * 64);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void quantize_act(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, int qtype, uint8_t* xq) {
  const int64_t nb = k / QK;
  const size_t stride = act_row_bytes(k, qtype);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = m0; r < m1; ++r) {
    const float* xr = x + r * ldx;
    uint8_t* q = xq + r * stride;
    float* dx = reinterpret_cast<float*>(q + k);
    uint8_t* ext = q + k + 32 * nb;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xr + b * QK + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      }
      const float d = hmax(amax) / 127.0f;
      const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      __m256i i[4];
      for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // half to even
      const int32_t s = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
      // packs interleave 128-bit lanes; the permute restores element order.
      const __m256i p16a = _mm256_packs_epi32(i[0], i[1]), p16b = _mm256_packs_epi32(i[2], i[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), p8);
      _mm256_storeu_ps(dx + b * 8, _mm256_set1_ps(d));
      if (qtype == kQ40)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ext) + b, _mm256_set1_epi32(-s));
      else if (qtype == kQ41)
        _mm256_storeu_ps(reinterpret_cast<float*>(ext) + b * 8, _mm256_set1_ps(d * static_cast<float>(s) * 0.125f));
    }
  }
}

inline float half_at(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// 16 packed nibbles -> 32 u8 in element order [lo0..15, hi0..15].
inline __m256i unpack_q4(const uint8_t* qs) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i aa = _mm256_broadcastsi128_si256(a);
  const __m256i z = _mm256_blend_epi32(aa, _mm256_srli_epi16(aa, 4), 0xF0);
  return _mm256_and_si256(z, _mm256_set1_epi8(0x0F));
}

// MR activation rows x one weight row.
template <int QT, int MR>
void dot_rows(const uint8_t* wrow, int64_t nb, int64_t k, const uint8_t* xq, size_t stride, float* out) {
  constexpr int bb = QT == kQ80 ? 34 : QT == kQ40 ? 18 : 20;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bb;
    const __m256 dw = _mm256_set1_ps(half_at(blk));
    __m256i w, aw;
    __m256 mn = _mm256_setzero_ps();
    if constexpr (QT == kQ80) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      aw = _mm256_sign_epi8(w, w);
    } else {
      aw = unpack_q4(blk + (QT == kQ41 ? 4 : 2));
      w = aw;
      if constexpr (QT == kQ41) mn = _mm256_set1_ps(half_at(blk + 2));
    }
    for (int r = 0; r < MR; ++r) {
      const uint8_t* row = xq + r * stride;
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));
      if constexpr (QT == kQ80) x = _mm256_sign_epi8(x, w);
      __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones);
      if constexpr (QT == kQ40)
        dot = _mm256_add_epi32(dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 32 * nb) + b));
      const __m256 s = _mm256_mul_ps(dw, _mm256_loadu_ps(reinterpret_cast<const float*>(row + k) + b * 8));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
      if constexpr (QT == kQ41)
        acc[r] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(reinterpret_cast<const float*>(row + k + 32 * nb) + b * 8), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum_ps(acc[r]);
}

template <int QT>
void gemm_t(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, const uint8_t* xq, int64_t m, const float* bias,
            float* y, int64_t ldy) {
  const int64_t nb = k / QK, rb = row_bytes(k, QT);
  const size_t stride = act_row_bytes(k, QT);
  float out[kMaxRows];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = w + n * rb;
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const uint8_t* x = xq + r0 * stride;
      const int64_t mr = std::min<int64_t>(kMaxRows, m - r0);
      switch (mr) {
        case 1: dot_rows<QT, 1>(wrow, nb, k, x, stride, out); break;
        case 2: dot_rows<QT, 2>(wrow, nb, k, x, stride, out); break;
        case 3: dot_rows<QT, 3>(wrow, nb, k, x, stride, out); break;
        default: dot_rows<QT, 4>(wrow, nb, k, x, stride, out); break;
      }
      for (int64_t r = 0; r < mr; ++r) y[(r0 + r) * ldy + n] = out[r] + b;
    }
  }
}

void gemm(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, int qtype, const uint8_t* xq, int64_t m,
          const float* bias, float* y, int64_t ldy) {
  if (qtype == kQ40) gemm_t<kQ40>(w, n0, n1, k, xq, m, bias, y, ldy);
  else if (qtype == kQ41) gemm_t<kQ41>(w, n0, n1, k, xq, m, bias, y, ldy);
  else gemm_t<kQ80>(w, n0, n1, k, xq, m, bias, y, ldy);
}

// d * q rounded before + m, as numpy does: the empty asm keeps GCC from contracting the pair into an FMA.
inline __m256 mul_then_add(__m256 d, __m256 q, __m256 m) {
  __m256 p = _mm256_mul_ps(d, q);
  __asm__("" : "+x"(p));
  return _mm256_add_ps(p, m);
}

// 8 bytes -> 8 floats (signed or unsigned).
inline __m256 bytes_ps(__m128i b8, bool is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b8) : _mm256_cvtepu8_epi32(b8));
}

void dequant(const uint8_t* w, int64_t r0, int64_t r1, int64_t k, int qtype, float* out) {
  const int64_t nb = k / QK, bb = block_bytes(qtype);
  for (int64_t i = r0 * nb; i < r1 * nb; ++i) {
    const uint8_t* blk = w + i * bb;
    float* o = out + (i - r0 * nb) * QK;
    const __m256 d = _mm256_set1_ps(half_at(blk));
    if (qtype == kQ80) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
      _mm256_storeu_ps(o, _mm256_mul_ps(bytes_ps(lo, true), d));
      _mm256_storeu_ps(o + 8, _mm256_mul_ps(bytes_ps(_mm_unpackhi_epi64(lo, lo), true), d));
      _mm256_storeu_ps(o + 16, _mm256_mul_ps(bytes_ps(hi, true), d));
      _mm256_storeu_ps(o + 24, _mm256_mul_ps(bytes_ps(_mm_unpackhi_epi64(hi, hi), true), d));
      continue;
    }
    const __m256i q = unpack_q4(blk + (qtype == kQ41 ? 4 : 2));  // [lo0..15, hi0..15] = element order
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
    const __m256 mn = _mm256_set1_ps(qtype == kQ41 ? half_at(blk + 2) : 0.0f);
    const __m256 eight = _mm256_set1_ps(8.0f);  // q - 8 is exact in fp32
    for (int j = 0; j < 4; ++j) {
      const __m256 v = bytes_ps(parts[j], false);
      _mm256_storeu_ps(o + 8 * j, qtype == kQ40 ? _mm256_mul_ps(d, _mm256_sub_ps(v, eight))
                                                : mul_then_add(d, v, mn));
    }
  }
}

}  // namespace

const QuantOps kAvx2Ops = {act_row_bytes, quantize_act, gemm, dequant};

}  // namespace pdserve::quant

#pragma GCC pop_options
#endif  // __x86_64__
