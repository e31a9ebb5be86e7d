// AVX-512 (F+BW+VL+DQ+VNNI) quantized-linear kernels. The dot product is _mm512_dpbusd_epi32 (u8 x s8), two
// weight blocks (64 weights) per zmm.
//
// Activation row layout (P = ceil(nb/2) pairs of blocks; an odd last block is paired with a zero block):
//   u8  q[P*64]     q + 128 (so activations are the unsigned operand for every weight type)
//   f32 dx[P*16]    per-lane block scale dx (lanes as below)
//   f32 sxd[P*16]   Q4_1 only: dx * sum(q) / 8 per lane (8 lanes per block sum back to dx * sum(q))
// Lane order of a pair: Q8_0 natural (bytes 0..31 block 0, 32..63 block 1: int32 lanes 0-7 block 0, 8-15 block 1);
// Q4_* [x0..15 of b0, x0..15 of b1, x16..31 of b0, x16..31 of b1], which is the order two 16-byte nibble arrays
// unpack to without a cross-lane byte shuffle (int32 lanes 0-3 and 8-11 block 0, 4-7 and 12-15 block 1).
// Weights become s8 w (Q4_0: q - 8, Q4_1: q, Q8_0: q) and the +128 offset is removed per int32 lane with
// wcorr = -128 * sum(w over the lane's 4 bytes), which is the dpbusd accumulator's initial value.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quant_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

namespace pdserve::quant {
namespace {

constexpr int kQ40 = 2, kQ41 = 3, kQ80 = 8;
constexpr int kMaxRows = 8;  // rows per register tile (8 accumulators of 32)

int64_t npairs(int64_t k) { return (k / QK + 1) / 2; }

size_t act_row_bytes(int64_t k, int qtype) {
  return static_cast<size_t>(npairs(k) * 64 * (qtype == kQ41 ? 3 : 2));
}

// Lane pattern of the two per-block values [v0, v1] for a pair (see the layout comment).
__m512i pair_index(int qtype) {
  return qtype == kQ80 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                       : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
}

__m512 expand_pair(__m512i idx, float v0, float v1) {
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_setr_ps(v0, v1, 0.0f, 0.0f)));
}

// One block of 32 floats -> int8 q (half-to-even) in two 16-byte halves, its scale and the sum of q.
struct QBlock { __m128i lo, hi; float d; int32_t s; };

QBlock quantize_block(const float* x) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
  return {_mm512_cvtepi32_epi8(i0), _mm512_cvtepi32_epi8(i1), d, _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1))};
}

void quantize_act(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, int qtype, uint8_t* xq) {
  const int64_t nb = k / QK, P = npairs(k);
  const size_t stride = act_row_bytes(k, qtype);
  const __m512i idx = pair_index(qtype);
  const __m128i off = _mm_set1_epi8(static_cast<char>(0x80));
  const QBlock zero = {_mm_setzero_si128(), _mm_setzero_si128(), 0.0f, 0};
  for (int64_t r = m0; r < m1; ++r) {
    const float* xr = x + r * ldx;
    uint8_t* q = xq + r * stride;
    float* dx = reinterpret_cast<float*>(q + P * 64);
    float* sxd = dx + P * 16;
    for (int64_t p = 0; p < P; ++p) {
      const QBlock b0 = quantize_block(xr + 2 * p * QK);
      const QBlock b1 = 2 * p + 1 < nb ? quantize_block(xr + (2 * p + 1) * QK) : zero;
      __m128i* o = reinterpret_cast<__m128i*>(q + p * 64);
      const bool q8 = qtype == kQ80;
      _mm_storeu_si128(o + 0, _mm_xor_si128(b0.lo, off));
      _mm_storeu_si128(o + (q8 ? 1 : 2), _mm_xor_si128(b0.hi, off));
      _mm_storeu_si128(o + (q8 ? 2 : 1), _mm_xor_si128(b1.lo, off));
      _mm_storeu_si128(o + 3, _mm_xor_si128(b1.hi, off));
      _mm512_storeu_ps(dx + p * 16, expand_pair(idx, b0.d, b1.d));
      if (qtype == kQ41)
        _mm512_storeu_ps(sxd + p * 16, expand_pair(idx, b0.d * static_cast<float>(b0.s) * 0.125f,
                                                   b1.d * static_cast<float>(b1.s) * 0.125f));
    }
  }
}

// A pair of weight blocks ready for dpbusd: s8 weights, per-lane offset correction, per-lane scales.
struct WPair { __m512i w, corr; __m512 dw, mn; };

inline float half_at(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// Q4 nibbles of two blocks -> [lo0, lo1, hi0, hi1] as u8 0..15. `b1` null means a zero second block.
inline __m512i unpack_q4(const uint8_t* qs0, const uint8_t* qs1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0));
  const __m128i b = qs1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)) : _mm_setzero_si128();
  const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
  __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(ab), ab, 1);
  z = _mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4);
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

