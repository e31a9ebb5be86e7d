// The PackedWeight interface (packed_weight.h): argument checks and the Python class. The weight formats and their
// kernels register their own factories (pack_* functions) that return a PackedWeight.
#include "packed_weight.h"

#include <algorithm>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops.h"
#include "registry.h"

namespace pdserve {

void PackedWeight::rows(const int64_t* ids, int64_t t, float* out) const {
  const at::Tensor w = dequantize();
  const float* wp = w.data_ptr<float>();
  for (int64_t i = 0; i < t; ++i) std::memcpy(out + i * k_, wp + ids[i] * k_, sizeof(float) * k_);
}

namespace {

void check_x(const PackedWeight& w, const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [M, K], got ", x.dim(), "-D");
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.size(1) == w.k(), "x has K=", x.size(1), " but the weight holds K=", w.k());
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, "x's last dimension must be contiguous");
  TORCH_CHECK(x.size(0) <= 1 || x.stride(0) >= w.k(), "x rows must not overlap");
}

// The rows' kinds as forward_rows takes them (null: every row a generated one).
const uint8_t* row_kinds(const std::optional<at::Tensor>& prompt_rows, int64_t m) {
  if (!prompt_rows) return nullptr;
  const at::Tensor& pr = *prompt_rows;
  TORCH_CHECK((pr.scalar_type() == at::kByte || pr.scalar_type() == at::kBool) && pr.dim() == 1 &&
                  pr.size(0) == m && pr.is_contiguous() && pr.device().is_cpu(),
              "prompt_rows must be a contiguous uint8 or bool CPU tensor [M=", m, "], got ", pr.scalar_type(), " ",
              pr.sizes());
  return static_cast<const uint8_t*>(pr.data_ptr());
}

}  // namespace

void packed_linear_into(const PackedWeight& w, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                        at::Tensor& y, const std::optional<at::Tensor>& prompt_rows) {
  check_x(w, x);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == w.n() &&
                  (y.stride(1) == 1 || w.n() == 1) && (y.size(0) <= 1 || y.stride(0) >= w.n()),
              "out must be float32 [", x.size(0), ", ", w.n(), "] with contiguous rows");
  const float* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat, "bias must be float32, got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.n(), "bias must be [N=", w.n(), "]");
    TORCH_CHECK(bias->is_contiguous(), "bias must be contiguous");
    b = bias->data_ptr<float>();
  }
  const uint8_t* kinds = row_kinds(prompt_rows, x.size(0));
  if (x.size(0) > 0)
    w.forward_rows(x.data_ptr<float>(), x.stride(0), x.size(0), y.data_ptr<float>(), y.stride(0), b, kinds);
}

bool packed_gated_into(const PackedWeight& w, const at::Tensor& x, at::Tensor& act, bool gelu,
                       const std::optional<at::Tensor>& prompt_rows) {
  check_x(w, x);
  const int64_t inter = w.n() / 2;
  TORCH_CHECK(w.n() % 2 == 0, "a gate/up weight has an even N, got ", w.n());
  TORCH_CHECK(act.scalar_type() == at::kFloat && act.dim() == 2 && act.size(0) == x.size(0) &&
                  act.size(1) == inter && act.stride(1) == 1 && (act.size(0) <= 1 || act.stride(0) >= inter),
              "act must be float32 [", x.size(0), ", ", inter, "] with contiguous rows");
  const uint8_t* kinds = row_kinds(prompt_rows, x.size(0));
  return x.size(0) > 0 && w.forward_gated(x.data_ptr<float>(), x.stride(0), x.size(0), act.data_ptr<float>(),
                                          act.stride(0), gated_mul_kernel(gelu), kinds);
}

at::Tensor packed_linear(const PackedWeight& w, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& prompt_rows) {
  at::Tensor y = at::empty({x.dim() == 2 ? x.size(0) : 0, w.n()}, at::kFloat);
  packed_linear_into(w, x, bias, y, prompt_rows);
  return y;
}

at::Tensor packed_rows(const PackedWeight& w, const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids must be int64, got ", ids.scalar_type());
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t t = flat.size(0);
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w.n(), "embedding id ", ip[i], " out of range [0, ", w.n(), ")");
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(w.k());
  at::Tensor out = at::empty(shape, at::kFloat);
  if (t > 0) w.rows(ip, t, out.data_ptr<float>());
  return out;
}

