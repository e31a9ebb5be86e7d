// Shared by the bf16 dot-product attention kernels (attention_amx.cpp: AMX tiles, attention_avx512bf16.cpp:
// vdpbf16ps) for bf16 KV caches and head_dim 64 or 128. Include after a `#pragma GCC target` with avx512f, bw, vl,
// dq and avx512bf16.
//
// GEMM-shaped flash attention over an item (attention_kernels.h): the item's rows (query tokens x the G heads of a
// KV head) in blocks of 16, its keys in tiles of 32 at fixed offsets from k0 (a partition start). Per key tile the
// K rows are transposed once into VNNI tiles K^T [d/2 pairs][32 keys] and the V rows interleaved into
// [16 key pairs][d] (the operand layouts of AMX B tiles and of vdpbf16ps), then every row block multiplies:
//   S = bf16(q * scale) . K^T      (fp32 accumulation)
//   online softmax per row on the tile (fp32: running max m, 16 lane-wise partial sums l16), p masked causally
//   acc = acc * alpha + bf16(p) . V
// Every step is per row: which rows share a block, how many rows the item has and which thread runs it never
// change a row's bits (AMX and vdpbf16ps compute each output row from its own A row). Probabilities are rounded
// to bf16 (about 3 significant digits), as bf16 flash attention does on GPUs; queries too in the vdpbf16ps kernel,
// while the AMX kernel multiplies q as two bf16 parts (prepare<D, true, false>: ~16 significant bits).
// The AMX kernel (attention_amx.cpp) walks whole partitions as one key block instead of tiles of 32 (its own walk
// over the same buffers and operand layouts: prepare, transpose16, kv_row, visible and finish are shared).
// Cache element types: kv_row() reads a bf16 K/V row. The vdpbf16ps kernel also takes int8/fp8 caches (kv_quant.h):
// prepare_kv converts each row of a key tile to bf16(scale * code) once (exact in fp32, then rounded to nearest
// even, as bf16 flash attention over that cache dequantized to bf16 would read it), and everything else is the same.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_kernels.h"
#include "attention_stored.h"
#include "attention_tiles.h"
#include "vec_avx512.h"

