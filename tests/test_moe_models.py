"""Qwen3-MoE, Qwen2-MoE (a shared expert) and Mixtral as whole models: transformers' Qwen3MoeForCausalLM /
Qwen2MoeForCausalLM / MixtralForCausalLM on tiny random configs against pdserve's native and PyTorch paths (greedy
tokens equal, prompts batched, chunked and then read from the prefix cache, the KV pool back at baseline), loaded
from memory (transformers 5's fused 3-D experts), from a Hugging Face directory (per-expert names, Mixtral's
block_sparse_moe) and from GGUF (qwen3moe, qwen2moe; llama with experts, 3-D `_exps` tensors and the older per-
expert tensors; F32 and Q8_0 experts, the latter read as stored)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_kernels_model import prefill_logits, rel_rms, runner_for
from test_loader import VOCAB_SIZE, write_gguf
from test_native_program import assert_program_equals_definition, native_runner

from pdserve import SamplingParams, kernels
from pdserve.config import ModelArchConfig
from pdserve.llm import LLM
from pdserve.model.layers.moe import SparseMoE
from pdserve.model.loader import LoadedModel, load_gguf, load_model
from pdserve.roofline.cost import active_params, count_params, decode_cost, expert_params

from conftest import TEST_DEVICE, hf_greedy, loaded_from_hf, make_tiny_hf_model

NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
needs_native = pytest.mark.skipif(not kernels.available(), reason="native kernels are not built")


def _prompts(tokenizer: Any) -> list[list[int]]:
    rng = random.Random(3)
    return [tokenizer.encode("Hello, my name is"), tokenizer.encode("你好，世界！请介绍一下杭州的西湖。" * 5),
            [rng.randrange(3, 49152) for _ in range(120)]]


def _llm(lm: LoadedModel, tokenizer: Any, kernels_choice: str) -> LLM:
    return LLM(loaded_model=lm, tokenizer=tokenizer, dtype="float32", device=TEST_DEVICE, device_peaks="off",
               num_kv_blocks=256, max_step_ms=0, kernels=kernels_choice, max_num_batched_tokens=64,
               enable_prefix_caching=True)


def _assert_greedy(llm: LLM, prompts: list[list[int]], ref: list[list[int]]) -> None:
    for _ in range(2):  # the second time, the prompts' full blocks come from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[2].num_cached_tokens > 0
    assert llm.engine.block_manager.is_at_baseline()


def test_config_fields() -> None:
    """Which layers are sparse, and the expert fields, as transformers' own classes decide them."""
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6, "decoder_sparse_step": 2,
            "mlp_only_layers": [3], "norm_topk_prob": True}
    cfg = ModelArchConfig.from_hf_config(qwen)
    assert cfg.moe_layers == (False, True, False, False, False, True) and cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 2, 6, True)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    renamed = {k: v for k, v in qwen.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert ModelArchConfig.from_hf_config(renamed).num_experts == 4
    mixtral = {**qwen, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "sliding_window": 32}
    cfg = ModelArchConfig.from_hf_config(mixtral)
    assert cfg.moe_layers == (True,) * 6 and cfg.norm_topk_prob and cfg.moe_intermediate_size == 16
    assert cfg.layer_types == ("sliding_attention",) * 6 and cfg.sliding_window == 32 and not cfg.qk_norm
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArchConfig.from_hf_config({**qwen, "num_experts_per_tok": 5})


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_tiny_matches_hf(tokenizer: Any, arch: str, kernels_choice: str) -> None:
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_tiny_hf_model(arch)
    prompts = _prompts(tokenizer)
    ref = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = _llm(loaded_from_hf(hf), tokenizer, kernels_choice)
    model = llm.engine.runner.model
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.layers]
    assert sparse == ([True, True] if arch == "mixtral" else [True, False, True])  # Qwen: mlp_only_layers
    assert (model.program is not None) == (kernels_choice == "native")  # routing is one op of the native program
    _assert_greedy(llm, prompts, ref)


def test_routing_matters(tokenizer: Any) -> None:
    """The reference depends on the routing (so the tests above could fail): renormalising the top-k weights, or
    choosing more experts, changes transformers' own greedy tokens."""
    prompt = _prompts(tokenizer)[2]
    ref = hf_greedy(make_tiny_hf_model("qwen3_moe"), prompt, NEW)
    assert hf_greedy(make_tiny_hf_model("qwen3_moe", norm_topk_prob=True), prompt, NEW) != ref
    assert hf_greedy(make_tiny_hf_model("qwen3_moe", num_experts_per_tok=3), prompt, NEW) != ref
    shared = make_tiny_hf_model("qwen2_moe")  # Qwen2-MoE's shared expert changes them too
    with torch.no_grad():
        for layer in shared.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate.weight.fill_(-30.0)  # sigmoid ~ 0: the shared expert off
    assert hf_greedy(shared, prompt, NEW) != hf_greedy(make_tiny_hf_model("qwen2_moe"), prompt, NEW)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_hf_directory(tokenizer: Any, tmp_path: Path, arch: str) -> None:
    """save_pretrained writes experts one by one (Qwen3: mlp.experts.E.gate_proj; Mixtral: block_sparse_moe.experts.
    E.w1/w3/w2), as the checkpoints people download are stored."""
    hf = make_tiny_hf_model(arch)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    assert any(".experts.0." in k for k in lm.state_dict)
    prompts = _prompts(tokenizer)
    _assert_greedy(_llm(lm, tokenizer, "torch"), prompts, [hf_greedy(hf, p, NEW) for p in prompts])


