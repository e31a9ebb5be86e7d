// AVX512-BF16 paged attention for generated rows (decode, speculative verification) of bf16 caches, head_dim 64 and
// 128, on K/V rows as stored (no transposes), items spanning several KV heads as the fp32 kernel's do.
//
// An item (at most one partition of keys, attention.cpp) runs in three passes: every row's scores, key tile by key
// tile (16 keys; per tile every KV head of the item in turn, so a token's rows of those heads are read together);
// every row's softmax over all its scores at once; then P . V, tile by tile. Without a running max there is no
// chain from one tile to the next (the online softmax waited on each tile's reductions and exp before the next
// tile's P . V), so the core overlaps the tiles' work.
//
// Scores: per row and key, vdpbf16ps on the K row as stored (32 bf16 = 16 pairs a vector) and the row's q, lane j
// summing the pair j products; a key's D / 32 vectors accumulate in one vector, and reduce16's tree turns the 16
// keys' vectors into one vector of 16 scores. q (pre-scaled) enters as two bf16 parts, hi = bf16(q) and
// lo = bf16(q - hi), so the scores carry ~16 significant bits of q, not 8 (an error in a score is an error of the
// same relative size in its probability). P . V: keys in pairs, the two V rows interleaved into [dims][2 keys]
// (vdpbf16ps's pair layout) and multiplied by the pair (bf16(p_i), bf16(p_i+1)): the probabilities are rounded to
// bf16, as the prompt rows' bf16 kernels and bf16 flash attention on GPUs do.
// Against the fp32 kernel, which widens every K and V element to fp32 and multiplies with FMAs: as many multiply
// instructions for the scores (q in two parts), a quarter for P . V, and no widening.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

#include "attention_bf16.h"

namespace pdserve {
namespace {

using attn_bf16::bcast_pair;
using attn_bf16::kNegInf;
using vec::reduce16;

template <int D>
struct DotRows {
  static constexpr int kRows = 3;   // rows of a token whose P . V shares each V pair's interleave
  static constexpr int C = D / 32;  // 32-value chunks of a row
  const uint8_t* k[16];  // the tile's K and V rows of one head (each_tile)
  const uint8_t* v[16];
  const uint16_t* qb = nullptr;  // per row: C chunks of hi, then C chunks of lo (32 bf16 each)

  // qs: the item's pre-scaled q rows (D apart) as bf16 hi and lo parts, into buf (rows x 2D).
  void prepare(const float* qs, int64_t rows, uint16_t* buf) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < C; ++c) {
        const __m512 lo = _mm512_loadu_ps(qs + r * D + 32 * c), hi = _mm512_loadu_ps(qs + r * D + 32 * c + 16);
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15: lo's, 16-31: hi's
        const __m512 lo_h = vec::bf16_to_ps(_mm512_castsi512_si256(h));
        const __m512 hi_h = vec::bf16_to_ps(_mm512_extracti64x4_epi64(h, 1));
        const __m512i rest = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(hi, hi_h), _mm512_sub_ps(lo, lo_h));
        _mm512_storeu_si512(buf + (r * 2 * C + c) * 32, h);
        _mm512_storeu_si512(buf + (r * 2 * C + C + c) * 32, rest);
      }
    }
    qb = buf;
  }

  // Scores of row r against the tile's 16 keys (key i: one vector, hi then lo per chunk, chunks in order).
  __m512 scores(int64_t r) const {
    const uint16_t* q = qb + r * 2 * D;
    __m512bh qv[2 * C];
    for (int c = 0; c < 2 * C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      __m512 x = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m512bh kc = (__m512bh)_mm512_loadu_si512(k[i] + 64 * c);
        x = _mm512_dpbf16_ps(x, kc, qv[c]);
        x = _mm512_dpbf16_ps(x, kc, qv[C + c]);
      }
      acc[i] = x;
    }
    return reduce16(acc);
  }

  // acc_r += sum over the tile's key pairs of bf16 p . V for R rows (acc D apart, pp: the rows' bf16 probabilities of
  // the tile, ks apart). With few chains (R x NV <= 8) even and odd pairs accumulate apart, then add (R follows
  // from G alone: a row's arithmetic is fixed). Two V rows interleave within 128-bit lanes (vpunpck{l,h}wd, on pipes
  // the dot products do not use; the vpermt2w that kept dims in order took one of theirs), so acc holds each 32-dim
  // chunk's dims in a fixed order of their own: unpermute() restores it once an item's keys are done.
  template <int R>
  void pv(float* acc, const uint16_t* pp, int64_t ks, int n) const {
    constexpr int NV = D / 16, SETS = R * NV <= 8 ? 2 : 1;
    __m512 o[SETS][R][NV];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) {
        o[0][r][j] = _mm512_loadu_ps(acc + r * D + 16 * j);
        if constexpr (SETS == 2) o[1][r][j] = _mm512_setzero_ps();
      }
    auto pair = [&](int i, auto set) {  // keys i, i + 1 (p of a key >= n is 0) into o[set]
      constexpr int S = decltype(set)::value;
      for (int c = 0; c < C; ++c) {
        const __m512i x = _mm512_loadu_si512(v[i] + 64 * c), y = _mm512_loadu_si512(v[i + 1] + 64 * c);
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
        for (int r = 0; r < R; ++r) {
          const __m512bh p2 = bcast_pair(pp + r * ks + i);
          o[S][r][2 * c] = _mm512_dpbf16_ps(o[S][r][2 * c], lo, p2);
          o[S][r][2 * c + 1] = _mm512_dpbf16_ps(o[S][r][2 * c + 1], hi, p2);
        }
      }
    };
    int i = 0;
    if constexpr (SETS == 2)
      for (; i + 2 < n; i += 4) {
        pair(i, std::integral_constant<int, 0>{});
        pair(i + 2, std::integral_constant<int, 1>{});
      }
    for (; i < n; i += 2) pair(i, std::integral_constant<int, 0>{});
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) {
        const __m512 x = SETS == 2 ? _mm512_add_ps(o[0][r][j], o[SETS - 1][r][j]) : o[0][r][j];
        _mm512_storeu_ps(acc + r * D + 16 * j, x);
      }
  }

  // One row's acc from pv's order to dims in order: in each 32-dim chunk, lane m of its first vector holds dim
  // 8 (m / 4) + m % 4 and of its second that + 4.
  static void unpermute(float* acc) {
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c = 0; c < C; ++c) {
      const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
      _mm512_storeu_ps(acc + 32 * c, _mm512_permutex2var_ps(lo, i0, hi));
      _mm512_storeu_ps(acc + 32 * c + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
  }
};

