"""Phi-3 / Phi-3.5 / Phi-4-mini: transformers' Phi3ForCausalLM on tiny random configs (fused qkv and gate_up in the
checkpoint, LongRoPE with short and long factors and its attention factor, Phi-4-mini's partial rotary, a sliding
window) against pdserve's PyTorch and native paths: logits close and greedy tokens equal, with prompts shorter and
longer than original_max_position_embeddings and generations that cross it.

LongRoPE's factor set is chosen per position here (model/layers/rotary.py); transformers chooses per forward call.
The reference therefore runs transformers with its calls cut at the original length (the prompt's first ORIG tokens,
then the rest, then one token per call), where the two agree."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from test_loader import BOS, EOS, VOCAB_SIZE, hf_model_from, logits, write_gguf
from test_native_program import assert_program_equals_definition, native_runner

from pdserve import SamplingParams, kernels
from pdserve.config import ModelArchConfig
from pdserve.model.attention import SDPABackend
from pdserve.model.inputs import ScheduledRequest, SchedulerOutput
from pdserve.model.layers.rotary import RotaryEmbedding
from pdserve.model.loader import load_gguf
from pdserve.model.native_ops import KernelSelection
from pdserve.model.runner import ModelRunner

from conftest import generate_twice, loaded_from_hf

ORIG = 32  # original_max_position_embeddings of the tiny configs
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
HEAD_DIM = 16


def longrope(rot: int, long_scale: float = 1.0) -> dict[str, Any]:
    half = rot // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIG,
            "short_factor": [1.0 + 0.0625 * i for i in range(half)],  # exact in float32, as GGUF stores them
            "long_factor": [long_scale * (1.0 + 0.875 * i) for i in range(half)]}


CONFIGS: dict[str, dict[str, Any]] = {
    # Phi-3.5/4-mini-like: LongRoPE, 3/4 of each head rotated (the factors cover the rotary dims)
    "longrope_partial": {"rope_scaling": {**longrope(12), "partial_rotary_factor": 0.75}},
    "longrope": {"rope_scaling": longrope(HEAD_DIM)},
    # Phi-3-mini-4k-like: plain rope and a sliding window on every layer
    "window": {"sliding_window": 20},
}


def make_phi3(name: str, seed: int = 0, **overrides: Any) -> Any:
    kw: dict[str, Any] = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * ORIG,
                              original_max_position_embeddings=ORIG, rms_norm_eps=1e-5, tie_word_embeddings=False,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=None)
    kw.update(CONFIGS[name])
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    with torch.no_grad():  # peaked next-token distributions: greedy does not hinge on rounding between near-ties
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.35 if "embed" in pname else 0.25)
    return model


def hf_reference(model: Any, prompt: list[int], new: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' prompt logits and greedy tokens, its calls cut at ORIG (see the module docstring)."""
    cache = transformers.DynamicCache(config=model.config)
    pieces = [prompt[:ORIG], prompt[ORIG:]] if len(prompt) > ORIG else [prompt]
    rows, tokens = [], []
    with torch.no_grad():
        for piece in pieces:
            out = model(torch.tensor([piece]), cache=cache, use_cache=True)
            rows.append(out.logits[0])
        for _ in range(new):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
    return torch.cat(rows), tokens


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (20, 2 * ORIG - 7)]


def pdserve_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    blocks = list(range((len(prompt) + 15) // 16))
    inp = runner.prepare(SchedulerOutput([ScheduledRequest("x", prompt, 0, blocks, True)],
                                         num_prefill_tokens=len(prompt)))
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(inp.input_ids, inp.positions, runner.kv_cache, inp.meta))


def test_config_json_of_the_released_models() -> None:
    """A Phi-3.5/4-mini config.json (rope_scaling at the top level, original length and partial factor beside it)
    and transformers 5's rope_parameters give the same architecture; the attention factor's `factor` is
    max_position_embeddings / original_max_position_embeddings unless given."""
    new = make_phi3("longrope_partial").config.to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=10000.0, partial_rotary_factor=0.75, rope_scaling={
        "type": "longrope", "short_factor": new["rope_parameters"]["short_factor"],
        "long_factor": new["rope_parameters"]["long_factor"]})
    a, b = ModelArchConfig.from_hf_config(new), ModelArchConfig.from_hf_config(old)
    su = ModelArchConfig.from_hf_config({**old, "rope_scaling": {**old["rope_scaling"], "type": "su"}})  # its old name
    assert su == b
    assert a.architecture == b.architecture == "Phi3ForCausalLM"
    assert a.rotary_dim == b.rotary_dim == 12 and a.layer_types is None
    for arch in (a, b):
        assert arch.rope_scaling is not None
        assert arch.rope_scaling["original_max_position_embeddings"] == ORIG and arch.rope_scaling["factor"] == 4.0
        assert arch.rope_scaling["long_factor"] == new["rope_parameters"]["long_factor"]
    w = ModelArchConfig.from_hf_config(make_phi3("window").config.to_dict())
    assert w.rope_scaling is None and w.rotary_dim == HEAD_DIM and [w.layer_window(i) for i in (0, 1)] == [20, 20]


