// Python bindings of the fused layer ops (rms_norm, fused_add_rms_norm, rms_norm_heads, rotary_embedding,
// silu_and_mul, gelu_tanh_and_mul): argument checks, ISA choice, row split across ATen's threads. The kernels are in fused_ops_{generic,avx2,avx512}.cpp.
#include <torch/extension.h>

#include <algorithm>

#include "parallel.h"
#include "dispatch.h"
#include "fused_kernels.h"
#include "ops.h"
#include "registry.h"

namespace pdserve {
namespace {

const FusedKernels& kernels() {
  static const IsaTable<const FusedKernels*> table = {
      {Isa::kGeneric, &fused_kernels_generic()},
      PDSERVE_X86({Isa::kAvx2, &fused_kernels_avx2()}, {Isa::kAvx512, &fused_kernels_avx512()})};
  return *table.pick();
}

// A [rows, cols] f32 matrix whose rows may be strided (a column slice of a wider tensor) but whose columns are not.
void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [T, H], got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols, "], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1 || cols <= 1, name, " must have a contiguous last dimension");
}

void check_vec(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must be 1-D of size ", n, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), name, " must be a contiguous CPU tensor");
}

// Rows per thread chunk: at least ~16K elements, so T = 1 runs inline with no thread hand-off.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t t = x.size(0), h = x.dim() == 2 ? x.size(1) : 0;
  check_rows(x, "x", t, h);
  check_rows(out, "out", t, h);
  check_vec(weight, "weight", h, at::kFloat);
  const auto fn = kernels().rms_norm;
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t os = out.stride(0), xs = x.stride(0);
  parallel_for(0, t, grain(h), [&](int64_t r0, int64_t r1) {
    fn(o, os, xp, xs, w, h, static_cast<float>(eps), r0, r1);
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t t = x.size(0), h = x.dim() == 2 ? x.size(1) : 0;
  check_rows(x, "x", t, h);
  check_rows(residual, "residual", t, h);
  check_vec(weight, "weight", h, at::kFloat);
  const auto fn = kernels().add_rms_norm;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  parallel_for(0, t, grain(2 * h), [&](int64_t r0, int64_t r1) {
    fn(xp, xs, rp, rs, w, h, static_cast<float>(eps), r0, r1);
  });
}

void rms_norm_heads(at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t t = x.size(0), w = x.dim() == 2 ? x.size(1) : 0, d = weight.dim() == 1 ? weight.size(0) : 0;
  check_rows(x, "x", t, w);
  check_vec(weight, "weight", d, at::kFloat);
  TORCH_CHECK(d > 0 && w % d == 0, "x width ", w, " is not a whole number of heads of ", d);
  const auto fn = kernels().rms_norm;  // each head is a row of d floats, d apart: the row kernel as it is
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), heads = w / d;
  parallel_for(0, t, grain(w), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(xp + r * xs, d, xp + r * xs, d, wp, d, static_cast<float>(eps), 0, heads);
  });
}

// The first rotary_dim = 2 * cos.size(1) <= head_dim dims of each head turn (a partial rotary, Phi-4-mini: the ISA
// kernel is then called per head, with that head's dims as its "head").
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even, got ", head_dim);
  const int64_t t = positions.size(0);
  check_vec(positions, "positions", t, at::kLong);
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2, "q and k must be 2-D [T, heads * head_dim]");
  TORCH_CHECK(q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0, "q and k widths must be multiples of head_dim");
  check_rows(q, "q", t, q.size(1));
  check_rows(k, "k", t, k.size(1));
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) > 0 && 2 * cos.size(1) <= head_dim,
              "cos must be [P, rotary_dim / 2] with rotary_dim <= head_dim, got ", cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), "sin must have the shape of cos");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous(), "cos and sin must be contiguous float32");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t p = cos.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < p, "positions[", i, "] = ", pos[i], " is outside the table [0, ", p, ")");
  const auto fn = kernels().rotary;
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), nq = q.size(1) / head_dim, nk = k.size(1) / head_dim;
  const int64_t rot = 2 * cos.size(1);
  parallel_for(0, t, grain(q.size(1) + k.size(1)), [&](int64_t r0, int64_t r1) {
    if (rot == head_dim) {
      fn(pos, qp, qs, nq, kp, ks, nk, cp, sp, head_dim, r0, r1);
      return;
    }
    for (int64_t h = 0; h < std::max(nq, nk); ++h)
      fn(pos, qp + std::min(h, nq - 1) * head_dim, qs, h < nq ? 1 : 0, kp + std::min(h, nk - 1) * head_dim, ks,
         h < nk ? 1 : 0, cp, sp, rot, r0, r1);
  });
}

namespace {

void run_gated(at::Tensor& out, const at::Tensor& x, GatedMulFn fn) {
  const int64_t t = x.size(0), i = out.dim() == 2 ? out.size(1) : 0;
  check_rows(out, "out", t, i);
  check_rows(x, "x", t, 2 * i);
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t os = out.stride(0), xs = x.stride(0);
  parallel_for(0, t, grain(3 * i), [&](int64_t r0, int64_t r1) { fn(o, os, xp, xs, i, r0, r1); });
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& x) { run_gated(out, x, kernels().silu_mul); }

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& x) { run_gated(out, x, kernels().gelu_tanh_mul); }

void gated_and_mul(at::Tensor& out, const at::Tensor& x, bool gelu) { run_gated(out, x, gated_mul_kernel(gelu)); }

GatedMulFn gated_mul_kernel(bool gelu) { return gelu ? kernels().gelu_tanh_mul : kernels().silu_mul; }

namespace {

void register_fused(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm, "out = x / sqrt(mean(x^2) + eps) * weight, row-wise (f32)", py::arg("out"),
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual <- x + residual; x <- rms_norm(residual) * weight (both in place)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rms_norm_heads", &rms_norm_heads,
        "in place: each head_dim-wide head of each row of x [T, heads * head_dim] (rows may be strided) is "
        "rms-normed and scaled by weight [head_dim] (Qwen3's q/k norm)", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("rotary_embedding", &rotary_embedding, "in-place rotate-half (neox) rotary on q [T, Hq*D] and k [T, Hkv*D]",
        py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("head_dim"));
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:]", py::arg("out"), py::arg("x"));
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "out = gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's GeGLU)",
        py::arg("out"), py::arg("x"));
}

PDSERVE_REGISTER(register_fused);

}  // namespace
}  // namespace pdserve
