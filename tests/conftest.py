"""Shared fixtures: the real SmolLM2 tokenizer, tiny random Llama models built in memory, engine factories."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any

# Before torch loads its OpenMP runtime (read once, at load), in this process and in every server it starts: idle
# OpenMP threads sleep instead of spinning. On a shared 2-core host a spinning team waits a whole time slice for a
# descheduled member at every barrier: SmolLM2 decode steps took 4-5 s instead of ~0.1 s (BENCHMARKS.md, suite time).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402

from pdserve.launch import ServerProc, free_port, start_server  # noqa: E402

# Tests never read or write the user's cache (~/.cache/pdserve: converted tokenizers, measured device peaks): one
# directory for the whole session, set before anything runs so server subprocesses inherit it. The tokenizer is then
# converted once per session (seconds); device peaks are measured fresh, never taken from an earlier busy start.
_SESSION_CACHE = tempfile.mkdtemp(prefix="pdserve-test-cache-")
os.environ["PDSERVE_CACHE_DIR"] = _SESSION_CACHE
torch.set_num_threads(2)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: uses the real default model (SmolLM2-135M)")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's tokenizer (vocab 49152), cached on disk after the first build; or, where the GGUF cannot
    travel (benchmarks/gpu_check.sh on a GPU machine), the saved copy in $PDSERVE_TEST_TOKENIZER."""
    from pdserve.model.loader import load_tokenizer

    saved = os.environ.get("PDSERVE_TEST_TOKENIZER")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)
    return load_tokenizer(None)


def make_tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A small random transformers model with the SmolLM2 vocabulary. Weights are scaled up so next-token
    distributions are peaked: greedy comparisons then do not hinge on float rounding between near-ties."""
    import transformers

    kw: dict[str, Any] = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }[arch]
    if arch in ("qwen3", "qwen3_moe"):
        kw.setdefault("head_dim", 16)
    if arch == "qwen3_moe":  # one dense layer between sparse ones; top-2 of 8 experts, weights not renormalised
        kw = {**kw, "num_hidden_layers": 3, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
              "mlp_only_layers": [1], "norm_topk_prob": False, **overrides}
    if arch == "qwen2_moe":  # top-2 of 8 experts and a shared expert; one dense layer
        kw = {**kw, "num_hidden_layers": 3, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
              "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1], **overrides}
    if arch == "mixtral":  # top-2 of 4 experts on every layer
        kw = {**kw, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, **overrides}
    if arch == "gemma3":  # local layers with a window shorter than the test prompts, each rope base its own
        kw = {**kw, **GEMMA3_TINY, **overrides}
    if arch == "gemma2":  # local layers with a window shorter than the test prompts, soft-capping that bites
        kw = {**kw, **GEMMA2_TINY, **overrides}
    cfg = cls_cfg(**kw)
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # 3-D: experts held fused (transformers 5)
                p.normal_(0, 0.35 if "embed" in name else 0.25)
            elif "bias" in name:
                p.normal_(0, 0.1)
            elif "norm" in name and arch in ("gemma2", "gemma3"):  # Gemma's norms scale by 1 + w, w initialised to 0
                p.normal_(0, 0.2)
    return model


SOFTCAP_ATTN, SOFTCAP_FINAL = 5.0, 8.0  # the tiny Gemma 2's caps: below its largest scores and logits

GEMMA3_TINY: dict[str, Any] = dict(
    num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=24, rms_norm_eps=1e-6,
    tie_word_embeddings=False,  # tied, the scaled-up random embedding makes one token win every step
    layer_types=["sliding_attention", "full_attention", "sliding_attention"], hidden_activation="gelu_pytorch_tanh",
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


GEMMA2_TINY: dict[str, Any] = dict(
    num_hidden_layers=3, head_dim=64, query_pre_attn_scalar=48, sliding_window=24, rms_norm_eps=1e-6,
    tie_word_embeddings=False, hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0,
    attn_logit_softcapping=SOFTCAP_ATTN, final_logit_softcapping=SOFTCAP_FINAL)  # layers: local, global, local


def loaded_from_hf(model: Any) -> Any:
    from pdserve.config import ModelArchConfig
    from pdserve.model.loader import LoadedModel

    cfg = model.config.to_dict()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return LoadedModel(arch=ModelArchConfig.from_hf_config(cfg), hf_config=cfg, state_dict=sd, source="<memory>")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Any:
    """The tiny random Llama as a Hugging Face directory (weights + the default model's tokenizer), for servers."""
    d = tmp_path_factory.mktemp("tiny-model")
    make_tiny_hf_model().save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_hf_model() -> Any:
    return make_tiny_hf_model()


# The device the engine tests run on: cpu in CI; benchmarks/gpu_check.sh runs the equality tests with cuda.
TEST_DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")


@pytest.fixture
def make_llm(tiny_hf_model: Any, tokenizer: Any) -> Callable[..., Any]:
    """Factory for a pdserve.LLM on the tiny model (fp32, no device peaks by default: a test that needs MFU/MBU
    passes explicit peaks, and no step budget: it depends on measured step times; so nothing depends on how busy the
    machine is), engine options as keywords."""
    from pdserve.llm import LLM

    def factory(hf_model: Any = None, **options: Any) -> Any:
        options.setdefault("dtype", "float32")
        options.setdefault("device", TEST_DEVICE)
        options.setdefault("device_peaks", "off")
        options.setdefault("num_kv_blocks", 256)
        options.setdefault("max_step_ms", 0)
        return LLM(loaded_model=loaded_from_hf(hf_model or tiny_hf_model), tokenizer=tokenizer, **options)

    return factory


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy tokens from transformers' generate (no EOS stop: fixed length)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                   dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def generate_twice(llm: Any, prompts: list[list[int]], params: Any, ref: list[list[int]]) -> list[Any]:
    """Generate `prompts` twice (the second time their full blocks come from the prefix cache, when it is on): both
    times each output's tokens are `ref`'s, and the KV pool is back at baseline. The second run's outputs."""
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.block_manager.is_at_baseline()
    return list(outs)


def serve_app(app: Any) -> tuple[str, Callable[[], None]]:
    """Serve a FastAPI app with uvicorn in a thread; (base URL once /health answers 200, stop)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return base, stop


def start_all(*starts: Callable[[], ServerProc]) -> list[ServerProc]:
    """Run several process starts at once, in order of the arguments: a start is mostly one core's imports and
    loading, so on two cores two of them overlap. If one fails, the others are stopped and its error is raised."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
        wait_all(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]  # type: ignore[misc]
    return [f.result() for f in futures]


# ---- servers shared by several modules ---------------------------------------------------------------------------
# A `pdserve serve` start is mostly one process's imports (torch, transformers, FastAPI): ~10 s on a quiet 2-core
# host, 30-45 s on a busy one. Modules that only send requests and check their own answers, counter deltas and the
# KV pool back at baseline share one server per configuration for the session. A module that changes server state
# (admin calls, aliases, shutdown, API keys, other engine options) starts its own. `--device-peaks off` where no
# user checks MFU/MBU: on a busy host every start measures the machine again (~2 s quiet, ~8 s busy).
TINY_SERVER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "2048", "--num-threads", "1",
                    "--device-peaks", "off")
