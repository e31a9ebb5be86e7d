// AVX-512 float-weight GEMM kernels (fgemm_kernels.h). One zmm = one panel's 16 output columns; a register tile is
// MR rows x NR panels. f32: one fma per k. bf16 block order: each dword pair of the panel split into its even
// element (shift left 16) and its odd one (high half masked), two accumulators E and O per output, folded into the
// output's accumulator every 16 pairs as acc + (E + O): bitwise the AMX tdpbf16ps result (fgemm_amx.cpp).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "fgemm_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

#include "fgemm_tiles.h"

namespace pdserve::fgemm {
namespace {

// y = acc (+ bias) for row r, panel p; the last panel of a matrix whose N is not a multiple of 16 is masked.
inline void store_panel(const Problem& pr, int64_t r, int64_t p, __m512 acc) {
  const int64_t c0 = p * kPanel, nc = std::min<int64_t>(kPanel, pr.n - c0);
  const __mmask16 mask = nc >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
  if (pr.bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, pr.bias + c0));
  _mm512_mask_storeu_ps(pr.y + r * pr.ldy + c0, mask, acc);
}

struct F32Tile {
  template <int MR, int NR>
  static void run(const Problem& pr, int64_t r0, int64_t p0) {
    const int64_t ps = pr.kpad * kPanel;  // floats per panel
    const float* w = static_cast<const float*>(pr.w) + p0 * ps;
    const float* x = pr.x + r0 * pr.ldx;
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pr.kpad; ++k) {
      __m512 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * ps + k * kPanel);
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_set1_ps(x[i * pr.ldx + k]);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) store_panel(pr, r0 + i, p0 + j, acc[i][j]);
  }
};

struct Bf16BlockTile {
  template <int MR, int NR>
  static void run(const Problem& pr, int64_t r0, int64_t p0) {
    const int64_t ps = pr.kpad / 2 * kPanel;  // dwords per panel
    const uint32_t* w = static_cast<const uint32_t*>(pr.w) + p0 * ps;
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < pr.kpad / 2; b += kKBlock / 2) {  // b: the block's first pair
      __m512 e[MR][NR], o[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) e[i][j] = o[i][j] = _mm512_setzero_ps();
      for (int64_t q = b; q < b + kKBlock / 2; ++q) {
        __m512 we[NR], wo[NR];
        for (int j = 0; j < NR; ++j) {
          const __m512i wv = _mm512_loadu_si512(w + j * ps + q * kPanel);
          we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
          wo[j] = _mm512_castsi512_ps(_mm512_and_si512(wv, hi));
        }
        for (int i = 0; i < MR; ++i) {
          uint32_t pair;
          std::memcpy(&pair, pr.xb + (r0 + i) * pr.ldx + 2 * q, sizeof pair);
          const __m512i xv = _mm512_set1_epi32(static_cast<int>(pair));
          const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));
          const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(xv, hi));
          for (int j = 0; j < NR; ++j) {
            e[i][j] = _mm512_fmadd_ps(xe, we[j], e[i][j]);
            o[i][j] = _mm512_fmadd_ps(xo, wo[j], o[i][j]);
          }
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_add_ps(e[i][j], o[i][j]));
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) store_panel(pr, r0 + i, p0 + j, acc[i][j]);
  }
};

}  // namespace

void f32_avx512(const Problem& pr, int64_t p0, int64_t p1) { walk<F32Tile, 6, 4>(pr, p0, p1); }

void bf16_block_avx512(const Problem& pr, int64_t p0, int64_t p1) { walk<Bf16BlockTile, 2, 3>(pr, p0, p1); }

void to_bf16_avx512(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t kpad, uint16_t* xb) {
  const __m512i exp = _mm512_set1_epi32(0x7F800000), one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = x + r * ldx;
    uint16_t* dst = xb + r * kpad;
    for (int64_t i = 0; i < kpad; i += 16) {
      const __mmask16 in = i + 16 <= k ? __mmask16(0xFFFF) : i >= k ? __mmask16(0) : __mmask16((1u << (k - i)) - 1);
      __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(in, src + i));
      const __mmask16 sub = _mm512_testn_epi32_mask(u, exp);  // zero or subnormal: a signed zero
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
      __m512i rne = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
      rne = _mm512_mask_mov_epi32(rne, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
      rne = _mm512_mask_mov_epi32(rne, sub, _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rne, 16)));
    }
  }
}

const Kernels kAvx512 = {f32_avx512, bf16_block_avx512, to_bf16_avx512, "block", false};

}  // namespace pdserve::fgemm

#pragma GCC pop_options
#endif  // __x86_64__
