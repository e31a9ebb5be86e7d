"""The native kernels inside the model: the build is present (CI fails without it), GGUF matrices of every type
pack_gguf takes (K-quants included, fused parts of different types stacked) are packed as stored and run as the
Linear modules' packed weights, float checkpoints as pack_float bf16/f32 by the dtype, `--quantization int8|int4` on
a float checkpoint, each ISA path gives the same answer, and the native model agrees with the PyTorch reference path
on the same weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from kernel_levels import ALL_LEVELS, LEVELS, machine_levels
from test_loader import tiny_model, write_gguf

from pdserve import SamplingParams, kernels
from pdserve.model.loader import load_gguf
from pdserve.model.packed_weights import GGUFMatrix, weight_formats
from pdserve.model.runner import ModelRunner

ISAS = list(LEVELS)


def machine_isas() -> list[str]:
    return machine_levels(LEVELS)


def test_native_build_is_present_and_reports_its_path() -> None:
    # CI runs this: a broken or missing native build fails here instead of hiding behind the PyTorch fallback.
    assert kernels.available(), "native kernels not built: run `make install` (python -m pdserve.kernels)"
    mod = kernels.require()
    assert mod.cpu_isa() in ALL_LEVELS and kernels.isa() in machine_levels()
    # auto is native whatever the dtype the native kernels store (weights and KV in float32 or bfloat16)
    assert kernels.resolve_kernels("auto", torch.float32) == "native"
    assert kernels.resolve_kernels("auto", torch.bfloat16) == "native"
    assert kernels.resolve_kernels("auto", torch.float16) == "torch"
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.resolve_kernels("native", torch.float16)


def test_calc_measure_says_what_auto_runs() -> None:
    from pdserve.config import parse_dtype
    from pdserve.roofline.calc_cli import auto_choice

    line = auto_choice()
    dtype = str(parse_dtype("auto")).removeprefix("torch.")
    assert line.startswith(f"--kernels auto: native; --dtype auto: {dtype} (") and "pack_gguf" in line
    assert ("pack_float bf16" if dtype == "bfloat16" else "pack_float f32") in line


def test_isa_can_be_lowered_by_environment() -> None:
    code = "import pdserve.kernels as k; k.require(); print(k.isa())"
    env = {**os.environ, kernels.ISA_ENV: "generic"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "generic"


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_path_says_each_rows_kernel(level: str) -> None:
    """The start-up log's attention line, per level: prompt rows on the bf16 dot-product kernel where the level has
    one (AMX tiles, vdpbf16ps; int8 caches too), else on fp32 FMAs in transposed tiles from avx512 up; generated rows
    by the level's group threshold (vdpbf16ps: on rows as stored below G = 8, in transposed tiles from it); fp32
    row kernels for other caches, head sizes and soft-capping."""
    from kernel_levels import lowered, module

    tiles = "AVX-512 FMA in transposed key tiles"
    for _ in lowered(module(), level):
        prompt, generated = kernels.attention_path("bfloat16", 3, 64)
        if level == "amx":
            assert prompt == "AMX-BF16 tiles" and generated.startswith("fp32") and "below 4" in generated
            assert kernels.attention_path("bfloat16", 4, 128) == ("AMX-BF16 tiles", "AMX-BF16 tiles")
        elif level == "avx512_bf16":
            assert prompt == "AVX512-BF16 vdpbf16ps" and generated == "AVX512-BF16 vdpbf16ps on rows as stored"
            assert kernels.attention_path("bfloat16", 8, 128) == ("AVX512-BF16 vdpbf16ps",) * 2
        elif level == "avx512":
            assert prompt == tiles and generated.startswith("fp32 dot products (avx512)")
        else:
            assert prompt == generated and generated.startswith(f"fp32 dot products ({level})")
        bf16_dots = level in ("avx512_bf16", "amx")
        for args, want in ((("float32", 3, 64, False), tiles), (("int8", 3, 64, False),
                                                                 "AVX512-BF16 vdpbf16ps" if bf16_dots else tiles),
                           (("bfloat16", 3, 256, False), None), (("bfloat16", 3, 64, True), None)):
            prompt, generated = kernels.attention_path(*args)
            assert generated.startswith("fp32 dot products"), args
            if want is None or level in ("generic", "avx2"):
                assert prompt == generated, args
            else:
                assert prompt == want, args


@pytest.fixture(scope="module")
def q41_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = tiny_model("llama", seed=3)
    path = tmp_path_factory.mktemp("q41") / "q41.gguf"

    def qtype(name: str, w: Any) -> Q:
        return Q.Q8_0 if "embed" in name or "lm_head" in name else Q.Q4_1

    write_gguf(path, model, "llama", qtype=qtype)
    return model, path


def runner_for(loaded: Any, kernels_choice: str, quantization: str | None = None,
               dtype: torch.dtype = torch.float32) -> ModelRunner:
    return ModelRunner(loaded.arch, loaded.state_dict, dtype, num_blocks=64, block_size=16,
                       max_model_len=256, kernels=kernels_choice, quantization=quantization)


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, through the runner's own forward (varlen or SDPA metadata)."""
    from pdserve.model.inputs import ScheduledRequest, SchedulerOutput

    sched = SchedulerOutput()
    sched.scheduled_reqs = [ScheduledRequest("r", ids, 0, list(range(-(-len(ids) // 16))), True)]
    sched.num_prefill_tokens = len(ids)
    inp = runner.prepare(sched)
    with torch.inference_mode():
        hidden = runner.model(inp.input_ids, inp.positions, runner.kv_cache, inp.meta)
        return runner.model.compute_logits(hidden)


def test_gguf_blocks_stay_blocks_and_agree_with_dequantized_reference(q41_gguf: tuple[Any, Path]) -> None:
    _, path = q41_gguf
    loaded = load_gguf(str(path), keep_quantized=True)
    matrix = loaded.state_dict["model.layers.0.mlp.down_proj.weight"]
    # read as stored: a view into the file, no copy
    assert isinstance(matrix, GGUFMatrix) and not matrix.data.flags.owndata and not matrix.data.flags.writeable
    native = runner_for(loaded, "native")
    ref = runner_for(load_gguf(str(path)), "torch")  # the same Q4_1/Q8_0 weights, dequantized to fp32
    lib = kernels.require()
    layer = native.model.layers[0]
    qkv = layer.self_attn.qkv_proj.packed
    assert isinstance(qkv, lib.PackedWeight) and qkv.type_name == "Q4_1"
    assert native.model.embed_tokens.packed.type_name == native.model.lm_head.packed.type_name == "Q8_0"
    assert weight_formats(native.model) == {"Q4_1": 8, "Q8_0": 2}
    assert native.model.program is not None  # the whole stack runs as one native program
    # the live roofline counts the bytes of the blocks, and the same number of weights
    assert native.step_cost_model().layer_weight_bytes < ref.step_cost_model().layer_weight_bytes / 5
    assert native.step_cost_model().layer_params == ref.step_cost_model().layer_params
    ids = [5, 17, 200, 33, 41, 9, 120, 77, 3, 250, 18, 64, 90, 11, 140, 7, 60, 21, 99]
    a, b = prefill_logits(native, ids), prefill_logits(ref, ids)
    # the only difference is int8 activation rounding inside the native matmuls
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


K_QUANT_MIX = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_K, "gate_proj": Q.Q4_K,
               "up_proj": Q.IQ4_XS, "down_proj": Q.Q3_K, "embed_tokens": Q.Q2_K, "lm_head": Q.Q6_K}


def test_k_quants_are_packed_as_stored(tmp_path: Path) -> None:
    """A Q4_K_M-like file: every matrix is read as stored, q/k/v of different types are stacked into one qkv
    projection, and the native model matches the PyTorch path on the dequantized weights."""
    model = tiny_model("llama", seed=4, hidden_size=256, intermediate_size=512)
    path = tmp_path / "kq.gguf"
    write_gguf(path, model, "llama", qtype=lambda name, w: next(q for k, q in K_QUANT_MIX.items() if k in name))
    native = runner_for(load_gguf(str(path), keep_quantized=True), "native")
    ref = runner_for(load_gguf(str(path)), "torch")
    attn, mlp = native.model.layers[0].self_attn, native.model.layers[0].mlp
    assert attn.qkv_proj.packed.type_name == "Q4_K+Q6_K" and mlp.gate_up_proj.packed.type_name == "Q4_K+IQ4_XS"
    assert weight_formats(native.model) == {"Q4_K": 4, "Q6_K": 3, "Q5_K": 2, "IQ4_XS": 2, "Q3_K": 2, "Q2_K": 1}
    ids = [5, 17, 200, 33, 41, 9, 120, 77, 3, 250, 18, 64, 90, 11, 140, 7, 60, 21, 99]
    a, b = prefill_logits(native, ids), prefill_logits(ref, ids)
    assert rel_rms(a, b) <= 0.03
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_float_checkpoint_packed_by_dtype(tiny_hf_model: Any) -> None:
    """Float weights become pack_float bf16 (dtype bfloat16) or f32 (float32); norms stay float32 (activations
    are float32); the KV cache takes the dtype; f32 matches the PyTorch path to float rounding."""
    from conftest import loaded_from_hf

    loaded = loaded_from_hf(tiny_hf_model)
    ids = list(range(40, 80))
    ref = prefill_logits(runner_for(loaded, "torch"), ids)
    for dtype, fmt, tol in [(torch.float32, "F32", 1e-4), (torch.bfloat16, "BF16", 0.03)]:
        runner = runner_for(loaded, "native", dtype=dtype)
        assert set(weight_formats(runner.model)) == {fmt}
        assert runner.kv_cache.dtype == dtype and runner.model.norm.weight.dtype == torch.float32
        assert runner.model.program is not None
        assert rel_rms(prefill_logits(runner, ids), ref) <= tol


def dequantized(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    """w rounded through `qtype` blocks by gguf's reference quantizer."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.float().numpy(), qtype), qtype).copy())


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_of_a_float_checkpoint(method: str, tiny_hf_model: Any) -> None:
    """`--quantization int8|int4` turns every projection into Q8_0 / Q4_1 blocks; the native model then matches the
    PyTorch path on the same (dequantized) block weights up to its int8 activation rounding. The weights' own
    rounding is the quantization's cost (large on this tiny random model: printed, not asserted)."""
    import copy

    from conftest import loaded_from_hf

    loaded = loaded_from_hf(tiny_hf_model)
    q = runner_for(loaded, "native", method)
    qtype = Q.Q8_0 if method == "int8" else Q.Q4_1
    down = q.model.layers[0].mlp.down_proj.packed
    assert down.type_name == qtype.name
    same_weights = copy.copy(loaded)
    same_weights.state_dict = {k: dequantized(v, qtype) if v.dim() == 2 and "embed" not in k
                               else v for k, v in loaded.state_dict.items()}
    ref = runner_for(same_weights, "torch")
    # int8 activations at every row count: their rounding is amplified by this random model's layers. (The
    # reference's tied lm_head keeps the float embedding; the quantized model's lm_head is blocks.)
    for ids, tol in [(list(range(40, 80)), 0.06 if method == "int8" else 0.15),
                     (list(range(40, 140)), 0.06 if method == "int8" else 0.15)]:
        a, b = prefill_logits(q, ids), prefill_logits(ref, ids)
        assert rel_rms(a, b) <= tol
    fp32 = prefill_logits(runner_for(loaded, "torch"), ids)
    print(f"{method}: logits vs fp32 weights, relative RMS {rel_rms(a, fp32):.3f}")
    with pytest.raises(ValueError, match="int4"):
        runner_for(loaded, "torch", "int4")


def test_every_isa_path_gives_the_same_logits(q41_gguf: tuple[Any, Path]) -> None:
    _, path = q41_gguf
    runner = runner_for(load_gguf(str(path), keep_quantized=True), "native")
    mod = kernels.require()
    before = mod.active_isa()
    ids = list(range(30, 75))
    try:
        results = {}
        for level in machine_isas():
            mod.set_active_isa(level)
            results[level] = prefill_logits(runner, ids)
    finally:
        mod.set_active_isa(before)
    base = results["generic"]
    for level, logits in results.items():
        torch.testing.assert_close(logits, base, rtol=1e-4, atol=1e-4 * float(base.abs().max()), msg=level)


def test_native_engine_greedy_equals_torch_engine_on_gguf_blocks(q41_gguf: tuple[Any, Path], tokenizer: Any) -> None:
    """Mixed batches with chunked prefill and decodes: the native engine's greedy tokens equal those of the PyTorch
    path running the same packed block weights (so only the attention, norms, RoPE and KV writes differ)."""
    from pdserve.llm import LLM

    _, path = q41_gguf
    outs = {}
    for choice in ("native", "torch"):
        loaded = load_gguf(str(path), keep_quantized=True)
        llm = LLM(loaded_model=loaded, tokenizer=tokenizer, dtype="float32", device_peaks="off", num_kv_blocks=128,
                  max_num_batched_tokens=48, kernels=choice, max_step_ms=0)
        prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(n)]}
                   for i, n in enumerate([5, 40, 90, 17])]
        res = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        outs[choice] = [r.outputs[0].token_ids for r in res]
        assert llm.engine.block_manager.is_at_baseline()
    assert outs["native"] == outs["torch"]

