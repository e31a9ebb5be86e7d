// MoeExperts (moe.h): routing, grouping rows by expert, the experts' linears and the weighted sum.
#include "moe.h"

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "ops.h"
#include "parallel.h"
#include "registry.h"

namespace pdserve {

MoeExperts::MoeExperts(std::vector<std::shared_ptr<PackedWeight>> gate_up,
                       std::vector<std::shared_ptr<PackedWeight>> down, int64_t top_k, bool renormalise,
                       std::shared_ptr<PackedWeight> shared_gate_up, std::shared_ptr<PackedWeight> shared_down,
                       std::shared_ptr<PackedWeight> shared_gate)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), shared_gate_up_(std::move(shared_gate_up)),
      shared_down_(std::move(shared_down)), shared_gate_(std::move(shared_gate)), top_k_(top_k),
      renormalise_(renormalise) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "MoeExperts: ", gate_up_.size(),
              " gate_up and ", down_.size(), " down matrices");
  TORCH_CHECK(top_k_ > 0 && top_k_ <= num_experts(), "MoeExperts: top_k ", top_k_, " of ", num_experts(),
              " experts");
  const int64_t h = down_[0]->n(), inter = down_[0]->k();
  for (size_t e = 0; e < gate_up_.size(); ++e) {
    TORCH_CHECK(gate_up_[e] && down_[e], "MoeExperts: expert ", e, " has no packed weight");
    TORCH_CHECK(gate_up_[e]->k() == h && gate_up_[e]->n() == 2 * inter && down_[e]->n() == h &&
                    down_[e]->k() == inter,
                "MoeExperts: expert ", e, " is not [2I, H] / [H, I] with H=", h, ", I=", inter);
  }
  const int n_shared = (shared_gate_up_ != nullptr) + (shared_down_ != nullptr) + (shared_gate_ != nullptr);
  TORCH_CHECK(n_shared == 0 || n_shared == 3, "MoeExperts: a shared expert needs gate_up, down and its gate");
  if (n_shared == 3)
    TORCH_CHECK(shared_gate_up_->k() == h && shared_down_->n() == h && shared_gate_up_->n() == 2 * shared_down_->k()
                    && shared_gate_->n() == 1 && shared_gate_->k() == h,
                "MoeExperts: the shared expert is not [2S, H] / [H, S] with a [1, H] gate");
}

// out[r] += sigmoid(x[r] . w_gate) * shared(x[r]), every row (in place, after the routed sum).
void MoeExperts::add_shared(const at::Tensor& x, at::Tensor& out, const std::optional<at::Tensor>& prompt_rows) const {
  const int64_t t = x.size(0), h = hidden(), s = shared_down_->k();
  at::Tensor gu = at::empty({t, 2 * s}, at::kFloat), act = at::empty({t, s}, at::kFloat),
             y = at::empty({t, h}, at::kFloat), g = at::empty({t, 1}, at::kFloat);
  packed_linear_into(*shared_gate_up_, x, std::nullopt, gu, prompt_rows);
  silu_and_mul(act, gu);
  packed_linear_into(*shared_down_, act, std::nullopt, y, prompt_rows);
  packed_linear_into(*shared_gate_, x, std::nullopt, g, prompt_rows);
  const float *yp = y.data_ptr<float>(), *gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float w = 1.f / (1.f + std::exp(-gp[r]));
      float* o = op + r * out.stride(0);
      for (int64_t c = 0; c < h; ++c) o[c] += w * yp[r * h + c];
    }
  });
}

namespace {

// Top-k of one row's logits: expert ids and weights (softmax in fp32, optionally renormalised over the k).
void route_row(const float* logits, int64_t n_expert, int64_t k, bool renormalise, std::vector<float>& probs,
               std::vector<int64_t>& order, int64_t* ids, float* weights) {
  const float m = *std::max_element(logits, logits + n_expert);
  float sum = 0.f;
  for (int64_t e = 0; e < n_expert; ++e) sum += probs[e] = std::exp(logits[e] - m);
  for (int64_t e = 0; e < n_expert; ++e) probs[e] /= sum;
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
  });
  float total = 0.f;
  for (int64_t s = 0; s < k; ++s) total += weights[s] = probs[ids[s] = order[s]];
  if (renormalise)
    for (int64_t s = 0; s < k; ++s) weights[s] /= total;
}

}  // namespace

