// Quantized linear over GGUF blocks: argument checks, ISA dispatch and threading (at::parallel_for) for
// quant_linear, dequantize, embedding and quantize. The arithmetic lives in quant_{generic,avx2,avx512}.cpp.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>

#include "dispatch.h"
#include "quant_f32_kernels.h"
#include "quant_kernels.h"
#include "ops.h"
#include "registry.h"

namespace pdserve {
namespace {

using quant::QuantOps;

const QuantOps& ops() {
  static const IsaTable<const QuantOps*> table = {
      {Isa::kGeneric, &quant::kGenericOps},
      PDSERVE_X86({Isa::kAvx2, &quant::kAvx2Ops}, {Isa::kAvx512, &quant::kAvx512Ops})};
  return *table.pick();
}

// From this many activation rows on, dequantizing the weight to fp32 once and calling torch's GEMM (MKL, ~28
// MAC/cycle/core) beats the integer kernel (~14 MAC/cycle/core: dpbusd + cvt + scale mul + fma per 64 MACs, the
// per-block scales forbid a longer int32 accumulation), whose advantage below it is skipping the dequantization
// (0.35 ms per 1.8M weights). Measured single-threaded on the AVX-512 machine with benchmarks/kernels_quant.py:
// int wins at M = 16 everywhere (0.81 vs 1.11 ms gate_up, 0.33 vs 0.59 ms down), at M = 32 it wins for down and
// loses 8-19% for gate_up/qkv, at M >= 48 dequant+GEMM wins for all three. In the engine (weights cold, every
// layer once per step; 2 threads) decode steps of 32 rows took 91 ms on the integer path and 151 ms on the
// dequant path, 64 rows 180 vs 145 ms: hence 64. `set_quant_linear_dequant_min_rows` changes it.
std::atomic<int64_t> g_dequant_min_rows{64};

int64_t check_qtype(int64_t qtype) {
  TORCH_CHECK(quant::block_bytes(static_cast<int>(qtype)) > 0, "qtype must be 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), got ",
              qtype);
  return qtype;
}

// w: uint8 [N, K/32 * block_bytes], contiguous. Returns K (from `k`, or from w's row bytes when k < 0).
int64_t check_weight(const at::Tensor& w, int64_t qtype, int64_t k) {
  check_qtype(qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte, "w must be uint8 GGUF blocks, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2, "w must be 2-D [N, row_bytes], got ", w.dim(), "-D");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t bb = quant::block_bytes(static_cast<int>(qtype));
  if (k < 0) {
    TORCH_CHECK(w.size(1) % bb == 0, "w row bytes ", w.size(1), " are not a whole number of ", bb, "-byte blocks");
    k = w.size(1) / bb * QK;
  }
  TORCH_CHECK(k > 0 && k % QK == 0, "K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(w.size(1) == quant::row_bytes(k, static_cast<int>(qtype)), "w has ", w.size(1),
              " bytes per row, K=", k, " needs ", quant::row_bytes(k, static_cast<int>(qtype)));
  return k;
}

int64_t grain(int64_t n) {  // split the output rows evenly over the team, at least 16 rows a task
  return std::max<int64_t>(16, n / std::max(1, at::get_num_threads()));
}

at::Tensor dequantize_impl(const at::Tensor& w, int qtype, int64_t k) {
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const QuantOps& o = ops();
  at::parallel_for(0, n, grain(n), [&](int64_t r0, int64_t r1) { o.dequant(wp, r0, r1, k, qtype, op + r0 * k); });
  return out;
}

quant::GemmF32Fn gemm_f32_fn() {
  static const IsaTable<quant::GemmF32Fn> table = {
      {Isa::kGeneric, quant::gemm_f32_generic},
      PDSERVE_X86({Isa::kAvx2, quant::gemm_f32_avx2}, {Isa::kAvx512, quant::gemm_f32_avx512})};
  return table.pick();
}

// Small row counts (decode): the blocks dequantized in registers against fp32 activations, parallel over N. Exact
// up to float summation order; measured against the int8-activation kernel (linear_int): the same speed at batch 1
// (both bandwidth-bound), and no activation rounding (top-1 agreement with the fp32-dequantized model 95.8 % ->
// see BENCHMARKS.md "Quantization quality").
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, int qtype, const float* bias) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const quant::GemmF32Fn f = gemm_f32_fn();
  at::parallel_for(0, n, grain(n), [&](int64_t n0, int64_t n1) { f(wp, n0, n1, k, qtype, xp, ldx, m, bias, yp, n); });
  return y;
}

at::Tensor linear_int(const at::Tensor& x, const at::Tensor& w, int qtype, const float* bias) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const QuantOps& o = ops();
  const size_t stride = o.act_row_bytes(k, qtype);
  at::Tensor xq = at::empty({m, static_cast<int64_t>(stride)}, at::kByte);
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  uint8_t* xqp = xq.data_ptr<uint8_t>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) { o.quantize_act(xp, ldx, r0, r1, k, qtype, xqp); });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, grain(n), [&](int64_t n0, int64_t n1) { o.gemm(wp, n0, n1, k, qtype, xqp, m, bias, yp, n); });
  return y;
}

