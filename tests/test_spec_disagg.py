"""PD disaggregation with speculative decoding: the decode instance of a prefill/decode pair speculates (ngram,
suffix, and a draft model, which never saw the pulled prompt and catches up on it) and greedy output through the
router equals a single non-speculative server's, token for token, streamed and not, with both pools back at
baseline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.launch import ServerProc, start_server

from conftest import make_tiny_hf_model, start_all
from test_disagg import PROMPTS, TINY, Cluster, complete, metric, start_router, wait_baseline

SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                   "policy": "always"},
         "suffix": {"method": "suffix", "num_speculative_tokens": 4, "policy": "always"},
         "draft_model": {"method": "draft_model", "num_speculative_tokens": 4, "policy": "always"}}  # model: the target


@pytest.fixture(scope="module")
def alphabet_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """The tiny random Llama whose outputs mostly stay in 16 tokens (as tests/test_spec_decode.py's alphabet model):
    its continuations repeat, so drafts are accepted."""
    d = tmp_path_factory.mktemp("alphabet-model")
    model = make_tiny_hf_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[1000:1016] *= 4.0
    model.save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def spec_cluster(tmp_path_factory: pytest.TempPathFactory, alphabet_dir: Path) -> Iterator[dict[str, Cluster]]:
    """A colocated server without speculation, one prefill instance, and one speculating decode instance per
    method, each behind its own router."""
    tmp = tmp_path_factory.mktemp("pd-spec")
    m = ["--model", str(alphabet_dir), *TINY]
    specs = {name: {**spec, "model": str(alphabet_dir)} if name == "draft_model" else spec
             for name, spec in SPECS.items()}
    colo, pre, *decs = start_all(
        partial(start_server, tmp, *m), partial(start_server, tmp, *m, "--role", "prefill"),
        *[partial(start_server, tmp, *m, "--role", "decode", "--speculative-config", json.dumps(spec))
          for spec in specs.values()])
    routers: list[ServerProc] = []
    try:
        routers = start_all(*[partial(start_router, tmp, [pre.base_url], [dec.base_url]) for dec in decs])
        yield {name: Cluster(colo, pre, [dec], router) for name, dec, router in zip(specs, decs, routers)}
    finally:
        for s in [*routers, *decs, pre, colo]:
            s.stop()


@pytest.mark.parametrize("method", sorted(SPECS))
def test_speculating_decode_instance_equals_single_server(spec_cluster: dict[str, Cluster], method: str) -> None:
    c = spec_cluster[method]
    dec = c.decode[0]
    seed = "Once upon a time, in a land far away"
    repetitive = seed + complete(c.ref, seed, stream=False, max_tokens=40) + seed  # its continuation repeats
    prompts = [repetitive, *PROMPTS]  # PROMPTS: several KV blocks, Chinese text, a one-token prompt
    for prompt in prompts:
        for chat in (False, True):
            want = complete(c.ref, prompt, stream=False, chat=chat, max_tokens=40)
            for stream in (False, True):
                got = complete(c.router.base_url, prompt, stream=stream, chat=chat, max_tokens=40)
                assert got == want, (method, prompt, chat, stream)
    assert metric(dec, "pdserve:kv_transfer_bytes_total") > 0
    assert metric(dec, "pdserve:kv_transfer_failures_total") == 0
    assert metric(dec, "pdserve:spec_decode_num_draft_tokens_total") > 0
    assert metric(dec, "pdserve:spec_decode_num_accepted_tokens_total") > 0
    if method == "draft_model":  # the draft is the target: it caught up on the pulled prompt exactly
        assert metric(dec, "pdserve:spec_decode_num_accepted_tokens_total") == \
            metric(dec, "pdserve:spec_decode_num_draft_tokens_total")
    for srv in (c.prefill, dec):
        kv = wait_baseline(srv)
        assert kv["num_used_blocks"] == 0 and kv.get("num_pinned_blocks", 0) == 0, kv
