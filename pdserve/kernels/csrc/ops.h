// The tensor-level entry points of the kernel families, for C++ callers (native_program.cpp) as well as Python.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "fused_kernels.h"

namespace pdserve {

// attention.cpp
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t sliding_window = 0, double softcap = 0.0,
                     const std::optional<at::Tensor>& prompt_lens = std::nullopt);
// uint8 [T]: 1 for the step's prompt rows (prompt_split, attention_kernels.h); int32 tensors as paged_attention's.
at::Tensor prompt_row_mask(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& prompt_lens);
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv, const at::Tensor& slot_mapping);

// fused_ops.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rms_norm_heads(at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t head_dim);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& x);
// One of the two: gelu_tanh_and_mul where gelu, else silu_and_mul.
void gated_and_mul(at::Tensor& out, const at::Tensor& x, bool gelu);
// The row kernel those two run on this CPU (gelu: gelu_tanh_and_mul's), for callers that fuse it into a GEMM.
GatedMulFn gated_mul_kernel(bool gelu);

}  // namespace pdserve
