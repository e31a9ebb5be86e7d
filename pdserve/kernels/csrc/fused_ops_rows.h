// The row kernels of fused_kernels.h written once over a vector type V, for the ISA files that differ only in their
// vector width (fused_ops_avx2.cpp, fused_ops_avx512.cpp: each includes this after its target pragma and passes its
// own V). Every loop walks a row a vector at a time and masks the tail, so any row length works.
//
// V supplies: F (a vector of kW floats), M (a tail mask) and static functions mask(n) (lanes i < n on), load(p, m) /
// store(p, m, v) (masked), loadu(p), set1(x), zero(), add, sub, mul, div, fmadd(a, b, c) = a * b + c,
// fmsub(a, b, c) = a * b - c, exp (Cephes expf, vec_avx*.h) and hsum (the sum of the lanes).
#pragma once

#include <cmath>
#include <cstdint>

#include "fused_kernels.h"

namespace pdserve::fused_rows {

template <class V>
float inv_rms(const float* x, int64_t h, float eps) {
  typename V::F a0 = V::zero(), a1 = V::zero();
  int64_t i = 0;
  for (; i + 2 * V::kW <= h; i += 2 * V::kW) {
    const typename V::F u = V::loadu(x + i), v = V::loadu(x + i + V::kW);
    a0 = V::fmadd(u, u, a0);
    a1 = V::fmadd(v, v, a1);
  }
  for (; i < h; i += V::kW) {
    const typename V::F u = V::load(x + i, V::mask(h - i));
    a0 = V::fmadd(u, u, a0);
  }
  const float ss = V::hsum(V::add(a0, a1));
  return 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
}

template <class V>
void scale_row(float* o, const float* x, const float* w, float inv, int64_t h) {
  const typename V::F s = V::set1(inv);
  for (int64_t i = 0; i < h; i += V::kW) {
    const typename V::M m = V::mask(h - i);
    V::store(o + i, m, V::mul(V::mul(V::load(x + i, m), s), V::load(w + i, m)));
  }
}

template <class V>
void rms_norm(float* out, int64_t os, const float* x, int64_t xs, const float* w, int64_t h, float eps, int64_t r0,
              int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) scale_row<V>(out + r * os, x + r * xs, w, inv_rms<V>(x + r * xs, h, eps), h);
}

template <class V>
void add_rms_norm(float* x, int64_t xs, float* res, int64_t rs, const float* w, int64_t h, float eps, int64_t r0,
                  int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float* xr = x + r * xs;
    float* rr = res + r * rs;
    for (int64_t i = 0; i < h; i += V::kW) {
      const typename V::M m = V::mask(h - i);
      V::store(rr + i, m, V::add(V::load(rr + i, m), V::load(xr + i, m)));
    }
    scale_row<V>(xr, rr, w, inv_rms<V>(rr, h, eps), h);
  }
}

template <class V>
void rotate_heads(float* x, int64_t nh, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < nh; ++hd) {
    float* x1 = x + hd * d;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; i += V::kW) {
      const typename V::M m = V::mask(half - i);
      const typename V::F a = V::load(x1 + i, m), b = V::load(x2 + i, m);
      const typename V::F cv = V::load(c + i, m), sv = V::load(s + i, m);
      V::store(x1 + i, m, V::fmsub(a, cv, V::mul(b, sv)));
      V::store(x2 + i, m, V::fmadd(b, cv, V::mul(a, sv)));
    }
  }
}

template <class V>
void rotary(const int64_t* pos, float* q, int64_t qs, int64_t nq, float* k, int64_t ks, int64_t nk, const float* cos,
            const float* sin, int64_t d, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cos + pos[r] * (d / 2);
    const float* s = sin + pos[r] * (d / 2);
    rotate_heads<V>(q + r * qs, nq, c, s, d);
    rotate_heads<V>(k + r * ks, nk, c, s, d);
  }
}

// The exp argument of each activation: out = g / (1 + exp(arg(g))) * u (see the generic kernel).
template <class V, bool kGelu>
typename V::F gate_arg(typename V::F g) {
  if constexpr (kGelu) {  // -2k (g + c g^3) = g * (-2k - 2kc g^2)
    const typename V::F g2 = V::mul(g, g);
    return V::mul(g, V::fmadd(g2, V::set1(-2.f * kGeluTanhK * kGeluTanhC), V::set1(-2.f * kGeluTanhK)));
  } else {  // SiLU: -g
    return V::sub(V::zero(), g);
  }
}

template <class V, bool kGelu>
void gated_mul(float* out, int64_t os, const float* x, int64_t xs, int64_t n, int64_t r0, int64_t r1) {
  const typename V::F one = V::set1(1.f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = x + r * xs;
    float* o = out + r * os;
    for (int64_t i = 0; i < n; i += V::kW) {
      const typename V::M m = V::mask(n - i);
      const typename V::F gv = V::load(g + i, m), uv = V::load(g + n + i, m);
      const typename V::F e = V::exp(gate_arg<V, kGelu>(gv));
      V::store(o + i, m, V::mul(V::div(gv, V::add(one, e)), uv));
    }
  }
}

template <class V>
FusedKernels kernels() {
  return {rms_norm<V>, add_rms_norm<V>, rotary<V>, gated_mul<V, false>, gated_mul<V, true>};
}

}  // namespace pdserve::fused_rows
