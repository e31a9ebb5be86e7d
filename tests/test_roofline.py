"""`pdserve calc` / pdserve.roofline: the 7B example, SmolLM2 from its GGUF header, KV capacity, presets,
--measure and the CLI report, the live meter, and device peaks (measurement, cache, start-up probe, provenance).
Fast: no model weights are loaded (the GGUF is read up to its tensor infos only)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import time

import pytest
import torch

from pdserve.cache import cache_root
from pdserve.config import ModelArchConfig
from pdserve.roofline import (
    DEVICE_PRESETS,
    Cost,
    DeviceSpec,
    PeaksProvenance,
    RooflineMeter,
    StepCostModel,
    add_calc_parser,
    count_params,
    decode_compute_bound_batch,
    decode_cost,
    device_preset,
    kv_bytes_per_token,
    kv_capacity,
    load_cached_device,
    measure_device,
    model_params,
    model_shape_from,
    peaks,
    peaks_key,
    prefill_cost,
    resolve_device_peaks,
    save_measured_device,
)
from pdserve.roofline.measure import is_busy

EX_PARAMS = 7_000_000_000
EX_WEIGHT_BYTES = EX_PARAMS * 2  # fp16


def run_cli(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_calc_parser(parser.add_subparsers())
    args = parser.parse_args(["calc", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def example() -> ModelArchConfig:
    return model_shape_from("example-7b")


def test_example_7b_kv_per_token_is_128_kib(example: ModelArchConfig) -> None:
    assert kv_bytes_per_token(example, 2) == 128 * 1024
    assert kv_bytes_per_token(example, 2) == example.kv_bytes_per_token(torch.float16)  # as the engine counts it
    assert model_params("example-7b", example) == EX_PARAMS
    assert model_params("llama-7b-gqa", example) == model_params("seed-7b", example) == EX_PARAMS  # aliases
    assert model_params("example-7b", example, override=6e9) == 6_000_000_000


def test_example_7b_prefill_4096(example: ModelArchConfig) -> None:
    c = prefill_cost(example, 4096, EX_WEIGHT_BYTES, 2, params=EX_PARAMS)
    assert c.flops == pytest.approx(57.3e12, rel=0.002)
    assert c.bytes == pytest.approx(14.5e9, rel=0.01)
    assert c.intensity == pytest.approx(3950, rel=0.02)
    assert c.bytes == c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes
    h100 = device_preset("H100")
    assert c.bound(h100) == "compute" and c.floor_s(h100) == c.compute_floor_s(h100)


def test_example_7b_decode_batch_1_and_32(example: ModelArchConfig) -> None:
    d1 = decode_cost(example, 1, 4096, EX_WEIGHT_BYTES, 2, params=EX_PARAMS)
    assert d1.flops == pytest.approx(14e9)
    assert d1.intensity == pytest.approx(0.97, rel=0.03)
    d32 = decode_cost(example, 32, 4096, EX_WEIGHT_BYTES, 2, params=EX_PARAMS)
    assert d32.flops == pytest.approx(448e9)
    assert d32.bytes == pytest.approx(30e9, rel=0.05)
    assert d32.intensity == pytest.approx(15, rel=0.10)
    for device in DEVICE_PRESETS.values():
        assert d1.bound(device) == d32.bound(device) == "bandwidth"
        assert d1.floor_s(device) == d1.bandwidth_floor_s(device)


def test_attention_flops_are_reported_beside_the_2p_rule(example: ModelArchConfig) -> None:
    heads_dims = example.num_hidden_layers * example.num_attention_heads * example.head_dim
    p = prefill_cost(example, 4096, EX_WEIGHT_BYTES, 2, params=EX_PARAMS)
    assert p.attn_flops == 2 * 4096 * 4097 * heads_dims  # causal: sum over i of 4·d·(i+1)
    d = decode_cost(example, 8, 1000, EX_WEIGHT_BYTES, 2, params=EX_PARAMS)
    assert d.attn_flops == 4 * 8 * 1001 * heads_dims
    assert d.intensity == d.flops / d.bytes < d.intensity_with_attention  # headline stays on the 2·P rule


def test_params_counted_from_the_shape(example: ModelArchConfig) -> None:
    # Llama-2-7B (MHA) is 6.74e9 parameters, Mistral-7B 7.24e9, Llama-3-8B 8.03e9
    assert count_params(model_shape_from("llama-2-7b")) == 6_738_415_616
    assert count_params(model_shape_from("mistral-7b")) == 7_241_732_096
    assert count_params(model_shape_from("llama-3-8b")) == 8_030_261_248
    assert count_params(example) == pytest.approx(5.93e9, rel=0.001)  # the example's dims; 7e9 is pinned by the preset
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


def test_kv_capacity(example: ModelArchConfig) -> None:
    # 80 GB x 0.9 - 14 GB = 58 GB of KV at 128 KiB/token
    tokens, seqs = kv_capacity(example, 80e9, EX_WEIGHT_BYTES, 2, 4096, reserve_fraction=0.1)
    assert tokens == 58_000_000_000 // 131072 == 442_504
    assert seqs == tokens // 4096 == 108
    assert kv_capacity(example, 80e9, EX_WEIGHT_BYTES, 2, 4096, reserve_fraction=0.0) == (
        66_000_000_000 // 131072, 66_000_000_000 // 131072 // 4096)
    assert kv_capacity(example, 10e9, EX_WEIGHT_BYTES, 2, 4096) == (0, 0)  # the weights alone do not fit
    assert kv_capacity(example, 80e9, EX_WEIGHT_BYTES, 1, 4096)[0] == 58_000_000_000 // 65536  # fp8 KV: 64 KiB/token
    # 5 of every 6 layers with a 1024-token window: a 32k-token sequence holds 32k tokens in 1/6 of the layers only
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(36))
    local = dataclasses.replace(example, num_hidden_layers=36, layer_types=types, sliding_window=1024)
    per_seq = 131072 * 36 / 32 * (6 * 32768 + 30 * 1024) / 36
    assert kv_capacity(local, 80e9, EX_WEIGHT_BYTES, 2, 32768)[1] == int(58e9 // per_seq)
    assert kv_capacity(local, 80e9, EX_WEIGHT_BYTES, 2, 512)[1] == int(58e9 // (131072 * 36 / 32 * 512))


def test_decode_compute_bound_batch(example: ModelArchConfig) -> None:
    h100 = device_preset("h100")
    assert decode_compute_bound_batch(example, 4096, EX_WEIGHT_BYTES, 2, h100, EX_PARAMS) is None  # KV grows too fast
    b = decode_compute_bound_batch(example, 0, EX_WEIGHT_BYTES, 2, h100, EX_PARAMS)
    assert b is not None
    below, above = (decode_cost(example, n, 0, EX_WEIGHT_BYTES, 2, EX_PARAMS) for n in (int(b), int(b) + 1))
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
    prov = dev.provenance
    assert prov is not None and prov.source == "measured" and prov.threads == 1 and prov.measured_at.endswith("Z")
    assert "best of 3 runs" in prov.method and "copy 8 MiB" in prov.method and prov.cpu_share is not None
    assert prov.busy == is_busy(prov.load_avg, prov.cpu_share)  # either verdict: it depends on the machine's load
    only = measure_device(threads=1, dtype=torch.float32, matmul_size=128, copy_bytes=2**20, repeats=1, budget_s=0.1)
    assert [k for k, _ in only.flops_by_dtype] == ["float32"]


def test_cli_reports_the_7b_example() -> None:
    out = run_cli("--model", "example-7b", "--device", "h100", "--dtype", "fp16", "--batch", "1", "32")
    assert "128 KiB/token" in out and "7 B (pinned" in out
    assert "prefill N=4096: compute-bound (intensity 3945 ≫ balance 295.2)" in out
    assert "decode B=1 L=4096: bandwidth-bound (intensity 0.9631 ≪ balance 295.2)" in out
    assert "decode B=32 L=4096: bandwidth-bound (intensity 14.37 ≪ balance 295.2)" in out
    assert "442,504 tokens = 108 sequences of 4,096 tokens" in out
    assert "attention FLOPs" in out and "not in the 2·P rule" in out
    assert "peaks    datasheet" in out


def test_cli_smollm2_json_and_quantized_weights() -> None:
    out = json.loads(run_cli("--device", "H200", "--batch", "1", "32", "--json"))
    assert out["model"] == "smollm2-135m" and out["params"] == 134_515_008
    assert out["kv_bytes_per_token"] == 23040 and out["weight_bytes"] == 134_515_008 * 2
    assert [p["phase"] for p in out["phases"]] == ["prefill N=4096", "decode B=1 L=4096", "decode B=32 L=4096"]
    assert [p["bound"] for p in out["phases"]] == ["compute", "bandwidth", "bandwidth"]
    assert out["device"]["name"] == "H200 SXM" and out["kv_capacity"]["max_seqs"] > 1000
    q4 = json.loads(run_cli("--weight-bits", "4", "--kv-dtype", "fp8", "--params", "1e8", "--json"))
    # fp8 KV as pdserve stores it: 64 one-byte codes + a 2-byte scale per (token, KV head) row
    assert q4["weight_bytes"] == 1e8 * 4 / 8 and q4["kv_bytes_per_token"] == 23040 // 2 * 66 // 64


def test_cli_rejects_unknown_device_and_dtype() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        run_cli("--device", "abacus")
    with pytest.raises(ValueError, match="unknown dtype"):
        run_cli("--model", "example-7b", "--dtype", "int3")


# ---- live roofline ---------------------------------------------------------------------------------------------


def test_step_cost_agrees_with_calc(example: ModelArchConfig) -> None:
    """A whole-prompt prefill and a uniform decode step cost what `calc` says, once the lm_head is split out."""
    head = example.vocab_size * example.hidden_size
    layers = count_params(example) - 2 * head - example.hidden_size  # untied embeddings + lm_head, final norm
    layers -= example.num_hidden_layers * 2 * example.hidden_size  # per-layer norms are not matmul weights
    model = StepCostModel.for_model(example, layers, 2 * layers, head, 2 * head, 0, kv_dtype_bytes=2)
    n = 512
    flops, nbytes = model.cost([(0, n)], num_sampled=1)
    pre = prefill_cost(example, n, weight_bytes=2 * (layers + head), kv_dtype_bytes=2, params=layers + head)
    assert flops == pre.attn_flops + 2 * layers * n + 2 * head  # logits only for the sampled row
    assert nbytes == pre.bytes
    b, ctx = 8, 300
    flops, nbytes = model.cost([(ctx, 1)] * b, num_sampled=b)
    dec = decode_cost(example, b, ctx, weight_bytes=2 * (layers + head), kv_dtype_bytes=2, params=layers + head)
    assert flops == dec.flops + dec.attn_flops and nbytes == dec.bytes
    assert model.cost([], 0) == (0.0, 0.0)
    # a chunk after a cached prefix: queries meet the prefix plus the causal part of the chunk
    chunk, _ = model.cost([(100, 10)], num_sampled=0)
    assert chunk == 2 * layers * 10 + model.attn_flops_per_pair * (10 * 100 + 55)
    # sliding-window layers (half the layers, window 64) read their window only: a decode at context 300
    types = tuple("sliding_attention" if i % 2 else "full_attention" for i in range(example.num_hidden_layers))
    local = StepCostModel.for_model(dataclasses.replace(example, layer_types=types, sliding_window=64), layers,
                                    2 * layers, head, 2 * head, 0, kv_dtype_bytes=2)
    assert local.keys_read(300) == (300 + 64) / 2 and local.keys_read(40) == 40 and model.keys_read(300) == 300
    _, local_bytes = local.cost([(ctx, 1)] * b, num_sampled=b)
    assert nbytes - local_bytes == b * (300 - 182) * model.kv_bytes_per_token


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


def test_resolve_device_peaks_off_given_and_presets() -> None:
    assert resolve_device_peaks("off") is None
    given = resolve_device_peaks("1.5e11, 2e10")
    assert given is not None and (given.peak_flops, given.mem_bandwidth) == (1.5e11, 2e10)
    assert given.source == "given"
    h100 = resolve_device_peaks("H100")
    assert h100 is not None and h100.peak_flops == 989e12 and h100.source == "datasheet"


# ---- device peaks: measurement, cache, start-up probe -----------------------------------------------------------


def _quiet(flops: float = 1e11, bandwidth: float = 1e10, busy: bool = False) -> DeviceSpec:
    prov = PeaksProvenance("measured", "2030-01-01T00:00:00Z", "fake", 2, 0.1, 0.3 if busy else 0.98, busy)
    return DeviceSpec("fake", flops, bandwidth, 1.0, (("float32", flops),), prov)


@pytest.fixture
def peaks_env(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A private cache directory, a fake measurement (records its thread counts) and a fresh per-process memo."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peaks, "_resolved", {})
    calls: list[int] = []
    result = {"device": _quiet()}

    def fake_measure(threads: int, **kw: object) -> DeviceSpec:
        calls.append(threads)
        return result["device"]

    monkeypatch.setattr(peaks, "measure_device", fake_measure)
    return tmp_path, calls, result


def _entries(path) -> dict:  # type: ignore[no-untyped-def]
    data = json.loads((path / "device-peaks.json").read_text())
    assert data["version"] == peaks.CACHE_VERSION
    return data["entries"]


def test_auto_peaks_measured_once_then_cached_and_confirmed_by_the_probe(peaks_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tmp_path, calls, _ = peaks_env
    probes: list[int] = []

    def slower_probe(threads: int, dtypes: list[str], *a: object) -> tuple[dict[str, float], float]:
        probes.append(threads)
        return {d: 0.9e11 for d in dtypes}, 0.95e10  # a quick probe reads below the full measurement

    monkeypatch.setattr(peaks, "probe_device", slower_probe)
    first = resolve_device_peaks("auto", threads=2)
    assert calls == [2] and first is not None and first.source == "measured"
    entry = _entries(tmp_path)[peaks_key(2)]
    assert entry["peak_flops"] == 1e11 and entry["provenance"]["measured_at"] == "2030-01-01T00:00:00Z"
    assert entry["provenance"]["key"] == peaks_key(2)
    assert resolve_device_peaks("auto", threads=2) is first and probes == []  # once per process
    monkeypatch.setattr(peaks, "_resolved", {})  # a new process: cache + probe, no measurement
    second = resolve_device_peaks("auto", threads=2)
    assert calls == [2] and probes == [2]
    assert second is not None and second.source == "cached" and second.peak_flops == 1e11
    assert second.provenance is not None and "cache confirmed" in second.provenance.probe
    assert "measured 2030-01-01T00:00:00Z" in second.describe_source()
    resolve_device_peaks("auto", threads=1)  # another thread count is another measurement
    assert calls == [2, 1] and set(_entries(tmp_path)) == {peaks_key(2), peaks_key(1)}
    assert "threads" in peaks_key(2) and torch.__version__ in peaks_key(2)


def test_measurement_on_a_busy_machine_is_used_but_never_cached(peaks_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tmp_path, calls, result = peaks_env
    result["device"] = _quiet(5e10, 5e9, busy=True)
    device = resolve_device_peaks("auto", threads=2)
    assert device is not None and device.peak_flops == 5e10  # this run uses it ...
    assert device.provenance is not None and device.provenance.busy and "not cached" in device.describe_source()
    assert not (tmp_path / "device-peaks.json").exists()  # ... but it is not remembered
    assert save_measured_device(device, 2) is None
    monkeypatch.setattr(peaks, "_resolved", {})
    resolve_device_peaks("auto", threads=2)  # the next start measures again
    assert calls == [2, 2]


def test_poisoned_cached_peaks_are_remeasured_at_start(peaks_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A user who ran pdserve before has a cached figure from a busy start: the start-up probe (real, small) beats
    it, so the machine is measured again and the cache corrected."""
    tmp_path, calls, result = peaks_env
    monkeypatch.setattr(peaks, "COPY_BYTES", 8 * 2**20)  # keep the real probe quick
    poisoned = DeviceSpec("this machine", 7.5e2, 1e3, 1.0, (("float32", 7.5e2), ("bfloat16", 7.5e2)),
                          PeaksProvenance("measured", "2020-01-01T00:00:00Z", "old", 2, 0.1, 0.99))
    (tmp_path / "device-peaks.json").write_text(json.dumps(
        {"version": peaks.CACHE_VERSION, "entries": {peaks_key(2): poisoned.to_json()}}))
    assert load_cached_device(2) is not None  # the planted figure is what start-up finds
    result["device"] = _quiet(2e11, 2e10)
    device = resolve_device_peaks("auto", threads=2)
    assert calls == [2] and device is not None and device.peak_flops == 2e11
    assert device.provenance is not None and "beats the cache" in device.provenance.probe
    assert _entries(tmp_path)[peaks_key(2)]["peak_flops"] == 2e11


