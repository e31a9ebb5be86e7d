"""DecodeGraphRunner's eager twin on cpu (the CUDA-graph path's padding, static buffers and metadata): its logits
equal the plain path's at every padded size, padding rows touch only the scratch block, and steps it cannot serve
go the plain way. Engine-level greedy equality through it: tests/test_engine_equivalence.py (`flex`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.model.decode_graphs import capture_sizes
from pdserve.model.inputs import ScheduledRequest, SchedulerOutput
from pdserve.model.runner import ModelRunner

from conftest import loaded_from_hf

BS = 16


def test_capture_sizes() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


def _runner(tiny_hf_model: Any, backend: str) -> ModelRunner:
    lm = loaded_from_hf(tiny_hf_model)
    runner = ModelRunner(lm.arch, lm.state_dict, torch.float32, 40, BS, 256, "torch", device="cpu",
                         attention_backend=backend, max_num_seqs=6)
    runner.enable_decode_graphs()
    assert runner.decode_graphs is not None and not runner.decode_graphs.capture  # cpu: the eager twin
    return runner


def _sched(reqs: list[ScheduledRequest], decode: bool) -> SchedulerOutput:
    n = sum(r.num_scheduled_tokens for r in reqs)
    return SchedulerOutput(reqs, num_prefill_tokens=0 if decode else n, num_decodes=len(reqs) if decode else 0)


def _plain_logits(runner: ModelRunner, sched: SchedulerOutput) -> torch.Tensor:
    inp = runner.prepare(sched)
    with torch.inference_mode():
        hidden = runner.model(inp.input_ids, inp.positions, runner.kv_cache, inp.meta)
        return runner.model.compute_logits(hidden[inp.sample_rows])


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_padded_decode_equals_plain_path(tiny_hf_model: Any, backend: str) -> None:
    runner = _runner(tiny_hf_model, backend)
    graphs = runner.decode_graphs
    assert graphs is not None
    # six sequences of ragged lengths over non-contiguous blocks (block 0 is left unused: it must stay zero)
    lengths = [3, 17, 40, 1, 33, 16]
    tables = [[5], [9, 2], [11, 4, 7], [1], [8, 12, 13], [6]]
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    pre = _sched([ScheduledRequest(str(i), p, 0, t, True) for i, (p, t) in enumerate(zip(prompts, tables))], False)
    assert not graphs.can_run(pre)
    first = runner.greedy_step(pre)
    for n, padded in [(3, 4), (1, 1), (5, 6), (6, 6)]:  # sizes 1, 2, 4, 6 (max_num_seqs: the last)
        reqs = []
        for i in range(n):
            tbl = tables[i] + ([30 + i] if lengths[i] % BS == 0 else [])  # a full block: the next one is new
            reqs.append(ScheduledRequest(str(i), [first[i]], lengths[i], tbl, True))
        sched = _sched(reqs, True)
        assert graphs.can_run(sched) and graphs.padded_size(n) == padded
        want = _plain_logits(runner, sched)
        before = runner.kv_cache.clone()
        replays = graphs.replays
        got = graphs.run(sched)
        assert graphs.replays == replays + 1 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        changed = (runner.kv_cache != before).flatten(3).any(-1).any(0).any(0)  # [blocks, slots]: rewritten
        # the real rows rewrote their own slot with the same values; only the scratch block may change
        assert not changed[:runner.num_blocks].any()
        assert runner.greedy_step(sched) == want.argmax(-1).tolist()
    scratch = runner.kv_cache[:, :, runner.num_blocks]
    assert scratch.abs().sum() > 0  # padding rows wrote there
    assert runner.kv_cache[:, :, 0].abs().sum() == 0  # block 0 (unused) never written: padding avoids it


def test_steps_the_graphs_do_not_serve(tiny_hf_model: Any) -> None:
    runner = _runner(tiny_hf_model, "sdpa")
    graphs = runner.decode_graphs
    assert graphs is not None
    dec = ScheduledRequest("a", [5], 4, [1], True)
    assert graphs.can_run(_sched([dec], True))
    spec = _sched([ScheduledRequest("a", [5, 6, 7], 4, [1], True, num_draft_tokens=2)], True)
    spec.num_spec_decodes, spec.num_decodes = 1, 0
    assert not graphs.can_run(spec)
    assert not graphs.can_run(_sched([ScheduledRequest(str(i), [5], 4, [i], True) for i in range(7)], True))
    long_table = ScheduledRequest("b", [5], 300, list(range(20)), True)  # past max_model_len's table width
    assert not graphs.can_run(_sched([long_table], True))
    pooled = ScheduledRequest("c", [5], 4, [2], True, pool_offset=0)
    assert not graphs.can_run(_sched([pooled], True))
    runner.allocate_kv_cache(20)  # a new cache: the graph runner follows it
    assert runner.decode_graphs is not None and runner.decode_graphs.kv_cache is runner.kv_cache
    assert runner.decode_graphs.scratch == 20