template <int QT>
inline WPair load_pair(const uint8_t* b0, const uint8_t* b1, __m512i idx) {  // b1 may be null (odd tail)
  WPair p;
  const float d1 = b1 ? half_at(b1) : 0.0f;
  p.dw = expand_pair(idx, half_at(b0), d1);
  if constexpr (QT == kQ80) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
    const __m256i b = b1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)) : _mm256_setzero_si256();
    p.w = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    const __m512i s128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), p.w);
    p.corr = _mm512_sub_epi32(_mm512_setzero_si512(), s128);
  } else if constexpr (QT == kQ40) {
    const __m512i q = unpack_q4(b0 + 2, b1 ? b1 + 2 : nullptr);
    p.w = _mm512_sub_epi8(q, _mm512_set1_epi8(8));
    // -128 * sum(q - 8) over 4 bytes = -128 * sum(q) + 4096. A zero tail block has scale 0, so its lanes don't matter.
    p.corr = _mm512_dpbusd_epi32(_mm512_set1_epi32(4096), q, _mm512_set1_epi8(-128));
  } else {
    p.w = unpack_q4(b0 + 4, b1 ? b1 + 4 : nullptr);
    p.corr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), p.w, _mm512_set1_epi8(-128));
    p.mn = expand_pair(idx, half_at(b0 + 2), b1 ? half_at(b1 + 2) : 0.0f);
  }
  return p;
}

// MR activation rows x one weight row: returns the MR dot products in out[].
template <int QT, int MR>
void dot_rows(const uint8_t* wrow, int64_t nb, const uint8_t* xq, size_t stride, float* out) {
  constexpr int bb = QT == kQ80 ? 34 : QT == kQ40 ? 18 : 20;
  const int64_t P = (nb + 1) / 2;
  const __m512i idx = pair_index(QT);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const uint8_t* b0 = wrow + 2 * p * bb;
    const WPair w = load_pair<QT>(b0, 2 * p + 1 < nb ? b0 + bb : nullptr, idx);
    for (int r = 0; r < MR; ++r) {
      const uint8_t* q = xq + r * stride + p * 64;
      const float* dx = reinterpret_cast<const float*>(xq + r * stride + P * 64) + p * 16;
      const __m512i dot = _mm512_dpbusd_epi32(w.corr, _mm512_loadu_si512(q), w.w);
      const __m512 s = _mm512_mul_ps(w.dw, _mm512_loadu_ps(dx));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
      if constexpr (QT == kQ41) acc[r] = _mm512_fmadd_ps(w.mn, _mm512_loadu_ps(dx + P * 16), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
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
        case 1: dot_rows<QT, 1>(wrow, nb, x, stride, out); break;
        case 2: dot_rows<QT, 2>(wrow, nb, x, stride, out); break;
        case 3: dot_rows<QT, 3>(wrow, nb, x, stride, out); break;
        case 4: dot_rows<QT, 4>(wrow, nb, x, stride, out); break;
        case 5: dot_rows<QT, 5>(wrow, nb, x, stride, out); break;
        case 6: dot_rows<QT, 6>(wrow, nb, x, stride, out); break;
        case 7: dot_rows<QT, 7>(wrow, nb, x, stride, out); break;
        default: dot_rows<QT, 8>(wrow, nb, x, stride, out); break;
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
inline __m512 mul_then_add(__m512 d, __m512 q, __m512 m) {
  __m512 p = _mm512_mul_ps(d, q);
  __asm__("" : "+v"(p));
  return _mm512_add_ps(p, m);
}

// 16 nibbles (lo or hi of a Q4 block) as floats.
inline __m512 nibbles_ps(__m128i qs, int shift) {
  const __m128i n = _mm_and_si128(_mm_srli_epi16(qs, shift), _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n));
}

void dequant(const uint8_t* w, int64_t r0, int64_t r1, int64_t k, int qtype, float* out) {
  const int64_t nb = k / QK, bb = block_bytes(qtype);
  for (int64_t i = r0 * nb; i < r1 * nb; ++i) {
    const uint8_t* blk = w + i * bb;
    float* o = out + (i - r0 * nb) * QK;
    const __m512 d = _mm512_set1_ps(half_at(blk));
    if (qtype == kQ80) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d));
      _mm512_storeu_ps(o + 16,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d));
    } else if (qtype == kQ40) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      const __m512 eight = _mm512_set1_ps(8.0f);  // q - 8 is exact in fp32
      _mm512_storeu_ps(o, _mm512_mul_ps(d, _mm512_sub_ps(nibbles_ps(qs, 0), eight)));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(d, _mm512_sub_ps(nibbles_ps(qs, 4), eight)));
    } else {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m512 mn = _mm512_set1_ps(half_at(blk + 2));
      _mm512_storeu_ps(o, mul_then_add(d, nibbles_ps(qs, 0), mn));
      _mm512_storeu_ps(o + 16, mul_then_add(d, nibbles_ps(qs, 4), mn));
    }
  }
}

}  // namespace

const QuantOps kAvx512Ops = {act_row_bytes, quantize_act, gemm, dequant};

}  // namespace pdserve::quant

#pragma GCC pop_options
#endif  // __x86_64__
