// AVX2 paged attention for head_dim 64, 128 and 256: the AVX-512 kernel's structure (attention_avx512.cpp) with
// 8-wide vectors; a 16-key tile is two halves of 8 for the scores.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "vec_avx2.h"
#include "attention_quant_tile.h"

namespace pdserve {
namespace {

using vec::exp8;
using vec::hsum;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lane i of the result = sum of the lanes of s[i] (transpose-add tree).
inline __m256 reduce8(__m256* s) {
  __m256 t[4];
  for (int k = 0; k < 4; ++k)
    t[k] = _mm256_add_ps(_mm256_unpacklo_ps(s[2 * k], s[2 * k + 1]), _mm256_unpackhi_ps(s[2 * k], s[2 * k + 1]));
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of one query row against the 8 keys kp[0..7].
template <int D>
inline __m256 scores8(const float* q, const float* const* kp) {
  __m256 s[8];
  const __m256 q0 = _mm256_loadu_ps(q);
  for (int i = 0; i < 8; ++i) s[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(kp[i]));
  for (int j = 8; j < D; j += 8) {
    const __m256 qj = _mm256_loadu_ps(q + j);
    for (int i = 0; i < 8; ++i) s[i] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(kp[i] + j), s[i]);
  }
  return reduce8(s);
}

// Scores of R rows (q D apart, R = 2 or 3) against the 8 keys kp[0..7] into out[0..R): each K element is read once
// for all R rows, the keys in two groups of 4 so R x 4 accumulators fit the 16 registers. reduce8's tree adds keys
// 0-3 and 4-7 apart until its last step, so each group's partial tree is reduce8's: a row's bits equal scores8's.
template <int D, int R>
inline void scores8_rows(const float* q, const float* const* kp, __m256* out) {
  __m256 u[R][2];
  for (int h = 0; h < 2; ++h) {
    __m256 s[R][4];
    for (int j = 0; j < D; j += 8) {
      __m256 qj[R];
      for (int r = 0; r < R; ++r) qj[r] = _mm256_loadu_ps(q + r * D + j);
      for (int i = 0; i < 4; ++i) {
        const __m256 kv = _mm256_loadu_ps(kp[4 * h + i] + j);
        for (int r = 0; r < R; ++r) s[r][i] = j == 0 ? _mm256_mul_ps(qj[r], kv) : _mm256_fmadd_ps(qj[r], kv, s[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(s[r][0], s[r][1]), _mm256_unpackhi_ps(s[r][0], s[r][1]));
      const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(s[r][2], s[r][3]), _mm256_unpackhi_ps(s[r][2], s[r][3]));
      u[r][h] = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm256_add_ps(_mm256_permute2f128_ps(u[r][0], u[r][1], 0x20), _mm256_permute2f128_ps(u[r][0], u[r][1], 0x31));
}

// acc_r = acc_r * alpha_r + sum_{i < n} p_r[i] * vp[i] for R rows (acc D apart, p 16 apart), each V element read
// once for all R rows, in column chunks of JB vectors (R x JB FMA chains). Each element's multiply-adds run in key
// order whatever R and JB: a row's bits do not depend on the rows beside it.
template <int D, int R>
inline void pv_rows(float* acc, const float* alpha, const float* p, const float* const* vp, int n) {
  constexpr int JB = R == 1 ? 8 : 4;
  for (int c = 0; c < D; c += 8 * JB) {
    __m256 a[R][JB];
    for (int r = 0; r < R; ++r) {
      const __m256 al = _mm256_set1_ps(alpha[r]);
      for (int j = 0; j < JB; ++j) a[r][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + c + 8 * j), al);
    }
    for (int i = 0; i < n; ++i) {
      __m256 pi[R];
      for (int r = 0; r < R; ++r) pi[r] = _mm256_set1_ps(p[16 * r + i]);
      for (int j = 0; j < JB; ++j) {
        const __m256 v = _mm256_loadu_ps(vp[i] + c + 8 * j);
        for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(pi[r], v, a[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < JB; ++j) _mm256_storeu_ps(acc + r * D + c + 8 * j, a[r][j]);
  }
}

// A quantized row (kv_quant.h: D codes, then the bf16 scale) as D floats in dst: scale * decode(code), the
// codes widened in registers (int8: sign-extend; fp8: to half bits, vcvtph2ps).
template <int D>
inline void dequant_row(KVFormat f, const uint8_t* src, float* dst) {
  const __m256 s = _mm256_set1_ps(kv_row_scale(src, D) * kv_code_factor(f));
  for (int j = 0; j < D; j += 8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j));
    __m256 x;
    if (f == KVFormat::kInt8) {
      x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    } else {
      __m128i h = _mm_cvtepu8_epi16(c);
      h = f == KVFormat::kFp8E5M2 ? _mm_slli_epi16(h, 8)
                                  : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                                                 _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
      x = _mm256_cvtph_ps(h);
    }
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(x, s));
  }
}

// K/V row pointers of keys kt .. kt + n - 1 (bf16 rows converted into kbuf/vbuf); entries n..15 repeat key kt.
template <int D>
void locate_tile(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, const float** kp, const float** vp,
                 float* kbuf, float* vbuf) {
  if (kv_quantized(a.kv_format))
    return locate_tile_quantized<D, dequant_row<D>>(a, it, kt, n, kp, vp, kbuf, vbuf);
  const int32_t* bt = a.block_table + it.seq * a.bt_stride;
  const int64_t row = a.hkv * D, plane = a.num_blocks * a.block_size * row;
  int64_t bi = kt / a.block_size, off = kt % a.block_size;
  for (int i = 0; i < n; ++i) {
    const int64_t e = (bt[bi] * a.block_size + off) * row + it.kvh * D;
    if (++off == a.block_size) off = 0, ++bi;
    if (!a.kv_bf16) {
      kp[i] = static_cast<const float*>(a.kv) + e;
      vp[i] = kp[i] + plane;
      continue;
    }
    const uint16_t* ks = static_cast<const uint16_t*>(a.kv) + e;
    for (int j = 0; j < D; j += 8) {
      const __m256i kw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ks + j)));
      const __m256i vw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ks + plane + j)));
      _mm256_storeu_ps(kbuf + i * D + j, _mm256_castsi256_ps(_mm256_slli_epi32(kw, 16)));
      _mm256_storeu_ps(vbuf + i * D + j, _mm256_castsi256_ps(_mm256_slli_epi32(vw, 16)));
    }
    kp[i] = kbuf + i * D;
    vp[i] = vbuf + i * D;
  }
  for (int i = n; i < 16; ++i) kp[i] = kp[0], vp[i] = vp[0];
}

