// AVX2 float-weight GEMM kernels (fgemm_kernels.h): the avx512 kernels' arithmetic with 8-wide vectors, a panel's
// 16 columns as two ymm halves. f32: fma per k (bitwise the avx512 result); bf16: the block order with even/odd
// accumulators (bitwise the generic, avx512 and amx results).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "fgemm_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "fgemm_tiles.h"

namespace pdserve::fgemm {
namespace {

inline void store_half(const Problem& pr, int64_t r, int64_t c0, __m256 acc) {
  const int64_t nc = std::min<int64_t>(8, pr.n - c0);
  if (nc <= 0) return;
  alignas(32) float v[8];
  if (pr.bias && nc == 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(pr.bias + c0));
  if (nc == 8) {
    _mm256_storeu_ps(pr.y + r * pr.ldy + c0, acc);
    return;
  }
  _mm256_store_ps(v, acc);
  for (int64_t j = 0; j < nc; ++j) pr.y[r * pr.ldy + c0 + j] = pr.bias ? v[j] + pr.bias[c0 + j] : v[j];
}

struct F32Tile {
  template <int MR, int NR>
  static void run(const Problem& pr, int64_t r0, int64_t p0) {
    const int64_t ps = pr.kpad * kPanel;
    const float* w = static_cast<const float*>(pr.w) + p0 * ps;
    const float* x = pr.x + r0 * pr.ldx;
    __m256 acc[MR][2 * NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 2 * NR; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < pr.kpad; ++k) {
      __m256 wv[2 * NR];
      for (int j = 0; j < 2 * NR; ++j) wv[j] = _mm256_loadu_ps(w + (j / 2) * ps + k * kPanel + 8 * (j % 2));
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * pr.ldx + k);
        for (int j = 0; j < 2 * NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 2 * NR; ++j) store_half(pr, r0 + i, (p0 + j / 2) * kPanel + 8 * (j % 2), acc[i][j]);
  }
};

struct Bf16BlockTile {
  template <int MR, int NR>
  static void run(const Problem& pr, int64_t r0, int64_t p0) {
    const int64_t ps = pr.kpad / 2 * kPanel;  // dwords per panel
    const uint32_t* w = static_cast<const uint32_t*>(pr.w) + p0 * ps;
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m256 acc[MR][2 * NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 2 * NR; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < pr.kpad / 2; b += kKBlock / 2) {
      __m256 e[MR][2 * NR], o[MR][2 * NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 2 * NR; ++j) e[i][j] = o[i][j] = _mm256_setzero_ps();
      for (int64_t q = b; q < b + kKBlock / 2; ++q) {
        __m256 we[2 * NR], wo[2 * NR];
        for (int j = 0; j < 2 * NR; ++j) {
          const __m256i wv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j / 2) * ps + q * kPanel + 8 * (j % 2)));
          we[j] = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
          wo[j] = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));
        }
        for (int i = 0; i < MR; ++i) {
          uint32_t pair;
          std::memcpy(&pair, pr.xb + (r0 + i) * pr.ldx + 2 * q, sizeof pair);
          const __m256i xv = _mm256_set1_epi32(static_cast<int>(pair));
          const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
          const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xv, hi));
          for (int j = 0; j < 2 * NR; ++j) {
            e[i][j] = _mm256_fmadd_ps(xe, we[j], e[i][j]);
            o[i][j] = _mm256_fmadd_ps(xo, wo[j], o[i][j]);
          }
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 2 * NR; ++j) acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_add_ps(e[i][j], o[i][j]));
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 2 * NR; ++j) store_half(pr, r0 + i, (p0 + j / 2) * kPanel + 8 * (j % 2), acc[i][j]);
  }
};

void f32_avx2(const Problem& pr, int64_t p0, int64_t p1) { walk<F32Tile, 6, 1>(pr, p0, p1); }

void bf16_block_avx2(const Problem& pr, int64_t p0, int64_t p1) { walk<Bf16BlockTile, 2, 1>(pr, p0, p1); }

void to_bf16_avx2(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t kpad, uint16_t* xb) {
  const __m256i exp = _mm256_set1_epi32(0x7F800000), one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
  const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF), quiet = _mm256_set1_epi32(0x400000);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = x + r * ldx;
    uint16_t* dst = xb + r * kpad;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(u, exp), _mm256_setzero_si256());
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), exp);  // |u| > inf as signed ints
      __m256i v = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
      v = _mm256_blendv_epi8(v, _mm256_or_si256(u, quiet), nan);
      v = _mm256_blendv_epi8(v, _mm256_and_si256(u, sign), sub);
      v = _mm256_srli_epi32(v, 16);
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
    }
    for (; i < k; ++i) dst[i] = to_bf16_flush(src[i]);
    for (; i < kpad; ++i) dst[i] = 0;
  }
}

}  // namespace

const Kernels kAvx2 = {f32_avx2, bf16_block_avx2, to_bf16_avx2, "block", false};

}  // namespace pdserve::fgemm

#pragma GCC pop_options
#endif  // __x86_64__
