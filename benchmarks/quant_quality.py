"""Quality cost of pdserve's weight modes on a fixed text: perplexity, and KL / top-1 agreement against float32.

    .venv/bin/python benchmarks/quant_quality.py [--model smollm2-135m] [--out out/quant_quality.json]

Runs the model over the text below (English and Chinese) through pdserve's own runner, in chunks: chunks of 4 tokens
take the small-batch paths (native GGUF-block GEMV; PyTorch int8 kernel with bf16 activations), chunks of 256 the
large-batch ones. Every mode sees the same tokens; logits of every position are compared with those of the float32
reference (the GGUF weights dequantized to fp32, PyTorch path). `native Q4_1` is the default model's own blocks read
by the native kernels (int8-quantized activations, as llama.cpp); `native int8/int4` re-quantize the fp32 weights.
The `... KV` rows keep the default model's blocks and change only `--kv-cache-dtype` (fp32, bf16, int8, fp8 e4m3 /
e5m2): every position reads its keys from the cache as stored (`--kv-only`: the reference, torch bf16 weights (what
bf16 weights alone cost) and those rows only; `--max-tokens N`: the first N tokens;
`--text-file`: another text, e.g. a longer one).

With `--llama-server PATH` llama.cpp is measured on the same GGUF file and tokens: for each position one
`/completion` request (the prefix as token ids, prompt cache on, one token forced to the text's next token by a
logit bias) returns the forced token's probability before sampling (so the perplexity is exact) and the top
`--llama-top` tokens (top-1 agreement exact). llama-server does not return the whole distribution, so KL is also
given for every mode over the same coarse distribution: llama.cpp's top tokens at that position plus one bucket for
the rest (a lower bound of the full KL, comparable across rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import httpx
import torch

from pdserve.config import EngineConfig
from pdserve.launch import free_port, start_process
from pdserve.model.inputs import ScheduledRequest, SchedulerOutput
from pdserve.model.kv_cache_dtype import kv_torch_dtype
from pdserve.model.loader import load_model, resolve_model_path
from pdserve.model.runner import ModelRunner

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could produce books far faster than "
    "scribes. Within fifty years, presses were running in more than two hundred European cities, and the price of "
    "books fell sharply. Scholars could compare identical copies of a text, which made errors easier to find and "
    "knowledge easier to share. The press also spread pamphlets, newspapers and religious tracts, and historians "
    "still debate how much it contributed to the Reformation and the scientific revolution.\n\n"
    "活字印刷术是中国古代四大发明之一。北宋时期，毕昇发明了泥活字印刷，比欧洲早了大约四百年。他先用胶泥刻成单个的字，"
    "再用火烧硬，排版时把字按顺序放在铁板上，印完以后还可以拆下来重复使用。后来人们又发明了木活字和铜活字。"
    "印刷术的发展大大降低了书籍的成本，让更多的人有机会读书学习，也促进了文化的传播和交流。\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
)


def position_logprobs(runner: ModelRunner, ids: list[int], chunk: int, prompt: bool = False) -> torch.Tensor:
    """log-softmax of the logits at every position, computed `chunk` tokens per forward pass; `prompt`: every
    position is a prompt row (as when a prompt is prefilled; native attention may run them on AMX tiles), else
    every row computes as a generated token's does."""
    n = len(ids)
    table = list(range(-(-n // runner.block_size)))
    out = []
    with torch.inference_mode():
        for c in range(0, n, chunk):
            m = min(chunk, n - c)
            sched = SchedulerOutput(scheduled_reqs=[ScheduledRequest("q", ids[c:c + m], c, table, True,
                                                                      num_prompt_tokens=n if prompt else 0)],
                                    num_prefill_tokens=m)
            inp = runner.prepare(sched)
            hidden = runner.model(inp.input_ids, inp.positions, runner.kv_cache, inp.meta)
            out.append(runner.model.compute_logits(hidden).log_softmax(-1))
    return torch.cat(out)


def llama_cpp_positions(server: str, gguf: str, ids: list[int],
                        top: int) -> tuple[list[int], list[float], torch.Tensor, torch.Tensor]:
    """Where llama.cpp answered (positions p of 0..n-2 predicting token p+1), its log-probability of the next token
    of `ids` there, and its top-`top` token ids and their log-probabilities ([len, top] each): one request a
    position, the text's token forced by a logit
    bias; probabilities are the raw softmax before any sampler, so the bias does not change them."""
    port = free_port()
    srv = start_process([server, "-m", gguf, "-t", "2", "-c", str(len(ids) + 64), "-np", "1", "--host", "127.0.0.1",
                         "--port", str(port)], f"http://127.0.0.1:{port}", Path("out") / "llama-quality.log")
    positions, logprobs, tops, top_lps = [], [], [], []
    try:
        with httpx.Client(timeout=120) as http:
            for i in range(1, len(ids)):
                entry = _forced_entry(http, srv.base_url, ids, i, top)
                if entry is None:
                    continue
                assert entry["id"] == ids[i], (i, entry["id"], ids[i])
                positions.append(i - 1)
                logprobs.append(float(entry["logprob"]))
                tops.append([t["id"] for t in entry["top_logprobs"]])
                top_lps.append([float(t["logprob"]) for t in entry["top_logprobs"]])
    finally:
        srv.stop()
    return positions, logprobs, torch.tensor(tops), torch.tensor(top_lps)


def _forced_entry(http: httpx.Client, url: str, ids: list[int], i: int, top: int) -> dict | None:
    """llama-server's probabilities of the token forced at position i (a logit bias), or None where it sends none:
    a token that ends inside a UTF-8 character (a byte of a CJK character) is held back with its probabilities
    until the character completes, which one forced token cannot do."""
    body = {"prompt": ids[:i], "n_predict": 1, "n_probs": top, "cache_prompt": True, "temperature": 0,
            "logit_bias": [[ids[i], 100.0]], "post_sampling_probs": False}
    r = http.post(url + "/completion", json=body)
    r.raise_for_status()
    probs = r.json().get("completion_probabilities")
    return dict(probs[0]) if probs else None


def coarse_kl(ref: torch.Tensor, pos: torch.Tensor, sets: torch.Tensor, lp: torch.Tensor | None = None,
              set_lp: torch.Tensor | None = None) -> torch.Tensor:
    """KL(ref || q) at positions `pos` over the tokens of `sets` plus one bucket for the rest; q is the full `lp`
    or, for llama.cpp, only its log-probabilities on the sets (`set_lp`)."""
    ps = ref[pos].exp().gather(1, sets)
    if set_lp is not None:
        qs = set_lp.exp()
    else:
        assert lp is not None
        qs = lp[pos].exp().gather(1, sets)
    pr, qr = (1 - ps.sum(1)).clamp_min(1e-12), (1 - qs.sum(1)).clamp_min(1e-12)
    return (ps * (ps.log() - qs.log())).sum(1) + pr * (pr.log() - qr.log())


def llama_cpp_row(args: argparse.Namespace, ids: list[int],
                  ref: torch.Tensor) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    """llama.cpp's row, over the positions it answered (top-1 and KL against the fp32 reference there); the
    reference's own perplexity on those positions beside it."""
    gguf = str(resolve_model_path(args.model))
    positions, logprobs, sets, set_lp = llama_cpp_positions(args.llama_server, gguf, ids, args.llama_top)
    pos = torch.tensor(positions)
    nll = -sum(logprobs) / len(logprobs)
    ref_nll = -ref[pos].gather(1, torch.tensor(ids)[pos + 1].unsqueeze(1)).mean().item()
    agree = (sets[:, 0] == ref[pos].argmax(-1)).float().mean()
    row = {"mode": f"llama.cpp llama-server, same file ({len(positions)} of {len(ids) - 1} positions)",
           "weight_bytes": Path(gguf).stat().st_size, "tokens": len(ids), "perplexity": round(math.exp(nll), 4),
           "fp32_perplexity_same_positions": round(math.exp(ref_nll), 4),
           "top1_agreement_vs_fp32": float(agree),
           "kl_coarse_vs_fp32": float(coarse_kl(ref, pos, sets, set_lp=set_lp).mean())}
    return row, (pos, sets)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--llama-server", default=None, help="also measure llama.cpp's llama-server on the same file")
    ap.add_argument("--kv-only", action="store_true", help="the fp32 reference and the KV cache dtype rows only")
    ap.add_argument("--text-file", default=None, help="score this UTF-8 text instead of the built-in one")
    ap.add_argument("--llama-top", type=int, default=100, help="top tokens llama-server returns a position")
    ap.add_argument("--max-tokens", type=int, default=0, help="score the text's first N tokens only (0: all)")
    ap.add_argument("--long-from", type=int, default=2048,
                    help="KV rows also report KL / top-1 over the positions from this one on (long context)")
    args = ap.parse_args()
    text = open(args.text_file, encoding="utf-8").read() if args.text_file else TEXT
    # (dtype, --quantization, kernels, keep GGUF blocks, chunk, --kv-cache-dtype, positions as prompt rows)
    modes = [("float32", None, "torch", False, 256, "auto", False), ("float32", None, "native", True, 4, "auto", False),
             ("float32", None, "native", True, 256, "auto", False),
             ("float32", "int8", "native", False, 4, "auto", False),
             ("float32", "int4", "native", False, 4, "auto", False),
             ("float32", "int8", "torch", False, 4, "auto", False),
             ("float32", "int8", "torch", False, 256, "auto", False),
             ("bfloat16", None, "torch", False, 256, "auto", False),
             ("bfloat16", None, "native", True, 256, "auto", False)]
    kv_modes = [("float32", None, "native", True, 256, kv, False) for kv in ("bf16", "int8", "fp8", "fp8_e5m2")]
    kv_modes.insert(1, ("float32", None, "native", True, 256, "bf16", True))
    # the default on a CPU with native bf16: bf16 KV, and prompt rows may take bf16 linears (AMX) as well
    kv_modes.insert(2, ("bfloat16", None, "native", True, 256, "auto", True))
    # the KV formats on the PyTorch path with fp32 weights: the KV format's own cost against the fp32 reference,
    # free of the native path's quantized activations (which amplify any small change into a KL floor)
    kv_modes += [("float32", None, "torch", False, 256, kv, False) for kv in ("bf16", "int8", "fp8")]
    # --kv-only keeps the torch bf16-weights row: what bf16 weights alone cost, the bar for a KV format's own cost
    modes = [modes[0], modes[2], modes[7], *kv_modes] if args.kv_only else modes + kv_modes
    kv_ref: torch.Tensor | None = None  # the native fp32-KV run: the KV rows' own reference
    tok = None
    ref: torch.Tensor | None = None
    llama_sets: tuple[torch.Tensor, torch.Tensor] | None = None  # positions llama.cpp answered, its top tokens
    llama_row: dict | None = None
    rows = []
    for dtype_name, quant, kernels, blocks, chunk, kv, prompt in modes:
        cfg = EngineConfig(model=args.model, dtype=dtype_name, quantization=quant, kernels=kernels, kv_cache_dtype=kv)
        loaded = load_model(cfg.model, dtype=cfg.torch_dtype, keep_quantized=blocks)
        tok = tok or loaded.tokenizer()
        ids = tok.encode(text)
        ids = ids[:args.max_tokens] if args.max_tokens else ids
        runner = ModelRunner(loaded.arch, loaded.state_dict, cfg.torch_dtype, -(-len(ids) // 16) + 1, 16,
                             len(ids) + 16, kernels=kernels, quantization=quant,
                             kv_cache_dtype=kv_torch_dtype(cfg.kv_storage))
        t0 = time.perf_counter()
        lp = position_logprobs(runner, ids, chunk, prompt).float()
        secs = time.perf_counter() - t0
        target = torch.tensor(ids[1:])
        nll = -lp[:-1].gather(1, target.unsqueeze(1)).mean().item()
        dtype_note = " (dtype bfloat16)" if dtype_name == "bfloat16" else ""
        label = f"native GGUF blocks{dtype_note}, {cfg.kv_storage} KV" if blocks else f"{kernels} {dtype_name}" + (
            f"+{quant}" if quant else "") + ("" if kv == "auto" else f", {cfg.kv_storage} KV")
        row = {"mode": f"{label} (chunks of {chunk}{', prompt rows' if prompt else ''})",
               "weight_bytes": runner.weight_bytes, "tokens": len(ids), "perplexity": round(math.exp(nll), 4),
               "seconds": round(secs, 2)}
        if ref is None:
            ref = lp
            if args.llama_server:
                llama_row, llama_sets = llama_cpp_row(args, ids, ref)
                print(json.dumps(llama_row, ensure_ascii=False), flush=True)
        else:
            kl = (ref.exp() * (ref - lp)).sum(-1)
            agree = (lp.argmax(-1) == ref.argmax(-1)).float()
            row.update(mean_kl_vs_fp32=float(kl.mean()), max_kl_vs_fp32=float(kl.max()),
                       top1_agreement_vs_fp32=float(agree.mean()))
            if len(ids) > args.long_from:
                row.update(mean_kl_vs_fp32_long=float(kl[args.long_from:].mean()),
                           top1_agreement_vs_fp32_long=float(agree[args.long_from:].mean()))
            if llama_sets is not None:
                pos, sets = llama_sets
                row["kl_coarse_vs_fp32"] = float(coarse_kl(ref, pos, sets, lp).mean())
                row["top1_agreement_llama_positions"] = float((lp[pos].argmax(-1) == ref[pos].argmax(-1))
                                                              .float().mean())
        if blocks and chunk == 256 and cfg.kv_storage == "float32":
            kv_ref = lp
        elif blocks and kv != "auto" and kv_ref is not None:
            kl = (kv_ref.exp() * (kv_ref - lp)).sum(-1)
            agree = (lp.argmax(-1) == kv_ref.argmax(-1)).float()
            row.update(mean_kl_vs_fp32_kv=float(kl.mean()), max_kl_vs_fp32_kv=float(kl.max()),
                       top1_agreement_vs_fp32_kv=float(agree.mean()))
            if len(ids) > args.long_from:
                row.update(long_from=args.long_from, mean_kl_vs_fp32_kv_long=float(kl[args.long_from:].mean()),
                           top1_agreement_vs_fp32_kv_long=float(agree[args.long_from:].mean()))
        rows.append(row)
        print(json.dumps(row, ensure_ascii=False), flush=True)
    if llama_row is not None:
        rows.insert(1, llama_row)
    print(render(rows))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"text_tokens": rows[0]["tokens"], "rows": rows}, f, ensure_ascii=False, indent=1)
    return 0


def render(rows: list[dict]) -> str:
    def num(r: dict, key: str, spec: str) -> str:
        v = r.get(key, 0 if r is rows[0] else None)
        return "n/a" if v is None else format(v, spec)

    lines = ["| mode | weight MB | perplexity | mean KL vs fp32 | max KL | KL, llama.cpp's top tokens + rest | "
             "top-1 agreement | top-1, llama.cpp's positions |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top1_llama = r.get("top1_agreement_llama_positions", r["top1_agreement_vs_fp32"] if "llama" in r["mode"]
                           else None)
        lines.append(f"| {r['mode']} | {r['weight_bytes'] / 1e6:.0f} | {r['perplexity']:.3f} | "
                     f"{num(r, 'mean_kl_vs_fp32', '.5f')} | {num(r, 'max_kl_vs_fp32', '.4f')} | "
                     f"{num(r, 'kl_coarse_vs_fp32', '.5f')} | {r.get('top1_agreement_vs_fp32', 1):.2%} | "
                     f"{'n/a' if top1_llama is None else format(top1_llama, '.2%')} |")
    lines += ["", "| KV cache dtype (same weights) | mean KL vs fp32 KV | max KL | top-1 agreement | "
              "mean KL, long positions | top-1, long positions |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['mean_kl_vs_fp32_kv']:.5f} | {r['max_kl_vs_fp32_kv']:.4f} | "
              f"{r['top1_agreement_vs_fp32_kv']:.2%} | {num(r, 'mean_kl_vs_fp32_kv_long', '.5f')} | "
              f"{'n/a' if 'long_from' not in r else format(r['top1_agreement_vs_fp32_kv_long'], '.2%')} |"
              for r in rows if "mean_kl_vs_fp32_kv" in r]
    return "\n" + "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