// An f32 tile's rows copied into kbuf/vbuf for rows that share it: in the cache a KV head's rows lie a whole token's
// K (Hkv x D floats) apart, so a tile's 16 rows can share too few L1 sets to stay there while its rows run.
template <int D>
void copy_tile(int n, const float** kp, const float** vp, float* kbuf, float* vbuf) {
  for (int i = 0; i < n; ++i) {
    std::copy(kp[i], kp[i] + D, kbuf + i * D);
    std::copy(vp[i], vp[i] + D, vbuf + i * D);
    kp[i] = kbuf + i * D;
    vp[i] = vbuf + i * D;
  }
  for (int i = n; i < 16; ++i) kp[i] = kp[0], vp[i] = vp[0];
}

// One row's online-softmax step on a 16-key tile (scores lo = keys 0..7, hi = 8..15; lanes >= nvalid masked):
// updates m and l16, writes the tile's p to pb and returns alpha, the factor on the row's accumulator.
inline float softmax_row(__m256 lo, __m256 hi, int nvalid, float& m, float* l16, float* pb) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 mlo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nvalid), iota));
  const __m256 mhi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nvalid - 8), iota));
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  lo = _mm256_blendv_ps(ninf, lo, mlo);
  hi = _mm256_blendv_ps(ninf, hi, mhi);
  const float mn = std::max(m, hmax(_mm256_max_ps(lo, hi)));
  const float alpha = mn == m ? 1.f : std::exp(m - mn);  // m = -inf on the first tile: alpha = 0
  m = mn;
  const __m256 mv = _mm256_set1_ps(mn), al = _mm256_set1_ps(alpha);
  const __m256 plo = _mm256_and_ps(mlo, exp8(_mm256_sub_ps(lo, mv)));
  const __m256 phi = _mm256_and_ps(mhi, exp8(_mm256_sub_ps(hi, mv)));
  _mm256_storeu_ps(l16, _mm256_fmadd_ps(_mm256_loadu_ps(l16), al, plo));
  _mm256_storeu_ps(l16 + 8, _mm256_fmadd_ps(_mm256_loadu_ps(l16 + 8), al, phi));
  _mm256_store_ps(pb, plo);
  _mm256_store_ps(pb + 8, phi);
  return alpha;
}

