// AMX paged attention for bf16 caches, head_dim 64 and 128: prompt rows on every AMX CPU, and all rows from
// attention_bf16_min_group query heads per KV head (attention.cpp). Flash attention in key blocks of kBlock:
// per block the K rows are transposed once into K^T tiles and the V rows interleaved into V tiles (attention_bf16.h's
// layouts), then every row block of 16 that sees the block
//   S = q . K^T        4 C tiles per 64 keys, q as two bf16 parts (hi + lo: ~16 significant bits), into
//                      s.s [16][kBlock]
//   softmax            per row over the whole block (fp32): m, alpha = exp(m_old - m_new) (the 16 rows' as vectors),
//                      l (16 lane-wise sums), bf16(p) into s.p [16][kBlock] (zero past the row's last visible key)
//   acc = acc * alpha + P . V   the acc rows in C tiles (zeroed on the row block's first keys) accumulated over the
//                      block's 32-key steps
// so the tile stores and the vector rescale happen once per block and row block, not per 32 keys (a tile product
// followed at once by its store and a vector read of it stalls the core on the tile unit's latency), and the next row
// block's S is issued before this one's P . V, whose tile loads wait for the vector stores of P and acc. Every step
// is per row and the blocks sit at fixed offsets from the item's first key (a partition start), so neither the rows
// beside a row nor the item's split change its bits.
// Tiles: scores: tmm0..3 C; tmm4, 5 q (hi, lo); tmm6, 7 K^T. P . V: tmm4..7 C (4 dim panels of 16); tmm2 P;
// tmm0, 1, 3 V.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

#include "attention_bf16.h"

