// Shared by the GEMM-shaped flash-attention kernels of prompt rows (attention_bf16.h: bf16 dot products, AMX tiles
// and vdpbf16ps; attention_avx512_tiles.cpp: fp32 FMAs): an item's rows in blocks of 16, its keys in tiles of 32 at
// fixed offsets from k0, per tile every row block's scores S [16][32], one online-softmax step per block, then
// P . V. Include after a `#pragma GCC target` with avx512f, bw, vl and dq.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_kernels.h"
#include "vec_avx512.h"

namespace pdserve::attn_tiles {

constexpr int kTile = 32;  // keys per tile: one AMX K step of 32 bf16 in the P . V product
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The stored row of key `key` (plane 0: K, 1: V) of the item's KV head, in the cache's format (kv_quant.h).
inline const uint8_t* stored_row(const AttnArgs& a, const AttnItem& it, int plane, int64_t key) {
  const int64_t blk = a.block_table[it.seq * a.bt_stride + key / a.block_size];
  const int64_t row = ((plane * a.num_blocks + blk) * a.block_size + key % a.block_size) * a.hkv + it.kvh;
  return static_cast<const uint8_t*>(a.kv) + row * kv_row_bytes(a.kv_format, a.d);
}

// 16 x 16 transpose of 32-bit elements: r[i] lane j -> r[j] lane i.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // u[4q + c] lane L: column 4L + c of rows 4q .. 4q + 3
    u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes per c
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Keys of the tile at kt (n of them) that a row seeing keys <= last sees: 0 (skip the row) .. n.
inline int visible(int64_t last, int64_t kt, int n) {
  return static_cast<int>(std::clamp<int64_t>(last - kt + 1, 0, n));
}

// The online-softmax step of a block of 16 rows on their scores s [16][32] (lanes >= a row's visible keys masked;
// last[i]: row i sees keys <= last[i]): updates the rows' running maxima m[16] and lane-wise sums l16 [16][16],
// hands each row's probabilities to store_p(i, p0, p1) (keys 0-15, 16-31; zeros for rows that see no key of the
// tile), writes the factor for acc to alpha[16] and returns the mask of rows that see the tile. Lane i of every
// vector step is row i alone; the rows' maxima come from one transpose tree, exp from exp16_scalef (arguments <= 0).
template <class StoreP>
inline __mmask16 softmax_block(const float* s, const int64_t* last, float* m, float* l16, int64_t kt, int n,
                               float* alpha, StoreP store_p) {
  __mmask16 seen = 0;
  __mmask16 k0[16], k1[16];
  __m512 rmax[16];
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  for (int i = 0; i < 16; ++i) {
    const int nv = visible(last[i], kt, n);
    k0[i] = nv >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nv) - 1);
    k1[i] = nv >= 32 ? __mmask16(0xFFFF) : nv > 16 ? __mmask16((1u << (nv - 16)) - 1) : 0;
    if (nv > 0) seen |= __mmask16(1u << i);
    rmax[i] = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, k0[i], s + 32 * i),
                            _mm512_mask_loadu_ps(ninf, k1[i], s + 32 * i + 16));
  }
  const __m512 mo = _mm512_loadu_ps(m);
  const __m512 mn = _mm512_max_ps(mo, vec::reduce16_with(rmax, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); }));
  // alpha = exp(m_old - m_new): exactly 1 when the max stays, 0 on a row's first tile (m_old = -inf)
  __m512 al = _mm512_mask_mov_ps(vec::exp16_scalef(_mm512_sub_ps(mo, mn)), _mm512_cmp_ps_mask(mo, mn, _CMP_EQ_OQ),
                                 _mm512_set1_ps(1.f));
  al = _mm512_mask_mov_ps(al, _mm512_cmp_ps_mask(mo, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
  _mm512_storeu_ps(alpha, al);
  _mm512_mask_storeu_ps(m, seen, mn);
  alignas(64) float mnv[16];
  _mm512_store_ps(mnv, mn);
  for (int i = 0; i < 16; ++i) {
    if (!(seen >> i & 1)) {
      store_p(i, _mm512_setzero_ps(), _mm512_setzero_ps());
      continue;
    }
    const __m512 mi = _mm512_set1_ps(mnv[i]);
    const __m512 p0 = _mm512_maskz_mov_ps(k0[i], vec::exp16_scalef(_mm512_sub_ps(_mm512_loadu_ps(s + 32 * i), mi)));
    const __m512 p1 =
        _mm512_maskz_mov_ps(k1[i], vec::exp16_scalef(_mm512_sub_ps(_mm512_loadu_ps(s + 32 * i + 16), mi)));
    float* l = l16 + 16 * i;
    _mm512_storeu_ps(l, _mm512_add_ps(_mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha[i]), p0), p1));
    store_p(i, p0, p1);
  }
  return seen;
}

// The item's key tiles in order (`rows`: the item's rows, 16 a block): per tile the next tile's K/V rows are asked
// into L2, prepare_kv(kt, n) readies the tile's keys kt .. kt + n - 1, then block(b, kt, n) runs every row block b
// with a row that sees the tile.
template <class PrepareKv, class Block>
void walk(const AttnArgs& a, const AttnItem& it, int64_t rows, PrepareKv prepare_kv, Block block) {
  const int64_t g = a.hq / a.hkv;
  for (int64_t kt = it.k0; kt < it.k1; kt += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, it.k1 - kt));
    const int64_t r0 = std::max<int64_t>(0, kt - it.pos0) * g;  // earlier rows do not see key kt
    if (r0 >= rows) break;
    for (int64_t k = kt + kTile; k < kt + 2 * kTile; k += 16)
      KvRowsAhead(a, it, k, kv_row_bytes(a.kv_format, a.d)).prefetch(it.kvh, 3);
    prepare_kv(kt, n);
    for (int64_t b = r0 / 16; b * 16 < rows; ++b) block(b, kt, n);
  }
}

// The runs of rows of a block that see the tile (mask `seen`), up to four rows a run, taken 4, 2 or 1 at a time:
// f(std::integral_constant<int, R>, first row).
template <class F>
inline void seen_runs(__mmask16 seen, F&& f) {
  for (int i = 0; i < 16;) {
    if (!(seen >> i & 1)) {
      ++i;
      continue;
    }
    int run = 1;
    while (run < 4 && i + run < 16 && (seen >> (i + run) & 1)) ++run;
    if (run == 4) {
      f(std::integral_constant<int, 4>(), i);
    } else if (run >= 2) {
      f(std::integral_constant<int, 2>(), i);
      run = 2;
    } else {
      f(std::integral_constant<int, 1>(), i);
    }
    i += run;
  }
}

}  // namespace pdserve::attn_tiles
