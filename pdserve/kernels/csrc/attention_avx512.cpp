// AVX-512 paged attention for head_dim 64, 128 and 256 (flash-attention style, online softmax).
//
// A work item (see attention_kernels.h) walks its keys in tiles of 16. Per tile the K/V rows of the item's KV head
// are located once (bf16 rows converted to f32 once) and shared by all rows = query tokens x the G query heads of
// that KV head; quantized rows are read in place when the item has few rows (decode) and widened once otherwise.
// Per row: 16 dot products (16 accumulators, reduced by a transpose-add tree into one vector of 16 scores), the
// online-softmax update, then acc = acc * alpha + sum_i p_i v_i. q is pre-scaled by `scale`.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

#include "attention_stored.h"
#include "vec_avx512.h"

namespace pdserve {
namespace {

using vec::exp16;
using vec::reduce16;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row readers: rows(i, j) = elements j .. j + 15 of key/value row i as floats.
struct FloatRows {
  const float* const* p;
  __m512 operator()(int i, int j) const { return _mm512_loadu_ps(p[i] + j); }
};

// reduce16's tree on 8 vectors (half a tile's keys): lane i of the result = sum of the lanes of s[i], added in the
// same order as reduce16 adds them.
inline __m256 reduce8(const __m512* s) {
  __m512 t[4];
  for (int k = 0; k < 4; ++k)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * k], s[2 * k + 1]), _mm512_unpackhi_ps(s[2 * k], s[2 * k + 1]));
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m128 lo = _mm_add_ps(_mm512_extractf32x4_ps(w, 0), _mm512_extractf32x4_ps(w, 1));
  const __m128 hi = _mm_add_ps(_mm512_extractf32x4_ps(w, 2), _mm512_extractf32x4_ps(w, 3));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

