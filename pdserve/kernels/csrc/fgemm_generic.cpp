// Portable float-weight GEMM kernels (fgemm_kernels.h): the f32 order with separate multiply and add, the bf16
// block order (bitwise what the avx2, avx512 and amx kernels compute). Lanes are plain arrays of 16.
#include <algorithm>
#include <atomic>

#include "fgemm_kernels.h"

namespace pdserve::fgemm {
namespace {

std::atomic<int64_t> g_amx_min_rows{1};

void store(const Problem& pr, int64_t r, int64_t p, const float* acc) {
  const int64_t c0 = p * kPanel, nc = std::min<int64_t>(kPanel, pr.n - c0);
  float* y = pr.y + r * pr.ldy + c0;
  for (int64_t j = 0; j < nc; ++j) y[j] = pr.bias ? acc[j] + pr.bias[c0 + j] : acc[j];
}

void f32_generic(const Problem& pr, int64_t p0, int64_t p1) {
  const float* w = static_cast<const float*>(pr.w);
  for (int64_t p = p0; p < p1; ++p) {
    const float* wp = w + p * pr.kpad * kPanel;
    for (int64_t r = 0; r < pr.m; ++r) {
      const float* x = pr.x + r * pr.ldx;
      float acc[kPanel] = {};
      for (int64_t k = 0; k < pr.kpad; ++k)
        for (int j = 0; j < kPanel; ++j) acc[j] = acc[j] + x[k] * wp[k * kPanel + j];
      store(pr, r, p, acc);
    }
  }
}

void bf16_generic(const Problem& pr, int64_t p0, int64_t p1) {
  const uint16_t* w = static_cast<const uint16_t*>(pr.w);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* wp = w + p * pr.kpad * kPanel;
    for (int64_t r = 0; r < pr.m; ++r) {
      const uint16_t* x = pr.xb + r * pr.ldx;
      float acc[kPanel] = {};
      for (int64_t b = 0; b < pr.kpad; b += kKBlock) {
        float e[kPanel] = {}, o[kPanel] = {};
        for (int64_t i = b; i < b + kKBlock; i += 2) {
          const float xe = bf16_to_fp32(x[i]), xo = bf16_to_fp32(x[i + 1]);
          const uint16_t* wi = wp + i * kPanel;  // pair i / 2: 16 (even, odd) entries
          for (int j = 0; j < kPanel; ++j) {
            e[j] = e[j] + xe * bf16_to_fp32(wi[2 * j]);
            o[j] = o[j] + xo * bf16_to_fp32(wi[2 * j + 1]);
          }
        }
        for (int j = 0; j < kPanel; ++j) acc[j] = acc[j] + (e[j] + o[j]);
      }
      store(pr, r, p, acc);
    }
  }
}

void to_bf16_generic(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t kpad, uint16_t* xb) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t i = 0; i < k; ++i) xb[r * kpad + i] = to_bf16_flush(x[r * ldx + i]);
    for (int64_t i = k; i < kpad; ++i) xb[r * kpad + i] = 0;
  }
}

}  // namespace

const Kernels kGeneric = {f32_generic, bf16_generic, to_bf16_generic, "block", false};

int64_t amx_min_rows() { return g_amx_min_rows.load(std::memory_order_relaxed); }
void set_amx_min_rows(int64_t rows) { g_amx_min_rows.store(rows, std::memory_order_relaxed); }

}  // namespace pdserve::fgemm
