"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks top-k experts per token, each a SwiGLU MLP.

Router: logits = x @ W_gate.T [T, E]; probs = softmax in fp32; top-k; renormalised over the k when `norm_topk_prob`
(Mixtral always: softmax over the top-k logits equals the renormalised top-k probs). Output = sum_k w_k * expert_k(x).
Each expert holds its own Linear modules (gate_up [2I, H], down [H, I]) so a loader can give each its packed weight
as stored (a 2-D slice of a GGUF 3-D expert tensor); tokens are grouped by expert and only the experts some token
chose are run, so a decode step reads only those experts' weights. Plain tensors in and out, no engine objects.
On the native path the whole layer after the router is one native op (csrc/moe.h: the same routing and experts,
its rows' sums in slot order), which the whole-stack program records like any other op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.model.layers.activation import SiluAndMul
from pdserve.model.layers.linear import Linear
from pdserve.model.native_ops import KernelSelection


class Expert(nn.Module):
    """down(silu(gate x) * up x) with gate | up fused in one [2I, H] projection (gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: KernelSelection) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, False, kernels)
        self.act_fn = SiluAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in logits' dtype, expert ids [T, k]) from router logits [T, E]; softmax and sums in fp32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class SparseMoE(nn.Module):
    """x [T, H] -> [T, H]: the top-k experts of each token, weighted by the router and summed; with a shared
    expert (Qwen2-MoE, `shared_intermediate_size` > 0), plus sigmoid(x . w_shared_gate) * shared_expert(x)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalise: bool, kernels: KernelSelection, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the expert count)")
        self.gate = Linear(hidden_size, num_experts, False, kernels)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size, kernels) for _ in range(num_experts))
        self.shared_expert = Expert(hidden_size, shared_intermediate_size, kernels) if shared_intermediate_size \
            else None
        self.shared_expert_gate = Linear(hidden_size, 1, False, kernels) if shared_intermediate_size else None
        self.top_k, self.renormalise = top_k, renormalise
        self.kernels = kernels
        self._native: Any = None  # the kernels' MoeExperts over the packed experts, made at the first native call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.native is not None:
            return self.kernels.ops.moe(x, self.gate(x), self._native_experts())
        weights, ids = route(self.gate(x), self.top_k, self.renormalise)
        t, k = ids.shape
        # sort the T*k (token, expert) assignments by expert: each chosen expert runs once on its contiguous rows
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = (order // k).tolist()
        outs, start = [], 0
        for expert_id, n in enumerate(counts):
            if n == 0:
                continue  # an expert no token chose: its weights are never read
            rows = tokens[start:start + n]
            outs.append(self.experts[expert_id](x[rows[0]:rows[0] + 1] if n == 1 else x[rows]))
            start += n
        # back to (token, slot) order, then each token's k outputs weighted and summed in slot order. One gather
        # instead of an index_add_ per expert (those cost ~0.2 ms each on the CPU, far more than the rows they add).
        y = torch.cat(outs)[torch.argsort(order)].view(t, k, -1)
        out = torch.bmm(weights.to(y.dtype).unsqueeze(1), y).squeeze(1).to(x.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _native_experts(self) -> Any:
        """The packed experts as one native object (csrc/moe.h): routing, grouping and every chosen expert's linears
        in one call. Made once, after the loader packed every matrix (the native path packs all of them)."""
        if self._native is None:
            from pdserve import kernels as native_kernels

            lib = native_kernels.require()
            gate_up = [e.gate_up_proj.packed for e in self.experts]  # type: ignore[union-attr]
            down = [e.down_proj.packed for e in self.experts]  # type: ignore[union-attr]
            shared = [] if self.shared_expert is None or self.shared_expert_gate is None else [
                self.shared_expert.gate_up_proj.packed, self.shared_expert.down_proj.packed,
                self.shared_expert_gate.packed]
            if not all(isinstance(w, lib.PackedWeight) for w in gate_up + down + shared):
                raise ValueError("the native MoE path needs every expert packed (native kernels pack at load)")
            self._native = lib.MoeExperts(gate_up, down, self.top_k, self.renormalise, *shared)
        return self._native