namespace pdserve::attn_bf16 {

using attn_tiles::kNegInf;
using attn_tiles::kTile;
using attn_tiles::stored_row;
using attn_tiles::transpose16;

// The same row of a bf16 cache.
inline const uint16_t* kv_row(const AttnArgs& a, const AttnItem& it, int plane, int64_t key) {
  return reinterpret_cast<const uint16_t*>(stored_row(a, it, plane, key));
}

// Per-thread buffers of one item.
struct Scratch {
  std::vector<uint16_t> q;   // A tiles of bf16(q * scale): [row block][d / 32][16 rows][32]
  std::vector<uint16_t> qlo;  // SplitQ: the rest, bf16(q * scale - float(q)), same layout
  std::vector<uint32_t> kt;  // K^T tiles of the key tile: [d / 32][2 key halves][16 pairs][16 keys] (AMX: per block)
  std::vector<uint32_t> vt;  // V tiles of the key tile: [d / 16 dim panels][16 key pairs][16 dims] (AMX: per block)
  std::vector<float> acc, m, l16;  // per row: [d], max, 16 lane-wise sums
  std::vector<int64_t> last;        // per row: its position (it sees keys <= last)
  std::vector<uint16_t> p;   // bf16(p) of a row block: an A tile [16 rows][32 keys] (AMX: [16][block])
  std::vector<float> s;      // scores of a row block [16][32] (AMX: [16][block])
  std::vector<uint16_t> conv;  // a quantized cache's key tile as bf16 rows: K [32][d], then V [32][d]
};

// Rows of the item: row r is token t0 + r / g, head kvh * g + r % g; it sees keys <= pos0 + r / g.
inline int64_t item_rows(const AttnArgs& a, const AttnItem& it) { return (it.t1 - it.t0) * (a.hq / a.hkv); }

// Fill s.q (rows padded to a multiple of 16 with zeros; SplitQ: and s.qlo) and reset m, l16 and, with ZeroAcc, acc
// (the AMX kernel starts each row block's acc in zeroed tiles instead).
template <int D, bool SplitQ = false, bool ZeroAcc = true>
void prepare(const AttnArgs& a, const AttnItem& it, Scratch& s) {
  const int64_t g = a.hq / a.hkv, rows = item_rows(a, it), blocks = (rows + 15) / 16;
  s.q.resize(blocks * 16 * D);  // every row's values are written below; the padding rows' zeroed here
  if constexpr (SplitQ) s.qlo.resize(blocks * 16 * D);
  for (int64_t r = rows; r < blocks * 16; ++r)
    for (int st = 0; st < D / 32; ++st) {
      const int64_t at = ((r / 16 * (D / 32) + st) * 16 + r % 16) * 32;
      std::fill_n(s.q.data() + at, 32, uint16_t{0});
      if constexpr (SplitQ) std::fill_n(s.qlo.data() + at, 32, uint16_t{0});
    }
  if constexpr (ZeroAcc) {
    s.acc.assign(rows * D, 0.f);
  } else {
    s.acc.resize(blocks * 16 * D);
  }
  s.m.assign(blocks * 16, kNegInf);
  s.last.resize(blocks * 16);
  for (int64_t r = 0; r < blocks * 16; ++r) s.last[r] = r < rows ? it.pos0 + r / g : -1;  // padding sees nothing
  s.l16.assign(blocks * 16 * 16, 0.f);
  s.p.assign(16 * kTile, 0);
  s.s.resize(16 * kTile);
  s.kt.resize(D / 2 * kTile);
  s.vt.resize(D / 2 * kTile);
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.q + (it.t0 + r / g) * a.q_stride + (it.kvh * g + r % g) * D;
    for (int st = 0; st < D / 32; ++st) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + 32 * st), sc);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + 32 * st + 16), sc);
      const int64_t at = ((r / 16 * (D / 32) + st) * 16 + r % 16) * 32;
      const __m512i q = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      _mm512_storeu_si512(s.q.data() + at, q);
      if constexpr (SplitQ) {  // what bf16 rounding left out of each value (exact in fp32), rounded to bf16
        // bf16 elements 0-15 are lo's, 16-31 hi's
        const __m512 lo_q = vec::bf16_to_ps(_mm512_castsi512_si256(q));
        const __m512 hi_q = vec::bf16_to_ps(_mm512_extracti64x4_epi64(q, 1));
        const __m512i rest = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(hi, hi_q), _mm512_sub_ps(lo, lo_q));
        _mm512_storeu_si512(s.qlo.data() + at, rest);
      }
    }
  }
}

// vpermt2w indices interleaving two rows of 32 bf16, x and y, into pairs (x[i], y[i]): lo for i = 0..15, hi for
// 16..31 (the pair layout of vdpbf16ps's and AMX's B operands).
inline void pair_indices(__m512i& lo, __m512i& hi) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  lo = _mm512_load_si512(kLo);
  hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
}

// The bf16 pair (p[0], p[1]) in every 32-bit lane.
inline __m512bh bcast_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
}

