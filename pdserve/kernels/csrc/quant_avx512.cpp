// AVX-512 (F+BW+VL+DQ+VNNI) quantized-linear kernels. The dot product is _mm512_dpbusd_epi32 (u8 weights x s8
// activations), two weight blocks (64 weights) per zmm; a register tile of MR activation rows x NC weight rows.
//
// Activation row layout (P = ceil(nb/2) pairs of blocks; an odd last block is paired with a zero block):
//   s8  q[P*64]     quantized activations
//   f32 dx[P*16]    the block scale in each of its 8 int32 lanes (lanes as below)
//   ext[P*16]       per lane of a block (8 lanes sum to the block's term):
//                   Q4_0: int32 -sum(q)      (the -8 zero point of the nibbles: -8 * sum(q))
//                   Q8_0: int32 -16*sum(q)   (weights enter as w + 128 in u8: -128 * sum(q))
//                   Q4_1: f32 dx*sum(q)/8    (times the block min m)
// ext is the dpbusd accumulator's initial value for Q4_0/Q8_0, so the offsets cost no ALU work per row.
// Lane order of a pair: Q8_0 natural (bytes 0..31 block 0, 32..63 block 1: int32 lanes 0-7 block 0, 8-15 block 1);
// Q4_* [x0..15 of b0, x0..15 of b1, x16..31 of b0, x16..31 of b1], which is the order two 16-byte nibble arrays
// unpack to without a cross-lane byte shuffle (int32 lanes 0-3 and 8-11 block 0, 4-7 and 12-15 block 1).
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

size_t act_row_bytes(int64_t k, int /*qtype*/) { return static_cast<size_t>(npairs(k) * 64 * 3); }

// Lane pattern of the two per-block values [v0, v1] for a pair (see the layout comment).
__m512i pair_index(int qtype) {
  return qtype == kQ80 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                       : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
}

__m512 expand_pair(__m512i idx, float v0, float v1) {
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_setr_ps(v0, v1, 0.0f, 0.0f)));
}

__m512i expand_pair_i(__m512i idx, int32_t v0, int32_t v1) {
  return _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(_mm_setr_epi32(v0, v1, 0, 0)));
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
  const QBlock zero = {_mm_setzero_si128(), _mm_setzero_si128(), 0.0f, 0};
  const bool q8 = qtype == kQ80;
  for (int64_t r = m0; r < m1; ++r) {
    const float* xr = x + r * ldx;
    uint8_t* q = xq + r * stride;
    float* dx = reinterpret_cast<float*>(q + P * 64);
    uint8_t* ext = q + P * 128;
    for (int64_t p = 0; p < P; ++p) {
      const QBlock b0 = quantize_block(xr + 2 * p * QK);
      const QBlock b1 = 2 * p + 1 < nb ? quantize_block(xr + (2 * p + 1) * QK) : zero;
      __m128i* o = reinterpret_cast<__m128i*>(q + p * 64);
      _mm_storeu_si128(o + 0, b0.lo);
      _mm_storeu_si128(o + (q8 ? 1 : 2), b0.hi);
      _mm_storeu_si128(o + (q8 ? 2 : 1), b1.lo);
      _mm_storeu_si128(o + 3, b1.hi);
      _mm512_storeu_ps(dx + p * 16, expand_pair(idx, b0.d, b1.d));
      void* e = ext + p * 64;
      if (qtype == kQ41)
        _mm512_storeu_ps(e, expand_pair(idx, b0.d * static_cast<float>(b0.s) * 0.125f,
                                        b1.d * static_cast<float>(b1.s) * 0.125f));
      else
        _mm512_storeu_si512(e, expand_pair_i(idx, (q8 ? -16 : -1) * b0.s, (q8 ? -16 : -1) * b1.s));
    }
  }
}

// A pair of weight blocks ready for dpbusd: u8 weights, per-lane scales (and Q4_1 mins).
struct WPair { __m512i w; __m512 dw, mn; };

inline float half_at(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// Q4 nibbles of two blocks -> [lo0, lo1, hi0, hi1] as u8 0..15. A null qs1 is a zero second block.
inline __m512i unpack_q4(const uint8_t* qs0, const uint8_t* qs1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0));
  const __m128i b = qs1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)) : _mm_setzero_si128();
  const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
  __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(ab), ab, 1);
  z = _mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4);
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

// The u8 weights of a pair of blocks (b1 null: odd tail, zero block). Scales come from load_scales.
template <int QT>
inline __m512i load_pair_weights(const uint8_t* b0, const uint8_t* b1) {
  if constexpr (QT == kQ80) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
    const __m256i b = b1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1),  // w + 128 as u8
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const int off = QT == kQ41 ? 4 : 2;
    return unpack_q4(b0 + off, b1 ? b1 + off : nullptr);
  }
}

// The fp16 scales (and Q4_1 mins) of up to 16 consecutive blocks as 16 floats each, with one gather: a block's
// first 4 bytes are d (and m for Q4_1), so one 32-bit load per block serves both. Lanes past nblk are zero.
template <int QT>
inline void load_scales(const uint8_t* blk0, int64_t nblk, __m512& d, __m512& m) {
  constexpr int bb = QT == kQ80 ? 34 : QT == kQ40 ? 18 : 20;
  const __m512i offs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(bb));
  const __mmask16 mask = static_cast<__mmask16>((1u << nblk) - 1u);
  const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offs, blk0, 1);
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
  if constexpr (QT == kQ41) m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
}

