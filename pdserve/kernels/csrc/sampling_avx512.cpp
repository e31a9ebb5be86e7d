// AVX-512 row primitives of the native sampler (sampling_kernels.h).
#include "sampling_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

#include "vec_avx512.h"

namespace pdserve {
namespace {

float row_max(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);  // NaN in x: m kept
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    m = _mm512_mask_max_ps(m, tail, _mm512_maskz_loadu_ps(tail, x + i), m);
  }
  return _mm512_reduce_max_ps(m);
}

float exp_row(const float* x, int64_t n, float s, float m, float* e) {
  const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m), lo = _mm512_set1_ps(kMinExpArg);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 on = n - i >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 d = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(on, x + i), vs), vm);  // max: exactly 0
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(on, d, lo, _CMP_GE_OQ);  // false for NaN
    const __m512 v = _mm512_maskz_mov_ps(keep, vec::exp16(d));
    _mm512_mask_storeu_ps(e + i, on, v);
    sum = _mm512_add_ps(sum, v);
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

const SamplingKernels& sampling_kernels_avx512() {
  static const SamplingKernels k{row_max, exp_row};
  return k;
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
