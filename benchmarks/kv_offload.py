"""TTFT of a long prompt after a restart, with the prefix cache's disk tier (`--kv-offload-dir`) against a cold prefill.

    PYTHONPATH=. python benchmarks/kv_offload.py [--model smollm2-135m|FILE.gguf] [--tokens 4096] [--rounds 3]
        [--drop-caches] [--beside-decode]

Each round makes a fresh random prompt of `--tokens` tokens and measures, one engine after another in this process
(an engine's memory, its prefix cache included, is gone with it, as in a restart): a cold prefill without the tier,
a first request with the tier (which writes the prompt's blocks), then a new engine on the same directory (the
restart) answering the same prompt. The time is that of a request of one output token (TTFT plus one sampling).
`--drop-caches` empties the OS page cache before the restart's request (root only), so the blocks come from the
disk rather than from memory. Prints per round and the medians, and the ratio restart / cold. `--beside-decode`:
after the restart, the prompt arrives while another request decodes; the decoding request's step times while the
prompt's blocks come back from disk are reported (median and longest), against its steps before the prompt came.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdserve import LLM, SamplingParams


def one_request(llm: LLM, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def beside_decode(llm: LLM, ids: list[int]) -> tuple[float, float, float, float]:
    """(the prompt's TTFT, the other request's median step before it, median and longest step while it loads)."""
    eng = llm.engine
    (other,) = eng.make_requests([{"prompt_token_ids": ids[:32][::-1]}],
                                 SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0), "decoding")
    eng.add_request(other)
    before = []
    for _ in range(20):
        t = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - t)
    (req,) = eng.make_requests([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), "long")
    t0 = time.perf_counter()
    eng.add_request(req)
    during: list[float] = []
    while not req.is_finished:
        t = time.perf_counter()
        eng.step()
        during.append(time.perf_counter() - t)
    ttft = time.perf_counter() - t0
    eng.abort_request(["decoding"])
    return ttft, statistics.median(before[5:]), statistics.median(during), max(during)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--beside-decode", action="store_true")
    args = ap.parse_args()
    opts = {"model": args.model, "kv_cache_memory": args.kv_cache_memory, "max_model_len": args.tokens + 16}
    rows = []
    for r in range(args.rounds):
        rng = random.Random(r)
        with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as d:
            cold_llm = LLM(**opts)
            ids = [rng.randrange(1000, cold_llm.engine.arch.vocab_size - 1000) for _ in range(args.tokens)]
            cold, _ = one_request(cold_llm, ids)
            del cold_llm
            first = LLM(**opts, kv_offload_dir=d)
            write, _ = one_request(first, ids)
            assert first.engine.kv_offload is not None
            first.engine.kv_offload.close()
            disk = first.engine.kv_offload.stats.disk_bytes
            del first
            if args.drop_caches:
                Path("/proc/sys/vm/drop_caches").write_text("1\n")
            restarted = LLM(**opts, kv_offload_dir=d)
            if args.beside_decode:
                ttft, base, med, worst = beside_decode(restarted, ids)
                print(f"round {r}: beside a decoding request: TTFT {ttft * 1e3:.0f} ms; the other request's step "
                      f"{base * 1e3:.1f} ms before, {med * 1e3:.1f} ms median and {worst * 1e3:.1f} ms longest while "
                      "the prompt's blocks came back", flush=True)
                if args.drop_caches:  # the same files again, from the disk
                    Path("/proc/sys/vm/drop_caches").write_text("1\n")
                restarted.engine.kv_offload.close()
                restarted = LLM(**opts, kv_offload_dir=d)
            warm, cached = one_request(restarted, ids)
            assert restarted.engine.kv_offload is not None
            restarted.engine.kv_offload.close()
            del restarted
        rows.append((cold, write, warm))
        print(f"round {r}: cold {cold * 1e3:.0f} ms, first with the tier {write * 1e3:.0f} ms, after the restart "
              f"{warm * 1e3:.0f} ms ({cached} of {len(ids)} tokens from disk, {disk / 2**20:.0f} MiB on disk)",
              flush=True)
    cold, write, warm = (statistics.median(x) for x in zip(*rows))
    print(f"\n| prompt tokens | cold ms | first with the tier ms | after a restart ms | restart / cold |\n"
          f"|---:|---:|---:|---:|---:|\n| {args.tokens} | {cold * 1e3:.0f} | {write * 1e3:.0f} | {warm * 1e3:.0f} | "
          f"{warm / cold:.2f} |")


if __name__ == "__main__":
    main()