void MoeExperts::forward_into(const at::Tensor& x, const at::Tensor& logits, at::Tensor& out,
                              const std::optional<at::Tensor>& prompt_rows) const {
  const int64_t t = x.size(0), h = hidden(), n_expert = num_experts(), k = top_k_, inter = down_[0]->k();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == h && x.stride(1) == 1,
              "moe: x must be float32 [T, ", h, "] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(0) == t &&
                  logits.size(1) == n_expert && logits.stride(1) == 1,
              "moe: logits must be float32 [T, ", n_expert, "]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == t && out.size(1) == h &&
                  out.stride(1) == 1, "moe: out must be float32 [T, ", h, "]");
  const uint8_t* kinds = nullptr;
  if (prompt_rows) {
    TORCH_CHECK(prompt_rows->numel() == t && prompt_rows->is_contiguous() && prompt_rows->element_size() == 1,
                "moe: prompt_rows must be uint8 [T]");
    kinds = static_cast<const uint8_t*>(prompt_rows->data_ptr());
  }
  if (t == 0) return;
  const int64_t n = t * k;
  std::vector<int64_t> ids(n);
  std::vector<float> weights(n);
  {
    std::vector<float> probs(n_expert);
    std::vector<int64_t> order(n_expert);
    for (int64_t r = 0; r < t; ++r)
      route_row(logits.data_ptr<float>() + r * logits.stride(0), n_expert, k, renormalise_, probs, order,
                ids.data() + r * k, weights.data() + r * k);
  }
  // (row, slot) pairs grouped by expert, in row order within an expert: pos[row * k + slot] is the pair's place
  std::vector<int64_t> start(n_expert + 1, 0), pos(n), row_of(n);
  for (int64_t i = 0; i < n; ++i) ++start[ids[i] + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) row_of[pos[i] = next[ids[i]]++] = i / k;
  }
  at::Tensor xs = at::empty({n, h}, at::kFloat), gu = at::empty({n, 2 * inter}, at::kFloat),
             act = at::empty({n, inter}, at::kFloat), ys = at::empty({n, h}, at::kFloat);
  at::Tensor ks = at::empty({kinds ? n : 0}, at::kByte);
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  uint8_t* ksp = kinds ? ks.data_ptr<uint8_t>() : nullptr;
  parallel_for(0, n, 64, [&](int64_t p0, int64_t p1) {  // a prefill gathers T * k rows: MBs a layer
    for (int64_t p = p0; p < p1; ++p) {
      std::memcpy(xsp + p * h, xp + row_of[p] * x.stride(0), sizeof(float) * h);
      if (ksp) ksp[p] = kinds[row_of[p]];
    }
  });
  std::vector<int64_t> used;
  int64_t most = 0;
  for (int64_t e = 0; e < n_expert; ++e)
    if (start[e + 1] > start[e]) used.push_back(e), most = std::max(most, start[e + 1] - start[e]);
  auto run = [&](int64_t e) {  // the expert's rows [start[e], start[e+1]) of xs -> ys
    const int64_t p0 = start[e], m = start[e + 1] - p0;
    const uint8_t* kp = ksp ? ksp + p0 : nullptr;
    gate_up_[e]->forward_rows(xs.data_ptr<float>() + p0 * h, h, m, gu.data_ptr<float>() + p0 * 2 * inter,
                              2 * inter, nullptr, kp);
    at::Tensor a = act.narrow(0, p0, m);
    silu_and_mul(a, gu.narrow(0, p0, m));
    down_[e]->forward_rows(act.data_ptr<float>() + p0 * inter, inter, m, ys.data_ptr<float>() + p0 * h, h, nullptr,
                           kp);
  };
  // Few rows per expert (decode): the experts are shared out among the threads, each running its experts' linears
  // on its own (nested loops run inline): one parallel region instead of several per expert. Many rows (prefill):
  // one expert at a time, its linears split over the threads. Either way each row's bits are the same.
  if (most <= 16 && static_cast<int64_t>(used.size()) >= num_threads()) {
    parallel_for(0, static_cast<int64_t>(used.size()), 1, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) run(used[i]);
    });
  } else {
    for (int64_t e : used) run(e);
  }
  float* op = out.data_ptr<float>();
  const float* yp = ys.data_ptr<float>();
  parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* o = op + r * out.stride(0);
      const float* y0 = yp + pos[r * k] * h;
      const float w0 = weights[r * k];
      for (int64_t c = 0; c < h; ++c) o[c] = w0 * y0[c];
      for (int64_t s = 1; s < k; ++s) {  // slot order: fixed, whichever rows share the experts
        const float* ysr = yp + pos[r * k + s] * h;
        const float w = weights[r * k + s];
        for (int64_t c = 0; c < h; ++c) o[c] += w * ysr[c];
      }
    }
  });
  if (shared_gate_up_ != nullptr) add_shared(x, out, prompt_rows);
}

namespace {

void register_moe(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<MoeExperts, std::shared_ptr<MoeExperts>>(
      m, "MoeExperts", "a sparse MoE MLP's experts, packed (moe.h): routing and the experts in one native call")
      .def(py::init<std::vector<std::shared_ptr<PackedWeight>>, std::vector<std::shared_ptr<PackedWeight>>, int64_t,
                    bool, std::shared_ptr<PackedWeight>, std::shared_ptr<PackedWeight>,
                    std::shared_ptr<PackedWeight>>(),
           py::arg("gate_up"), py::arg("down"), py::arg("top_k"), py::arg("renormalise"),
           py::arg("shared_gate_up") = nullptr, py::arg("shared_down") = nullptr, py::arg("shared_gate") = nullptr,
           "shared_*: a shared expert (Qwen2-MoE) and its [1, H] gate, or none")
      .def(
          "forward_into",
          [](const MoeExperts& self, const at::Tensor& x, const at::Tensor& logits, at::Tensor& out,
             const std::optional<at::Tensor>& prompt_rows) { self.forward_into(x, logits, out, prompt_rows); },
          py::arg("x"), py::arg("logits"), py::arg("out"), py::arg("prompt_rows") = py::none(),
          py::call_guard<py::gil_scoped_release>(),
          "out[T, H] = the top-k experts of each row of x [T, H] by router logits [T, E], weighted and summed")
      .def_property_readonly("num_experts", &MoeExperts::num_experts)
      .def_property_readonly("hidden", &MoeExperts::hidden);
}

}  // namespace
PDSERVE_REGISTER(register_moe);
}  // namespace pdserve
