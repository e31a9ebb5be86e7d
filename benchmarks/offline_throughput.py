"""Offline throughput: pdserve (continuous batching) against Hugging Face transformers `generate` (static batching)
on the same weights, in one process, one after the other, so the ratio comes from one run.

Workload: --num-prompts requests of random token ids (seeded), prompt lengths uniform in [--min-input, --max-input],
output lengths uniform in [--min-output, --max-output], greedy, ignore_eos so every request produces exactly its
requested number of tokens.

* pdserve: one `LLM.generate` over all requests. Output tok/s = sum of output tokens / wall time;
  total tok/s = sum of (prompt + output) tokens / wall time.
* transformers: requests in arrival order, in batches of --hf-batch-size, left-padded with an attention mask; each
  batch runs `generate(max_new_tokens=M, min_new_tokens=M, do_sample=False)` with M the batch's largest requested
  output. Only each request's own requested output tokens count as useful output (the tokens a static batch
  generates past a request's length, and the padding, are the waste continuous batching avoids), so both engines
  are credited with exactly the same tokens.
* batch-1 decode ms/token: (wall time of 129 new tokens - wall time of 1 new token) / 128 from a 32-token prompt,
  median of 3, for both (pdserve also reports its per-request TPOT metric).
* 512-token prefill: wall time of a single 512-token prompt with 1 new token, median of 3, for both
  (pdserve also reports metrics.prefill_time; transformers also a bare forward of [1, 512]).

Every timed pdserve request uses a fresh random prompt, so the prefix cache never serves a timed prompt.

    .venv/bin/python benchmarks/offline_throughput.py [--skip-hf] [--json results.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import random
import shlex
import statistics
import sys
import time
from typing import Any

import torch

from pdserve import SamplingParams
from pdserve.config import parse_dtype
from pdserve.llm import LLM
from pdserve.model.loader import load_model
from pdserve.roofline import machine_info

DECODE_PROMPT_LEN = 32
DECODE_TOKENS = 128
PREFILL_LEN = 512
REPEATS = 3


# --------------------------------------------------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------------------------------------------------


class Workload:
    """Seeded random prompts; every call to `prompt` draws fresh ids so no two timed prompts share a prefix."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.rng = random.Random(seed)
        self.lo, self.hi = 100, vocab_size - 100

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(length)]

    def requests(self, n: int, min_in: int, max_in: int, min_out: int, max_out: int) -> list[tuple[list[int], int]]:
        lengths = [(self.rng.randint(min_in, max_in), self.rng.randint(min_out, max_out)) for _ in range(n)]
        return [(self.prompt(p), o) for p, o in lengths]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# --------------------------------------------------------------------------------------------------------------------
# pdserve
# --------------------------------------------------------------------------------------------------------------------


def _pd_params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _pd_generate(llm: LLM, reqs: list[tuple[list[int], int]],
                 rec: StepRecorder | None = None) -> tuple[float, list[Any]]:
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [_pd_params(n) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, on_step=rec.add if rec is not None else None)
    wall = time.perf_counter() - t0
    for out, (_, n) in zip(outs, reqs):
        comp = out.outputs[0]
        if out.error or len(comp.token_ids) != n:
            raise RuntimeError(f"pdserve request {out.request_id} failed: error={out.error!r}, "
                               f"finish_reason={comp.finish_reason!r}, {len(comp.token_ids)} of {n} tokens")
    return wall, outs


class StepRecorder:
    """Collects each step's StepStats (pass `rec.add` as `LLM.generate(on_step=...)`)."""

    def __init__(self) -> None:
        self.stats: list[Any] = []

    def add(self, stats: Any) -> None:
        self.stats.append(stats)

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, list[Any]] = {}
        for s in self.stats:
            kinds.setdefault(s.kind, []).append(s)
        out: dict[str, Any] = {"num_steps": len(self.stats)}
        for kind, ss in kinds.items():
            out[kind] = {"steps": len(ss), "seconds": sum(s.duration for s in ss),
                         "mean_ms": 1e3 * sum(s.duration for s in ss) / len(ss),
                         "mean_decode_tokens": sum(s.num_decode_tokens for s in ss) / len(ss),
                         "mean_prefill_tokens": sum(s.num_prefill_tokens for s in ss) / len(ss)}
        out["num_preempted"] = sum(s.num_preempted for s in self.stats)
        return out