namespace {

// The rows of several PackedWeights stacked into one W (a fused q/k/v or gate/up projection whose parts a GGUF file
// stores in different types, e.g. Q4_K q/k beside a Q6_K v). Each part writes its own columns of y, so batch
// invariance holds part by part.
class StackedWeight final : public PackedWeight {
 public:
  StackedWeight(std::vector<PackedWeightPtr> parts, int64_t n)
      : PackedWeight(n, parts[0]->k()), parts_(std::move(parts)) {}

  std::string type_name() const override {
    std::string s;
    for (const auto& p : parts_) s += (s.empty() ? "" : "+") + p->type_name();
    return s;
  }
  int64_t nbytes() const override {
    int64_t b = 0;
    for (const auto& p : parts_) b += p->nbytes();
    return b;
  }
  void forward(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias) const override {
    forward_rows(x, ldx, m, y, ldy, bias, nullptr);
  }
  // Where the parts take slabs (their forward_rows is forward), each part runs as one whole slab and they share
  // one quantization of x (kXKeep, then kXKept: a part of another type quantizes again): the bits of forward.
  void forward_rows(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias,
                    const uint8_t* prompt_rows) const override {
    if (parts_.size() > 1 && forward_slab(x, ldx, m, y, ldy, bias, 0, n(), 0, k(), false, kXKeep)) return;
    int64_t col = 0;
    for (const auto& p : parts_) {
      p->forward_rows(x, ldx, m, y + col, ldy, bias ? bias + col : nullptr, prompt_rows);
      col += p->n();
    }
  }
  bool takes_slabs() const override {
    return std::all_of(parts_.begin(), parts_.end(), [](const PackedWeightPtr& p) { return p->takes_slabs(); });
  }
  // Each part takes the columns of [c0, c0 + nc) that are its own (from its first: parts hold whole 16-column
  // panels where a slab's columns cross them).
  bool forward_slab(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, const float* bias, int64_t c0,
                    int64_t nc, int64_t k0, int64_t kn, bool accumulate, XReuse x_reuse) const override {
    if (!takes_slabs()) return false;
    int64_t col = 0;
    for (const auto& p : parts_) {
      const int64_t lo = std::max(c0, col), hi = std::min(c0 + nc, col + p->n());
      if (lo < hi && !p->forward_slab(x, ldx, m, y + (lo - c0), ldy, bias ? bias + (lo - c0) : nullptr, lo - col,
                                      hi - lo, k0, kn, accumulate, x_reuse))
        return false;
      if (lo < hi && x_reuse == kXKeep) x_reuse = kXKept;  // the next part may reuse what this one kept
      col += p->n();
    }
    return true;
  }
  at::Tensor dequantize() const override {
    std::vector<at::Tensor> w;
    for (const auto& p : parts_) w.push_back(p->dequantize());
    return at::cat(w, 0);
  }
  void rows(const int64_t* ids, int64_t t, float* out) const override {
    for (int64_t i = 0; i < t; ++i) {
      int64_t id = ids[i];
      for (const auto& p : parts_) {
        if (id < p->n()) {
          p->rows(&id, 1, out + i * k());
          break;
        }
        id -= p->n();
      }
    }
  }

