"""`pdserve calc` / pdserve.roofline: the seed's 7B example, SmolLM2 from its GGUF header, KV capacity, presets,
--measure and the CLI report. Fast: no model weights are loaded (the GGUF is read up to its tensor infos only)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time

import pytest
import torch

from pdserve.config import ModelArchConfig
from pdserve.roofline import (
    DEVICE_PRESETS,
    Cost,
    DeviceSpec,
    RooflineMeter,
    StepCostModel,
    add_calc_parser,
    count_params,
    decode_compute_bound_batch,
    decode_cost,
    device_preset,
    kv_bytes_per_token,
    kv_capacity,
    measure_device,
    model_params,
    model_shape_from,
    prefill_cost,
    resolve_device_peaks,
)

SEED_PARAMS = 7_000_000_000
SEED_WEIGHT_BYTES = SEED_PARAMS * 2  # fp16


def run_cli(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_calc_parser(parser.add_subparsers())
    args = parser.parse_args(["calc", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def seed() -> ModelArchConfig:
    return model_shape_from("seed-7b")


def test_seed_7b_kv_per_token_is_128_kib(seed: ModelArchConfig) -> None:
    assert kv_bytes_per_token(seed, 2) == 128 * 1024
    assert kv_bytes_per_token(seed, 2) == seed.kv_bytes_per_token(torch.float16)  # agrees with the engine's formula
    assert model_params("seed-7b", seed) == SEED_PARAMS
    assert model_params("llama-7b-gqa", seed) == SEED_PARAMS  # alias
    assert model_params("seed-7b", seed, override=6e9) == 6_000_000_000


def test_seed_7b_prefill_4096(seed: ModelArchConfig) -> None:
    c = prefill_cost(seed, 4096, SEED_WEIGHT_BYTES, 2, params=SEED_PARAMS)
    assert c.flops == pytest.approx(57.3e12, rel=0.002)
    assert c.bytes == pytest.approx(14.5e9, rel=0.01)
    assert c.intensity == pytest.approx(3950, rel=0.02)
    assert c.bytes == c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes
    h100 = device_preset("H100")
    assert c.bound(h100) == "compute" and c.floor_s(h100) == c.compute_floor_s(h100)


def test_seed_7b_decode_batch_1_and_32(seed: ModelArchConfig) -> None:
    d1 = decode_cost(seed, 1, 4096, SEED_WEIGHT_BYTES, 2, params=SEED_PARAMS)
    assert d1.flops == pytest.approx(14e9)
    assert d1.intensity == pytest.approx(0.97, rel=0.03)
    d32 = decode_cost(seed, 32, 4096, SEED_WEIGHT_BYTES, 2, params=SEED_PARAMS)
    assert d32.flops == pytest.approx(448e9)
    assert d32.bytes == pytest.approx(30e9, rel=0.05)
    assert d32.intensity == pytest.approx(15, rel=0.10)
    for device in DEVICE_PRESETS.values():
        assert d1.bound(device) == d32.bound(device) == "bandwidth"
        assert d1.floor_s(device) == d1.bandwidth_floor_s(device)


def test_attention_flops_are_reported_beside_the_seed_rule(seed: ModelArchConfig) -> None:
    heads_dims = seed.num_hidden_layers * seed.num_attention_heads * seed.head_dim
    p = prefill_cost(seed, 4096, SEED_WEIGHT_BYTES, 2, params=SEED_PARAMS)
    assert p.attn_flops == 2 * 4096 * 4097 * heads_dims  # causal: sum over i of 4·d·(i+1)
    d = decode_cost(seed, 8, 1000, SEED_WEIGHT_BYTES, 2, params=SEED_PARAMS)
    assert d.attn_flops == 4 * 8 * 1001 * heads_dims
    assert d.intensity == d.flops / d.bytes < d.intensity_with_attention  # headline stays on the 2·P rule


def test_params_counted_from_the_shape(seed: ModelArchConfig) -> None:
    # Llama-2-7B (MHA) is 6.74e9 parameters, Mistral-7B 7.24e9, Llama-3-8B 8.03e9
    assert count_params(model_shape_from("llama-2-7b")) == 6_738_415_616
    assert count_params(model_shape_from("mistral-7b")) == 7_241_732_096
    assert count_params(model_shape_from("llama-3-8b")) == 8_030_261_248
    assert count_params(seed) == pytest.approx(5.93e9, rel=0.001)  # the seed's dims; 7e9 is pinned by the preset
    tied = ModelArchConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)
    # embed 800; q 64 + k 32 + v 32 + o 64; mlp 3·8·16 = 384; 2 norms 16; final norm 8
    assert count_params(tied) == 800 + 192 + 384 + 16 + 8
    assert count_params(ModelArchConfig(**{**tied.__dict__, "tie_word_embeddings": False})) == 1400 + 800
    qwen2 = ModelArchConfig(**{**tied.__dict__, "attention_bias": True})
    assert count_params(qwen2) == count_params(tied) + 8 + 4 + 4
    qwen3 = ModelArchConfig(**{**tied.__dict__, "qk_norm": True})
    assert count_params(qwen3) == count_params(tied) + 8


def test_smollm2_from_gguf_header() -> None:
    t0 = time.perf_counter()
    arch = model_shape_from("smollm2-135m")
    assert time.perf_counter() - t0 < 30.0  # header only, no tensor payloads
    assert model_shape_from(None) == arch
    assert (arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim) == (30, 3, 64)
    assert arch.tie_word_embeddings
    assert count_params(arch) == 134_515_008  # = sum of the GGUF's tensor element counts
    assert kv_bytes_per_token(arch, 2) == 2 * 30 * 3 * 64 * 2 == 23040


def test_model_from_config_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_dir, by_file = model_shape_from(str(tmp_path)), model_shape_from(str(tmp_path / "config.json"))
    assert by_dir == by_file and by_dir.head_dim == 16 and by_dir.attention_bias
    with pytest.raises(FileNotFoundError):
        model_shape_from(str(tmp_path / "missing.gguf"))


def test_kv_capacity(seed: ModelArchConfig) -> None:
    # 80 GB x 0.9 - 14 GB = 58 GB of KV at 128 KiB/token
    tokens, seqs = kv_capacity(seed, 80e9, SEED_WEIGHT_BYTES, 2, 4096, reserve_fraction=0.1)
    assert tokens == 58_000_000_000 // 131072 == 442_504
    assert seqs == tokens // 4096 == 108
    assert kv_capacity(seed, 80e9, SEED_WEIGHT_BYTES, 2, 4096, reserve_fraction=0.0) == (
        66_000_000_000 // 131072, 66_000_000_000 // 131072 // 4096)
    assert kv_capacity(seed, 10e9, SEED_WEIGHT_BYTES, 2, 4096) == (0, 0)  # the weights alone do not fit
    assert kv_capacity(seed, 80e9, SEED_WEIGHT_BYTES, 1, 4096)[0] == 58_000_000_000 // 65536  # fp8 KV: 64 KiB/token


def test_decode_compute_bound_batch(seed: ModelArchConfig) -> None:
    h100 = device_preset("h100")
    assert decode_compute_bound_batch(seed, 4096, SEED_WEIGHT_BYTES, 2, h100, SEED_PARAMS) is None  # KV grows too fast
    b = decode_compute_bound_batch(seed, 0, SEED_WEIGHT_BYTES, 2, h100, SEED_PARAMS)
    assert b is not None
    below, above = (decode_cost(seed, n, 0, SEED_WEIGHT_BYTES, 2, SEED_PARAMS) for n in (int(b), int(b) + 1))
    assert below.bound(h100) == "bandwidth" and above.bound(h100) == "compute"


def test_device_presets() -> None:
    assert {d.name for d in DEVICE_PRESETS.values()} == {"A100 80GB SXM", "H100 SXM", "H200 SXM", "L40S", "RTX 4090"}
    assert device_preset("RTX 4090") is device_preset("rtx-4090") is device_preset("4090")
    h100 = device_preset("H100")
    assert (h100.peak_flops, h100.mem_bandwidth, h100.memory) == (989e12, 3.35e12, 80e9)
    assert h100.balance == pytest.approx(295.2, rel=0.001)
    assert device_preset("a100").balance == pytest.approx(153, rel=0.01)
    with pytest.raises(ValueError, match="unknown device"):
        device_preset("TPU v9")
    cost = Cost(flops=2e12, bytes=1e9)
    assert cost.compute_floor_s(h100) == pytest.approx(2e12 / 989e12)
    assert cost.bandwidth_floor_s(h100) == pytest.approx(1e9 / 3.35e12)
    assert cost.bound(h100) == "compute" and cost.intensity == 2000  # 2000 FLOP/B > balance 295
    assert Cost(flops=2e11, bytes=1e9).bound(h100) == "bandwidth"  # 200 < 295


def test_measure_device_is_quick_and_positive() -> None:
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    dev = measure_device(threads=1, matmul_size=256, copy_bytes=8 * 2**20, repeats=2, budget_s=0.2)
    assert time.perf_counter() - t0 < 5.0
    assert torch.get_num_threads() == threads  # restored
    by_dtype = dict(dev.flops_by_dtype)
    assert set(by_dtype) == {"float32", "bfloat16"} and all(f > 0 for f in by_dtype.values())
    assert dev.peak_flops == max(by_dtype.values())
    assert dev.mem_bandwidth > 0 and dev.memory > 2**30 and dev.balance > 0
    only = measure_device(threads=1, dtype=torch.float32, matmul_size=128, copy_bytes=2**20, repeats=1, budget_s=0.1)
    assert [k for k, _ in only.flops_by_dtype] == ["float32"]


def test_cli_reports_the_seed_7b_example() -> None:
    out = run_cli("--model", "seed-7b", "--device", "h100", "--dtype", "fp16", "--batch", "1", "32")
    assert "128 KiB/token" in out and "7 B (pinned" in out
    assert "prefill N=4096: compute-bound (intensity 3945 ≫ balance 295.2)" in out
    assert "decode B=1 L=4096: bandwidth-bound (intensity 0.9631 ≪ balance 295.2)" in out
    assert "decode B=32 L=4096: bandwidth-bound (intensity 14.37 ≪ balance 295.2)" in out
    assert "442,504 tokens = 108 sequences of 4,096 tokens" in out
    assert "attention FLOPs" in out and "not in the seed's 2·P rule" in out


def test_cli_smollm2_json_and_quantized_weights() -> None:
    out = json.loads(run_cli("--device", "H200", "--batch", "1", "32", "--json"))
    assert out["model"] == "smollm2-135m" and out["params"] == 134_515_008
    assert out["kv_bytes_per_token"] == 23040 and out["weight_bytes"] == 134_515_008 * 2
    assert [p["phase"] for p in out["phases"]] == ["prefill N=4096", "decode B=1 L=4096", "decode B=32 L=4096"]
    assert [p["bound"] for p in out["phases"]] == ["compute", "bandwidth", "bandwidth"]
    assert out["device"]["name"] == "H200 SXM" and out["kv_capacity"]["max_seqs"] > 1000
    q4 = json.loads(run_cli("--weight-bits", "4", "--kv-dtype", "fp8", "--params", "1e8", "--json"))
    assert q4["weight_bytes"] == 1e8 * 4 / 8 and q4["kv_bytes_per_token"] == 23040 // 2


def test_cli_rejects_unknown_device_and_dtype() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        run_cli("--device", "abacus")
    with pytest.raises(ValueError, match="unknown dtype"):
        run_cli("--model", "seed-7b", "--dtype", "int3")


# ---- live roofline ---------------------------------------------------------------------------------------------


def test_step_cost_agrees_with_calc(seed: ModelArchConfig) -> None:
    """A whole-prompt prefill and a uniform decode step cost what `calc` says, once the lm_head is split out."""
    head = seed.vocab_size * seed.hidden_size
    layers = count_params(seed) - 2 * head - seed.hidden_size  # untied embeddings + lm_head, final norm
    layers -= seed.num_hidden_layers * 2 * seed.hidden_size  # per-layer norms are not matmul weights
    model = StepCostModel.for_model(seed, layers, 2 * layers, head, 2 * head, 0, kv_dtype_bytes=2)
    n = 512
    flops, nbytes = model.cost([(0, n)], num_sampled=1)
    pre = prefill_cost(seed, n, weight_bytes=2 * (layers + head), kv_dtype_bytes=2, params=layers + head)
    assert flops == pre.attn_flops + 2 * layers * n + 2 * head  # logits only for the sampled row
    assert nbytes == pre.bytes
    b, ctx = 8, 300
    flops, nbytes = model.cost([(ctx, 1)] * b, num_sampled=b)
    dec = decode_cost(seed, b, ctx, weight_bytes=2 * (layers + head), kv_dtype_bytes=2, params=layers + head)
    assert flops == dec.flops + dec.attn_flops and nbytes == dec.bytes
    assert model.cost([], 0) == (0.0, 0.0)
    # a chunk after a cached prefix: queries meet the prefix plus the causal part of the chunk
    chunk, _ = model.cost([(100, 10)], num_sampled=0)
    assert chunk == 2 * layers * 10 + model.attn_flops_per_pair * (10 * 100 + 55)


def test_roofline_meter_mfu_mbu() -> None:
    dev = DeviceSpec("test", 1e11, 1e10, 0.0, (("float32", 2e11), ("bfloat16", 1e11)))
    meter = RooflineMeter(dev, torch.float32)
    assert meter.peak_flops == 2e11  # the compute dtype's own peak
    assert meter.utilization(2e10, 1e9, 0.5) == (0.2, 0.2)
    meter.add("decode", 0.1, 1e9, 5e8)
    meter.add("decode", 0.1, 1e9, 5e8)
    meter.add("prefill", 1.0, 1e11, 1e9)
    s = meter.summary()
    assert s["decode"]["steps"] == 2 and s["decode"]["mfu"] == pytest.approx(0.05)
    assert s["decode"]["mbu"] == pytest.approx(0.5) and s["decode"]["nearer_roof"] == "bandwidth"
    assert s["prefill"]["mfu"] == pytest.approx(0.5) and s["prefill"]["nearer_roof"] == "compute"
    assert "mfu" not in RooflineMeter(None, torch.float32).summary().get("decode", {})


def test_resolve_device_peaks(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pdserve.roofline as rl

    assert resolve_device_peaks("off") is None
    given = resolve_device_peaks("1.5e11, 2e10")
    assert given is not None and (given.peak_flops, given.mem_bandwidth) == (1.5e11, 2e10)
    h100 = resolve_device_peaks("H100")
    assert h100 is not None and h100.peak_flops == 989e12
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(threads: int, **kw: object) -> DeviceSpec:
        calls.append(threads)
        return DeviceSpec("fake", 1e11, 1e10, 1.0, (("float32", 1e11),))

    monkeypatch.setattr(rl, "measure_device", fake_measure)
    first = resolve_device_peaks("auto", threads=2)
    second = resolve_device_peaks("auto", threads=2)  # from the cache file
    assert calls == [2] and first == second and (tmp_path / "device-peaks.json").exists()
    resolve_device_peaks("auto", threads=1)  # another thread count is another measurement
    assert calls == [2, 1]


def test_engine_reports_live_roofline(make_llm) -> None:  # type: ignore[no-untyped-def]
    from pdserve import SamplingParams

    llm = make_llm(device_peaks="1e11,1e10")
    steps: list = []
    llm.generate(["Hello there", "你好，世界"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                 on_step=steps.append)
    eng = llm.engine
    s = eng.roofline.summary()
    assert set(s) >= {"prefill", "decode"}
    for row in s.values():
        assert row["mfu"] == pytest.approx(row["flops_per_s"] / 1e11, rel=1e-3)
        assert row["mbu"] == pytest.approx(row["bytes_per_s"] / 1e10, rel=1e-3)
    last = steps[-1]
    assert last.kind == "decode" and last.flops > 0 and 0 < last.model_time <= last.duration
    assert last.mfu == pytest.approx(last.flops / last.model_time / 1e11)