// Scores of R query rows (q, D apart) against the 16 rows of k, into s[0..R): each K element is read once for all R
// rows (the G query heads of a KV head share their keys). One row takes all 16 keys in one pass (16 rows' misses
// overlap); more rows take half a tile at a time so R x 8 accumulators fit the registers. A row's arithmetic (the
// order of its multiply-adds and of reduce16's tree) does not depend on R.
template <int D, int R, class Rows>
inline void scores_rows(const float* q, const Rows& k, __m512* s) {
  constexpr int KB = R == 1 ? 16 : 8;
  __m256 half[R][2];
  for (int h = 0; h < 16 / KB; ++h) {
    __m512 acc[R][KB];
    for (int j = 0; j < D; j += 16) {
      __m512 qj[R];
      for (int r = 0; r < R; ++r) qj[r] = _mm512_loadu_ps(q + r * D + j);
      for (int i = 0; i < KB; ++i) {
        const __m512 kv = k(KB * h + i, j);
        for (int r = 0; r < R; ++r) acc[r][i] = j == 0 ? _mm512_mul_ps(qj[r], kv) : _mm512_fmadd_ps(qj[r], kv, acc[r][i]);
      }
    }
    if constexpr (KB == 16) {
      s[0] = reduce16(acc[0]);
      return;
    } else {
      for (int r = 0; r < R; ++r) half[r][h] = reduce8(acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    s[r] = _mm512_insertf32x8(_mm512_castps256_ps512(half[r][0]), half[r][1], 1);
}

// acc_r = acc_r * alpha_r + sum_{i < n} p_r[i] * v(i) for R rows (acc D apart, p 16 apart), each V element read once
// for all R rows, in column chunks of JB vectors so R x JB x SETS accumulators fit the registers. With SETS = 2 even
// and odd keys accumulate apart (enough FMAs in flight for one row). A row's arithmetic depends on SETS, not on R:
// SETS is fixed per cache format (kPvSets), as a row may be a decode row alone or among a prompt's rows.
template <int D, int R, int SETS, class Rows>
inline void pv_rows(float* acc, const float* alpha, const float* p, const Rows& v, int n) {
  constexpr int NV = D / 16, JB = std::min(NV, R * SETS <= 3 ? 8 : 4);  // at most 24 accumulators
  for (int j0 = 0; j0 < NV; j0 += JB) {
    __m512 a[SETS][R][JB];
    for (int r = 0; r < R; ++r) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
      for (int j = 0; j < JB; ++j) {
        a[0][r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * (j0 + j)), al);
        if constexpr (SETS == 2) a[1][r][j] = _mm512_setzero_ps();
      }
    }
    int i = 0;
    if constexpr (SETS == 2) {
      for (; i + 2 <= n; i += 2) {
        __m512 p0[R], p1[R];
        for (int r = 0; r < R; ++r) p0[r] = _mm512_set1_ps(p[16 * r + i]), p1[r] = _mm512_set1_ps(p[16 * r + i + 1]);
        for (int j = 0; j < JB; ++j) {
          const __m512 v0 = v(i, 16 * (j0 + j)), v1 = v(i + 1, 16 * (j0 + j));
          for (int r = 0; r < R; ++r) {
            a[0][r][j] = _mm512_fmadd_ps(p0[r], v0, a[0][r][j]);
            a[1][r][j] = _mm512_fmadd_ps(p1[r], v1, a[1][r][j]);
          }
        }
      }
    }
    for (; i < n; ++i) {
      __m512 p0[R];
      for (int r = 0; r < R; ++r) p0[r] = _mm512_set1_ps(p[16 * r + i]);
      for (int j = 0; j < JB; ++j) {
        const __m512 v0 = v(i, 16 * (j0 + j));
        for (int r = 0; r < R; ++r) a[0][r][j] = _mm512_fmadd_ps(p0[r], v0, a[0][r][j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < JB; ++j) {
        const __m512 x = SETS == 2 ? _mm512_add_ps(a[0][r][j], a[SETS - 1][r][j]) : a[0][r][j];
        _mm512_storeu_ps(acc + r * D + 16 * (j0 + j), x);
      }
    }
  }
}

template <KVFormat F>
struct StoredRows {  // a tile's rows read in place, unscaled
  const uint8_t* const* p;
  __m512 operator()(int i, int j) const { return stored16<F>(p[i], j); }
};

// A key tile of a bf16 or quantized cache: the rows as stored and, quantized, their scales (kv_code_factor folded
// in). A score is scale_k * (q . codes) and a value row enters as (p * scale_v) * codes: codes are never scaled.
struct StoredTile {
  const uint8_t* k[16];
  const uint8_t* v[16];
  alignas(64) float ks[16];
  alignas(64) float vs[16];
};

// Keys kt .. kt + n - 1; entries n..15 repeat key kt (their scores are masked, their value scale is 0).
template <int D, KVFormat F>
void locate_stored(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, StoredTile& t) {
  const int32_t* bt = a.block_table + it.seq * a.bt_stride;
  const int64_t rb = kv_row_bytes(F, D), plane = a.num_blocks * a.block_size * a.hkv * rb;
  const uint8_t* base = static_cast<const uint8_t*>(a.kv);
  int64_t bi = kt / a.block_size, off = kt % a.block_size;
  for (int i = 0; i < n; ++i) {
    t.k[i] = base + ((bt[bi] * a.block_size + off) * a.hkv + it.kvh) * rb;
    t.v[i] = t.k[i] + plane;
    if (++off == a.block_size) off = 0, ++bi;
    if constexpr (F != KVFormat::kBF16) {
      t.ks[i] = kv_row_scale(t.k[i], D) * kv_code_factor(F);
      t.vs[i] = kv_row_scale(t.v[i], D) * kv_code_factor(F);
    }
  }
  for (int i = n; i < 16; ++i) t.k[i] = t.k[0], t.v[i] = t.v[0], t.ks[i] = t.ks[0], t.vs[i] = 0.f;
}

// The tile's rows widened once into kbuf/vbuf ([16][D] floats), for items whose many rows share the tile.
template <int D, KVFormat F>
void widen_stored(const StoredTile& t, int n, float* kbuf, float* vbuf, const float** kp, const float** vp) {
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < D; j += 16) {
      _mm512_storeu_ps(kbuf + i * D + j, stored16<F>(t.k[i], j));
      _mm512_storeu_ps(vbuf + i * D + j, stored16<F>(t.v[i], j));
    }
    kp[i] = kbuf + i * D;
    vp[i] = vbuf + i * D;
  }
  for (int i = n; i < 16; ++i) kp[i] = kp[0], vp[i] = vp[0];
}

// K/V row pointers of keys kt .. kt + n - 1 of an f32 cache; entries n..15 repeat key kt so the 16-wide score code
// reads valid memory (their scores are masked).
template <int D>
void locate_f32(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, const float** kp, const float** vp) {
  const int32_t* bt = a.block_table + it.seq * a.bt_stride;
  const int64_t row = a.hkv * D, plane = a.num_blocks * a.block_size * row;
  int64_t bi = kt / a.block_size, off = kt % a.block_size;
  for (int i = 0; i < n; ++i) {
    kp[i] = static_cast<const float*>(a.kv) + (bt[bi] * a.block_size + off) * row + it.kvh * D;
    vp[i] = kp[i] + plane;
    if (++off == a.block_size) off = 0, ++bi;
  }
  for (int i = n; i < 16; ++i) kp[i] = kp[0], vp[i] = vp[0];
}

// One row's online-softmax step on a tile: s = scores (lanes >= nvalid masked), update m and l (16 lane-wise partial
// sums); pb = the tile's p; returns alpha, the factor on the row's accumulator.
inline float softmax_step(__m512 s, int nvalid, float& m, float* l16, float* pb) {
  const __mmask16 mask = nvalid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nvalid) - 1);
  const float mn = std::max(m, _mm512_mask_reduce_max_ps(mask, s));
  const float alpha = mn == m ? 1.f : std::exp(m - mn);  // m = -inf on the first tile: alpha = 0
  m = mn;
  const __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
  _mm512_storeu_ps(l16, _mm512_fmadd_ps(_mm512_loadu_ps(l16), _mm512_set1_ps(alpha), p));
  _mm512_store_ps(pb, p);
  return alpha;
}

