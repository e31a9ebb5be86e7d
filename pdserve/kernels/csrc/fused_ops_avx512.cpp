// AVX-512 row kernels: 16 floats a vector, masked loads/stores for the tail (any row length).
#include "fused_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

#include "vec_avx512.h"

namespace pdserve {
namespace {

using vec::exp16;

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

float inv_rms(const float* x, int64_t h, float eps) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= h; i += 32) {
    const __m512 u = _mm512_loadu_ps(x + i), v = _mm512_loadu_ps(x + i + 16);
    a0 = _mm512_fmadd_ps(u, u, a0);
    a1 = _mm512_fmadd_ps(v, v, a1);
  }
  for (; i < h; i += 16) {
    const __m512 u = _mm512_maskz_loadu_ps(tail_mask(h - i), x + i);
    a0 = _mm512_fmadd_ps(u, u, a0);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  return 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
}

void scale_row(float* o, const float* x, const float* w, float inv, int64_t h) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = tail_mask(h - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s);
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
  }
}

void rms_norm(float* out, int64_t os, const float* x, int64_t xs, const float* w, int64_t h, float eps, int64_t r0,
              int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) scale_row(out + r * os, x + r * xs, w, inv_rms(x + r * xs, h, eps), h);
}

void add_rms_norm(float* x, int64_t xs, float* res, int64_t rs, const float* w, int64_t h, float eps, int64_t r0,
                  int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float* xr = x + r * xs;
    float* rr = res + r * rs;
    for (int64_t i = 0; i < h; i += 16) {
      const __mmask16 m = tail_mask(h - i);
      _mm512_mask_storeu_ps(rr + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, rr + i), _mm512_maskz_loadu_ps(m, xr + i)));
    }
    scale_row(xr, rr, w, inv_rms(rr, h, eps), h);
  }
}

void rotate_heads(float* x, int64_t nh, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < nh; ++hd) {
    float* x1 = x + hd * d;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail_mask(half - i);
      const __m512 a = _mm512_maskz_loadu_ps(m, x1 + i), b = _mm512_maskz_loadu_ps(m, x2 + i);
      const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
      _mm512_mask_storeu_ps(x1 + i, m, _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv)));
      _mm512_mask_storeu_ps(x2 + i, m, _mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv)));
    }
  }
}

void rotary(const int64_t* pos, float* q, int64_t qs, int64_t nq, float* k, int64_t ks, int64_t nk,
            const float* cos, const float* sin, int64_t d, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cos + pos[r] * (d / 2);
    const float* s = sin + pos[r] * (d / 2);
    rotate_heads(q + r * qs, nq, c, s, d);
    rotate_heads(k + r * ks, nk, c, s, d);
  }
}

inline __m512 silu_arg(__m512 g) { return _mm512_sub_ps(_mm512_setzero_ps(), g); }
inline __m512 gelu_tanh_arg(__m512 g) {  // -2k (g + c g^3) = g * (-2k - 2kc g^2)
  const __m512 g2 = _mm512_mul_ps(g, g);
  return _mm512_mul_ps(g, _mm512_fmadd_ps(g2, _mm512_set1_ps(-2.f * kGeluTanhK * kGeluTanhC),
                                          _mm512_set1_ps(-2.f * kGeluTanhK)));
}

// out = g / (1 + exp(Arg(g))) * u (see the generic kernel)
template <__m512 (*Arg)(__m512)>
void gated_mul(float* out, int64_t os, const float* x, int64_t xs, int64_t n, int64_t r0, int64_t r1) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = x + r * xs;
    float* o = out + r * os;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, g + n + i);
      const __m512 e = exp16(Arg(gv));
      _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
    }
  }
}

}  // namespace

const FusedKernels& fused_kernels_avx512() {
  static const FusedKernels k{rms_norm, add_rms_norm, rotary, gated_mul<silu_arg>, gated_mul<gelu_tanh_arg>};
  return k;
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
