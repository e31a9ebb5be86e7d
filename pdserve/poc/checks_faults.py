"""Abnormal interruption: clients that disconnect mid-stream, a request aborted while queued, a burst over the
admission limit; afterwards KV usage and running requests must return to where they were before."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from pdserve.poc.check import FAIL, PASS, CheckResult, RunLog, prompt
from pdserve.poc.config import PocConfig
from pdserve.poc.target import LoadState, PocTarget

LONG_OUTPUT = 1024  # tokens a disconnecting client asks for: it leaves long before the end


def _long_output(t: PocTarget) -> int:
    return min(LONG_OUTPUT, t.max_model_len - 64) if t.max_model_len and t.max_model_len > 128 else LONG_OUTPUT


async def _disconnect_after_first_chunk(t: PocTarget, i: int, tenant: str, started: asyncio.Event,
                                        release: asyncio.Event) -> dict[str, Any]:
    """Stream a long completion, read until the first text chunk, hold the connection until `release` (the
    stream keeps its slot meanwhile), then drop it."""
    headers, extra = t.tenant_fields(tenant)
    body = {"model": t.model, "prompt": prompt(i), "max_tokens": _long_output(t), "ignore_eos": True, "stream": True,
            **extra}
    try:
        async with t.http.stream("POST", t.base_url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                return {"status": resp.status_code, "left_after_chunks": 0}
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"text"' in line:
                    started.set()
                    await release.wait()
                    return {"status": 200, "left_after_chunks": 1}  # leaving the block closes the connection
        return {"status": 200, "left_after_chunks": 0, "note": "the stream ended before a text chunk"}
    except httpx.HTTPError as e:
        return {"status": 0, "error": f"{type(e).__name__}: {e}"[:200]}
    finally:
        started.set()


async def _abort_queued(t: PocTarget, tenant: str, wait_s: float) -> dict[str, Any]:
    """Send a stream while the server is busy and close it after `wait_s` if no token came (it was queued)."""
    got: list[str] = []
    headers, extra = t.tenant_fields(tenant)
    body = {"model": t.model, "prompt": prompt(3), "max_tokens": _long_output(t), "ignore_eos": True, "stream": True,
            **extra}

    async def run() -> None:
        async with t.http.stream("POST", t.base_url + "/v1/completions", json=body, headers=headers) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"text"' in line:
                    got.append(line)
                    return

    state = await t.load_state()
    try:
        await asyncio.wait_for(run(), wait_s)
    except TimeoutError:
        pass
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    return {"aborted_before_first_token": not got, "waiting_when_sent": state.waiting}


async def _burst(t: PocTarget, n: int, tenant: str) -> dict[str, Any]:
    """n short non-streamed requests at once: each must end in 200 or 429 (with an OpenAI error body)."""
    async def one(i: int) -> tuple[int, str]:
        try:
            r = await t.complete({"prompt": prompt(i), "max_tokens": 2}, tenant)
        except httpx.HTTPError as e:
            return 0, f"{type(e).__name__}: {e}"
        return r.status_code, r.text[:300]

    results = await asyncio.gather(*(one(i) for i in range(n)))
    statuses: dict[str, int] = {}
    for s, _ in results:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    bodies_429 = [b for s, b in results if s == 429]
    well_formed = all(_is_openai_error(b) for b in bodies_429)
    other = [f"{s}: {b[:120]}" for s, b in results if s not in (200, 429)]
    return {"requests": n, "statuses": statuses, "saw_429": bool(bodies_429), "429_bodies_well_formed": well_formed,
            "sample_429": bodies_429[0][:200] if bodies_429 else None, "unexpected": other[:5]}


def _is_openai_error(text: str) -> bool:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and bool(err.get("message")) and "type" in err


async def burst_size(t: PocTarget, cfg: PocConfig) -> tuple[int, str]:
    """Past the admission limit when the server says it (GET /v1/config: `server.max_waiting_requests`, or a
    model's options), else the profile's default."""
    conf = await t.get_json("/v1/config") or {}
    limits = [(conf.get("server") or {}).get("max_waiting_requests")]
    limits += [m.get("options", {}).get("max_waiting_requests") for m in conf.get("models", {}).values()
               if isinstance(m, dict)]
    limit = next((int(v) for v in limits if isinstance(v, int)), None)
    seats = next((int(m["options"]["max_num_seqs"]) for m in conf.get("models", {}).values()
                  if isinstance(m, dict) and isinstance(m.get("options", {}).get("max_num_seqs"), int)), 0)
    limit = None if limit is None else limit + seats  # free seats of the running batch are taken first
    p = cfg.sizes
    if limit is not None:
        return min(limit + p.burst_extra, p.burst_max), f"admission limit {limit} (GET /v1/config) + {p.burst_extra}"
    return p.burst_default, "admission limit unknown: the profile's burst size"


async def check_interruption(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    p = cfg.sizes
    tenant = cfg.tenants[-1]
    _, baseline, _ = await t.wait_idle(LoadState(None, None, None), p.baseline_timeout_s)
    # long streams hold the running slots; a request sent behind them waits, and is aborted while it waits; a
    # burst past the admission limit follows; then the long streams' clients vanish mid-stream
    release = asyncio.Event()
    started = [asyncio.Event() for _ in range(p.disconnects)]
    holders = [asyncio.create_task(_disconnect_after_first_chunk(t, i, tenant, started[i], release))
               for i in range(p.disconnects)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), cfg.request_timeout)
    n, why = await burst_size(t, cfg)
    aborted_task = asyncio.create_task(_abort_queued(t, tenant, 0.5))
    await asyncio.sleep(0.1)
    burst_task = asyncio.create_task(_burst(t, n, tenant))
    aborted = await aborted_task
    release.set()
    drops = list(await asyncio.gather(*holders))
    burst = await burst_task
    back, after, waited = await t.wait_idle(baseline, p.baseline_timeout_s)
    res.evidence = {"baseline": baseline.as_dict(), "after": after.as_dict(), "back_to_baseline": back,
                    "waited_s": round(waited, 2), "disconnects": drops, "aborted_while_queued": aborted,
                    "burst": {**burst, "sized_by": why}, "state_known": baseline.known}
    problems = []
    if not back:
        problems.append(f"not back to baseline after {waited:.0f} s: {after.as_dict()} (before: "
                        f"{baseline.as_dict()}) — KV or requests leaked")
    if burst["unexpected"]:
        problems.append(f"burst answers other than 200/429: {burst['unexpected'][:2]}")
    if burst["saw_429"] and not burst["429_bodies_well_formed"]:
        problems.append("429 answers without an OpenAI error body")
    if any(d.get("status") not in (200, 429) for d in drops):
        problems.append(f"a disconnecting client's request failed first: {drops}")
    res.status = FAIL if problems else PASS
    res.summary = "; ".join(problems) if problems else (
        f"{len(drops)} mid-stream disconnects, 1 abort "
        f"{'while queued' if aborted.get('aborted_before_first_token') else '(it had started)'}, burst of {n}: "
        f"{burst['statuses']}{'' if burst['saw_429'] else ' (no 429: limit not reached)'}; back to baseline in "
        f"{waited:.1f} s" + ("" if baseline.known else " (the server exports no KV state: unverified)"))
