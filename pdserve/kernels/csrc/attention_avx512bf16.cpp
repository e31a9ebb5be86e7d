// AVX512-BF16 paged attention for bf16 caches (and int8/fp8 ones, converted per key tile), head_dim 64 and 128
// (attention_bf16.h has the scheme): the AMX kernel's tiles multiplied with vdpbf16ps. Scores: 16 keys per zmm
// lane-wise, a query pair broadcast per d-pair, up to eight rows sharing each K load; P . V: 16 dims per zmm,
// acc * alpha first, then a probability pair broadcast per key pair into four dim panels, up to four rows sharing
// each V load (the broadcasts and loads per product bound this kernel, not the products; BENCHMARKS.md).
// A row's chains and their order do not depend on how many rows share the loads: the same bits.
#include "attention_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

#include "attention_bf16.h"

namespace pdserve {
namespace {

using attn_bf16::bcast_pair;
using attn_bf16::kTile;
using attn_bf16::Scratch;

// Scores of rows i .. i + R - 1 of row block b against the key tile into sc[32] each (R rows share each K load).
// One accumulation chain per row and key half, d-pairs in order, whatever R: a row's bits do not depend on the rows
// beside it.
template <int D, int R>
void scores(const Scratch& s, int64_t b, int i, float* sc) {
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
  for (int st = 0; st < D / 32; ++st) {
    const uint16_t* q = s.q.data() + ((b * (D / 32) + st) * 16 + i) * 32;
    const uint32_t* k0 = s.kt.data() + (st * 2) * 256;
    const uint32_t* k1 = k0 + 256;
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const __m512bh ka = (__m512bh)_mm512_loadu_si512(k0 + 16 * j), kb = (__m512bh)_mm512_loadu_si512(k1 + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = bcast_pair(q + 32 * r + 2 * j);
        s0[r] = _mm512_dpbf16_ps(s0[r], qp, ka);
        s1[r] = _mm512_dpbf16_ps(s1[r], qp, kb);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(sc + 32 * r, s0[r]);
    _mm512_storeu_ps(sc + 32 * r + 16, s1[r]);
  }
}

// acc rows i .. i + R - 1 of block b (each seeing the tile): acc * alpha first, then a probability pair per key
// pair. A pass covers H dim panels of R rows (R x H chains, one per row and panel, keys in order), so each
// probability broadcast feeds H products and each V load R; a row's chains and their order do not depend on R.
template <int D, int R>
void pv_rows(Scratch& s, int64_t b, int i, const float* alpha) {
  constexpr int NV = D / 16, H = NV < 4 ? NV : 4;
  for (int c0 = 0; c0 < NV; c0 += H) {
    __m512 o[R][H];
    for (int r = 0; r < R; ++r) {
      const float* acc = s.acc.data() + ((16 * b + i + r) * D + 16 * c0);
      const __m512 al = _mm512_set1_ps(alpha[i + r]);
      for (int h = 0; h < H; ++h) o[r][h] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * h), al);
    }
    const uint32_t* v = s.vt.data() + c0 * 256;
#pragma GCC unroll 16
    for (int j = 0; j < kTile / 2; ++j) {
      __m512bh vv[H];
      for (int h = 0; h < H; ++h) vv[h] = (__m512bh)_mm512_loadu_si512(v + h * 256 + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512bh p2 = bcast_pair(s.p.data() + 32 * (i + r) + 2 * j);
        for (int h = 0; h < H; ++h) o[r][h] = _mm512_dpbf16_ps(o[r][h], p2, vv[h]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) _mm512_storeu_ps(s.acc.data() + ((16 * b + i + r) * D + 16 * (c0 + h)), o[r][h]);
  }
}

template <int D>
void run(const AttnArgs& a, const AttnItem& it) {
  thread_local Scratch s;
  attn_bf16::prepare<D>(a, it, s);
  const int64_t rows = attn_bf16::item_rows(a, it);
  attn_bf16::walk<D>(
      a, it, s,
      [&](int64_t b) {
        int i = 0;
        for (; i + 7 < 16 && 16 * b + i + 7 < rows; i += 8) scores<D, 8>(s, b, i, s.s.data() + 32 * i);
        for (; i + 3 < 16 && 16 * b + i + 3 < rows; i += 4) scores<D, 4>(s, b, i, s.s.data() + 32 * i);
        for (; i + 1 < 16 && 16 * b + i + 1 < rows; i += 2) scores<D, 2>(s, b, i, s.s.data() + 32 * i);
        if (i < 16 && 16 * b + i < rows) scores<D, 1>(s, b, i, s.s.data() + 32 * i);
      },
      [&](int64_t b, __mmask16 seen, const float* alpha) {
        attn_tiles::seen_runs(seen, [&](auto r, int i) { pv_rows<D, decltype(r)::value>(s, b, i, alpha); });
      });
  attn_bf16::finish<D>(a, it, s);
}

}  // namespace

void attn_item_avx512bf16(const AttnArgs& a, const AttnItem& it) {
  with_head_dim<64, 128>(a.d, [&](auto d) { run<decltype(d)::value>(a, it); });
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