// MR activation rows x NC weight rows (the weight rows at wrow + c * rb): out[r * NC + c].
template <int QT, int MR, int NC>
void dot_tile(const uint8_t* wrow, int64_t rb, int64_t nb, const uint8_t* xq, size_t stride, float* out) {
  constexpr int bb = QT == kQ80 ? 34 : QT == kQ40 ? 18 : 20;
  const int64_t P = (nb + 1) / 2;
  const __m512i idx = pair_index(QT);
  __m512 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  // 8 pairs (16 blocks) at a time: their scales in one gather per weight row, then one permute per pair.
  for (int64_t p0 = 0; p0 < P; p0 += 8) {
    const int64_t pend = std::min<int64_t>(P, p0 + 8), nblk = std::min<int64_t>(16, nb - 2 * p0);
    __m512 d16[NC], m16[NC];
    for (int c = 0; c < NC; ++c) load_scales<QT>(wrow + c * rb + 2 * p0 * bb, nblk, d16[c], m16[c]);
    for (int64_t p = p0; p < pend; ++p) {
      const __m512i pidx = _mm512_add_epi32(idx, _mm512_set1_epi32(static_cast<int>(2 * (p - p0))));
      WPair w[NC];
      for (int c = 0; c < NC; ++c) {
        const uint8_t* b0 = wrow + c * rb + 2 * p * bb;
        w[c].w = load_pair_weights<QT>(b0, 2 * p + 1 < nb ? b0 + bb : nullptr);
        w[c].dw = _mm512_permutexvar_ps(pidx, d16[c]);
        if constexpr (QT == kQ41) w[c].mn = _mm512_permutexvar_ps(pidx, m16[c]);
      }
      for (int r = 0; r < MR; ++r) {
        const uint8_t* q = xq + r * stride + p * 64;
        const __m512i x = _mm512_loadu_si512(q);
        const __m512 dx = _mm512_loadu_ps(q + P * 64);
        for (int c = 0; c < NC; ++c) {
          const __m512i init = QT == kQ41 ? _mm512_setzero_si512() : _mm512_loadu_si512(q + P * 128);
          const __m512i dot = _mm512_dpbusd_epi32(init, w[c].w, x);
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w[c].dw, dx), acc[r][c]);
          if constexpr (QT == kQ41) acc[r][c] = _mm512_fmadd_ps(w[c].mn, _mm512_loadu_ps(q + P * 128), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = _mm512_reduce_add_ps(acc[r][c]);
}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const uint8_t*, size_t, float*);

// Tile shapes: few rows (decode) take several weight rows at once so each activation load serves them all; from 5
// rows on, one weight row against up to 8 activation rows (32 zmm: 8 accumulators + operands).
template <int QT>
TileFn tile_for(int64_t mr, int nc) {
  if (nc == 4) return mr == 1 ? dot_tile<QT, 1, 4> : dot_tile<QT, 2, 4>;
  if (nc == 2) return mr == 3 ? dot_tile<QT, 3, 2> : dot_tile<QT, 4, 2>;
  static constexpr TileFn one[kMaxRows] = {dot_tile<QT, 1, 1>, dot_tile<QT, 2, 1>, dot_tile<QT, 3, 1>,
                                           dot_tile<QT, 4, 1>, dot_tile<QT, 5, 1>, dot_tile<QT, 6, 1>,
                                           dot_tile<QT, 7, 1>, dot_tile<QT, 8, 1>};
  return one[mr - 1];
}

// Weight rows per column block when m > kMaxRows: the block's weights and one row tile of activations stay in L1
// while every row tile passes over the block (instead of all m activation rows streaming per weight row).
constexpr int64_t kColBlock = 16;

template <int QT>
void gemm_t(const uint8_t* w, int64_t n0, int64_t n1, int64_t k, const uint8_t* xq, int64_t m, const float* bias,
            float* y, int64_t ldy) {
  const int64_t nb = k / QK, rb = row_bytes(k, QT);
  const size_t stride = act_row_bytes(k, QT);
  const int nc = m <= 2 ? 4 : m <= 4 ? 2 : 1;
  float out[kMaxRows * 4];
  for (int64_t nblk = n0; nblk < n1; nblk += kColBlock) {
    const int64_t nend = std::min(n1, nblk + kColBlock);
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int64_t mr = std::min<int64_t>(kMaxRows, m - r0);
      for (int64_t n = nblk; n < nend;) {
        const int c = n + nc <= nend ? nc : 1;
        tile_for<QT>(mr, c)(w + n * rb, rb, nb, xq + r0 * stride, stride, out);
        for (int64_t r = 0; r < mr; ++r)
          for (int j = 0; j < c; ++j) y[(r0 + r) * ldy + n + j] = out[r * c + j] + (bias ? bias[n + j] : 0.0f);
        n += c;
      }
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
