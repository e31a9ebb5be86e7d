"""Checks of single requests: short requests, long context near the model's limit, streaming well-formedness."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from pdserve.bench.client import error_message
from pdserve.poc.check import FAIL, FILLER, PASS, SKIPPED, CheckResult, RunLog, error_counts, has_mojibake, prompt
from pdserve.poc.config import PocConfig
from pdserve.poc.target import PocTarget


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 1) if values else None


async def check_short(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    """A handful of short prompts (half Chinese), streamed one after another: all succeed."""
    n, out = cfg.sizes.short_requests, cfg.sizes.short_output_len
    recs = []
    for i in range(n):
        tenant = cfg.tenants[i % len(cfg.tenants)]
        recs.append(log.add(res.name, tenant, await t.stream(prompt(i), out, tenant, i)))
    ok = [r for r in recs if r.success]
    garbled = [r.generated_text[:80] for r in ok if has_mojibake(r.generated_text)]
    res.evidence = {"requests": n, "succeeded": len(ok), "errors": error_counts(recs),
                    "ttft_p50_ms": _ms([r.ttft for r in ok], 50), "ttft_p99_ms": _ms([r.ttft for r in ok], 99),
                    "e2el_p50_ms": _ms([r.e2el for r in ok], 50),
                    "samples": [{"prompt": prompt(i), "text": r.generated_text[:120]} for i, r in enumerate(recs[:2])],
                    "garbled_texts": garbled}
    # U+FFFD alone is no failure: a model may emit invalid byte sequences, and a max_tokens cut can end inside a
    # character (vLLM decodes that the same way); the streaming check compares streamed and whole text instead
    res.status = PASS if len(ok) == n else FAIL
    res.summary = (f"{len(ok)}/{n} succeeded, TTFT p50 {res.evidence['ttft_p50_ms']} ms"
                   + (f"; {len(garbled)} texts hold U+FFFD (see evidence)" if garbled else "")
                   + (f"; errors: {res.evidence['errors']}" if len(ok) < n else ""))


async def _long_prompt(t: PocTarget, tokens: int) -> tuple[str, int | None, int]:
    """(a prompt of about `tokens` tokens, its count by the server's /tokenize when it has one, tokens per
    FILLER)."""
    unit = await t.count_tokens(FILLER)
    per = unit or max(1, len(FILLER) // 3)
    reps = max(1, tokens // per)
    text = " ".join([FILLER] * reps)
    count = await t.count_tokens(text)
    while count is not None and count > tokens and reps > 1:
        reps = max(1, reps - max(1, (count - tokens) // per + 1))
        text = " ".join([FILLER] * reps)
        count = await t.count_tokens(text)
    return text + "\n总结上文：", count, per


async def check_long_context(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    """A prompt at `long_fill` of max_model_len succeeds; one over the limit is refused with a 400, not a crash."""
    if t.max_model_len is None:
        res.status, res.summary = SKIPPED, "the server does not say its max_model_len in GET /v1/models"
        return
    p = cfg.sizes
    want = min(int(p.long_fill * t.max_model_len) - p.long_output_len, p.long_context_cap)
    text, counted, per = await _long_prompt(t, want)
    rec = log.add(res.name, cfg.tenants[0], await t.stream(text, p.long_output_len, cfg.tenants[0]))
    res.evidence = {"max_model_len": t.max_model_len, "target_prompt_tokens": want, "prompt_tokens": rec.prompt_len
                    or counted, "succeeded": rec.success, "error": rec.error or None,
                    "ttft_ms": round(rec.ttft * 1000, 1), "e2el_ms": round(rec.e2el * 1000, 1)}
    over_ok = True
    if counted is not None:  # over the limit: a request that can never fit is the client's error (400)
        over = " ".join([FILLER] * (t.max_model_len // per + 2))
        try:
            resp = await t.complete({"prompt": over, "max_tokens": 4})
            status, body = resp.status_code, error_message(resp.status_code, resp.content)
        except Exception as e:  # noqa: BLE001 - a dropped connection is evidence too
            status, body = 0, f"{type(e).__name__}: {e}"
        over_ok = status == 400
        res.evidence["over_limit"] = {"status": status, "answer": body[:200]}
    res.status = PASS if rec.success and over_ok else FAIL
    res.summary = (f"{res.evidence['prompt_tokens']} prompt tokens of max_model_len {t.max_model_len}: "
                   + (f"TTFT {res.evidence['ttft_ms']:.0f} ms" if rec.success else f"failed ({rec.error[:120]})")
                   + (f"; over the limit: HTTP {res.evidence['over_limit']['status']}"
                      if "over_limit" in res.evidence else ""))


def _stream_problems(events: list[str]) -> tuple[list[str], str, dict[str, Any] | None]:
    """(problems, text, usage) of one stream's `data:` payloads: each chunk JSON with the completion shape, one
    finish_reason, [DONE] last."""
    problems: list[str] = []
    parts: list[str] = []
    usage = None
    finishes = 0
    if not events or events[-1] != "[DONE]":
        problems.append("the stream does not end with [DONE]")
    for i, e in enumerate(events):
        if e == "[DONE]":
            if i != len(events) - 1:
                problems.append(f"[DONE] at chunk {i} is not the last")
            continue
        try:
            obj = json.loads(e)
        except json.JSONDecodeError:
            problems.append(f"chunk {i} is not JSON: {e[:80]!r}")
            continue
        if "error" in obj:
            problems.append(f"chunk {i} is an error event: {str(obj['error'])[:120]}")
            continue
        if obj.get("object") != "text_completion" or not isinstance(obj.get("choices"), list) or "id" not in obj:
            problems.append(f"chunk {i} lacks id/object/choices: {e[:80]!r}")
        for c in obj.get("choices") or []:
            parts.append(c.get("text") or "")
            finishes += c.get("finish_reason") is not None
        usage = obj.get("usage") or usage
    if finishes != 1:
        problems.append(f"{finishes} chunks carry a finish_reason (expected exactly 1)")
    return problems, "".join(parts), usage


async def check_streaming(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    """For an English and a Chinese prompt, sampled with a seed: every chunk well-formed, and the streamed text
    equals the non-streamed text of the same request."""
    n = cfg.sizes.stream_output_len
    cases: list[dict[str, Any]] = []
    for i, text in enumerate((prompt(0), prompt(1))):
        body = {"prompt": text, "max_tokens": n, "temperature": 0.8, "seed": cfg.seed + i,
                "stream_options": {"include_usage": True}}
        try:
            status, events, _ = await asyncio.wait_for(t.raw_stream(body, cfg.tenants[0]), cfg.request_timeout)
        except TimeoutError:
            cases.append({"prompt": text, "problems": [f"the stream did not finish within {cfg.request_timeout:g} s "
                                                       "(hung stream)"]})
            continue
        plain = await t.complete({k: v for k, v in body.items() if k != "stream_options"}, cfg.tenants[0])
        problems, streamed, usage = _stream_problems(events) if status == 200 else ([f"HTTP {status}"], "", None)
        whole = plain.json()["choices"][0]["text"] if plain.status_code == 200 else None
        if plain.status_code != 200:
            problems.append(f"non-streamed request: {error_message(plain.status_code, plain.content)}")
        elif streamed != whole:
            problems.append("streamed text differs from the non-streamed text for the same seed")
        if usage is None and status == 200:
            problems.append("no usage chunk although stream_options.include_usage was set")
        if has_mojibake(streamed) and not has_mojibake(whole or ""):
            problems.append("streamed text holds U+FFFD the whole text does not (a CJK character cut between chunks)")
        cases.append({"prompt": text, "chunks": len(events), "streamed": streamed[:160], "non_streamed":
                      (whole or "")[:160], "usage": usage, "problems": problems})
    bad = [c for c in cases if c["problems"]]
    res.evidence = {"cases": cases}
    res.status = FAIL if bad else PASS
    res.summary = ("; ".join(p for c in bad for p in c["problems"])[:300] if bad else
                   f"{len(cases)} streams well-formed, text equal to the non-streamed one (seeded sampling)")