// Row r of an item: its token's index in the item.
inline int64_t row_token(int64_t r, int64_t per_head, int64_t g) { return r % per_head / g; }

// The item's key tiles (heads inner: a token's rows of the item's heads are adjacent), calling f(kt, n, first row of
// the head) after the tile's K/V rows of that head are in rows.k and rows.v (entries n..15 repeat key kt: their p
// is 0). The block and offset of kt advance with it (no division per tile); a tile inside one block is one stride.
// Each head's rows of the tile 16 keys ahead, of the plane this pass reads, are prefetched into L2 as the walk
// reaches that head (KvRowsAhead).
template <int D, class F>
void each_tile(const AttnArgs& a, const AttnItem& it, DotRows<D>& rows, int64_t per_head, int plane_bit, F f) {
  const int32_t* bt = a.block_table + it.seq * a.bt_stride;
  const int64_t rb = 2 * D, stride = a.hkv * rb, plane = a.num_blocks * a.block_size * stride;
  const uint8_t* base = static_cast<const uint8_t*>(a.kv) + it.kvh * rb;
  int64_t bi = it.k0 / a.block_size, off = it.k0 % a.block_size;
  for (int64_t kt = it.k0; kt < it.k1; kt += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, it.k1 - kt));
    const uint8_t* first = base + (bt[bi] * a.block_size + off) * stride;
    const uint8_t* k[16];
    if (off + n <= a.block_size) {
      for (int i = 0; i < n; ++i) k[i] = first + i * stride;
    } else {
      for (int64_t i = 0, b = bi, o = off; i < n; ++i) {
        k[i] = base + (bt[b] * a.block_size + o) * stride;
        if (++o == a.block_size) o = 0, ++b;
      }
    }
    for (int i = n; i < 16; ++i) k[i] = first;
    const KvRowsAhead ahead(a, it, kt + 16, rb);
    for (int64_t hl = 0; hl < it.nkvh; ++hl) {
      ahead.prefetch(it.kvh + hl, plane_bit);
      for (int i = 0; i < 16; ++i) {
        rows.k[i] = k[i] + hl * rb;
        rows.v[i] = rows.k[i] + plane;
      }
      f(kt, n, hl * per_head);
    }
    for (off += 16; off >= a.block_size;) off -= a.block_size, ++bi;
  }
}