 private:
  std::vector<PackedWeightPtr> parts_;
};

std::shared_ptr<PackedWeight> stack_packed(const std::vector<std::shared_ptr<PackedWeight>>& parts) {
  TORCH_CHECK(!parts.empty(), "stack_packed needs at least one part");
  int64_t n = 0;
  for (const auto& p : parts) {
    TORCH_CHECK(p != nullptr, "stack_packed: a part is None");
    TORCH_CHECK(p->k() == parts[0]->k(), "stack_packed: parts differ in K (", p->k(), " vs ", parts[0]->k(), ")");
    n += p->n();
  }
  return std::make_shared<StackedWeight>(std::vector<PackedWeightPtr>(parts.begin(), parts.end()), n);
}

// y[:, :] (+)= x @ W[c0 : c0 + y.size(1), k0 : k0 + x.size(1)].T (+ bias): PackedWeight::forward_slab, checked.
bool packed_slab_into(const PackedWeight& w, const at::Tensor& x, at::Tensor& y, int64_t c0, int64_t k0, bool accumulate,
                      const std::optional<at::Tensor>& bias, int x_reuse) {
  TORCH_CHECK(x_reuse >= 0 && x_reuse <= 2, "x_reuse must be 0 (once), 1 (keep) or 2 (kept)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "x must be float32 [M, kn]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1,
              "y must be float32 [M, nc] with contiguous rows");
  TORCH_CHECK(c0 >= 0 && c0 + y.size(1) <= w.n() && k0 >= 0 && k0 + x.size(1) <= w.k(), "slab out of W's range");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == y.size(1) &&
                        bias->is_contiguous()), "bias must be float32 [nc]");
  pybind11::gil_scoped_release nogil;
  return w.forward_slab(x.data_ptr<float>(), x.stride(0), x.size(0), y.data_ptr<float>(), y.stride(0),
                        bias ? bias->data_ptr<float>() : nullptr, c0, y.size(1), k0, x.size(1), accumulate,
                        static_cast<PackedWeight::XReuse>(x_reuse));
}

void register_packed_weight(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<PackedWeight, std::shared_ptr<PackedWeight>>(
      m, "PackedWeight", "a weight matrix W [N, K] packed for the native kernels (packed_weight.h)")
      .def("forward", &packed_linear, py::arg("x"), py::arg("bias") = py::none(), py::arg("prompt_rows") = py::none(),
           py::call_guard<py::gil_scoped_release>(),
           "y[M, N] = x[M, K] @ W.T (+ bias); x float32; prompt_rows (uint8/bool [M]): which rows are prompt rows "
           "(a format may multiply those by another fixed arithmetic; packed_weight.h)")
      .def("forward_into",
           [](const PackedWeight& w, const at::Tensor& x, at::Tensor& out, const std::optional<at::Tensor>& bias,
              const std::optional<at::Tensor>& prompt_rows) { packed_linear_into(w, x, bias, out, prompt_rows); },
           py::arg("x"), py::arg("out"), py::arg("bias") = py::none(),
           py::arg("prompt_rows") = py::none(), py::call_guard<py::gil_scoped_release>(),
           "forward's product written into out (float32 [M, N], contiguous rows): no new tensor")
      .def("forward_gated", &packed_gated_into, py::arg("x"), py::arg("act"), py::arg("gelu") = false,
           py::arg("prompt_rows") = py::none(), py::call_guard<py::gil_scoped_release>(),
           "act[M, N/2] = silu (gelu: gelu_tanh) of x @ gate.T times x @ up.T, W = [gate; up], where the format "
           "fuses it for these rows (packed_weight.h: forward_gated); returns whether it did (nothing written if not)")
      .def("forward_slab", &packed_slab_into, py::arg("x"), py::arg("y"), py::arg("c0"), py::arg("k0"),
           py::arg("accumulate"), py::arg("bias") = py::none(), py::arg("x_reuse") = 0,
           "y (+)= x @ W[c0 : c0 + y.shape[1], k0 : k0 + x.shape[1]].T (+ bias), the fp32 accumulation over K carried "
           "in y from the call over the K range before; x_reuse 1 keeps x's quantization, 2 reuses the kept one "
           "(x unchanged since; packed_weight.h: forward_slab); whether the format did")
      .def_property_readonly("takes_slabs", &PackedWeight::takes_slabs)
      .def("rows", &packed_rows, py::arg("ids"), py::call_guard<py::gil_scoped_release>(),
           "W[ids] as float32 [*ids.shape, K] (an embedding lookup); ids out of range raise")
      .def("dequantize", &PackedWeight::dequantize, "W as float32 [N, K]: the values the kernels multiply by")
      .def_property_readonly("n", &PackedWeight::n)
      .def_property_readonly("k", &PackedWeight::k)
      .def_property_readonly("shape", [](const PackedWeight& w) { return py::make_tuple(w.n(), w.k()); })
      .def_property_readonly("type_name", &PackedWeight::type_name)
      .def_property_readonly("nbytes", &PackedWeight::nbytes);
  m.def("stack_packed", &stack_packed, py::arg("parts"),
        "one PackedWeight whose rows are the parts' rows in order (same K); each part keeps its own format");
}

}  // namespace
PDSERVE_REGISTER(register_packed_weight);
}  // namespace pdserve
