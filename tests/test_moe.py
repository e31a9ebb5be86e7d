"""The sparse MoE MLP (model/layers/moe.py) against transformers' Qwen3-MoE and Mixtral blocks (fp32, tiny random)."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pdserve.model.attention import SDPABackend
from pdserve.model.layers.moe import SparseMoE, route
from pdserve.model.native_ops import KernelSelection

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


def _copy_from_hf(block: torch.nn.Module, num_experts: int, renormalise: bool) -> SparseMoE:
    """A SparseMoE holding the HF block's weights (router [E, H]; gate_up [E, 2I, H]; down [E, H, I])."""
    moe = SparseMoE(HIDDEN, INTER, num_experts, TOP_K, renormalise, KernelSelection(SDPABackend()))
    with torch.no_grad():
        moe.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(moe.experts):
            expert.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
    return moe


def _randomise(block: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)


def _assert_block_matches(block: torch.nn.Module, renormalise: bool, tokens: int) -> None:
    """A SparseMoE with the HF block's (randomised) weights gives the block's output on `tokens` random rows."""
    block = block.float().eval()
    _randomise(block)
    moe = _copy_from_hf(block, EXPERTS, renormalise)
    x = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), block(x[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_qwen3_moe_block_matches_hf(norm_topk_prob: bool, tokens: int) -> None:
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob)
    _assert_block_matches(Qwen3MoeSparseMoeBlock(config), norm_topk_prob, tokens)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_mixtral_block_matches_hf(tokens: int) -> None:
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K)
    _assert_block_matches(MixtralSparseMoeBlock(config), True, tokens)


def test_route_renormalises_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalise=True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.softmax(logits[:, :2], dim=-1))
    raw, _ = route(logits, 2, renormalise=False)
    torch.testing.assert_close(raw, torch.softmax(logits, dim=-1)[:, :2])


def test_decode_reads_only_chosen_experts() -> None:
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, True, KernelSelection(SDPABackend()))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    called: list[int] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda _m, _i, _o, e=e: called.append(e))
    x = torch.randn(1, HIDDEN)
    with torch.no_grad():
        _, ids = route(moe.gate(x), TOP_K, True)
        moe(x)
    assert sorted(called) == sorted(ids[0].tolist())


def test_top_k_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        SparseMoE(HIDDEN, INTER, 4, 5, True, KernelSelection(SDPABackend()))


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_gguf_expert_slices_are_views_in_stored_type(type_name: str) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from pdserve.model.moe_gguf import expert_matrices

    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 16, 64)).astype(np.float32)  # [n_expert, rows, cols]
    stored = quants.quantize(w, qtype)
    raw = np.frombuffer(bytearray(stored.tobytes()), dtype=np.uint8)
    parts = expert_matrices(raw, int(qtype), 4, 16, 64)
    for e, part in enumerate(parts):
        assert np.shares_memory(part.data, raw) and part.type_name == type_name
        expected = quants.dequantize(quants.quantize(w[e], qtype), qtype)
        np.testing.assert_array_equal(part.dequantize().numpy(), expected)
    with pytest.raises(ValueError, match="experts"):
        expert_matrices(raw[:-1], int(qtype), 4, 16, 64)
