// AMX float-weight GEMM kernel (fgemm_kernels.h): bf16 weights multiplied with tdpbf16ps tiles from
// amx_min_rows() rows on; fewer rows run the avx512 block-order kernel, which gives the same bits.
//
// What one tdpbf16ps computes (measured on this project's Sapphire Rapids machine with random bf16 operands of
// exponents spread over +-12, 10^4 outputs per case, 0 mismatches for K steps of 1..16 pairs): per output,
//   E = e_0 + e_1 + ... + e_{P-1},  O = o_0 + o_1 + ... + o_{P-1}  (fp32, round to nearest even, left to right)
//   C = C + (E + O)
// with e_p, o_p the exact products of the even and odd elements of pair p. It is NOT the sequence of vdpbf16ps
// over the same pairs (that adds o_p then e_p to the accumulator pair by pair; the two differ in about half of all
// outputs by 1-2 ulp), nor a fused dot product, nor a pairwise tree. So the amx level computes the "block" order
// everywhere: AMX tiles for many rows, FMA kernels with two accumulators for few, bitwise equal (tests check it).
// Tiles: C = tmm0..3 (2 x 2 blocks of 16 rows x 16 columns), A = tmm4, 5 (activation rows), B = tmm6, 7 (a panel's
// 16 pairs x 16 columns: 1 KiB of the packed layout, contiguous).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "fgemm_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

