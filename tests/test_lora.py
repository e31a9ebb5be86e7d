"""LoRA adapters (model/lora.py): random PEFT adapters on the tiny model give PEFT's merged model's greedy tokens,
batched in one step with base-model requests and each other (torch and native kernels); the prefix cache never
shares blocks across adapters; a real `pdserve serve --lora-modules` serves them as model names to the `openai`
client, loads and unloads them through the admin API (audited, 409 while in use), and refuses bad adapters with
coded 400/404 errors; the KV pool is back to its baseline after every request."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from pdserve.launch import ServerProc, start_server
from pdserve.lora_request import LoRARequest, next_lora_id
from pdserve.model.lora_peft import LoRAAdapterError
from pdserve.sampling_params import SamplingParams

from conftest import hf_greedy, make_tiny_hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEY = "lora-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [[1, 5, 9, 100, 2000, 40, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 7, 300, 20]]
N = 10


def make_adapter(base: Any, out: Path, seed: int, targets: list[str], r: int = 8, **cfg: Any) -> Any:
    """Save a PEFT adapter with random A and B (B is zero by PEFT's default) and return the merged model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                            init_lora_weights=False, **cfg))
    model.save_pretrained(out)
    return model.merge_and_unload()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_hf_model: Any) -> dict[str, tuple[Path, Any]]:
    """a1: every target; a2: q and v only, rsLoRA scaling; r16: rank 16; each with its merged model."""
    d = tmp_path_factory.mktemp("lora")
    return {name: (d / name, make_adapter(tiny_hf_model, d / name, seed, targets, r, **cfg))
            for name, seed, targets, r, cfg in (("a1", 1, ALL, 8, {}), ("a2", 2, ["q_proj", "v_proj"], 4,
                                                                          {"use_rslora": True}),
                                                ("r16", 3, ["o_proj"], 16, {}))}


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_mixed_batch_matches_merged_models(make_llm: Any, tiny_hf_model: Any, adapters: dict[str, Any],
                                           kernels: str) -> None:
    llm = make_llm(kernels=kernels, enable_lora=True)
    a1 = LoRARequest("a1", next_lora_id(), str(adapters["a1"][0]))
    a2 = LoRARequest("a2", next_lora_id(), str(adapters["a2"][0]))
    cases = [(PROMPTS[0], None), (PROMPTS[0], a1), (PROMPTS[1], a2), (PROMPTS[1], a1), (PROMPTS[1], None)]
    outs = llm.generate([p for p, _ in cases], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                        lora_request=[lr for _, lr in cases])
    merged = {None: tiny_hf_model, a1: adapters["a1"][1], a2: adapters["a2"][1]}
    for out, (prompt, lr) in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(merged[lr], prompt, N), lr
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the adapter changes the output
    steps, _ = llm.engine.step_log.between(0.0, float("inf"))
    assert any(s.lora_ids == (0, a1.lora_int_id, a2.lora_int_id) for s in steps)  # base and both in one step
    assert any(s.kind == "decode" and len(s.lora_ids) == 3 for s in steps)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # KV pool back to baseline


def test_prefix_cache_keeps_adapters_apart(make_llm: Any, tiny_hf_model: Any, adapters: dict[str, Any]) -> None:
    llm = make_llm(kernels="torch", enable_lora=True, block_size=4)
    a1 = LoRARequest("a1", next_lora_id(), str(adapters["a1"][0]))
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    [base] = llm.generate([PROMPTS[0]], params)
    [first] = llm.generate([PROMPTS[0]], params, lora_request=a1)
    [again] = llm.generate([PROMPTS[0]], params, lora_request=a1)
    assert first.num_cached_tokens == 0  # the base model's blocks of the same prompt are not the adapter's
    assert again.num_cached_tokens >= 16  # the adapter's own blocks are
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(adapters["a1"][1], PROMPTS[0], N)
    assert base.outputs[0].token_ids == hf_greedy(tiny_hf_model, PROMPTS[0], N)


def bad_adapters(root: Path, adapters: dict[str, Any]) -> dict[str, tuple[Path, int, str]]:
    """Adapter directories each wrong in one way: (path, status, code) the admin API answers."""
    root.mkdir(parents=True, exist_ok=True)
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    lm_head = root / "lm-head"
    make_adapter(make_tiny_hf_model(), lm_head, 4, ["lm_head"])
    shapes = root / "shapes"
    make_adapter(make_tiny_hf_model(hidden_size=32, intermediate_size=64), shapes, 5, ["q_proj"])
    dora = root / "dora"
    make_adapter(make_tiny_hf_model(), dora, 6, ["q_proj"], use_dora=True)
    return {"missing": (root / "nowhere", 404, "lora_adapter_not_found"),
            "no-weights": (no_weights, 404, "lora_adapter_not_found"),
            "rank": (adapters["r16"][0], 400, "invalid_lora_adapter"),
            "lm-head": (lm_head, 400, "invalid_lora_adapter"), "shapes": (shapes, 400, "invalid_lora_adapter"),
            "dora": (dora, 400, "invalid_lora_adapter")}


