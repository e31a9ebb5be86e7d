// Portable scalar row kernels (the reference the vector paths are tested against, and non-x86 builds).
#include <cmath>

#include "fused_kernels.h"

namespace pdserve {
namespace {

float inv_rms(const float* x, int64_t h, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
}

void rms_norm(float* out, int64_t os, const float* x, int64_t xs, const float* w, int64_t h, float eps, int64_t r0,
              int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * xs;
    float* o = out + r * os;
    const float inv = inv_rms(xr, h, eps);
    for (int64_t i = 0; i < h; ++i) o[i] = xr[i] * inv * w[i];
  }
}

void add_rms_norm(float* x, int64_t xs, float* res, int64_t rs, const float* w, int64_t h, float eps, int64_t r0,
                  int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float* xr = x + r * xs;
    float* rr = res + r * rs;
    for (int64_t i = 0; i < h; ++i) rr[i] += xr[i];
    const float inv = inv_rms(rr, h, eps);
    for (int64_t i = 0; i < h; ++i) xr[i] = rr[i] * inv * w[i];
  }
}

void rotate_heads(float* x, int64_t nh, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < nh; ++hd) {
    float* x1 = x + hd * d;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * c[i] - b * s[i];
      x2[i] = b * c[i] + a * s[i];
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

// out = g / (1 + exp(Arg(g))) * u: SiLU with Arg = -g, tanh-GELU with Arg = -2u.
template <float (*Arg)(float)>
void gated_mul(float* out, int64_t os, const float* x, int64_t xs, int64_t n, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = x + r * xs;
    const float* u = g + n;
    float* o = out + r * os;
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(Arg(g[i]))) * u[i];
  }
}

float silu_arg(float g) { return -g; }
float gelu_tanh_arg(float g) { return -2.f * kGeluTanhK * (g + kGeluTanhC * g * g * g); }

}  // namespace

const FusedKernels& fused_kernels_generic() {
  static const FusedKernels k{rms_norm, add_rms_norm, rotary, gated_mul<silu_arg>, gated_mul<gelu_tanh_arg>};
  return k;
}

}  // namespace pdserve
