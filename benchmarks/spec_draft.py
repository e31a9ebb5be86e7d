"""Decode rate at batch 1 with a draft model (`draft_model` speculative decoding) against no speculation.

The target is the default model's own weights in fp32 (the shipped GGUF converted once to a Hugging Face directory,
`pdserve convert`) or those weights quantized to int8 at load; the draft is the shipped Q4_1 GGUF. Two prompts,
chat-templated: an editing task over real source code shipped with Python (the answer copies much of the prompt)
and a prompt of random words (nothing to copy). Each configuration generates the same greedy continuation; the
rounds alternate the configurations so that machine noise falls on all of them alike.

    .venv/bin/python benchmarks/spec_draft.py [--max-tokens 128] [--rounds 3] [--k 4] [--out out/spec_draft.json]

Reports per (target, prompt, config): decode tok/s ((output tokens - 1) / (finished - first token), median over
rounds), the speedup against no speculation, and the draft acceptance rate and mean acceptance length.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch

from pdserve import SamplingParams
from pdserve.llm import LLM
from pdserve.model.convert import convert_gguf_to_hf
from pdserve.model.loader import resolve_model_path
from pdserve.roofline import machine_info


def prompts(llm: LLM) -> dict[str, str]:
    """The two chat-templated prompts (as text)."""
    import json as json_module

    source = textwrap.dedent(inspect.getsource(json_module.dumps))[:2400]
    rng = random.Random(0)
    words = "river glass orbit pencil thunder maple velvet cobalt lantern quartz fig harbor".split()
    chats = {
        "edit_code": "Rewrite this Python function with the same code but every comment removed. Output only the "
                     "code.\n\n" + source,
        "random_words": "Continue this list: " + " ".join(rng.choice(words) for _ in range(120)),
    }
    tok = llm.engine.tokenizer
    return {name: tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True) for name, text in chats.items()}


def run_one(llm: LLM, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    t = out.metrics
    assert t is not None and t.first_token is not None and t.finished is not None
    n = len(out.outputs[0].token_ids)
    return (n - 1) / (t.finished - t.first_token), list(out.outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--targets", default="fp32,int8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    draft = resolve_model_path(None)
    results: dict[str, Any] = {"machine": machine_info(), "draft": Path(draft).name, "k": args.k,
                               "max_tokens": args.max_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        fp32_dir = str(Path(tmp) / "fp32")
        convert_gguf_to_hf(draft, fp32_dir, dtype=torch.float32)
        for target in args.targets.split(","):
            opts: dict[str, Any] = dict(model=fp32_dir, dtype="float32", kv_cache_memory="256MiB",
                                        quantization="int8" if target == "int8" else None, device_peaks="off")
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
            llms = {"none": LLM(**opts), "draft_q4": LLM(**opts, speculative_config=spec)}
            texts = prompts(llms["none"])
            rates: dict[tuple[str, str], list[float]] = {}
            outputs: dict[tuple[str, str], list[int]] = {}
            counts = {pname: [0, 0, 0] for pname in texts}  # drafts, draft tokens, accepted
            stats = llms["draft_q4"].engine.spec.stats  # type: ignore[union-attr]
            for _ in range(args.rounds):
                for pname, text in texts.items():
                    for cname, llm in llms.items():
                        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
                        rate, toks = run_one(llm, text, args.max_tokens)
                        after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
                        counts[pname] = [c + a - b for c, a, b in zip(counts[pname], after, before)]
                        rates.setdefault((pname, cname), []).append(rate)
                        outputs[(pname, cname)] = toks
            for pname in texts:
                assert outputs[(pname, "none")] == outputs[(pname, "draft_q4")], "speculation changed greedy output"
                drafts, drafted, accepted = counts[pname]
                acc = {"target": target, "prompt": pname, "acceptance_rate": round(accepted / max(drafted, 1), 3),
                       "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 2)}
                results.setdefault("acceptance", []).append(acc)
                print(json.dumps(acc), flush=True)
            for pname in texts:
                base = statistics.median(rates[(pname, "none")])
                for cname in llms:
                    r = statistics.median(rates[(pname, cname)])
                    row = {"target": target, "prompt": pname, "config": cname, "decode_tok_s": round(r, 1),
                           "speedup": round(r / base, 2), "rounds": [round(x, 1) for x in rates[(pname, cname)]]}
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