// A quantized row (codes, then its bf16 scale) as bf16(scale * code): the product is exact in fp32.
template <int D, KVFormat F>
void row_to_bf16(const uint8_t* row, uint16_t* out) {
  const __m512 sc = _mm512_set1_ps(kv_row_scale(row, D) * kv_code_factor(F));
  for (int j = 0; j < D; j += 32) {
    const __m512 lo = _mm512_mul_ps(stored16<F>(row, j), sc), hi = _mm512_mul_ps(stored16<F>(row, j + 16), sc);
    _mm512_storeu_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

template <int D, KVFormat F>
void tile_to_bf16(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, uint16_t* out) {
  for (int i = 0; i < n; ++i) {
    row_to_bf16<D, F>(stored_row(a, it, 0, kt + i), out + i * D);
    row_to_bf16<D, F>(stored_row(a, it, 1, kt + i), out + (kTile + i) * D);
  }
}

// Rows of keys kt .. kt + n - 1 as bf16 (nullptr past n): in place for a bf16 cache, else converted into s.conv.
template <int D>
void tile_rows(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, Scratch& s, const uint16_t** k,
               const uint16_t** v) {
  const bool conv = a.kv_format != KVFormat::kBF16;
  if (conv) {
    s.conv.resize(2 * kTile * D);
    if (a.kv_format == KVFormat::kInt8) tile_to_bf16<D, KVFormat::kInt8>(a, it, kt, n, s.conv.data());
    else if (a.kv_format == KVFormat::kFp8E4M3) tile_to_bf16<D, KVFormat::kFp8E4M3>(a, it, kt, n, s.conv.data());
    else tile_to_bf16<D, KVFormat::kFp8E5M2>(a, it, kt, n, s.conv.data());
  }
  for (int i = 0; i < kTile; ++i) {
    k[i] = i >= n ? nullptr : conv ? s.conv.data() + i * D : kv_row(a, it, 0, kt + i);
    v[i] = i >= n ? nullptr : conv ? s.conv.data() + (kTile + i) * D : kv_row(a, it, 1, kt + i);
  }
}

// K^T and V tiles of keys kt .. kt + n - 1 (n <= 32; missing keys are zero).
template <int D>
void prepare_kv(const AttnArgs& a, const AttnItem& it, int64_t kt, int n, Scratch& s) {
  const uint16_t *krows[kTile], *vrows[kTile];
  tile_rows<D>(a, it, kt, n, s, krows, vrows);
  for (int h = 0; h < 2; ++h) {
    const uint16_t* const* rows = krows + 16 * h;
    for (int st = 0; st < D / 32; ++st) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 32 * st) : _mm512_setzero_si512();
      transpose16(r);
      uint32_t* dst = s.kt.data() + (st * 2 + h) * 256;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + 16 * i, r[i]);
    }
  }
  // V: dword (v[2i][dim], v[2i + 1][dim]) at [dim / 16][i][dim % 16]
  __m512i lo, hi;
  pair_indices(lo, hi);
  for (int i = 0; i < kTile / 2; ++i) {
    const uint16_t *v0 = vrows[2 * i], *v1 = vrows[2 * i + 1];
    for (int seg = 0; seg < D / 32; ++seg) {
      const __m512i x = v0 ? _mm512_loadu_si512(v0 + 32 * seg) : _mm512_setzero_si512();
      const __m512i y = v1 ? _mm512_loadu_si512(v1 + 32 * seg) : _mm512_setzero_si512();
      _mm512_storeu_si512(s.vt.data() + ((2 * seg) * 16 + i) * 16, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(s.vt.data() + ((2 * seg + 1) * 16 + i) * 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// Keys of the tile at kt (n of them) that row r sees: 0 (skip the row) .. n.
inline int visible(const Scratch& s, int64_t r, int64_t kt, int n) { return attn_tiles::visible(s.last[r], kt, n); }

// attn_tiles::softmax_block on row block b: bf16(p) into s.p [16][32].
inline __mmask16 softmax_block(Scratch& s, int64_t b, int64_t kt, int n, float* alpha) {
  return attn_tiles::softmax_block(s.s.data(), s.last.data() + 16 * b, s.m.data() + 16 * b,
                                   s.l16.data() + 256 * b, kt, n, alpha, [&](int i, __m512 p0, __m512 p1) {
                                     _mm512_storeu_si512(s.p.data() + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                                   });
}

// The item's key tiles in order and, per tile, every row block with a row that sees it (attn_tiles::walk): scores(b)
// fills s.s with the block's scores, softmax_block turns them into s.p, then pv(b, seen, alpha) adds P . V to the
// rows' acc.
template <int D, class Scores, class Pv>
void walk(const AttnArgs& a, const AttnItem& it, Scratch& s, Scores scores, Pv pv) {
  alignas(64) float alpha[16];
  attn_tiles::walk(
      a, it, item_rows(a, it), [&](int64_t kt, int n) { prepare_kv<D>(a, it, kt, n, s); },
      [&](int64_t b, int64_t kt, int n) {
        scores(b);
        pv(b, softmax_block(s, b, kt, n, alpha), alpha);
      });
}

// The item's results: normalised rows into out, or (it.part) acc, m, l for attention.cpp's fold.
template <int D>
void finish(const AttnArgs& a, const AttnItem& it, const Scratch& s) {
  const int64_t rows = item_rows(a, it);
  for (int64_t r = 0; r < rows; ++r)
    finish_row(a, it, rows, r, s.acc.data() + r * D, s.m[r],
               _mm512_reduce_add_ps(_mm512_loadu_ps(s.l16.data() + 16 * r)));
}

}  // namespace pdserve::attn_bf16
