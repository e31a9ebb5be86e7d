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

// Rows [r0, r0 + 16) (those < m) of panel p from a stored C tile, plus bias.
void store_tile(const Problem& pr, const float* c, int64_t r0, int64_t p) {
  const int64_t c0 = p * kPanel, nc = std::min<int64_t>(kPanel, pr.n - c0);
  const __mmask16 mask = nc >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
  const __m512 b = pr.bias ? _mm512_maskz_loadu_ps(mask, pr.bias + c0) : _mm512_setzero_ps();
  for (int64_t i = 0; i < 16 && r0 + i < pr.m; ++i) {
    __m512 y = _mm512_loadu_ps(c + i * kPanel);
    if (pr.bias) y = _mm512_add_ps(y, b);
    _mm512_mask_storeu_ps(pr.y + (r0 + i) * pr.ldy + c0, mask, y);
  }
}

// MB row blocks of 16 from r0 x NB panels from p0, over all of K. xb has its rows padded to a multiple of 16.
template <int MB, int NB>
void block(const Problem& pr, int64_t r0, int64_t p0) {
  const int64_t ps = pr.kpad * kPanel * 2;  // bytes per panel
  const char* w = static_cast<const char*>(pr.w) + p0 * ps;
  const uint16_t* a = pr.xb + r0 * pr.ldx;
  const int64_t lda = pr.ldx * 2;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MB > 1) _tile_zero(2);
  if constexpr (MB > 1 && NB > 1) _tile_zero(3);
  for (int64_t kb = 0; kb < pr.kpad; kb += kKBlock) {
    _tile_loadd(4, a + kb, lda);
    if constexpr (MB > 1) _tile_loadd(5, a + 16 * pr.ldx + kb, lda);
    _tile_loadd(6, w + kb * kPanel * 2, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, w + ps + kb * kPanel * 2, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (MB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[16 * kPanel];
  _tile_stored(0, c, 64);
  store_tile(pr, c, r0, p0);
  if constexpr (NB > 1) {
    _tile_stored(1, c, 64);
    store_tile(pr, c, r0, p0 + 1);
  }
  if constexpr (MB > 1) {
    _tile_stored(2, c, 64);
    store_tile(pr, c, r0 + 16, p0);
  }
  if constexpr (MB > 1 && NB > 1) {
    _tile_stored(3, c, 64);
    store_tile(pr, c, r0 + 16, p0 + 1);
  }
}

void bf16_amx(const Problem& pr, int64_t p0, int64_t p1) {
  if (pr.m < amx_min_rows()) {
    bf16_block_avx512(pr, p0, p1);
    return;
  }
  configure();
  const int64_t mb = (pr.m + 15) / 16;
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    int64_t b = 0;
    for (; b + 2 <= mb; b += 2) two ? block<2, 2>(pr, 16 * b, p) : block<2, 1>(pr, 16 * b, p);
    if (b < mb) two ? block<1, 2>(pr, 16 * b, p) : block<1, 1>(pr, 16 * b, p);
  }
  _tile_release();
}

}  // namespace

const Kernels kAmx = {f32_avx512, bf16_amx, to_bf16_avx512, "block"};

}  // namespace pdserve::fgemm

#pragma GCC pop_options
#endif  // __x86_64__