def bench_pdserve(args: argparse.Namespace, wl: Workload, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads)
    load_s = time.perf_counter() - t0
    print(f"[pdserve] engine ready in {load_s:.1f}s", file=sys.stderr)

    # warm-up (not timed): a small mixed batch, a full-chunk prefill and a batch-1 decode
    _pd_generate(llm, [(wl.prompt(64), 16), (wl.prompt(200), 8), (wl.prompt(400), 8), (wl.prompt(32), 24)])
    _pd_generate(llm, [(wl.prompt(PREFILL_LEN), 1)])
    _pd_generate(llm, [(wl.prompt(DECODE_PROMPT_LEN), 16)])

    # throughput: one generate over everything
    rec = StepRecorder()
    cpu0 = time.process_time()
    wall, outs = _pd_generate(llm, reqs, rec)
    cpu_share = (time.process_time() - cpu0) / (wall * args.threads)
    n_in = sum(len(ids) for ids, _ in reqs)
    n_out = sum(n for _, n in reqs)
    ttfts = [o.metrics.ttft for o in outs]
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    print(f"[pdserve] throughput run: {n_out} output tokens in {wall:.1f}s ({n_out / wall:.1f} tok/s, "
          f"cpu share {cpu_share:.2f})", file=sys.stderr)

    # batch-1 decode: (129 tokens - 1 token) / 128, each run on a fresh prompt
    t_long, t_short, tpot_b1 = [], [], []
    for _ in range(REPEATS):
        w, o = _pd_generate(llm, [(wl.prompt(DECODE_PROMPT_LEN), DECODE_TOKENS + 1)])
        t_long.append(w)
        tpot_b1.append(o[0].metrics.tpot)
        t_short.append(_pd_generate(llm, [(wl.prompt(DECODE_PROMPT_LEN), 1)])[0])
    decode_ms = 1e3 * (_median(t_long) - _median(t_short)) / DECODE_TOKENS

    # 512-token prefill
    pre_wall, pre_metric = [], []
    for _ in range(REPEATS):
        w, o = _pd_generate(llm, [(wl.prompt(PREFILL_LEN), 1)])
        pre_wall.append(w)
        pre_metric.append(o[0].metrics.prefill_time)

    res = {
        "engine": "pdserve",
        "load_s": load_s,
        "wall_s": wall,
        "cpu_share": cpu_share,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_in + n_out) / wall,
        "mean_ttft_s": statistics.mean(ttfts),
        "mean_tpot_ms": 1e3 * statistics.mean(tpots),
        "steps": rec.summary(),
        "decode_b1_ms_per_token": decode_ms,
        "decode_b1_tpot_metric_ms": 1e3 * _median(tpot_b1),
        "decode_b1_wall_129_s": t_long,
        "decode_b1_wall_1_s": t_short,
        "prefill_512_ms": 1e3 * _median(pre_wall),
        "prefill_512_metric_ms": 1e3 * _median(pre_metric),
        "prefill_512_wall_s": pre_wall,
        "engine_options": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                           "kv_cache_memory": args.kv_cache_memory, "num_kv_blocks": llm.engine.num_blocks,
                           "block_size": llm.engine.block_size},
        "_outputs": [o.outputs[0].token_ids for o in outs],
    }
    del llm, outs, rec
    gc.collect()
    return res


# --------------------------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------------------------


def build_hf_model(model: str | None, dtype: torch.dtype) -> tuple[Any, int]:
    import transformers

    lm = load_model(model, dtype=dtype)
    cfg = transformers.AutoConfig.for_model(**lm.hf_config)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    missing, unexpected = hf.load_state_dict(lm.state_dict, strict=False)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing}, unexpected={unexpected}")
    hf = hf.to(dtype).eval()
    if tied and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens after loading")
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    del lm
    return hf, int(pad)


@torch.inference_mode()
def _hf_generate(hf: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=pad_id)
    wall = time.perf_counter() - t0
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {new_tokens}")
    return wall, out[:, width:]