// Rows per KV head of an item up to which a bf16 or int8 tile is read in place (every row widens the rows again);
// above it, and for fp8 (whose widening costs more than the L1 round trip), the tile is widened once into L1 and
// shared. Both give the same arithmetic. Measured on Sapphire Rapids (BENCHMARKS.md).
template <KVFormat F>
constexpr int64_t kInPlaceRows = F == KVFormat::kInt8 || F == KVFormat::kBF16 ? 4 : 0;

// Query rows sharing a tile's keys at once, at most (R x 8 score accumulators in the registers). An f32 cache's
// decode rows, read from memory, go one at a time: a single row's scores touch all 16 keys at once, so their
// misses overlap. Prompt rows (an item of several tokens) reuse the tile from L1 and share its loads.
template <KVFormat F>
constexpr int row_block(int64_t tokens) {
  return F == KVFormat::kF32 && tokens == 1 ? 1 : 3;
}

// P . V's accumulator sets per row: 2 (even and odd keys apart) for f32 caches, whose decode rows go one at a time;
// 1 for the others, whose decode rows go a token's query heads (up to 3) at a time: the bits their rows had before
// prompt rows were blocked across tokens.
template <KVFormat F>
constexpr int kPvSets = F == KVFormat::kF32 ? 2 : 1;

// The rows of one key tile and one KV head: scores, softmax step, p . V. F is the cache's format: f32 rows are read
// through kp/vp; bf16 and quantized rows in place (st) or widened (kp/vp), quantized ones scaled.
template <int D, KVFormat F>
struct TileRows {
  const float* kp[16];
  const float* vp[16];
  StoredTile st;
  bool in_place = false;