namespace pdserve {
namespace {

using attn_bf16::kNegInf;
using attn_bf16::Scratch;

// Keys per block: a call's keys lie within one partition (attention.cpp), so one block covers them all and a row's
// softmax runs once per call: no rescale of acc, which would stall the next tile load of it (a vector store read
// by a tile load) per block.
constexpr int kBlock = static_cast<int>(kPartition);
static_assert(kBlock % 32 == 0, "a block is whole 32-key steps");

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// K^T tiles of the block's keys kb .. kb + n - 1 at s.kt [16-key group][d / 32][16 pairs][16 keys], V tiles at
// s.vt [32-key step][d / 16 panels][16 key pairs][16 dims]; keys past n (up to the next multiple of 32) are zero.
template <int D>
void prepare_block(const AttnArgs& a, const AttnItem& it, int64_t kb, int n, Scratch& s) {
  const int nq = (n + 31) / 32;
  for (int j = 0; j < 2 * nq; ++j) {
    const uint16_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = 16 * j + i < n ? attn_bf16::kv_row(a, it, 0, kb + 16 * j + i) : nullptr;
    for (int st = 0; st < D / 32; ++st) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + 32 * st) : _mm512_setzero_si512();
      attn_bf16::transpose16(r);
      uint32_t* dst = s.kt.data() + (j * (D / 32) + st) * 256;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + 16 * i, r[i]);
    }
  }
  // V: dword (v[2i][dim], v[2i + 1][dim]) at [step][dim / 16][i][dim % 16]
  __m512i lo, hi;
  attn_bf16::pair_indices(lo, hi);
  for (int q = 0; q < nq; ++q) {
    uint32_t* dst = s.vt.data() + q * (D / 16) * 256;
    for (int i = 0; i < 16; ++i) {
      const int k0 = 32 * q + 2 * i;
      const uint16_t* v0 = k0 < n ? attn_bf16::kv_row(a, it, 1, kb + k0) : nullptr;
      const uint16_t* v1 = k0 + 1 < n ? attn_bf16::kv_row(a, it, 1, kb + k0 + 1) : nullptr;
      for (int seg = 0; seg < D / 32; ++seg) {
        const __m512i x = v0 ? _mm512_loadu_si512(v0 + 32 * seg) : _mm512_setzero_si512();
        const __m512i y = v1 ? _mm512_loadu_si512(v1 + 32 * seg) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + ((2 * seg) * 16 + i) * 16, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(dst + ((2 * seg + 1) * 16 + i) * 16, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
  }
}

// Scores of row block b against the block's nq 32-key steps into s.s [16][kBlock], 64 keys (four C tiles, tmm0..3)
// at a time: per 32-dim step st, q's hi and lo tiles (tmm4, 5) and the K^T tiles of two 16-key groups at a time
// (tmm6, 7). Each C tile sums, per st, q_hi . K^T then q_lo . K^T; four independent sums keep the tile unit busy
// where two wait on each other's latency.
template <int D>
void scores(Scratch& s, int64_t b, int nq) {
  const auto kt = [&](int j, int st) { return s.kt.data() + (j * (D / 32) + st) * 256; };
  for (int q = 0; q < nq; q += 2) {
    const bool two = q + 1 < nq;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int st = 0; st < D / 32; ++st) {
      const int64_t at = (b * (D / 32) + st) * 512;
      _tile_loadd(4, s.q.data() + at, 64);
      _tile_loadd(5, s.qlo.data() + at, 64);
      _tile_loadd(6, kt(2 * q, st), 64);
      _tile_loadd(7, kt(2 * q + 1, st), 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(0, 5, 6);
      _tile_dpbf16ps(1, 5, 7);
      if (two) {
        _tile_loadd(6, kt(2 * q + 2, st), 64);
        _tile_loadd(7, kt(2 * q + 3, st), 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, s.s.data() + 32 * q, kBlock * 4);
    _tile_stored(1, s.s.data() + 32 * q + 16, kBlock * 4);
    if (two) {
      _tile_stored(2, s.s.data() + 32 * q + 32, kBlock * 4);
      _tile_stored(3, s.s.data() + 32 * q + 48, kBlock * 4);
    }
  }
}

// What a softmax step leaves for P . V: whether a row of the block sees a key of it, and whether none had seen one
// before (the block's acc is then not written yet: P . V starts it in zeroed tiles).
struct Seen {
  bool any, fresh;
};

// The online-softmax step of row block b on the block at kb (n keys, nq steps of 32): m and l16 updated, bf16(p)
// written to s.p (zero past each row's last visible key), the rows' acc scaled by alpha = exp(m_old - m_new).
// The 16 rows' maxima and alphas are taken as vectors (row i in lane i).
template <int D>
Seen softmax(Scratch& s, int64_t b, int64_t kb, int n, int nq) {
  alignas(64) float m_new[16], alpha[16];
  __m512 part[16];  // row i's lane-wise maxima over its visible scores
  int nv[16];
  __mmask16 seen = 0;
  for (int i = 0; i < 16; ++i) {
    nv[i] = attn_bf16::visible(s, 16 * b + i, kb, n);
    const float* srow = s.s.data() + i * kBlock;
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int v = 0; 16 * v < nv[i]; ++v) {
      const int left = nv[i] - 16 * v;
      mx = _mm512_mask_max_ps(mx, left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1), mx,
                              _mm512_loadu_ps(srow + 16 * v));
    }
    part[i] = mx;
    if (nv[i] > 0) seen |= __mmask16(1u << i);
  }
  if (seen == 0) return {false, false};
  float* m = s.m.data() + 16 * b;
  const __m512 mo = _mm512_loadu_ps(m);
  const __m512 mn = _mm512_max_ps(mo, vec::reduce16_with(part, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); }));
  // exactly 1 where the max stays (a row without keys here included), 0 on a row's first keys (m_old = -inf)
  __m512 al = _mm512_mask_mov_ps(vec::exp16_scalef(_mm512_sub_ps(mo, mn)),
                                 _mm512_cmp_ps_mask(mo, mn, _CMP_EQ_OQ), _mm512_set1_ps(1.f));
  const __mmask16 first = _mm512_cmp_ps_mask(mo, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
  al = _mm512_mask_mov_ps(al, first, _mm512_setzero_ps());
  _mm512_store_ps(alpha, al);
  _mm512_store_ps(m_new, mn);
  _mm512_storeu_ps(m, mn);
  for (int i = 0; i < 16; ++i) {
    const int64_t r = 16 * b + i;
    uint16_t* prow = s.p.data() + i * kBlock;
    if (nv[i] == 0) {  // p = 0 and alpha = 1: the row's state stays as it is
      for (int q = 0; q < nq; ++q) _mm512_storeu_si512(prow + 32 * q, _mm512_setzero_si512());
      continue;
    }
    const float* srow = s.s.data() + i * kBlock;
    const __m512 mi = _mm512_set1_ps(m_new[i]);
    __m512 sum = _mm512_setzero_ps();
    for (int q = 0; q < nq; ++q) {
      __m512 p[2];
      for (int h = 0; h < 2; ++h) {
        const int left = nv[i] - (32 * q + 16 * h);
        const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0);
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(srow + 32 * q + 16 * h), mi);
        p[h] = _mm512_maskz_mov_ps(k, vec::exp16_scalef(x));
        sum = _mm512_add_ps(sum, p[h]);
      }
      _mm512_storeu_si512(prow + 32 * q, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    }
    float* l16 = s.l16.data() + 16 * r;
    const __m512 ai = _mm512_set1_ps(alpha[i]);
    _mm512_storeu_ps(l16, _mm512_fmadd_ps(_mm512_loadu_ps(l16), ai, sum));
    if (alpha[i] != 1.f && !(first >> i & 1)) {  // (a row's first keys: its block's acc may not be written yet)
      float* acc = s.acc.data() + r * D;
      for (int j = 0; j < D; j += 16) _mm512_storeu_ps(acc + j, _mm512_mul_ps(_mm512_loadu_ps(acc + j), ai));
    }
  }
  return {true, first == 0xFFFF};
}