// Large row counts: dequantize the whole weight into a scratch buffer that is kept between calls (a fresh buffer
// would page-fault on every call: measured 1.5x slower per step) and multiply with torch's GEMM (MKL, both
// threads). Measured against dequantizing tile by tile into L2 with a single-threaded GEMM per tile: 1.2x faster
// for 512-row prefill chunks here. The scratch is the largest weight seen in fp32, per calling thread.
at::Tensor linear_dequant(const at::Tensor& x, const at::Tensor& w, int qtype, const std::optional<at::Tensor>& bias) {
  const int64_t n = w.size(0), k = x.size(1);
  thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < n * k) scratch = at::empty({n * k}, at::kFloat);
  const at::Tensor wf = scratch.narrow(0, 0, n * k).view({n, k});
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = wf.data_ptr<float>();
  const QuantOps& o = ops();
  at::parallel_for(0, n, grain(n), [&](int64_t r0, int64_t r1) { o.dequant(wp, r0, r1, k, qtype, op + r0 * k); });
  return bias ? at::addmm(*bias, x, wf.t()) : at::mm(x, wf.t());
}

// path: "auto" (by row count: f32 below the threshold, dequant from it), "f32" (blocks dequantized in registers,
// fp32 activations), "int" (int8 activations, integer dot products) or "dequant" (fp32 weight + torch GEMM).
}  // namespace

at::Tensor quant_linear_with(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                             const std::optional<at::Tensor>& bias, const std::string& path) {
  const int64_t k = check_weight(w, qtype, -1);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [M, K], got ", x.dim(), "-D");
  TORCH_CHECK(x.size(1) == k, "x has K=", x.size(1), " but w holds K=", k);
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, "x's last dimension must be contiguous");
  TORCH_CHECK(x.size(0) == 0 || x.stride(0) >= k, "x rows must not overlap");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat, "bias must be float32, got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "bias must be [N=", w.size(0), "]");
    TORCH_CHECK(bias->is_contiguous(), "bias must be contiguous");
  }
  TORCH_CHECK(path == "auto" || path == "f32" || path == "int" || path == "dequant",
              "path must be auto, f32, int or dequant, got ", path);
  const bool dq = path == "dequant" || (path == "auto" && x.size(0) >= g_dequant_min_rows.load(std::memory_order_relaxed));
  if (x.size(0) == 0) return at::empty({0, w.size(0)}, at::kFloat);
  if (dq) return linear_dequant(x, w, static_cast<int>(qtype), bias);
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (path == "int") return linear_int(x, w, static_cast<int>(qtype), b);
  return linear_f32(x, w, static_cast<int>(qtype), b);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias) {
  return quant_linear_with(x, w, qtype, bias, "auto");
}

at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t k) {
  check_weight(w, qtype, k);
  return dequantize_impl(w, static_cast<int>(qtype), k);
}

at::Tensor embedding(const at::Tensor& ids, const at::Tensor& w, int64_t qtype, int64_t k) {
  check_weight(w, qtype, k);
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids must be int64, got ", ids.scalar_type());
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t t = flat.size(0), n = w.size(0);
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "embedding id ", ip[i], " out of range [0, ", n, ")");
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(k);
  at::Tensor out = at::empty(shape, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const QuantOps& o = ops();
  at::parallel_for(0, t, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) o.dequant(wp, ip[i], ip[i] + 1, k, static_cast<int>(qtype), op + i * k);
  });
  return out;
}

at::Tensor quantize(const at::Tensor& w, int64_t qtype) {
  check_qtype(qtype);
  TORCH_CHECK(w.scalar_type() == at::kFloat, "w must be float32, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2, "w must be 2-D [N, K], got ", w.dim(), "-D");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k > 0 && k % QK == 0, "K must be a positive multiple of 32, got ", k);
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty({n, quant::row_bytes(k, static_cast<int>(qtype))}, at::kByte);
  const float* wp = wc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t rb = out.size(1);
  at::parallel_for(0, n, grain(n), [&](int64_t r0, int64_t r1) {
    quant::quantize_ref(wp, r0, r1, k, static_cast<int>(qtype), op + r0 * rb);
  });
  return out;
}

namespace {

void register_quant(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none(),
        "y[M, N] = x[M, K] @ W.T (+ bias) with W the GGUF blocks w (Q4_0=2, Q4_1=3, Q8_0=8); x float32, last dim "
        "contiguous. Activations are quantized per 32-block to int8 below the row threshold, else W is "
        "dequantized to fp32 and multiplied with torch's GEMM");
  m.def("quant_linear_with", &quant_linear_with, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias"),
        py::arg("path"), "quant_linear with a forced path: 'auto', 'int' or 'dequant' (tests, benchmarks)");
  m.def("quant_linear_dequant_min_rows", [] { return g_dequant_min_rows.load(); },
        "row count from which quant_linear dequantizes and uses torch's GEMM");
  m.def("set_quant_linear_dequant_min_rows", [](int64_t rows) {
          TORCH_CHECK(rows >= 1, "rows must be >= 1");
          g_dequant_min_rows.store(rows);
        }, py::arg("rows"), "change that threshold (benchmarks; measured per machine)");
  m.def("dequantize", &dequantize, py::arg("w"), py::arg("qtype"), py::arg("k"),
        "float32 [N, k] equal (bitwise) to gguf.quants.dequantize");
  m.def("embedding", &embedding, py::arg("ids"), py::arg("w"), py::arg("qtype"), py::arg("k"),
        "dequantized rows w[ids] as float32 [*ids.shape, k]; ids out of range raise");
  m.def("quantize", &quantize, py::arg("w"), py::arg("qtype"),
        "GGUF blocks (uint8 [N, K/32*block_bytes]) of float32 w [N, K], byte for byte gguf.quants.quantize");
}

PDSERVE_REGISTER(register_quant);

}  // namespace
}  // namespace pdserve