REAL_SERVER_ARGS = ("--kv-cache-memory", "256MiB", "--max-model-len", "2048")


def _shared_server(log_dir: Any, *args: str) -> Any:
    srv = start_server(log_dir, *args)
    yield srv
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: -15 is a clean exit
    assert srv.stop() in (0, -15)
    assert "Finished server process" in srv.log()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Any) -> Any:
    """The tiny model served (fp32, 256 KV blocks, max_model_len 2048, one thread), shared by read-only modules."""
    yield from _shared_server(tmp_path_factory.mktemp("tiny-server"), "--model", str(tiny_dir), *TINY_SERVER_ARGS)


@pytest.fixture(scope="session")
def real_server_fp32(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The default model served in float32 (256 MiB of KV, max_model_len 2048), shared by read-only modules."""
    yield from _shared_server(tmp_path_factory.mktemp("real-fp32"), "--dtype", "float32", *REAL_SERVER_ARGS,
                              "--device-peaks", "off")


@pytest.fixture(scope="session")
def real_server_bf16(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The default model served in bfloat16 (256 MiB of KV, max_model_len 2048, bodies up to 200000 bytes, peaks
    measured or cached: test_server checks the live MFU), shared by read-only modules."""
    yield from _shared_server(tmp_path_factory.mktemp("real-bf16"), "--dtype", "bfloat16", *REAL_SERVER_ARGS,
                              "--max-body-bytes", "200000")


@pytest.fixture(scope="session")
def shared_once() -> Any:
    """`shared_once(key, start)`: the first call runs `start()` -> (value, stop) and returns value; later calls with
    the same key, from any module, return the same value; every stop runs at the end of the session (last started,
    first stopped). For a set-up two modules need as it is (e.g. a PD deployment a module-scoped fixture of each
    builds), where their tests read counters as deltas rather than from zero."""
    made: dict[str, Any] = {}
    stops: list[Callable[[], Any]] = []

    def get(key: str, start: Callable[[], tuple[Any, Callable[[], Any]]]) -> Any:
        if key not in made:
            made[key], stop = start()
            stops.append(stop)
        return made[key]

    yield get
    for stop in reversed(stops):
        stop()
