"""Checks that need the admin API (the lifecycle contract in README "Model lifecycle"): an alias switched to another
version and rolled back while streams run, and a model loaded, used and unloaded with its memory coming back.
Without `--admin-api-key`, or against a server without /admin (vLLM, llama-server), they are skipped, saying why."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from pdserve.bench.server_metrics import parse_metrics
from pdserve.poc.check import FAIL, PASS, SKIPPED, CheckResult, RunLog, prompt
from pdserve.poc.config import PocConfig
from pdserve.poc.target import PocTarget

POC_ALIAS = "poc-switch"  # the alias the switch check creates when --model is a plain model, not an alias
POC_MODEL = "poc-reclaim"  # the model the reclaim check loads and unloads
RSS_METRIC = "process_resident_memory_bytes"


async def _admin_or_skip(t: PocTarget, res: CheckResult) -> bool:
    ok, why = await t.has_admin_api()
    if not ok:
        res.status, res.summary = SKIPPED, why
    return ok


async def _models(t: PocTarget) -> dict[str, dict[str, Any]]:
    data = await t.get_json("/v1/models")
    return {str(m.get("id")): m for m in (data or {}).get("data", []) if isinstance(m, dict)}


async def _served(t: PocTarget, alias: str, i: int, tenant: str) -> dict[str, Any]:
    """One streamed request to `alias`: its status and the version that served it (response header)."""
    body = {"model": alias, "prompt": prompt(i), "max_tokens": 16, "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        status, events, version = await t.raw_stream(body, tenant)
    except httpx.HTTPError as e:
        return {"i": i, "ok": False, "error": f"{type(e).__name__}: {e}"[:200], "version": None}
    errors = [e for e in events if e != "[DONE]" and '"error"' in e]
    ok = status == 200 and bool(events) and events[-1] == "[DONE]" and not errors
    return {"i": i, "ok": ok, "status": status, "version": version, "e2el_s": round(time.perf_counter() - t0, 3),
            **({"error": (errors or events or ["no events"])[0][:200]} if not ok else {})}


async def _switch_under_load(t: PocTarget, cfg: PocConfig, alias: str, original: str) -> dict[str, Any]:
    """Streams spread over the switch and the rollback; the alias's answers and every request's outcome."""
    n = cfg.sizes.switch_requests
    tasks: list[asyncio.Task[dict[str, Any]]] = []

    async def spawn(k: int) -> None:
        for _ in range(k):
            tasks.append(asyncio.create_task(_served(t, alias, len(tasks), cfg.tenants[len(tasks) % len(cfg.tenants)])))
            await asyncio.sleep(0.05)

    await spawn(n // 3)
    sw_status, switch = await t.admin("PUT", f"/admin/aliases/{alias}", {"model": cfg.switch_to})
    await spawn(n // 3)
    await asyncio.sleep(0.3)
    rb_status, rollback = await t.admin("POST", f"/admin/aliases/{alias}/rollback")
    await spawn(n - 2 * (n // 3))
    served = await asyncio.gather(*tasks)
    return {"alias": alias, "original": original, "switch_to": cfg.switch_to,
            "switch": {"status": sw_status, **switch}, "rollback": {"status": rb_status, **rollback},
            "requests": list(served)}


async def check_switch_rollback(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    if not await _admin_or_skip(t, res):
        return
    if not cfg.switch_to:
        res.status, res.summary = SKIPPED, "no --switch-to NAME given (the version to switch the alias to)"
        return
    models = await _models(t)
    if cfg.switch_to not in models:
        res.status, res.summary = FAIL, f"--switch-to {cfg.switch_to!r} is not served (GET /v1/models)"
        return
    entry = models.get(t.model, {})
    alias, original = (t.model, entry["alias_of"]) if entry.get("alias_of") else (POC_ALIAS, t.model)
    created = None
    if alias == POC_ALIAS:  # the model under test is not an alias: make one in front of it for the check
        status, body = await t.admin("PUT", f"/admin/aliases/{alias}", {"model": original})
        created = {"status": status, **body}
        if status != 200:
            res.status, res.summary = FAIL, f"could not create alias {alias}: {status} {json.dumps(body)[:200]}"
            res.evidence = {"create_alias": created}
            return
    ev = await _switch_under_load(t, cfg, alias, original)
    after = (await _models(t)).get(alias, {})
    ev["alias_after"] = after.get("alias_of")
    ev["create_alias"] = created
    reqs = ev["requests"]
    versions: dict[str, int] = {}
    for r in reqs:
        versions[str(r["version"])] = versions.get(str(r["version"]), 0) + 1
    failed = [r for r in reqs if not r["ok"]]
    problems = [f"{len(failed)} of {len(reqs)} requests failed during the switch: {failed[0].get('error')}"] \
        if failed else []
    if ev["switch"]["status"] != 200:
        problems.append(f"switch answered {ev['switch']['status']}: {json.dumps(ev['switch'])[:160]}")
    if ev["rollback"]["status"] != 200 or ev["rollback"].get("model") != original:
        problems.append(f"rollback answered {ev['rollback']['status']}, alias -> {ev['rollback'].get('model')} "
                        f"(expected {original})")
    if ev["alias_after"] not in (None, original):
        problems.append(f"after the rollback the alias points at {ev['alias_after']}, not {original}")
    res.evidence = {**ev, "served_by": versions}
    res.status = FAIL if problems else PASS
    res.summary = "; ".join(problems) if problems else (
        f"{len(reqs)} requests, 0 failed; served by {versions}; switch {_ms(ev['switch'].get('switch_s'))}, "
        f"rollback {_ms(ev['rollback'].get('switch_s'))}; alias back on {original}")


def _ms(seconds: Any) -> str:
    return f"{seconds * 1e3:.3f} ms" if isinstance(seconds, (int, float)) else "? ms"


async def _rss(t: PocTarget) -> float | None:
    try:
        resp = await t.http.get(t.base_url + "/metrics", timeout=10.0)
        return parse_metrics(resp.text).values.get(RSS_METRIC) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _model_path(t: PocTarget) -> str | None:
    """The path the model under test was loaded from (GET /v1/config: options.model)."""
    conf = await t.get_json("/v1/config") or {}
    entries: dict[str, Any] = conf.get("models", {})
    target = (await _models(t)).get(t.model, {}).get("alias_of") or t.model
    entry: dict[str, Any] = entries.get(target) or next(iter(entries.values()), {})
    opts: dict[str, Any] = entry.get("options", {})
    return str(opts["model"]) if opts.get("model") else None


async def check_reclaim(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    """Load a second copy of the model, use it, unload it: requests to it then answer 404 and the process's
    resident memory returns near its level before the load."""
    if not await _admin_or_skip(t, res):
        return
    path = await _model_path(t)
    rss0 = await _rss(t)
    t0 = time.perf_counter()
    st, body = await t.admin("POST", "/admin/models?wait=true", {"name": POC_MODEL, "version": "poc",
                                                                  **({"path": path} if path else {})}, timeout=600)
    load_s = time.perf_counter() - t0
    rss1 = await _rss(t)
    used = await _served(t, POC_MODEL, 0, cfg.tenants[0]) if st == 200 else None
    ust, ubody = await t.admin("DELETE", f"/admin/models/{POC_MODEL}")
    gone = None
    for _ in range(50):
        r = await t.complete({"model": POC_MODEL, "prompt": "hi", "max_tokens": 1})
        gone = r.status_code
        if gone == 404:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    rss2 = await _rss(t)
    grew = (rss1 - rss0) if rss0 is not None and rss1 is not None else None
    kept = (rss2 - rss0) if rss0 is not None and rss2 is not None else None
    res.evidence = {"path": path, "load": {"status": st, "seconds": round(load_s, 2), **body}, "request": used,
                    "unload": {"status": ust, **ubody}, "status_after_unload": gone,
                    "rss_mib": {k: None if v is None else round(v / 2**20, 1)
                                for k, v in (("before", rss0), ("loaded", rss1), ("unloaded", rss2))}}
    problems = []
    if st != 200 or not (used or {}).get("ok"):
        problems.append(f"load answered {st} ({json.dumps(body)[:160]}), request {used}")
    if ust not in (200, 202, 204) or gone != 404:
        problems.append(f"unload answered {ust}; requests to it then answered {gone}, not 404")
    if grew is not None and kept is not None and kept > max(64 * 2**20, 0.25 * max(grew, 0)):
        problems.append(f"memory not reclaimed: +{kept / 2**20:.0f} MiB after unload (the load added "
                        f"{grew / 2**20:.0f} MiB)")
    res.status = FAIL if problems else PASS
    res.summary = "; ".join(problems) if problems else (
        f"loaded in {load_s:.1f} s, served, unloaded (then 404); RSS MiB {res.evidence['rss_mib']}"
        + ("" if grew is not None else " (the server exports no process_resident_memory_bytes: memory unverified)"))
