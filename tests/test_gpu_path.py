"""`--device cpu|cuda`: option checks, the CUDA memory plan with injected numbers, kernel and peaks resolution,
and the runner with the device passed explicitly (cpu here; the same code runs on cuda in benchmarks/gpu_check.sh).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_spec_decode import alphabet_model  # noqa: F401  (fixture)

from pdserve.config import EngineConfig
from pdserve.kernels import resolve_kernels
from pdserve.model.device import kv_cache_budget, resolve_device
from pdserve.model.inputs import ScheduledRequest, SchedulerOutput
from pdserve.model.runner import ModelRunner
from pdserve.roofline.devices import DEVICE_PRESETS
from pdserve.roofline.peaks import gpu_preset

from conftest import loaded_from_hf

GiB = 2**30


def test_device_option_is_checked() -> None:
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton")
    assert EngineConfig(device="cuda").torch_dtype == torch.bfloat16  # auto: bf16 on a GPU
    assert EngineConfig(device="cuda", dtype="float32").torch_dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_fails_clearly(make_llm: Any) -> None:
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is false"):
        resolve_device("cuda")
    with pytest.raises(RuntimeError, match="--device cpu"):
        make_llm(device="cuda")


def test_kernels_on_cuda_are_torch() -> None:
    assert resolve_kernels("auto", torch.float32, "cuda") == "torch"
    assert resolve_kernels("torch", torch.bfloat16, "cuda") == "torch"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kernels("native", torch.float32, "cuda")


def test_memory_plan_follows_vllm_utilization() -> None:
    """KV = utilization x total - what this process held - weights - profiled activations."""
    plan = kv_cache_budget(total=140 * GiB, free=139 * GiB, weights=16 * GiB, activations=3 * GiB, utilization=0.9,
                           used_before_load=GiB // 2)
    assert plan.budget == int(140 * GiB * 0.9)
    assert plan.kv_cache == int(140 * GiB * 0.9) - GiB // 2 - 16 * GiB - 3 * GiB
    per_block = 16 * 131072  # Llama-3-8B bf16: 128 KiB per token
    assert plan.num_blocks(per_block) == plan.kv_cache // per_block


def test_memory_plan_errors() -> None:
    with pytest.raises(ValueError, match="only 60.00 GiB are free"):  # another process holds 80 GiB
        kv_cache_budget(total=140 * GiB, free=60 * GiB, weights=GiB, activations=GiB, utilization=0.9)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        kv_cache_budget(total=24 * GiB, free=24 * GiB, weights=16 * GiB, activations=6 * GiB, utilization=0.9)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        kv_cache_budget(total=GiB, free=GiB, weights=0, activations=0, utilization=0)


@pytest.mark.parametrize(("name", "key"), [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                           ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                           ("NVIDIA L40S", "l40s")])
def test_gpu_preset_by_device_name(name: str, key: str) -> None:
    assert gpu_preset(name) is DEVICE_PRESETS[key]


def test_unknown_gpu_has_no_peaks() -> None:
    assert gpu_preset("Some Future GPU 9000") is None


def _runner(tiny_hf_model: Any, **kw: Any) -> ModelRunner:
    lm = loaded_from_hf(tiny_hf_model)
    kw.setdefault("device", "cpu")
    return ModelRunner(lm.arch, lm.state_dict, torch.float32, 64, 16, 512, "torch", **kw)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_runner_with_explicit_device_matches_default(tiny_hf_model: Any, backend: str) -> None:
    """device="cpu" passed explicitly: weights, KV cache and every step tensor on it, same logits as the default
    runner; a mixed step (decode + chunk with context) on both."""
    a, b = _runner(tiny_hf_model, attention_backend=backend), _runner(tiny_hf_model, attention_backend="sdpa")
    assert a.device == torch.device("cpu") and a.kv_cache.device == a.device
    assert a.kv_cache.shape[2] == 65  # 64 blocks + the scratch block
    assert all(p.device == a.device for p in a.model.parameters())
    steps = [SchedulerOutput([ScheduledRequest("x", list(range(5, 45)), 0, [3, 7, 1], True),
                              ScheduledRequest("y", list(range(9, 20)), 0, [2], True)], num_prefill_tokens=51),
             SchedulerOutput([ScheduledRequest("y", [21], 11, [2], True),
                              ScheduledRequest("x", list(range(45, 60)), 40, [3, 7, 1, 9], True)],
                             num_prefill_tokens=15, num_decodes=1)]
    for sched in steps:
        ia, ib = a.prepare(sched), b.prepare(sched)
        with torch.inference_mode():
            ha = a.model(ia.input_ids, ia.positions, a.kv_cache, ia.meta)
            hb = b.model(ib.input_ids, ib.positions, b.kv_cache, ib.meta)
        torch.testing.assert_close(ha, hb, rtol=1e-5, atol=1e-5)
        assert a.greedy_step(sched) == b.greedy_step(sched)


def test_profile_step_runs_on_cpu(tiny_hf_model: Any) -> None:
    """The profiling step the cuda memory plan measures: the largest step over many sequences; 0 bytes on cpu."""
    blocks = ModelRunner.profile_num_blocks(512, 64, 16)
    runner = _runner(tiny_hf_model)
    runner.allocate_kv_cache(blocks)
    assert runner.profile_activation_bytes(512, 64) == 0
    runner.allocate_kv_cache(10)
    assert runner.num_blocks == 10 and runner.kv_cache.shape[2] == 11


def test_quantization_and_native_kernels_are_cpu_only(tiny_hf_model: Any) -> None:
    lm = loaded_from_hf(tiny_hf_model)
    with pytest.raises(ValueError, match="CPU-only"):
        ModelRunner(lm.arch, lm.state_dict, torch.float32, 8, 16, 64, "torch", "int8", device="meta")


def test_nixl_memory_type_follows_the_cache_device() -> None:
    """NIXL registration and descriptors: VRAM with the GPU index for a cuda cache, DRAM for a host cache (no NIXL
    needed to decide)."""
    from pdserve.kv_transfer.nixl_connector import nixl_memory

    assert nixl_memory(torch.zeros(2, 3).device) == ("DRAM", 0)
    assert nixl_memory(torch.device("cuda", 1)) == ("VRAM", 1)  # a device object needs no GPU
    assert nixl_memory(torch.device("cuda", 0)) == ("VRAM", 0)
    with pytest.raises(ValueError, match="not meta"):
        nixl_memory(torch.device("meta"))


def test_bitmask_on_device_equals_xgrammar() -> None:
    """The structured-output mask the GPU path applies with torch ops equals xgrammar's CPU kernel, bit 31 and a
    vocabulary that is not a multiple of 32 included."""
    from pdserve.model.sampler import apply_token_bitmask, apply_token_bitmask_torch

    g = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [0, 2, 3]
    logits = torch.randn(5, vocab, generator=g)
    masks = [torch.randint(-2**31, 2**31 - 1, (-(-vocab // 32),), generator=g, dtype=torch.int32) for _ in rows]
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask(want, rows, masks)
    apply_token_bitmask_torch(got, rows, masks)
    assert torch.equal(got, want)
    assert got[1].isfinite().all() and not got[0].isfinite().all()


def test_cli_flags() -> None:
    """The new options are flags of every command line (serve here), through the one option machinery."""
    from pdserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--device", "cuda", "--gpu-memory-utilization", "0.8",
                                      "--enforce-eager", "--attention-backend", "sdpa"])
    cfg = engine_config_from_args(args)
    assert (cfg.device, cfg.gpu_memory_utilization, cfg.enforce_eager, cfg.attention_backend) == \
        ("cuda", 0.8, True, "sdpa")
    default = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert (default.device, default.enforce_eager, default.attention_backend) == ("cpu", False, "auto")


def test_engine_sizes_the_cache_from_a_memory_plan(make_llm: Any) -> None:
    """The engine's glue on cuda (profile, plan, reallocate) with injected device memory: on cpu the profiled
    activations are 0, so KV blocks = (0.9 x total - weights) / bytes per block - the scratch block."""
    engine = make_llm().engine
    total = 64 * 2**20
    engine._size_kv_cache_from_device(engine.config, total, total)
    per_block = engine.block_size * engine.arch.kv_bytes_per_token(torch.float32)
    assert engine.runner.num_blocks == (int(total * 0.9) - engine.runner.weight_bytes) // per_block - 1
    assert engine.runner.kv_cache.shape[2] == engine.runner.num_blocks + 1


def test_speculative_decoding_through_flex_and_graphs(make_llm: Any, tokenizer: Any,
                                                     alphabet_model: Any) -> None:  # noqa: F811
    """Multi-token decode rows (drafts verified) through FlexBackend, plain decodes through the decode-graph twin:
    the same greedy output as the sdpa path without speculation (test_spec_decode's repetitive model and prompts)."""
    from test_spec_decode import GREEDY, NGRAM, _repetitive, _run, _texts

    base = make_llm(alphabet_model, kernels="torch", max_num_batched_tokens=96)
    prompts = _texts(tokenizer) + [_repetitive(base, tokenizer)]
    want = _run(base, prompts, GREEDY)
    spec = make_llm(alphabet_model, kernels="torch", attention_backend="flex", max_num_batched_tokens=96,
                    speculative_config=NGRAM)
    spec.engine.runner.enable_decode_graphs()
    graphs = spec.engine.runner.decode_graphs
    assert _run(spec, prompts, GREEDY) == want
    assert spec.engine.spec.stats.num_accepted_tokens > 0 and graphs is not None and graphs.replays > 0
