// The decoder stack in one call: for models whose projections are all GGUF blocks (QuantLinear), Python hands the
// weights over once (NativeDecoder) and each step runs every layer here, so a batch-1 decode step pays one Python
// call for the whole stack instead of ~15 per layer. The per-layer computation is exactly the Python native path
// (pdserve/model/llama.py, forward_native): fused add+RMSNorm, qkv, RoPE in place, KV write, paged attention, o_proj,
// fused add+RMSNorm, gate_up, SiLU*mul, down.
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "ops.h"
#include "registry.h"

namespace pdserve {
namespace {

struct QLinear {
  at::Tensor w;
  int64_t qtype;
  std::optional<at::Tensor> bias;
  at::Tensor operator()(const at::Tensor& x) const { return quant_linear(x, w, qtype, bias); }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  QLinear qkv, o, gate_up, down;
};

class NativeDecoder {
 public:
  NativeDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                double scale, at::Tensor cos, at::Tensor sin)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), inter_(intermediate), eps_(eps), scale_(scale),
        cos_(std::move(cos)), sin_(std::move(sin)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv_w, int64_t qkv_t,
                 std::optional<at::Tensor> qkv_b, at::Tensor o_w, int64_t o_t, at::Tensor gu_w, int64_t gu_t,
                 at::Tensor down_w, int64_t down_t) {
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), QLinear{std::move(qkv_w), qkv_t, qkv_b},
                            QLinear{std::move(o_w), o_t, std::nullopt}, QLinear{std::move(gu_w), gu_t, std::nullopt},
                            QLinear{std::move(down_w), down_t, std::nullopt}});
  }

  // x: the embedded tokens [T, hidden] (consumed); kv_cache [layers, 2, NB, BS, Hkv, D]. Returns the last layer's
  // output and the residual stream; the caller applies the final norm (fused add+RMSNorm).
  std::pair<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& positions, at::Tensor& kv_cache,
                                            const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens) const {
    TORCH_CHECK(kv_cache.size(0) == static_cast<int64_t>(layers_.size()), "kv_cache has ", kv_cache.size(0),
                " layers, the decoder ", layers_.size());
    const int64_t t = x.size(0), qs = hq_ * d_, kvs = hkv_ * d_;
    at::Tensor residual = x;
    at::Tensor h = at::empty_like(x);
    at::Tensor attn = at::empty({t, hq_, d_}, x.options());
    at::Tensor act = at::empty({t, inter_}, x.options());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      if (i == 0) {
        rms_norm(h, residual, L.input_norm, eps_);
      } else {
        fused_add_rms_norm(h, residual, L.input_norm, eps_);
      }
      at::Tensor qkv = L.qkv(h);
      at::Tensor q = qkv.narrow(1, 0, qs), k = qkv.narrow(1, qs, kvs), v = qkv.narrow(1, qs + kvs, kvs);
      rotary_embedding(positions, q, k, cos_, sin_, d_);
      at::Tensor layer_cache = kv_cache.select(0, static_cast<int64_t>(i));
      reshape_and_cache(k.view({t, hkv_, d_}), v.view({t, hkv_, d_}), layer_cache, slot_mapping);
      paged_attention(attn, q.view({t, hq_, d_}), layer_cache, block_table, query_start_loc, seq_lens, scale_);
      h = L.o(attn.view({t, qs}));
      fused_add_rms_norm(h, residual, L.post_norm, eps_);
      silu_and_mul(act, L.gate_up(h));
      h = L.down(act);
    }
    return {h, residual};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  int64_t hq_, hkv_, d_, inter_;
  double eps_, scale_;
  at::Tensor cos_, sin_;
  std::vector<Layer> layers_;
};

void register_model_forward(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<NativeDecoder>(m, "NativeDecoder", "the decoder layers of a GGUF-block model, run in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("scale"), py::arg("cos"), py::arg("sin"))
      .def("add_layer", &NativeDecoder::add_layer)
      .def("forward", &NativeDecoder::forward, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &NativeDecoder::num_layers);
}

}  // namespace
PDSERVE_REGISTER(register_model_forward);
}  // namespace pdserve
