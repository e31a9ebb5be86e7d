// AVX2 row kernels: 8 floats a vector, maskload/maskstore for the tail (any row length).
#include "fused_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "vec_avx2.h"

namespace pdserve {
namespace {

using vec::exp8;
using vec::hsum;

// Lanes i < n are on (all lanes when n >= 8).
inline __m256i tail_mask(int64_t n) {
  const int k = n >= 8 ? 8 : static_cast<int>(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load(const float* p, __m256i m) { return _mm256_maskload_ps(p, m); }
inline void store(float* p, __m256i m, __m256 v) { _mm256_maskstore_ps(p, m, v); }

float inv_rms(const float* x, int64_t h, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= h; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(u, u, a0);
    a1 = _mm256_fmadd_ps(v, v, a1);
  }
  for (; i < h; i += 8) {
    const __m256 u = load(x + i, tail_mask(h - i));
    a0 = _mm256_fmadd_ps(u, u, a0);
  }
  const float ss = hsum(_mm256_add_ps(a0, a1));
  return 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
}

void scale_row(float* o, const float* x, const float* w, float inv, int64_t h) {
  const __m256 s = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < h; i += 8) {
    const __m256i m = tail_mask(h - i);
    store(o + i, m, _mm256_mul_ps(_mm256_mul_ps(load(x + i, m), s), load(w + i, m)));
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
    for (int64_t i = 0; i < h; i += 8) {
      const __m256i m = tail_mask(h - i);
      store(rr + i, m, _mm256_add_ps(load(rr + i, m), load(xr + i, m)));
    }
    scale_row(xr, rr, w, inv_rms(rr, h, eps), h);
  }
}

void rotate_heads(float* x, int64_t nh, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < nh; ++hd) {
    float* x1 = x + hd * d;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; i += 8) {
      const __m256i m = tail_mask(half - i);
      const __m256 a = load(x1 + i, m), b = load(x2 + i, m), cv = load(c + i, m), sv = load(s + i, m);
      store(x1 + i, m, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
      store(x2 + i, m, _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv)));
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

inline __m256 silu_arg(__m256 g) { return _mm256_sub_ps(_mm256_setzero_ps(), g); }
inline __m256 gelu_tanh_arg(__m256 g) {  // -2k (g + c g^3) = g * (-2k - 2kc g^2)
  const __m256 g2 = _mm256_mul_ps(g, g);
  return _mm256_mul_ps(g, _mm256_fmadd_ps(g2, _mm256_set1_ps(-2.f * kGeluTanhK * kGeluTanhC),
                                          _mm256_set1_ps(-2.f * kGeluTanhK)));
}

// out = g / (1 + exp(Arg(g))) * u (see the generic kernel)
template <__m256 (*Arg)(__m256)>
void gated_mul(float* out, int64_t os, const float* x, int64_t xs, int64_t n, int64_t r0, int64_t r1) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = x + r * xs;
    float* o = out + r * os;
    for (int64_t i = 0; i < n; i += 8) {
      const __m256i m = tail_mask(n - i);
      const __m256 gv = load(g + i, m), uv = load(g + n + i, m);
      const __m256 e = exp8(Arg(gv));
      store(o + i, m, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
    }
  }
}

}  // namespace

const FusedKernels& fused_kernels_avx2() {
  static const FusedKernels k{rms_norm, add_rms_norm, rotary, gated_mul<silu_arg>, gated_mul<gelu_tanh_arg>};
  return k;
}

}  // namespace pdserve

#pragma GCC pop_options
#endif  // __x86_64__
