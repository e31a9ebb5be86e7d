// AVX512-BF16 float-weight GEMM kernels (fgemm_kernels.h): bf16 weights multiplied with vdpbf16ps, the "pair"
// order: per pair of K, acc = (acc + x[2p+1] w[2p+1]) + x[2p] w[2p] (measured on Sapphire Rapids: bitwise two
// fp32 adds, odd element first, round to nearest even). A register tile is MR rows x NR panels, one zmm each; a
// pair of activations is one broadcast dword. f32 weights and the bf16 conversion are the avx512 kernels'.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

#include "fgemm_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

#include "fgemm_tiles.h"

namespace pdserve::fgemm {
namespace {

struct Bf16PairTile {
  template <int MR, int NR>
  static void run(const Problem& pr, int64_t r0, int64_t p0) {
    const int64_t ps = pr.kpad / 2 * kPanel;  // dwords per panel
    const uint32_t* w = static_cast<const uint32_t*>(pr.w) + p0 * ps;
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pr.kpad / 2; ++q) {
      __m512i wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w + j * ps + q * kPanel);
      for (int i = 0; i < MR; ++i) {
        uint32_t pair;
        std::memcpy(&pair, pr.xb + (r0 + i) * pr.ldx + 2 * q, sizeof pair);
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(pair));
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        const int64_t c0 = (p0 + j) * kPanel, nc = std::min<int64_t>(kPanel, pr.n - c0);
        const __mmask16 mask = nc >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
        __m512 y = acc[i][j];
        if (pr.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, pr.bias + c0));
        _mm512_mask_storeu_ps(pr.y + (r0 + i) * pr.ldy + c0, mask, y);
      }
  }
};

void bf16_pair(const Problem& pr, int64_t p0, int64_t p1) { walk<Bf16PairTile, 4, 4>(pr, p0, p1); }

}  // namespace

const Kernels kAvx512Bf16 = {f32_avx512, bf16_pair, to_bf16_avx512, "pair", false};

}  // namespace pdserve::fgemm

#pragma GCC pop_options
#endif  // __x86_64__