_LAYOUTS = {"qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"), "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
            "mixtral": ("mixtral", "MixtralForCausalLM"), "mixtral-per-expert": ("mixtral", "MixtralForCausalLM")}


@needs_native
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_gguf_f32_matches_hf(tokenizer: Any, tmp_path: Path, layout: str) -> None:
    kind, architecture = _LAYOUTS[layout]
    renorm = layout != "qwen2moe"  # llama.cpp's qwen2moe never renormalises (it has no key for it)
    hf = make_tiny_hf_model(kind, norm_topk_prob=renorm)
    write_gguf(tmp_path / "m.gguf", hf, layout)
    lm = load_gguf(str(tmp_path / "m.gguf"), keep_quantized=True)
    assert lm.arch.architecture == architecture
    assert lm.arch.moe_layers == ((True, True) if kind == "mixtral" else (True, False, True))
    assert lm.arch.norm_topk_prob == renorm and lm.arch.num_experts_per_tok == 2
    assert lm.arch.shared_expert_intermediate_size == (64 if kind == "qwen2_moe" else 0)
    prompts = _prompts(tokenizer)
    _assert_greedy(_llm(lm, tokenizer, "native"), prompts, [hf_greedy(hf, p, NEW) for p in prompts])


@needs_native
def test_gguf_quantized_experts_read_as_stored(tmp_path: Path) -> None:
    """Quantized 3-D experts are cut into per-expert views of the file and packed as stored (gate and up of
    different types in one fused matrix), each expert holding its own rows; the native model's logits match the
    PyTorch path's on the same file dequantized, up to the int8 rounding of its activations."""
    hf = make_tiny_hf_model("qwen3_moe", norm_topk_prob=True)
    types = {"gate_proj": Q.Q8_0, "up_proj": Q.Q4_0, "down_proj": Q.Q8_0}
    write_gguf(tmp_path / "q.gguf", hf, "qwen3moe",
               qtype=lambda name, w: next((q for k, q in types.items() if f"experts.{k}" in name), Q.F32))
    stored = load_gguf(str(tmp_path / "q.gguf"), keep_quantized=True)
    dequantized = load_gguf(str(tmp_path / "q.gguf"))
    native, ref = runner_for(stored, "native"), runner_for(dequantized, "torch")
    for layer in (0, 2):
        for e, expert in enumerate(native.model.layers[layer].mlp.experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            assert expert.gate_up_proj.packed.type_name == "Q8_0+Q4_0"
            sd = dequantized.state_dict
            want = torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]])
            assert torch.equal(expert.gate_up_proj.packed.dequantize(), want)
            assert torch.equal(expert.down_proj.packed.dequantize(), dequantized.state_dict[p + "down_proj.weight"])
    ids = [5, 17, 200, 33, 41, 9, 120, 77, 3, 250, 18, 64, 90, 11, 140, 7, 60, 21, 99]
    a, b = prefill_logits(native, ids), prefill_logits(ref, ids)
    assert rel_rms(a, b) <= 0.03
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@needs_native
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_native_program_is_the_definition(arch: str, tmp_path: Path) -> None:
    """The whole-stack program (its `moe` op) computes bit for bit what the layers compute op by op, on F32 and on
    Q8_0 experts read as stored; prefill rows, decode rows and a chunk with context in one step."""
    hf = make_tiny_hf_model(arch, vocab_size=VOCAB_SIZE)
    assert_program_equals_definition(native_runner(loaded_from_hf(hf)))
    write_gguf(tmp_path / "q.gguf", hf, {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}.get(arch, "mixtral"),
               qtype=lambda name, w: Q.Q8_0 if "experts" in name else Q.F32)
    assert_program_equals_definition(native_runner(load_gguf(str(tmp_path / "q.gguf"), keep_quantized=True)))


