"""The prefix cache's disk tier (--kv-offload-dir, engine/kv_offload.py): blocks written after the step that filled
them, read back after a restart as cached blocks with the same output as a cold prefill; corrupt, foreign and
other-salt files never served; the size bound; the KV pool back at its baseline; the Prometheus series."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from pdserve.engine import kv_offload
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.messages import KVOffloadStats
from pdserve.prefix_hash import chain_hashes
from pdserve.sampling_params import SamplingParams
from pdserve.server.metrics import Metrics

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)


def prompt_ids(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


def run(llm: Any, ids: list[int], cache_salt: str | None = None) -> Any:
    eng = llm.engine
    (req,) = eng.make_requests([{"prompt_token_ids": ids}], GREEDY, f"r{random.random()}", cache_salt=cache_salt)
    eng.add_request(req)
    out = None
    while eng.has_unfinished_requests():
        out = next((o for o in eng.step().outputs if o.finished), out)
    eng.kv_offload.flush()
    assert llm.engine.block_manager.is_at_baseline()
    llm.engine.block_manager.check_integrity()
    return out


def files(d: Path) -> list[Path]:
    return sorted(d.glob("*/*.kvb"))


def block_file(d: Path, ids: list[int], i: int) -> Path:
    """The file of the prompt's block i (no salt), named by its chained hash."""
    h = chain_hashes(ids, 16, None)[i]
    (path,) = d.glob(f"*/{h & (2**64 - 1):016x}.kvb")
    return path


@pytest.fixture
def offload_llm(make_llm: Any, tmp_path: Path) -> Any:
    made = []

    def factory(**options: Any) -> Any:
        options.setdefault("kv_offload_dir", str(tmp_path / "kv"))
        llm = make_llm(**options)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        llm.engine.kv_offload.close()