def test_cache_of_an_older_format_is_ignored(peaks_env) -> None:  # type: ignore[no-untyped-def]
    tmp_path, calls, _ = peaks_env
    old = {f"{peaks.cpu_name()}|2 threads|torch {torch.__version__}": {  # the first format: no provenance
        "name": "this machine", "peak_flops": 9.27e10, "mem_bandwidth": 1e10, "memory": 1.0,
        "flops_by_dtype": [["float32", 9.27e10], ["bfloat16", 7.5e8]]}}
    (tmp_path / "device-peaks.json").write_text(json.dumps(old))
    device = resolve_device_peaks("auto", threads=2)
    assert calls == [2] and device is not None and device.peak_flops == 1e11
    assert set(_entries(tmp_path)) == {peaks_key(2)}


def test_tests_use_a_session_cache_not_the_users() -> None:
    root = cache_root()
    assert str(root) == os.environ["PDSERVE_CACHE_DIR"]
    assert not str(root).startswith(os.path.join(os.path.expanduser("~"), ".cache"))


def test_busy_verdict() -> None:
    cores = os.cpu_count() or 1
    assert not is_busy(None, 0.95) and not is_busy(0.1, 0.95)
    assert is_busy(None, 0.5)  # our threads got half the CPU: others held the cores
    assert is_busy(2.0 * cores, 0.95)  # load average says the machine is busy