def test_reader_errors_are_coded(adapters: dict[str, Any], tmp_path: Path) -> None:
    from pdserve.model.lora_peft import read_peft_adapter

    for name, (path, status, code) in bad_adapters(tmp_path, adapters).items():
        if name == "shapes":
            continue  # shapes are checked against the model (the server test)
        with pytest.raises(LoRAAdapterError) as e:
            read_peft_adapter(str(path), max_rank=8)
        assert e.value.code == code, (name, e.value)
        assert (status == 404) == (code == "lora_adapter_not_found")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path,
           adapters: dict[str, Any]) -> Iterator[ServerProc]:
    d = tmp_path_factory.mktemp("lora-server")
    srv = start_server(d, "--model", str(tiny_dir), "--served-model-name", "tiny", "--dtype", "float32",
                       "--device-peaks", "off", "--max-step-ms", "0", "--num-kv-blocks", "64", "--admin-api-key",
                       KEY, "--audit-log", str(d / "audit.jsonl"), "--max-lora-rank", "8", "--max-loras", "3",
                       "--lora-modules", f"a1={adapters['a1'][0]}")
    yield srv
    assert srv.stop() in (0, -15)


def admin(srv: ServerProc, path: str, body: dict[str, Any], headers: dict[str, str] | None = ADMIN) -> Any:
    return httpx.post(srv.base_url + path, json=body, headers=headers, timeout=60)


def kv_used(srv: ServerProc) -> int:
    kv = httpx.get(srv.base_url + "/debug/kv", params={"model": "tiny"}, headers=ADMIN, timeout=30).json()
    return int(kv["num_used_blocks"])


def greedy(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[str, str]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text, out.model


def test_served_adapters_load_and_unload(server: ServerProc, tiny_hf_model: Any, adapters: dict[str, Any],
                                         tokenizer: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert listed["a1"]["parent"] == "tiny" and listed["a1"]["root"] == str(adapters["a1"][0])
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "你好"}], max_tokens=4)
    assert chat.model == "a1"
    with pytest.raises(openai.BadRequestError):  # embeddings run the base model only
        client.embeddings.create(model="a1", input="hi")
    expect = {"tiny": tiny_hf_model, "a1": adapters["a1"][1], "a2": adapters["a2"][1]}
    assert admin(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a2"][0])},
                 None).status_code == 401
    r = admin(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a2"][0])})
    assert r.status_code == 200, r.text
    for model in ("tiny", "a1", "a2"):
        text, name = greedy(client, model, PROMPTS[1])
        assert text == tokenizer.decode(hf_greedy(expect[model], PROMPTS[1], N)), model
        assert name == model
        assert kv_used(server) == 0
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="a2", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found"
    r = admin(server, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "lora_adapter_not_found")
    metrics = httpx.get(server.base_url + "/metrics", headers=ADMIN, timeout=30).text
    assert 'pdserve:lora_requests_info{max_lora="3",model_name="tiny",running_lora_adapters="' in metrics
    audit = httpx.get(server.base_url + "/admin/audit", headers=ADMIN, timeout=30).json()["entries"]
    assert [e["action"] for e in audit if e["model"] == "a2"] == ["load_lora", "unload_lora", "unload_lora"]


def test_unload_in_use_is_refused(server: ServerProc, adapters: dict[str, Any]) -> None:
    """A running request pins its adapter: the unload is a 409 lora_in_use until it ends."""
    started, done = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.base_url + "/v1/completions", headers=ADMIN, timeout=120,
                          json={"model": "a1", "prompt": "Once", "max_tokens": 400, "ignore_eos": True,
                                "stream": True}) as resp:
            for _ in resp.iter_lines():
                started.set()
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    r = admin(server, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    finished_first = done.is_set()
    t.join(120)
    if not finished_first:
        assert (r.status_code, r.json()["error"]["code"]) == (409, "lora_in_use")
    assert kv_used(server) == 0
    if r.status_code == 200:  # the stream had ended: load it back for the other tests
        assert admin(server, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapters["a1"][0])}
                     ).status_code == 200


def test_bad_adapters_and_names(server: ServerProc, adapters: dict[str, Any], tmp_path: Path) -> None:
    for name, (path, status, code) in bad_adapters(tmp_path, adapters).items():
        r = admin(server, "/v1/load_lora_adapter", {"lora_name": f"bad-{name}", "lora_path": str(path)})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (name, r.text)
    good = str(adapters["a2"][0])
    for lora_name, status, code in (("../x", 400, "invalid_model_name"), ("tiny", 409, "model_exists"),
                                    ("a1", 409, "model_exists")):
        r = admin(server, "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": good})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), lora_name
    r = admin(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": good, "model": "nope"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    ids = {m["id"] for m in httpx.get(server.base_url + "/v1/models", headers=ADMIN, timeout=30).json()["data"]}
    assert not any(i.startswith("bad-") for i in ids)
    # --max-loras 3 with a1 resident: two more fit, the third is refused until one is unloaded
    for name in ("l2", "l3"):
        assert admin(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": good}).status_code == 200
    r = admin(server, "/v1/load_lora_adapter", {"lora_name": "l4", "lora_path": good})
    assert (r.status_code, r.json()["error"]["code"]) == (409, "lora_limit_reached")
    for name in ("l2", "l3"):
        assert admin(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    assert admin(server, "/v1/load_lora_adapter", {"lora_name": "l4", "lora_path": good}).status_code == 200
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "l4"}).status_code == 200