def bench_hf(args: argparse.Namespace, wl: Workload, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    import transformers

    t0 = time.perf_counter()
    hf, pad_id = build_hf_model(args.model, parse_dtype(args.dtype))
    load_s = time.perf_counter() - t0
    print(f"[transformers] model ready in {load_s:.1f}s (attn={hf.config._attn_implementation})", file=sys.stderr)

    # warm-up (not timed)
    _hf_generate(hf, [wl.prompt(64), wl.prompt(200)], 16, pad_id)
    _hf_generate(hf, [wl.prompt(PREFILL_LEN)], 1, pad_id)
    _hf_generate(hf, [wl.prompt(DECODE_PROMPT_LEN)], 16, pad_id)

    # throughput: static batches in arrival order
    bs = args.hf_batch_size
    wall, generated, outputs, batches = 0.0, 0, [], []
    cpu0 = time.process_time()
    for start in range(0, len(reqs), bs):
        batch = reqs[start:start + bs]
        m = max(n for _, n in batch)
        w, toks = _hf_generate(hf, [ids for ids, _ in batch], m, pad_id)
        wall += w
        generated += m * len(batch)
        outputs += [toks[i, :n].tolist() for i, (_, n) in enumerate(batch)]
        batches.append({"size": len(batch), "max_input": max(len(ids) for ids, _ in batch), "max_new_tokens": m,
                        "seconds": w})
        print(f"[transformers] batch {len(batches)}: {len(batch)} x {m} new tokens in {w:.1f}s", file=sys.stderr)
    cpu_share = (time.process_time() - cpu0) / (wall * args.threads)
    n_in = sum(len(ids) for ids, _ in reqs)
    n_out = sum(n for _, n in reqs)
    print(f"[transformers] throughput run: {n_out} useful output tokens in {wall:.1f}s ({n_out / wall:.1f} tok/s, "
          f"cpu share {cpu_share:.2f})", file=sys.stderr)

    # batch-1 decode: same prompt for both lengths (transformers keeps no cache between calls)
    t_long, t_short = [], []
    for _ in range(REPEATS):
        p = wl.prompt(DECODE_PROMPT_LEN)
        t_long.append(_hf_generate(hf, [p], DECODE_TOKENS + 1, pad_id)[0])
        t_short.append(_hf_generate(hf, [p], 1, pad_id)[0])
    decode_ms = 1e3 * (_median(t_long) - _median(t_short)) / DECODE_TOKENS

    # 512-token prefill: generate(max_new_tokens=1), and a bare forward
    pre_wall, pre_fwd = [], []
    for _ in range(REPEATS):
        p = wl.prompt(PREFILL_LEN)
        pre_wall.append(_hf_generate(hf, [p], 1, pad_id)[0])
        with torch.inference_mode():
            x = torch.tensor([p])
            t1 = time.perf_counter()
            hf(input_ids=x, use_cache=True, logits_to_keep=1)
            pre_fwd.append(time.perf_counter() - t1)

    res = {
        "engine": "transformers",
        "version": transformers.__version__,
        "attn_implementation": hf.config._attn_implementation,
        "load_s": load_s,
        "batch_size": bs,
        "wall_s": wall,
        "cpu_share": cpu_share,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "generated_tokens_incl_waste": generated,
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_in + n_out) / wall,
        "generated_tok_s_incl_waste": generated / wall,
        "batches": batches,
        "decode_b1_ms_per_token": decode_ms,
        "decode_b1_wall_129_s": t_long,
        "decode_b1_wall_1_s": t_short,
        "prefill_512_ms": 1e3 * _median(pre_wall),
        "prefill_512_forward_ms": 1e3 * _median(pre_fwd),
        "prefill_512_wall_s": pre_wall,
        "_outputs": outputs,
    }
    del hf
    gc.collect()
    return res


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How many requests produced identical greedy tokens in both engines (bf16 batching may flip near-ties)."""
    exact = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return {"identical_requests": exact, "requests": len(a), "mean_common_prefix_fraction": statistics.mean(prefix)}


def markdown(pd: dict[str, Any], hf: dict[str, Any] | None) -> str:
    cols = ["output tok/s", "total tok/s", "batch-1 decode ms/token", "512-token prefill ms"]
    keys = ["output_tok_s", "total_tok_s", "decode_b1_ms_per_token", "prefill_512_ms"]
    lines = ["| engine | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    rows = [("pdserve", pd)] + ([(f"transformers (static batch {hf['batch_size']})", hf)] if hf else [])
    for name, r in rows:
        lines.append(f"| {name} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    if hf:
        lines.append("| **pdserve / transformers** | " + " | ".join(f"**{pd[k] / hf[k]:.2f}x**" for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or name (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-input", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 with native CPU bf16, else float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    ap.add_argument("--json", metavar="OUT", help="write all results as JSON to OUT")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_info(args.threads)
    resolved_dtype = str(parse_dtype(args.dtype)).removeprefix("torch.")  # "auto" depends on the CPU
    dtype_desc = args.dtype if args.dtype == resolved_dtype else f"{args.dtype} -> {resolved_dtype}"

    # vocabulary size from the model's config, so the ids are valid for it
    vocab = load_model(args.model, dtype=parse_dtype(args.dtype)).hf_config["vocab_size"]
    gc.collect()
    reqs = Workload(args.seed, vocab).requests(args.num_prompts, args.min_input, args.max_input, args.min_output,
                                              args.max_output)
    # the same fresh-prompt stream for both engines (warm-up, batch-1 and prefill prompts)
    loadavg = [os.getloadavg()[0]]  # other processes on the machine skew both engines; record it

    def write_json(pd: dict[str, Any], hf: dict[str, Any] | None, agree: dict[str, float] | None) -> None:
        if not args.json:
            return
        results = {"date": date, "command": command, "machine": machine, "dtype": resolved_dtype,
                   "loadavg_1min": loadavg, "args": vars(args),
                   "pdserve": {k: v for k, v in pd.items() if not k.startswith("_")},
                   "transformers": {k: v for k, v in hf.items() if not k.startswith("_")} if hf else None,
                   "ratio": {k: pd[k] / hf[k] for k in ("output_tok_s", "total_tok_s", "decode_b1_ms_per_token",
                                                        "prefill_512_ms")} if hf else None,
                   "greedy_agreement": agree}
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

    pd = bench_pdserve(args, Workload(args.seed + 1, vocab), reqs)
    loadavg.append(os.getloadavg()[0])
    write_json(pd, None, None)  # a partial result survives if the transformers half dies
    print(markdown(pd, None), file=sys.stderr)
    hf = None if args.skip_hf else bench_hf(args, Workload(args.seed + 1, vocab), reqs)
    if hf:
        loadavg.append(os.getloadavg()[0])
    agree = greedy_agreement(pd["_outputs"], hf["_outputs"]) if hf else None
    write_json(pd, hf, agree)

    n_in = sum(len(ids) for ids, _ in reqs)
    n_out = sum(n for _, n in reqs)
    print(f"\n## Offline throughput ({date})\n")
    print(f"Command: `{command}`\n")
    print(f"Machine: {machine['cpu']}, {machine['cores']} cores ({', '.join(machine['isa'])}; torch CPU capability "
          f"{machine['torch_cpu_capability']}), torch {machine['torch']}, {args.threads} threads, dtype {dtype_desc}"
          + (f", transformers {hf['version']}" if hf else "")
          + f"; 1-min load average before/between/after: {' / '.join(f'{x:.2f}' for x in loadavg)}\n")
    print(f"Workload: {args.num_prompts} requests, prompts {args.min_input}-{args.max_input} tokens "
          f"({n_in} total), outputs {args.min_output}-{args.max_output} tokens ({n_out} total), seed {args.seed}, "
          f"greedy, ignore_eos. pdserve: one generate(), max_num_seqs={args.max_num_seqs}, "
          f"max_num_batched_tokens={args.max_num_batched_tokens} (a 512-token prompt is "
          f"{'one chunk' if args.max_num_batched_tokens >= PREFILL_LEN else 'chunked'}), "
          f"kv_cache_memory={args.kv_cache_memory}." + (
              f" transformers: generate() in arrival-order static batches of {args.hf_batch_size}, left-padded; "
              f"output tok/s counts only each request's requested tokens ({n_out}), not the "
              f"{hf['generated_tokens_incl_waste']} it generated." if hf else "") + "\n")
    print(markdown(pd, hf))
    if hf:
        print("\nRatios are pdserve / transformers: above 1 is better for tok/s, below 1 is better for ms.")
    shares = [r["cpu_share"] for r in (pd, hf) if r]
    print(f"\nCPU share of the throughput runs (process CPU time / (wall x threads)): "
          f"{' / '.join(f'{x:.2f}' for x in shares)}"
          + ("  **WARNING: other processes competed for the cores; these timings are not trustworthy**"
             if min(shares) < 0.9 else ""))
    print(f"\npdserve: {pd['wall_s']:.1f}s wall, mean TTFT {pd['mean_ttft_s']:.2f}s, mean TPOT "
          f"{pd['mean_tpot_ms']:.1f} ms, batch-1 TPOT metric {pd['decode_b1_tpot_metric_ms']:.1f} ms, "
          f"512 prefill metric {pd['prefill_512_metric_ms']:.1f} ms, steps {json.dumps(pd['steps'])}")
    if hf:
        print(f"transformers: {hf['wall_s']:.1f}s wall, {hf['generated_tok_s_incl_waste']:.1f} generated tok/s "
              f"incl. waste, 512 forward {hf['prefill_512_forward_ms']:.1f} ms")
        print(f"greedy agreement: {agree['identical_requests']}/{agree['requests']} identical, mean common prefix "
              f"{agree['mean_common_prefix_fraction']:.2f}")


if __name__ == "__main__":
    main()