def test_reference_depends_on_what_is_tested() -> None:
    """transformers' tokens change with the long factors, the partial rotary and the window, so the equality
    tests below could fail."""
    prompt = prompts()[1]
    for name, change in (("longrope", {"rope_scaling": longrope(HEAD_DIM, long_scale=0.5)}),
                         ("longrope_partial", {"partial_rotary_factor": 1.0, "rope_scaling": longrope(HEAD_DIM)}),
                         ("window", {"sliding_window": None})):
        ref = hf_reference(make_phi3(name), prompt, NEW)[1]
        assert hf_reference(make_phi3(name, **change), prompt, NEW)[1] != ref, name


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_logits_close(name: str, kernels_choice: str) -> None:
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_phi3(name)
    lm = loaded_from_hf(hf)
    runner = ModelRunner(lm.arch, lm.state_dict, torch.float32, num_blocks=16, block_size=16, max_model_len=256,
                         kernels=kernels_choice)
    for prompt in prompts():
        torch.testing.assert_close(pdserve_logits(runner, prompt), hf_reference(hf, prompt, 0)[0],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_greedy_matches_hf_batched_and_chunked(tokenizer: Any, make_llm: Any, name: str, kernels_choice: str) -> None:
    """A prompt below the original length whose generation crosses it, and one longer than it, prefilled in
    16-token chunks beside each other's decodes, then again from the prefix cache (per-position LongRoPE makes a
    cached block's K valid for any later request)."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_phi3(name)
    ps = prompts()
    ref = [hf_reference(hf, p, NEW)[1] for p in ps]
    llm = make_llm(hf_model=hf, kernels=kernels_choice, attention_backend="sdpa" if kernels_choice == "torch"
                   else "auto", max_num_batched_tokens=16, max_model_len=4 * ORIG, enable_prefix_caching=True)
    assert generate_twice(llm, ps, GREEDY, ref)[1].num_cached_tokens >= ORIG


@pytest.mark.skipif(not kernels.available(), reason="native kernels are not built")
@pytest.mark.parametrize("name", ["longrope_partial", "window"])
def test_native_program_is_the_definition(name: str) -> None:
    runner = native_runner(loaded_from_hf(make_phi3(name)))
    assert runner.model.program.ops().count("rotary") == 2
    assert_program_equals_definition(runner)


def test_rotary_dim_must_be_even_and_within_the_head() -> None:
    for dim in (3, HEAD_DIM + 2):
        with pytest.raises(ValueError, match="rotary_dim"):
            RotaryEmbedding(HEAD_DIM, 8, 10000.0, None, KernelSelection(SDPABackend()), rotary_dim=dim)


# ---------------------------------------------------------------------------------------------------------------------
# GGUF (llama.cpp's phi3: fused attn_qkv / ffn_up, LongRoPE factors as tensors, rope.dimension_count)
# ---------------------------------------------------------------------------------------------------------------------

def write_phi3_gguf(path: Path, model: Any, qtype: Any = lambda name, w: Q.F32) -> None:
    """As llama.cpp's converter writes Phi-3 (Phi3MiniModel): the keys it adds to the Llama family's."""
    cfg = model.config
    rope = cfg.rope_parameters

    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_dimension_count(int(HEAD_DIM * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    write_gguf(path, model, "phi3", qtype=qtype, extra=extra)


@pytest.mark.parametrize("name", ["longrope_partial", "window"])
def test_gguf_config_and_weights_are_transformers(name: str, tmp_path: Path) -> None:
    model = make_phi3(name, vocab_size=VOCAB_SIZE)
    write_phi3_gguf(tmp_path / "f32.gguf", model)
    lm = load_gguf(str(tmp_path / "f32.gguf"))
    ref = model.state_dict()
    assert set(lm.state_dict) == set(ref)
    for pname, w in lm.state_dict.items():
        torch.testing.assert_close(w, ref[pname], rtol=0, atol=0, msg=pname)
    want = ModelArchConfig.from_hf_config(model.config.to_dict())
    assert lm.arch == dataclasses.replace(want, bos_token_id=BOS, eos_token_id=EOS)
    ids = [BOS, *range(3, 3 + 2 * ORIG)]  # past the original length: transformers uses the long factors
    torch.testing.assert_close(logits(hf_model_from(lm), ids), logits(model, ids), rtol=1e-5, atol=1e-5)


def test_gguf_with_half_the_rope_factors_is_refused(tmp_path: Path) -> None:
    model = make_phi3("longrope", vocab_size=VOCAB_SIZE)

    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_orig_ctx_len(ORIG)
        w.add_tensor("rope_factors_long.weight", np.ones(HEAD_DIM // 2, dtype=np.float32))

    write_gguf(tmp_path / "half.gguf", model, "phi3", extra=extra)
    with pytest.raises(ValueError, match="rope_factors_short"):
        load_gguf(str(tmp_path / "half.gguf"))


@pytest.mark.skipif(not kernels.available(), reason="native kernels are not built")
def test_quantized_gguf_native_program(tmp_path: Path) -> None:
    """Q8_0 matrices packed as stored (the fused qkv and gate_up as one matrix each); the program is the definition
    and the logits stay close to transformers' on the dequantized weights."""
    model = make_phi3("longrope_partial", vocab_size=VOCAB_SIZE)
    write_phi3_gguf(tmp_path / "q.gguf", model, qtype=lambda name, w: Q.Q8_0)
    lm = load_gguf(str(tmp_path / "q.gguf"), keep_quantized=True)
    runner = native_runner(lm)
    assert {type(lm.state_dict[f"model.layers.0.{n}.weight"]).__name__
            for n in ("self_attn.qkv_proj", "mlp.gate_up_proj")} == {"GGUFMatrix"}
    assert_program_equals_definition(runner)