// Softmax of row r's scores s[0, nvis) (the keys it sees): m, l and bf16(p) into pp (zeros up to the next 16).
inline void softmax_row(const float* s, int nvis, float& m, float& l, uint16_t* pp) {
  m = kNegInf;
  l = 0.f;
  if (nvis == 0) return;
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int j = 0; j < nvis; j += 16) {
    const __mmask16 k = nvis - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nvis - j)) - 1);
    mx = _mm512_mask_max_ps(mx, k, mx, _mm512_loadu_ps(s + j));
  }
  m = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < nvis; j += 16) {
    const __mmask16 k = nvis - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nvis - j)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(k, vec::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + j), (__m256i)_mm512_cvtneps_pbh(p));
  }
  l = _mm512_reduce_add_ps(sum);
}

// One item in three passes over its keys (attention.cpp cuts items at partitions: at most 256 keys): every row's
// scores, every row's softmax, then P . V. No running max: the passes have no chain from one tile to the next, so
// the core overlaps the tiles' work (the online softmax, tile after tile, waited on each tile's reduce, max and
// exp). The first V tile is asked for before the softmax, which covers its latency.
template <int D>
void run_item(const AttnArgs& a, const AttnItem& it) {
  const int64_t g = a.hq / a.hkv, nt = it.t1 - it.t0, per_head = nt * g, nrows = per_head * it.nkvh;
  const int nkeys = static_cast<int>(it.k1 - it.k0);
  const int64_t ks = (nkeys + 15) / 16 * 16;  // a row's scores and probabilities: the item's tiles
  thread_local std::vector<float> fbuf;
  thread_local std::vector<uint16_t> pbuf;
  fbuf.resize(nrows * (2 * D + ks + 2));
  pbuf.resize(nrows * (ks + 2 * D));  // bf16 probabilities, then q's two bf16 parts
  float *qs = fbuf.data(), *acc = qs + nrows * D, *sc = acc + nrows * D, *m = sc + nrows * ks, *l = m + nrows;
  uint16_t* pp = pbuf.data();
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t r = 0; r < nrows; ++r) {
    const float* src = a.q + item_row_offset(it, r, g, D, a.q_stride);
    for (int j = 0; j < D; j += 16) {
      _mm512_storeu_ps(qs + r * D + j, _mm512_mul_ps(_mm512_loadu_ps(src + j), scale));
      _mm512_storeu_ps(acc + r * D + j, _mm512_setzero_ps());
    }
  }
  DotRows<D> rows;
  rows.prepare(qs, nrows, pp + nrows * ks);
  // a token t sees the tile at kt when kt <= pos0 + t
  each_tile<D>(a, it, rows, per_head, 1, [&](int64_t kt, int, int64_t h0) {
    for (int64_t r = h0 + std::max<int64_t>(0, kt - it.pos0) * g; r < h0 + per_head; ++r) {
      __m512 s = rows.scores(r);
      if (a.softcap > 0.f) {
        alignas(64) float sb[16];
        _mm512_store_ps(sb, s);
        softcap_scores(sb, 16, a.softcap);
        s = _mm512_load_ps(sb);
      }
      _mm512_storeu_ps(sc + r * ks + (kt - it.k0), s);
    }
  });
  KvRowsAhead(a, it, it.k0, 2 * D).prefetch_first(it, 2);  // P . V's first tile arrives during the softmax
  for (int64_t r = 0; r < nrows; ++r) {
    const int nvis = static_cast<int>(std::clamp<int64_t>(it.pos0 + row_token(r, per_head, g) + 1 - it.k0, 0, nkeys));
    softmax_row(sc + r * ks, nvis, m[r], l[r], pp + r * ks);
  }
  each_tile<D>(a, it, rows, per_head, 2, [&](int64_t kt, int n, int64_t h0) {
    for (int64_t t = std::max<int64_t>(0, kt - it.pos0); t < nt; ++t) {
      for (int64_t r = h0 + t * g, e = r + g; r < e; r += DotRows<D>::kRows) {
        const int64_t rr = std::min<int64_t>(DotRows<D>::kRows, e - r);
        const uint16_t* p = pp + r * ks + (kt - it.k0);
        if (rr == 3) {
          rows.template pv<3>(acc + r * D, p, ks, n);
        } else if (rr == 2) {
          rows.template pv<2>(acc + r * D, p, ks, n);
        } else {
          rows.template pv<1>(acc + r * D, p, ks, n);
        }
      }
    }
  });
  for (int64_t r = 0; r < nrows; ++r) {
    DotRows<D>::unpermute(acc + r * D);
    finish_row(a, it, nrows, r, acc + r * D, m[r], l[r]);
  }
}

}  // namespace

void attn_item_avx512bf16_rows(const AttnArgs& a, const AttnItem& it) {
  with_head_dim<64, 128>(a.d, [&](auto d) { run_item<decltype(d)::value>(a, it); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
