// AVX-512 row kernels (fused_ops_rows.h): 16 floats a vector, masked loads/stores for the tail.
#include "fused_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

#include "fused_ops_rows.h"
#include "vec_avx512.h"

namespace pdserve {
namespace {

struct V512 {
  using F = __m512;
  using M = __mmask16;
  static constexpr int64_t kW = 16;
  static M mask(int64_t n) { return n >= 16 ? M(0xFFFF) : M((1u << n) - 1); }
  static F load(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, M m, F v) { _mm512_mask_storeu_ps(p, m, v); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F exp(F x) { return vec::exp16(x); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace

const FusedKernels& fused_kernels_avx512() {
  static const FusedKernels k = fused_rows::kernels<V512>();
  return k;
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
