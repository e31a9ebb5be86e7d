// Row primitives of the native sampler (sampling.cpp), one set per ISA level. No torch here: the ISA files include
// only this.
#pragma once

#include <cstdint>

#include "common.h"

namespace pdserve {

struct SamplingKernels {
  // max over the row's values, NaN ignored (-inf when every value is NaN or -inf)
  float (*row_max)(const float* x, int64_t n);
  // e[i] = exp(x[i] * s - m) (m = max(x) * s, so e <= 1), exactly 0 where x[i] * s - m < kMinExpArg (underflow and
  // -inf: banned or grammar-masked tokens) or x[i] is NaN; returns the sum of e
  float (*exp_row)(const float* x, int64_t n, float s, float m, float* e);
};

// exp below this is under the smallest normal float: such a token's probability is 0, as in torch's fp32 softmax
constexpr float kMinExpArg = -87.33f;

const SamplingKernels& sampling_kernels_generic();
#if defined(__x86_64__)
const SamplingKernels& sampling_kernels_avx2();
const SamplingKernels& sampling_kernels_avx512();
#endif

}  // namespace pdserve