  // R consecutive rows of one token (q, acc D apart; m; l16 16 apart).
  template <int R>
  void run(const AttnArgs& a, const float* q, int nvalid, float* m, float* l16, float* acc) const {
    constexpr bool kQuant = kv_quantized(F);
    __m512 s[R];
    if (F != KVFormat::kF32 && in_place) {
      scores_rows<D, R>(q, StoredRows<F>{st.k}, s);
    } else {
      scores_rows<D, R>(q, FloatRows{kp}, s);
    }
    alignas(64) float pb[16 * R];
    float alpha[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (kQuant) s[r] = _mm512_mul_ps(s[r], _mm512_load_ps(st.ks));
      if (a.softcap > 0.f) {
        alignas(64) float sb[16];
        _mm512_store_ps(sb, s[r]);
        softcap_scores(sb, 16, a.softcap);
        s[r] = _mm512_load_ps(sb);
      }
      alpha[r] = softmax_step(s[r], nvalid, m[r], l16 + 16 * r, pb + 16 * r);
      if constexpr (kQuant) _mm512_store_ps(pb + 16 * r, _mm512_mul_ps(_mm512_load_ps(pb + 16 * r), _mm512_load_ps(st.vs)));
    }
    if (F != KVFormat::kF32 && in_place) return pv_rows<D, R, kPvSets<F>>(acc, alpha, pb, StoredRows<F>{st.v}, nvalid);
    pv_rows<D, R, kPvSets<F>>(acc, alpha, pb, FloatRows{vp}, nvalid);
  }
};

template <int D, KVFormat F>
void run(const AttnArgs& a, const AttnItem& it) {
  const int64_t g = a.hq / a.hkv, nt = it.t1 - it.t0, per_head = nt * g, rows = per_head * it.nkvh;
  thread_local std::vector<float> scratch;
  scratch.resize(2 * rows * D + 17 * rows + 32 * D);
  float *qs = scratch.data(), *acc = qs + rows * D, *m = acc + rows * D, *l16 = m + rows, *kbuf = l16 + 16 * rows;
  float* vbuf = kbuf + 16 * D;
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.q + item_row_offset(it, r, g, D, a.q_stride);
    for (int j = 0; j < D; j += 16) {
      _mm512_storeu_ps(qs + r * D + j, _mm512_mul_ps(_mm512_loadu_ps(src + j), sc));
      _mm512_storeu_ps(acc + r * D + j, _mm512_setzero_ps());
    }
    _mm512_storeu_ps(l16 + 16 * r, _mm512_setzero_ps());
    m[r] = kNegInf;
  }
  TileRows<D, F> tile;
  tile.in_place = F != KVFormat::kF32 && per_head <= kInPlaceRows<F>;
  const int64_t block = row_block<F>(nt);
  for (int64_t kt = it.k0; kt < it.k1; kt += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, it.k1 - kt));
    const KvRowsAhead ahead(a, it, kt + 16, kv_row_bytes(F, D));
    for (int64_t hl = 0; hl < it.nkvh; ++hl) {  // every head of the item on this tile
      AttnItem head = it;
      head.kvh = it.kvh + static_cast<int32_t>(hl);
      ahead.prefetch(head.kvh, 3);
      if constexpr (F == KVFormat::kF32) {
        locate_f32<D>(a, head, kt, n, tile.kp, tile.vp);
      } else {
        locate_stored<D, F>(a, head, kt, n, tile.st);
        if (!tile.in_place) widen_stored<D, F>(tile.st, n, kbuf, vbuf, tile.kp, tile.vp);
      }
      for_tile_rows(it, kt, n, g, hl * per_head, block, [&](auto rows, int64_t r, int nvalid) {
        tile.template run<decltype(rows)::value>(a, qs + r * D, nvalid, m + r, l16 + 16 * r, acc + r * D);
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    finish_row(a, it, rows, r, acc + r * D, m[r], _mm512_reduce_add_ps(_mm512_loadu_ps(l16 + 16 * r)));
}

template <int D>
void run_format(const AttnArgs& a, const AttnItem& it) {
  switch (a.kv_format) {
    case KVFormat::kBF16:
      return run<D, KVFormat::kBF16>(a, it);
    case KVFormat::kInt8:
      return run<D, KVFormat::kInt8>(a, it);
    case KVFormat::kFp8E4M3:
      return run<D, KVFormat::kFp8E4M3>(a, it);
    case KVFormat::kFp8E5M2:
      return run<D, KVFormat::kFp8E5M2>(a, it);
    default:
      return run<D, KVFormat::kF32>(a, it);
  }
}

}  // namespace

void attn_item_avx512(const AttnArgs& a, const AttnItem& it) {
  with_head_dim<64, 128, 256>(a.d, [&](auto d) { run_format<decltype(d)::value>(a, it); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