@needs_native
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_native_moe_op_matches_the_reference(tokens: int) -> None:
    """The native op (routing, experts, sums in slot order) against the layer's PyTorch definition on the same fp32
    weights: float rounding apart, the same outputs; experts no row chose do not matter."""
    hf = make_tiny_hf_model("qwen3_moe")
    native, ref = runner_for(loaded_from_hf(hf), "native"), runner_for(loaded_from_hf(hf), "torch")
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        a, b = native.model.layers[0].mlp(x), ref.model.layers[0].mlp(x)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_mistral_sliding_window(tokenizer: Any, kernels_choice: str) -> None:
    """Mistral 7B v0.1's config sets a sliding window on every layer: prompts longer than it match transformers."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_tiny_hf_model("mistral", sliding_window=24)
    prompts = _prompts(tokenizer)
    ref = [hf_greedy(hf, p, NEW) for p in prompts]
    assert ref[2] != hf_greedy(make_tiny_hf_model("mistral", sliding_window=None), prompts[2], NEW)
    _assert_greedy(_llm(loaded_from_hf(hf), tokenizer, kernels_choice), prompts, ref)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_roofline_counts_the_experts_a_step_reads(arch: str) -> None:
    """count_params is every stored parameter (transformers' own count); a token's FLOPs use k of E experts; a decode
    step's bytes count the experts its tokens are expected to choose, all of them only for a large batch."""
    hf = make_tiny_hf_model(arch)
    cfg = ModelArchConfig.from_hf_config(hf.config.to_dict())
    assert count_params(cfg) == sum(p.numel() for p in hf.parameters())
    k, n = cfg.num_experts_per_tok, cfg.num_experts
    assert active_params(cfg) == count_params(cfg) - expert_params(cfg) * (1 - k / n)
    wb = 4.0 * count_params(cfg)
    one, many = decode_cost(cfg, 1, 100, wb, 4), decode_cost(cfg, 512, 100, wb, 4)
    assert one.weight_bytes == pytest.approx(wb - 4.0 * expert_params(cfg) * (1 - k / n))
    assert many.weight_bytes == pytest.approx(wb) and one.flops == 2 * active_params(cfg)
    model = runner_for(loaded_from_hf(hf), "torch").step_cost_model()
    assert model.expert_params == expert_params(cfg) and model.expert_fraction == k / n
    flops_1, bytes_1 = model.cost([(100, 1)], 1)
    flops_2, bytes_2 = model.cost([(100, 1), (100, 1)], 2)
    assert flops_2 == pytest.approx(2 * flops_1)  # FLOPs scale with tokens ...
    expert_bytes_1 = model.expert_bytes * k / n  # ... the experts read do not: 2 tokens share some
    assert bytes_2 - bytes_1 == pytest.approx(model.expert_bytes * (k / n) * (1 - k / n) + model.kv_bytes_per_token
                                              * 101 + model.embed_row_bytes)
    assert expert_bytes_1 < model.expert_bytes


@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_lora_on_a_moe_model(tokenizer: Any, tmp_path: Path, kernels_choice: str) -> None:
    """Adapters on attention serve as on a dense model (PEFT's merged model's greedy tokens, beside base-model rows);
    weights for a sparse layer's MLP are refused with a coded error, never attached to the experts."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    from test_lora import make_adapter

    from pdserve.lora_request import LoRARequest, next_lora_id
    from pdserve.model.lora_peft import LoRAAdapterError, PEFTAdapter

    hf = make_tiny_hf_model("qwen3_moe")
    merged = make_adapter(hf, tmp_path / "a", 5, ["q_proj", "v_proj", "o_proj"])
    llm = LLM(loaded_model=loaded_from_hf(hf), tokenizer=tokenizer, dtype="float32", device=TEST_DEVICE,
              device_peaks="off", num_kv_blocks=256, max_step_ms=0, kernels=kernels_choice, enable_lora=True)
    prompt = _prompts(tokenizer)[0]
    lr = LoRARequest("a", next_lora_id(), str(tmp_path / "a"))
    out = llm.generate([prompt, prompt], GREEDY, lora_request=[lr, None])
    assert out[0].outputs[0].token_ids == hf_greedy(merged, prompt, NEW)
    assert out[1].outputs[0].token_ids == hf_greedy(hf, prompt, NEW)
    lora = llm.engine.runner.lora
    assert lora is not None
    bad = PEFTAdapter("x", 2, 1.0, {(0, "gate_proj"): (torch.zeros(2, 64), torch.zeros(32, 2))})
    with pytest.raises(LoRAAdapterError, match="sparse MoE") as e:
        lora.layout(99, bad)
    assert e.value.code == "invalid_lora_adapter"
    assert llm.engine.block_manager.is_at_baseline()


@needs_native
def test_bf16_default_path_close_to_fp32() -> None:
    """With native bf16 (the default dtype on such CPUs) every expert and the router are packed as bf16 and run in
    the native op: prompt logits stay close to the fp32 model's."""
    hf = make_tiny_hf_model("qwen2_moe")
    ids = [5, 17, 200, 33, 41, 9, 120, 77, 3, 250, 18, 64, 90, 11, 140, 7, 60, 21, 99]
    ref = prefill_logits(runner_for(loaded_from_hf(hf), "native"), ids)
    bf16 = runner_for(loaded_from_hf(hf), "native", dtype=torch.bfloat16)
    expert = bf16.model.layers[0].mlp.experts[0]
    assert expert.gate_up_proj.packed.type_name == "BF16" and bf16.model.program is not None
    got = prefill_logits(bf16, ids)
    assert rel_rms(got, ref) <= 0.05
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
