// A sparse mixture-of-experts MLP over packed experts (model/layers/moe.py's SparseMoE on the native path):
// route each row to its top-k experts, run each chosen expert once on the rows that chose it, sum the k results.
//
// Routing: softmax of the router logits in fp32, the k largest (ties: the lower expert id), weights renormalised
// over the k when asked (Qwen3-MoE's norm_topk_prob; Mixtral always). Experts: down(silu(gate x) * up x) with
// gate|up one packed [2I, H] matrix. A shared expert (Qwen2-MoE), when given, runs on every row and adds
// sigmoid(x . w_gate) * shared(x) after the routed sum. A row's result depends only on its own x, logits and kind (the linears'
// batch invariance, packed_weight.h): the same bits whichever rows share its experts, however the work is split.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <vector>

#include "packed_weight.h"

namespace pdserve {

class MoeExperts {
 public:
  MoeExperts(std::vector<std::shared_ptr<PackedWeight>> gate_up, std::vector<std::shared_ptr<PackedWeight>> down,
             int64_t top_k, bool renormalise, std::shared_ptr<PackedWeight> shared_gate_up = nullptr,
             std::shared_ptr<PackedWeight> shared_down = nullptr, std::shared_ptr<PackedWeight> shared_gate = nullptr);
  int64_t num_experts() const { return static_cast<int64_t>(gate_up_.size()); }
  int64_t hidden() const { return down_[0]->n(); }
  // out [T, H] (rows may be strided) from x [T, H] and router logits [T, E]; prompt_rows: the rows' kinds for the
  // linears (uint8 [T]) or none.
  void forward_into(const at::Tensor& x, const at::Tensor& logits, at::Tensor& out,
                    const std::optional<at::Tensor>& prompt_rows) const;

 private:
  void add_shared(const at::Tensor& x, at::Tensor& out, const std::optional<at::Tensor>& prompt_rows) const;
  std::vector<std::shared_ptr<PackedWeight>> gate_up_, down_;
  std::shared_ptr<PackedWeight> shared_gate_up_, shared_down_, shared_gate_;  // all or none
  int64_t top_k_;
  bool renormalise_;
};

}  // namespace pdserve