// acc rows of block b += P . V over the block's nq steps, 4 dim panels (64 dims) at a time in C tiles tmm4..7;
// `fresh`: the block's first P . V, whose acc starts as zeroed tiles (not yet written in s.acc).
template <int D>
void pv(Scratch& s, int64_t b, int nq, bool fresh) {
  for (int c0 = 0; c0 < D / 16; c0 += 4) {
    float* acc = s.acc.data() + 16 * b * D + 16 * c0;
    if (fresh) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
    } else {
      _tile_loadd(4, acc, D * 4);
      _tile_loadd(5, acc + 16, D * 4);
      _tile_loadd(6, acc + 32, D * 4);
      _tile_loadd(7, acc + 48, D * 4);
    }
    for (int q = 0; q < nq; ++q) {
      const uint32_t* v = s.vt.data() + (q * (D / 16) + c0) * 256;
      _tile_loadd(2, s.p.data() + 32 * q, kBlock * 2);
      _tile_loadd(3, v, 64);
      _tile_dpbf16ps(4, 2, 3);
      _tile_loadd(0, v + 256, 64);
      _tile_dpbf16ps(5, 2, 0);
      _tile_loadd(1, v + 512, 64);
      _tile_dpbf16ps(6, 2, 1);
      _tile_loadd(3, v + 768, 64);
      _tile_dpbf16ps(7, 2, 3);
    }
    _tile_stored(4, acc, D * 4);
    _tile_stored(5, acc + 16, D * 4);
    _tile_stored(6, acc + 32, D * 4);
    _tile_stored(7, acc + 48, D * 4);
  }
}

template <int D>
void run(const AttnArgs& a, const AttnItem& it) {
  thread_local Scratch s;
  attn_bf16::prepare<D, true, false>(a, it, s);
  const int64_t g = a.hq / a.hkv, rows = attn_bf16::item_rows(a, it), blocks = (rows + 15) / 16;
  // acc (whole row blocks: the C tiles load and store 16 rows) is written by a row block's first P . V
  s.s.resize(16 * kBlock);
  s.p.resize(16 * kBlock);
  s.kt.resize(kBlock / 16 * (D / 32) * 256);
  s.vt.resize(kBlock / 32 * (D / 16) * 256);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  for (int64_t kb = it.k0; kb < it.k1; kb += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, it.k1 - kb)), nq = (n + 31) / 32;
    const int64_t r0 = std::max<int64_t>(0, kb - it.pos0) * g;  // earlier rows do not see key kb
    if (r0 >= rows) break;
    prepare_block<D>(a, it, kb, n, s);
    // the block's rows see keys up to its last row's position: the 32-key steps past it are all masked
    const auto visible_keys = [&](int64_t b) {
      return static_cast<int>(std::clamp<int64_t>(s.last[std::min(rows - 1, 16 * b + 15)] - kb + 1, 0, n));
    };
    // Row block b + 1's scores are issued between b's softmax and b's P . V: the tile loads of P and acc wait for
    // the vector stores that wrote them to leave the store buffer, and the tile products cover that wait.
    int64_t b = r0 / 16;
    int nb = visible_keys(b);
    scores<D>(s, b, (nb + 31) / 32);
    Seen seen = softmax<D>(s, b, kb, nb, (nb + 31) / 32);
    for (; b < blocks; ++b) {
      const int nqb = (nb + 31) / 32, nb1 = b + 1 < blocks ? visible_keys(b + 1) : 0;
      if (b + 1 < blocks) scores<D>(s, b + 1, (nb1 + 31) / 32);  // s.s is free: b's softmax has read it
      if (seen.any) pv<D>(s, b, nqb, seen.fresh);
      if (b + 1 < blocks) seen = softmax<D>(s, b + 1, kb, nb1, (nb1 + 31) / 32);
      nb = nb1;
    }
  }
  _tile_release();
  for (int64_t b = 0; b < blocks; ++b)  // row blocks none of whose rows saw a key of the item: acc = 0 (l = 0)
    if (std::all_of(s.m.begin() + 16 * b, s.m.begin() + 16 * b + 16, [](float m) { return m == kNegInf; }))
      std::fill_n(s.acc.data() + 16 * b * D, 16 * D, 0.f);
  attn_bf16::finish<D>(a, it, s);
}

}  // namespace

void attn_item_amx(const AttnArgs& a, const AttnItem& it) {
  with_head_dim<64, 128>(a.d, [&](auto d) { run<decltype(d)::value>(a, it); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
