// AVX2 row primitives of the native sampler (sampling_kernels.h).
#include "sampling_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "vec_avx2.h"

namespace pdserve {
namespace {

float row_max(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);  // NaN in x: m kept
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = lanes[0];
  for (int j = 1; j < 8; ++j) mx = std::max(mx, lanes[j]);
  for (; i < n; ++i)
    if (x[i] > mx) mx = x[i];
  return mx;
}

float exp_row(const float* x, int64_t n, float s, float m, float* e) {
  const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(kMinExpArg);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i on = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n - i, 8))),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));  // lanes < n - i
    const __m256 d = _mm256_sub_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, on), vs), vm);  // max: exactly 0
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(d, lo, _CMP_GE_OQ), _mm256_castsi256_ps(on));  // not NaN
    const __m256 v = _mm256_and_ps(keep, vec::exp8(d));
    _mm256_maskstore_ps(e + i, on, v);
    sum = _mm256_add_ps(sum, v);
  }
  return vec::hsum(sum);
}

}  // namespace

const SamplingKernels& sampling_kernels_avx2() {
  static const SamplingKernels k{row_max, exp_row};
  return k;
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