// R consecutive rows (q, acc D apart; m; l16 16 apart) on one tile, all seeing nvalid keys: scores, softmax, P . V.
// One row reads all 8 keys of a half in one pass (their misses overlap: decode rows); more rows share the loads.
template <int D, int R>
inline void rows_step(const AttnArgs& a, const float* q, int nvalid, float* m, float* l16, float* acc,
                      const float* const* kp, const float* const* vp) {
  __m256 lo[R], hi[R];
  if constexpr (R == 1) {
    lo[0] = scores8<D>(q, kp);
    hi[0] = nvalid > 8 ? scores8<D>(q, kp + 8) : _mm256_setzero_ps();
  } else {
    scores8_rows<D, R>(q, kp, lo);
    if (nvalid > 8) {
      scores8_rows<D, R>(q, kp + 8, hi);
    } else {
      for (int r = 0; r < R; ++r) hi[r] = _mm256_setzero_ps();
    }
  }
  alignas(32) float pb[16 * R];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    if (a.softcap > 0.f) {
      alignas(32) float sb[16];
      _mm256_store_ps(sb, lo[r]);
      _mm256_store_ps(sb + 8, hi[r]);
      softcap_scores(sb, 16, a.softcap);
      lo[r] = _mm256_load_ps(sb);
      hi[r] = _mm256_load_ps(sb + 8);
    }
    alpha[r] = softmax_row(lo[r], hi[r], nvalid, m[r], l16 + 16 * r, pb + 16 * r);
  }
  pv_rows<D, R>(acc, alpha, pb, vp, nvalid);
}

template <int D>
void run(const AttnArgs& a, const AttnItem& it) {
  const int64_t g = a.hq / a.hkv, nt = it.t1 - it.t0, per_head = nt * g, rows = per_head * it.nkvh;
  thread_local std::vector<float> scratch;
  scratch.resize(2 * rows * D + 17 * rows + 32 * D);
  float *qs = scratch.data(), *acc = qs + rows * D, *m = acc + rows * D, *l16 = m + rows, *kbuf = l16 + 16 * rows;
  float* vbuf = kbuf + 16 * D;
  const __m256 sc = _mm256_set1_ps(a.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.q + item_row_offset(it, r, g, D, a.q_stride);
    for (int j = 0; j < D; j += 8) {
      _mm256_storeu_ps(qs + r * D + j, _mm256_mul_ps(_mm256_loadu_ps(src + j), sc));
      _mm256_storeu_ps(acc + r * D + j, _mm256_setzero_ps());
    }
    std::fill(l16 + 16 * r, l16 + 16 * (r + 1), 0.f);
    m[r] = kNegInf;
  }
  const float* kp[16];
  const float* vp[16];
  // Rows sharing a tile's loads: decode rows (one token) one at a time, prompt rows three (the tile is in L1).
  const int64_t block = nt == 1 ? 1 : 3;
  for (int64_t kt = it.k0; kt < it.k1; kt += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, it.k1 - kt));
    const KvRowsAhead ahead(a, it, kt + 16, kv_row_bytes(a.kv_format, D));
    for (int64_t hl = 0; hl < it.nkvh; ++hl) {  // every head of the item on this tile
      AttnItem head = it;
      head.kvh = it.kvh + static_cast<int32_t>(hl);
      ahead.prefetch(head.kvh, 3);
      locate_tile<D>(a, head, kt, n, kp, vp, kbuf, vbuf);
      if (block > 1 && a.kv_format == KVFormat::kF32) copy_tile<D>(n, kp, vp, kbuf, vbuf);
      for_tile_rows(it, kt, n, g, hl * per_head, block, [&](auto rows, int64_t r, int nvalid) {
        rows_step<D, decltype(rows)::value>(a, qs + r * D, nvalid, m + r, l16 + 16 * r, acc + r * D, kp, vp);
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    finish_row(a, it, rows, r, acc + r * D, m[r],
               hsum(_mm256_add_ps(_mm256_loadu_ps(l16 + 16 * r), _mm256_loadu_ps(l16 + 16 * r + 8))));
}

}  // namespace

void attn_item_avx2(const AttnArgs& a, const AttnItem& it) {
  with_head_dim<64, 128, 256>(a.d, [&](auto d) { run<decltype(d)::value>(a, it); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