def test_calc_measure_reports_provenance_and_caches_only_quiet(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pdserve.roofline.measure as calc_mod  # calc_cli imports measure_device from it when measuring

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calc_mod, "measure_device", lambda threads: _quiet())
    out = run_cli("--model", "example-7b", "--measure", "--threads", "2")
    assert "# measured peaks saved to" in out and "peaks    measured; measured 2030-01-01T00:00:00Z; fake" in out
    assert peaks_key(2) in _entries(tmp_path)
    (tmp_path / "device-peaks.json").unlink()
    monkeypatch.setattr(calc_mod, "measure_device", lambda threads: _quiet(busy=True))
    out = run_cli("--model", "example-7b", "--measure", "--threads", "2")
    assert "busy while measuring: these peaks are not cached" in out and "machine busy" in out
    assert not (tmp_path / "device-peaks.json").exists()
    data = json.loads(run_cli("--model", "example-7b", "--measure", "--threads", "2", "--json"))
    assert data["device"]["provenance"]["busy"] is True


def test_peaks_provenance_in_metrics_and_generate_lines(capsys) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import generate_latest

    from pdserve.cli import _print_roofline
    from pdserve.server.metrics import Metrics

    device = dataclasses.replace(_quiet(), provenance=dataclasses.replace(
        _quiet().provenance, source="cached", probe="start-up probe read float32 90 GFLOP/s: cache confirmed"))
    m = Metrics("tiny")
    m.set_peaks(1e11, 1e10, device)
    text = generate_latest(m.registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("pdserve:device_peaks_info{"))
    for label in ('source="cached"', 'measured_at="2030-01-01T00:00:00Z"', 'method="fake"', 'busy="false"',
                  'cpu_share="0.98"', 'probe="start-up probe read float32 90 GFLOP/s: cache confirmed"'):
        assert label in line
    assert line.endswith(" 1.0")
    m.set_peaks(1e11, 1e10)  # the old two-argument call still works
    meter = RooflineMeter(device, torch.float32)
    meter.add("decode", 0.1, 1e9, 5e8)
    _print_roofline(meter)
    err = capsys.readouterr().err
    assert "# roofline peaks: 100.0 GFLOP/s, 10.0 GB/s (fake)" in err
    assert "# roofline peaks from: cached; measured 2030-01-01T00:00:00Z; fake" in err and "cache confirmed" in err


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
