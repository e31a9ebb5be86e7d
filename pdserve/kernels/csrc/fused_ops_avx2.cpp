// AVX2 row kernels (fused_ops_rows.h): 8 floats a vector, maskload/maskstore for the tail.
#include "fused_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "fused_ops_rows.h"
#include "vec_avx2.h"

namespace pdserve {
namespace {

struct V256 {
  using F = __m256;
  using M = __m256i;
  static constexpr int64_t kW = 8;
  static M mask(int64_t n) {  // lanes i < n on (all lanes when n >= 8)
    const int k = n >= 8 ? 8 : static_cast<int>(n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F load(const float* p, M m) { return _mm256_maskload_ps(p, m); }
  static void store(float* p, M m, F v) { _mm256_maskstore_ps(p, m, v); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F exp(F x) { return vec::exp8(x); }
  static float hsum(F v) { return vec::hsum(v); }
};

}  // namespace

const FusedKernels& fused_kernels_avx2() {
  static const FusedKernels k = fused_rows::kernels<V256>();
  return k;
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