namespace pdserve::fgemm {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// MB row blocks of 16 from row r0 x NB panels (w, and w + ps), over all of K; the C tiles go to c (16 * MB rows of ldc floats:
// the scratch's rows of 32 or, for whole row blocks of whole panels without bias, the rows of y themselves). Tile
// loads cannot start before the tile products reading the same tile register finish, so a load that misses L1
// stalls the products: the activation tiles two K steps ahead are prefetched (measured +25 % at
// K = 8192, 512 rows), and so are the weight tiles four steps ahead on the first row blocks, which stream them
// from memory (batch 1: 10.3 -> 12 GB/s, the single-core read bandwidth). Splitting K into chunks that stay in L1
// (C reloaded between them) measured no faster.
template <int MB, int NB>
void block(const Problem& pr, const char* w, int64_t ps, int64_t r0, float* c, int64_t ldc_floats) {
  const int64_t nkb = pr.kpad / kKBlock, ldc = ldc_floats * 4;  // ps: bytes from w to the second panel
  const uint16_t* a = pr.xb + r0 / 16 * nkb * 512;  // row block r0 / 16: its K blocks' tiles, 512 bf16 each
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MB > 1) _tile_zero(2);
  if constexpr (MB > 1 && NB > 1) _tile_zero(3);
  const bool stream_w = r0 == 0;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const char* next = reinterpret_cast<const char*>(a + (kb + 2) * 512);
    for (int l = 0; l < 1024; l += 64) {
      _mm_prefetch(next + l, _MM_HINT_T0);
      if constexpr (MB > 1) _mm_prefetch(next + nkb * 1024 + l, _MM_HINT_T0);
      if (stream_w) _mm_prefetch(w + (kb + 4) * 1024 + l, _MM_HINT_T0);
      if (NB > 1 && stream_w) _mm_prefetch(w + ps + (kb + 4) * 1024 + l, _MM_HINT_T0);
    }
    _tile_loadd(4, a + kb * 512, 64);
    if constexpr (MB > 1) _tile_loadd(5, a + (nkb + kb) * 512, 64);
    _tile_loadd(6, w + kb * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, w + ps + kb * 1024, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (MB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* c1 = c + 16 * ldc_floats;  // the second row block
  _tile_stored(0, c, ldc);
  if constexpr (NB > 1) _tile_stored(1, c + kPanel, ldc);
  if constexpr (MB > 1) _tile_stored(2, c1, ldc);
  if constexpr (MB > 1 && NB > 1) _tile_stored(3, c1 + kPanel, ldc);
}

// y (+ bias) of panel pair p0 (np = 1 or 2 panels), rows [r0, m), from the scratch c [rows][32].
void store_pair(const Problem& pr, const float* c, int64_t p0, int np, int64_t r0) {
  for (int j = 0; j < np; ++j) {
    const int64_t c0 = (p0 + j) * kPanel, nc = std::min<int64_t>(kPanel, pr.n - c0);
    const __mmask16 mask = nc >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
    const __m512 b = pr.bias ? _mm512_maskz_loadu_ps(mask, pr.bias + c0) : _mm512_setzero_ps();
    for (int64_t r = r0; r < pr.m; ++r) {
      __m512 y = _mm512_loadu_ps(c + r * 2 * kPanel + j * kPanel);
      if (pr.bias) y = _mm512_add_ps(y, b);
      _mm512_mask_storeu_ps(pr.y + r * pr.ldy + c0, mask, y);
    }
  }
}

// Gate panels [p0, p1) of a gated problem, each beside its up panel into the scratch c [rows][32] (gate | up), then
// pr.gated over those rows into y's 16 columns of the panel.
void gated_panels(const Problem& pr, int64_t p0, int64_t p1, float* c) {
  const int64_t mb = (pr.m + 15) / 16, ps = pr.kpad * kPanel * 2;
  for (int64_t p = p0; p < p1; ++p) {
    const char* w = static_cast<const char*>(pr.w) + p * ps;
    int64_t b = 0;
    for (; b + 2 <= mb; b += 2) block<2, 2>(pr, w, pr.up * ps, 16 * b, c + 16 * b * 2 * kPanel, 2 * kPanel);
    if (b < mb) block<1, 2>(pr, w, pr.up * ps, 16 * b, c + 16 * b * 2 * kPanel, 2 * kPanel);
    pr.gated(pr.y + p * kPanel, pr.ldy, c, 2 * kPanel, kPanel, 0, pr.m);
  }
}

void bf16_amx(const Problem& pr, int64_t p0, int64_t p1) {
  if (!pr.xb_tiles) {  // fewer than amx_min_rows() rows
    bf16_block_avx512(pr, p0, p1);
    return;
  }
  configure();
  const int64_t mb = (pr.m + 15) / 16, ps = pr.kpad * kPanel * 2;
  thread_local std::vector<float> scratch;
  scratch.resize(mb * 16 * 2 * kPanel);
  float* c = scratch.data();
  if (pr.gated) {
    gated_panels(pr, p0, p1, c);
    _tile_release();
    return;
  }
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    const char* w = static_cast<const char*>(pr.w) + p * ps;
    // whole row blocks of whole panels without bias: C tiles stored straight into y (no pass over a scratch)
    const bool direct = pr.bias == nullptr && (p + (two ? 2 : 1)) * kPanel <= pr.n;
    int64_t b = 0, done = 0;  // rows [0, done) are in y
    const auto dst = [&](int64_t blocks, float*& to, int64_t& ld) {
      const bool in_y = direct && 16 * (b + blocks) <= pr.m && done == 16 * b;
      to = in_y ? pr.y + 16 * b * pr.ldy + p * kPanel : c + 16 * b * 2 * kPanel;
      ld = in_y ? pr.ldy : 2 * kPanel;
      if (in_y) done = 16 * (b + blocks);
    };
    float* to;
    int64_t ld;
    for (; b + 2 <= mb; b += 2) {
      dst(2, to, ld);
      two ? block<2, 2>(pr, w, ps, 16 * b, to, ld) : block<2, 1>(pr, w, ps, 16 * b, to, ld);
    }
    if (b < mb) {
      dst(1, to, ld);
      two ? block<1, 2>(pr, w, ps, 16 * b, to, ld) : block<1, 1>(pr, w, ps, 16 * b, to, ld);
    }
    store_pair(pr, c, p, two ? 2 : 1, done);
  }
  _tile_release();
}

}  // namespace

const Kernels kAmx = {f32_avx512, bf16_amx, to_bf16_avx512, "block", true};

}  // namespace pdserve::fgemm

#pragma GCC pop_options
#endif  // __x86_64__