def test_a_restart_reads_the_prefix_back_with_the_cold_output(offload_llm: Any, make_llm: Any,
                                                              tmp_path: Path) -> None:
    ids = prompt_ids(1)
    cold = make_llm().generate([{"prompt_token_ids": ids}], GREEDY)[0]
    first = offload_llm()
    out1 = run(first, ids)
    stats = first.engine.kv_offload.stats
    assert stats.blocks_saved == (len(ids) // 16) and stats.disk_bytes > 0  # every full block of the prompt
    assert len(files(tmp_path / "kv")) == stats.blocks_saved
    first.engine.kv_offload.close()

    second = offload_llm()  # a restart: a new engine on the same directory
    out2 = run(second, ids)
    s2 = second.engine.kv_offload.stats
    assert s2.hits == s2.blocks_loaded == (len(ids) - 1) // 16 and s2.rejected == 0
    assert out2.num_cached_tokens == s2.hits * 16
    for out in (out1, out2):
        assert out.outputs[0].token_ids == cold.outputs[0].token_ids
        for a, b in zip(out.outputs[0].logprobs, cold.outputs[0].logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert s2.blocks_saved == 0  # the blocks read back are not written again


def test_the_prefix_summary_names_blocks_only_on_disk(offload_llm: Any) -> None:
    """What /kv/prefix_hashes publishes for routers: after a restart the prompt's blocks are on disk only; once a
    request read them back they are in memory, and disk_hashes no longer names them."""
    from pdserve.engine.published import PrefixSummary

    ids = prompt_ids(9)
    chain = set(chain_hashes(ids, 16, None))
    first = offload_llm()
    run(first, ids)
    s = PrefixSummary.of(first.engine)
    assert chain <= set(s.hashes) and not chain & set(s.disk_hashes)  # in memory: not listed as disk-only
    first.engine.kv_offload.close()
    second = offload_llm()
    before = PrefixSummary.of(second.engine)
    assert chain <= set(before.disk_hashes) and not chain & set(before.hashes)
    assert PrefixSummary.of(second.engine, before) is before  # nothing changed: the same summary
    run(second, ids)
    after = PrefixSummary.of(second.engine, before)
    assert after.etag != before.etag and after.epoch == before.epoch
    assert chain <= set(after.hashes) and not chain & set(after.disk_hashes)


def test_corrupt_and_foreign_files_are_rejected_and_recomputed(offload_llm: Any, tmp_path: Path) -> None:
    ids = prompt_ids(2)
    first = offload_llm()
    ref = run(first, ids).outputs[0].token_ids
    first.engine.kv_offload.close()
    bad, head = block_file(tmp_path / "kv", ids, 3), block_file(tmp_path / "kv", ids, 0)
    raw = bytearray(bad.read_bytes())
    raw[-5] ^= 0xFF  # a flipped payload byte: the CRC fails
    bad.write_bytes(bytes(raw))
    second = offload_llm()
    out = run(second, ids)
    s = second.engine.kv_offload.stats
    assert s.rejected == 1 and s.hits == 3  # the chain stops at the bad block; the rest is computed
    assert out.num_cached_tokens == 3 * 16 and out.outputs[0].token_ids == ref
    assert bad.read_bytes() != bytes(raw)  # deleted, then written again from the recomputed block

    # a file of another fingerprint copied in under this one's name: its header says so
    second.engine.kv_offload.close()
    head.write_bytes(head.read_bytes().replace(head.parent.name.encode(), b"ffffffffffff", 1))
    third = offload_llm()
    out3 = run(third, ids)
    assert third.engine.kv_offload.stats.rejected == 1 and out3.num_cached_tokens == 0
    assert out3.outputs[0].token_ids == ref


def test_other_dtype_and_other_salt_never_read_the_files(offload_llm: Any, tmp_path: Path) -> None:
    ids = prompt_ids(3)
    run(offload_llm(), ids, cache_salt="tenant-a")
    other_kv = offload_llm(kv_cache_dtype="int8")  # another KV layout: its own fingerprint directory
    assert run(other_kv, ids, cache_salt="tenant-a").num_cached_tokens == 0
    assert other_kv.engine.kv_offload.stats.hits == 0
    assert len({p.parent for p in files(tmp_path / "kv")}) == 2
    same = offload_llm()
    assert run(same, ids, cache_salt="tenant-b").num_cached_tokens == 0  # another tenant's salt: another chain
    assert run(same, ids).num_cached_tokens == 0  # no salt
    assert run(same, ids, cache_salt="tenant-a").num_cached_tokens == ((len(ids) - 1) // 16) * 16


def test_the_size_bound_drops_the_least_recently_used(offload_llm: Any, tmp_path: Path) -> None:
    llm = offload_llm()
    run(llm, prompt_ids(4, 64))
    per_file = llm.engine.kv_offload.stats.disk_bytes // 4
    llm.engine.kv_offload.close()
    small = offload_llm(kv_offload_max_size=int(per_file * 6.5))  # (headers differ by a few bytes)
    first = prompt_ids(5, 64)
    run(small, first)  # 4 more blocks: 8 > 6, the oldest (the first run's) go
    s = small.engine.kv_offload.stats
    assert s.evicted == 2 and s.disk_bytes <= per_file * 6.5 and len(files(tmp_path / "kv")) == 6
    assert run(small, first).num_cached_tokens == 3 * 16  # the newest survive (in memory and on disk)


def test_a_small_pool_takes_what_fits_and_returns_to_baseline(offload_llm: Any) -> None:
    ids = prompt_ids(6, 400)
    run(offload_llm(), ids)
    tight = offload_llm(num_kv_blocks=30)  # the prompt needs 26 blocks: room for a few loaded ones only
    out = run(tight, ids)
    assert 0 < tight.engine.kv_offload.stats.hits < (len(ids) - 1) // 16
    assert out.num_cached_tokens == tight.engine.kv_offload.stats.hits * 16


def test_adopted_blocks_are_cached_free_blocks() -> None:
    bm = BlockManager(4, 16)
    bm.newly_cached = []
    blk = bm.adopt_cached(1234, 0, range(16))
    assert bm.cached[1234] is blk and blk.ref_cnt == 0 and list(bm.free_queue)[-1] == blk.block_id
    bm.check_integrity()
    assert bm.is_at_baseline() and bm.newly_cached == []  # read back, not to be written again


def test_prometheus_series() -> None:
    m = Metrics("tiny")
    m.observe_offload(KVOffloadStats(blocks_saved=5, bytes_saved=500, blocks_loaded=3, bytes_loaded=300, lookups=4,
                                     hits=3, rejected=1, evicted=2, disk_bytes=1000))
    m.observe_offload(KVOffloadStats(blocks_saved=6, bytes_saved=600, blocks_loaded=3, bytes_loaded=300, lookups=4,
                                     hits=3, rejected=1, evicted=2, disk_bytes=1100))
    text = generate_latest(m.registry).decode()
    assert 'pdserve:kv_offload_blocks_total{direction="saved",model_name="tiny"} 6.0' in text
    assert 'pdserve:kv_offload_hits_total{model_name="tiny"} 3.0' in text
    assert 'pdserve:kv_offload_files_removed_total{model_name="tiny",reason="evicted"} 2.0' in text
    assert 'pdserve:kv_offload_disk_bytes{model_name="tiny"} 1100.0' in text


@pytest.mark.slow
def test_a_served_prompt_survives_a_server_restart(tmp_path: Path, tiny_dir: Path) -> None:
    """`pdserve serve --kv-offload-dir`: the prompt's blocks are on disk when the server stops (SIGTERM lets the
    writer finish), and the next server answers the same prompt from them (cached_tokens, /metrics)."""
    import httpx

    from pdserve.launch import start_server
    from pdserve.router.prefix import InstancePrefixes, PrefixQuery

    from conftest import TINY_SERVER_ARGS

    ids = prompt_ids(7, 100)
    body = {"model": str(tiny_dir), "prompt": ids, "max_tokens": 4, "temperature": 0}
    answers, routed = [], []
    for run_no in range(2):
        srv = start_server(tmp_path / f"log{run_no}", "--model", str(tiny_dir), *TINY_SERVER_ARGS,
                           "--kv-offload-dir", str(tmp_path / "kv"))
        try:
            # what a prefix-aware router reads before the request: the prompt's blocks on disk after the restart
            seen = InstancePrefixes()
            seen.publish(httpx.get(srv.base_url + "/kv/prefix_hashes", timeout=30).json(), None)
            routed.append(seen.hit_tokens(PrefixQuery(ids), 0.0))
            r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json())
            metrics = httpx.get(srv.base_url + "/metrics", timeout=30).text
        finally:
            assert srv.stop() in (0, -15)
    first, second = answers
    assert routed == [(0, 0), (0, 96)]  # (in memory, on disk) prompt tokens the router expects there
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert 'pdserve:kv_offload_hits_total{model_name=' in metrics
    hits = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:kv_offload_hits_total")]
    assert hits and float(hits[0].split()[-1]) == 6


def test_a_long_prefix_is_read_a_bounded_amount_a_step(offload_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier reads at most READ_BYTES_PER_STEP a step while the request waits; the running requests keep
    decoding meanwhile, and the request then hits the whole prefix."""
    ids = prompt_ids(8)
    ref = run(offload_llm(), ids).outputs[0].token_ids
    llm = offload_llm()
    eng = llm.engine
    kv = eng.runner.kv_cache
    monkeypatch.setattr(kv_offload, "READ_BYTES_PER_STEP", 2 * kv[:, :, 0].numel() * kv.element_size())
    decode40 = SamplingParams(max_tokens=40, ignore_eos=True)
    (other,) = eng.make_requests([{"prompt_token_ids": prompt_ids(9, 20)}], decode40, "other")
    eng.add_request(other)
    eng.step()  # its prefill
    (req,) = eng.make_requests([{"prompt_token_ids": ids}], GREEDY, "long")
    eng.add_request(req)
    reads, final = [], None
    while eng.has_unfinished_requests():
        before, other_tokens = eng.kv_offload.stats.blocks_loaded, len(other.all_token_ids)
        outs = eng.step().outputs
        got = eng.kv_offload.stats.blocks_loaded - before
        if got:
            reads.append((got, len(other.all_token_ids) > other_tokens))
        final = next((o for o in outs if o.request_id == req.request_id and o.finished), final)
    assert [n for n, _ in reads] == [2, 2, 2, 2, 2, 2] and all(decoded for _, decoded in reads)
    assert final is not None and final.num_cached_tokens == 12 * 16 and final.outputs[0].token_ids == ref
    assert eng.block_manager.is_at_baseline()


def test_a_bad_size_is_refused_by_the_config() -> None:
    from pdserve.config import EngineConfig

    for bad in ("0", "-1GiB", "lots"):
        with pytest.raises(ValueError):
            EngineConfig(kv_offload_max_size=bad)


def test_waiting_requests_walk_the_disk_once(tmp_path: Path) -> None:
    """Requests held in the queue (here: for a prefix another request is computing) look their prefix up on disk
    once, not at every step they wait; a preempted one looks again."""
    import torch

    from pdserve.engine.request import Request, RequestStatus
    from pdserve.engine.scheduler import Scheduler

    bm = BlockManager(64, 16)
    store = kv_offload.KVOffloadStore(str(tmp_path), 2**30, "m", torch.zeros(2, 2, 65, 16, 1, 8), bm)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=512)
    sched.kv_offload = store
    walks: list[str] = []
    match = bm.match_prefix
    bm.match_prefix = lambda r: (walks.append(r.request_id), match(r))[1]  # type: ignore[method-assign]
    ids = prompt_ids(7, 300)
    reqs = [Request(r, ids, SamplingParams(), eos_token_ids={2}, max_tokens=4) for r in "abc"]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):  # the model never runs: a keeps writing its first block, b and c keep waiting for it
        out = sched.schedule()
        assert [d.req_id for d in out.scheduled_reqs] == ["a"]
        reqs[0].num_computed_tokens = 0
    assert sorted(walks) == ["a", "b", "c"] and sched.num_prefix_waits == 2
    reqs[1].times.preemptions.append(0.0)  # as _preempt records it
    sched.schedule()
    assert sorted(walks) == ["a", "b", "b", "c"]
    sched.finish_requests(["a", "b", "c"], RequestStatus.FINISHED_ABORTED)
    store.close()
    assert bm.is_at_baseline()
