"""Soak: a server at saturation for a long time, with good, abusive and disconnecting clients mixed.

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--good 8] [--abusive 2] [--disconnecting 2]

Starts `pdserve serve` (default model) on loopback and runs three kinds of clients until the time is up:
- good: streamed greedy chat requests with a few fixed prompts; every answer must equal the first answer to the
  same prompt (a neighbour's bad input must not change it);
- abusive: the inputs a hostile or careless client sends (huge `n`, out-of-range sampling values, oversized and
  malformed bodies, lone surrogates, unsupported fields, thousands of stop strings, forged KV hand-off params);
  each must be refused with a 4xx and an OpenAI error body;
- disconnecting: streams dropped after a few chunks;
- slowloris: connections sending their headers a byte a second (each must be answered 408 and closed).
The server has two tenants' keys (--api-key-file: good and disconnecting clients use one, abusive clients the other)
and an admin key; abusive clients also look up the good tenant's requests (/debug/requests), read /metrics, /version
and /kv/prefix_hashes without a key, put their key in a query string, and send wrong or missing keys. Each abusive
input has the outcomes it may get; any other fails the soak, and so does any key found in the server's logs (access
and request-log lines at info level, audit log) at the end.
Every 10 s it samples the server's RSS and `/debug/kv`. At the end, after the clients stop, KV usage and open requests
must be back at their baseline. Prints a report (errors by kind, good clients' latency percentiles, RSS over time).
All traffic goes to 127.0.0.1; every loop is bounded by the deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdserve.launch import start_server
from pdserve.roofline import machine_info

ADMIN_KEY = "soak-admin-key"  # the soak's server runs with --admin-api-key so that admin abuse reaches the checks
GOOD_KEY, ABUSER_KEY = "soak-good-key-7f3a", "soak-abuser-key-91c2"  # two tenants (--api-key-file): good, abuser
KEYS = {"good": GOOD_KEY, "abuser": ABUSER_KEY, "admin": ADMIN_KEY}  # no value may ever reach a log
GOOD_PROMPTS = ["Name three colours.", "用一句话介绍长城。", "What is 2+2? Answer briefly.", "Say hello in French."]
ANY_4XX = frozenset({"4xx"})
HEAD_REFUSED = frozenset({"431", "RemoteProtocolError", "ReadError", "WriteError"})  # answered 431 or reset


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@dataclass(frozen=True)
class Case:
    """One abusive input; `expect`: the outcomes that pass ("4xx": any 400-499; an exception's class name)."""

    kind: str
    path: str
    headers: dict[str, str]
    body: bytes | None = None  # None: a GET
    expect: frozenset[str] = ANY_4XX


def abusive_requests() -> list[Case]:
    """Each abusive input, sent with the abuser's key unless the case says otherwise."""
    j = {"content-type": "application/json", **bearer(ABUSER_KEY)}
    admin = {**j, **bearer(ADMIN_KEY)}
    ok_or_4xx = ANY_4XX | {"200"}  # not an error on a colocated server (see each case)

    def chat(**extra: Any) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}).encode()

    def cmpl(**extra: Any) -> bytes:
        return json.dumps({"prompt": "Hi", "max_tokens": 1, **extra}).encode()

    return [
        Case("huge_n", "/v1/completions", j, cmpl(n=1_000_000_000)),
        Case("top_k_2^63", "/v1/completions", j, cmpl(top_k=2**63)),
        Case("stop_token_out_of_vocab", "/v1/completions", j,
             cmpl(min_tokens=1, max_tokens=2, stop_token_ids=[10**7])),
        Case("temperature_inf", "/v1/completions", j, b'{"prompt": "Hi", "max_tokens": 1, "temperature": 1e309}'),
        Case("seed_2^70", "/v1/completions", j, cmpl(seed=2**70)),
        Case("many_stop_strings", "/v1/completions", j, cmpl(stop=[f"s{i}" for i in range(100_000)])),
        Case("huge_prompt", "/v1/completions", j, json.dumps({"prompt": "a " * 2_000_000, "max_tokens": 1}).encode()),
        Case("lone_surrogate", "/v1/completions", j, b'{"prompt": "bad \\ud800 text", "max_tokens": 1}'),
        Case("bad_json", "/v1/chat/completions", j, b'{"messages": [{"role": "user", "content": "Hi"}'),
        Case("wrong_type_n", "/v1/completions", j, cmpl(n="abc")),
        # tools are supported: a function without parameters is a valid tool
        Case("tools_unsupported", "/v1/chat/completions", j,
             chat(tools=[{"type": "function", "function": {"name": "f"}}]), ok_or_4xx),
        Case("image_part", "/v1/chat/completions", j, json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).encode()),
        # KV params are ignored by a colocated server (nothing is pulled, nothing pinned)
        Case("forged_kv_params", "/v1/completions", j, cmpl(kv_transfer_params={
            "do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 1, "remote_block_ids": [1],
            "remote_engine_id": "x", "remote_request_id": "y"}), ok_or_4xx),
        Case("oversized_body", "/v1/completions", j, b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'),
        # issue 31: logprob fields, what scoring a prompt may allocate, tool schemas, oversized request heads
        Case("prompt_logprobs_true", "/v1/completions", j, cmpl(prompt_logprobs=True)),
        Case("top_logprobs_21", "/v1/chat/completions", j, chat(logprobs=True, top_logprobs=21)),
        Case("prompt_logprobs_over_bound", "/v1/completions", j, cmpl(prompt="hello " * 7000, prompt_logprobs=20)),
        Case("tool_schema_too_large", "/v1/chat/completions", j, chat(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                f"p{i}": {"type": "string", "description": "x" * 64} for i in range(1000)}}}}])),
        # issue 31, items 1, 6, 7: remote-decode params without the router's signature (ignored when colocated),
        # admin calls with names outside the documented set (with the admin key) and without the key
        Case("unsigned_remote_decode", "/v1/completions", j, cmpl(kv_transfer_params={"do_remote_decode": True}),
             ok_or_4xx),
        Case("admin_bad_name", "/admin/models", admin,
             json.dumps({"name": "../x\n{\"level\": \"ERROR\"}<img src=x>", "path": "/nonexistent"}).encode()),
        Case("admin_long_name", "/admin/models", admin, json.dumps({"name": "a" * 10_000, "path": "/x"}).encode()),
        Case("admin_with_tenant_key", "/admin/models", j, json.dumps({"name": "m", "path": "/nonexistent"}).encode()),
        Case("10000_headers", "/v1/completions", {**j, **{f"x-h{i}": "v" for i in range(10_000)}}, cmpl(),
             HEAD_REFUSED),
        Case("1mb_header", "/v1/completions", {**j, "x-big": "a" * 2**20}, cmpl(), HEAD_REFUSED),
        # issue 31, items 3, 5, 12: a key in a query string must not reach any log (checked at the end); another
        # tenant's requests are not visible by id prefix nor by full id, even naming that tenant; /metrics,
        # /version and /kv/prefix_hashes follow the API key; a wrong key is refused
        Case("dashboard_key_in_query", f"/dashboard?key={ABUSER_KEY}", {}, None, frozenset({"200"})),
        Case("debug_requests_by_prefix", "/debug/requests/chatcmpl-", j),
        Case("debug_requests_other_tenant", "/debug/requests/{good_id}", j),
        Case("debug_requests_forged_tenant", "/debug/requests/{good_id}", {**j, "x-tenant": "good"}),
        Case("metrics_without_key", "/metrics", {}),
        Case("version_without_key", "/version", {}),
        Case("prefix_hashes_without_key", "/kv/prefix_hashes", {}),
        Case("wrong_key", "/v1/completions", {**j, **bearer("not-a-key")}, cmpl()),
        Case("no_key", "/v1/chat/completions", {"content-type": "application/json"}, chat()),
    ]


def outcome_passes(outcome: str, expect: frozenset[str]) -> bool:
    return outcome in expect or ("4xx" in expect and outcome.isdigit() and 400 <= int(outcome) < 500)


class Soak:
    def __init__(self, url: str, deadline: float) -> None:
        self.url, self.deadline = url, deadline
        self.outcomes: Counter[str] = Counter()  # "good:ok", "abusive:<kind>:<status>", ...
        self.good_latency: list[float] = []
        self.good_ttft: list[float] = []
        self.expected: dict[str, str] = {}
        self.mismatches = 0
        self.unexpected: Counter[str] = Counter()  # abusive outcomes outside their case's `expect`
        self.good_ids: list[str] = []  # the good tenant's recent request ids, for the abuser to look up

    async def good(self, http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            prompt = rng.choice(GOOD_PROMPTS)
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0,
                    "stream": True}
            t0 = time.monotonic()
            text, ttft = "", None
            try:
                async with http.stream("POST", self.url + "/v1/chat/completions", json=body,
                                       headers=bearer(GOOD_KEY)) as r:
                    if r.status_code != 200:
                        self.outcomes[f"good:http_{r.status_code}"] += 1
                        await asyncio.sleep(0.5)
                        continue
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                self.outcomes[f"good:stream_error_{chunk['error'].get('code')}"] += 1
                                break
                            if chunk.get("choices"):
                                if ttft is None:
                                    self.good_ids = [*self.good_ids[-31:], chunk["id"]]
                                ttft = ttft if ttft is not None else time.monotonic() - t0
                                text += chunk["choices"][0]["delta"].get("content") or ""
            except httpx.HTTPError as e:
                self.outcomes[f"good:{type(e).__name__}"] += 1
                continue
            self.good_latency.append(time.monotonic() - t0)
            if ttft is not None:
                self.good_ttft.append(ttft)
            first = self.expected.setdefault(prompt, text)
            self.mismatches += first != text
            self.outcomes["good:ok"] += 1

    async def abusive(self, http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        cases = abusive_requests()
        while time.monotonic() < self.deadline:
            case = rng.choice(cases)
            path = case.path.format(good_id=rng.choice(self.good_ids or ["chatcmpl-none"]))
            try:
                if case.body is None:
                    r = await http.get(self.url + path, headers=case.headers)
                else:
                    r = await http.post(self.url + path, content=case.body, headers=case.headers)
                outcome = str(r.status_code)
                ok_body = r.status_code < 400 or (r.headers.get("content-type", "").startswith("application/json")
                                                  and "error" in r.json())
            except (httpx.HTTPError, ValueError) as e:
                outcome, ok_body = type(e).__name__, True
            self.outcomes[f"abusive:{case.kind}:{outcome}{'' if ok_body else ':no_openai_body'}"] += 1
            # a client-side timeout is the machine's load, not a wrong answer: counted above, not judged
            timed_out = outcome.endswith("Timeout")
            if not timed_out and (not outcome_passes(outcome, case.expect) or not ok_body):
                self.unexpected[f"{case.kind}:{outcome}"] += 1
            await asyncio.sleep(0.2)

    async def slowloris(self, host: str, port: int) -> None:
        """Headers trickled a byte a second: the server must answer 408 and close (--header-read-timeout)."""
        while time.monotonic() < self.deadline:
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection(host, port)
            reply = b""
            try:
                for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 120:
                    writer.write(bytes([b]))
                    await writer.drain()
                    try:
                        reply = await asyncio.wait_for(reader.read(200), 1.0)
                        break
                    except TimeoutError:
                        continue
            except OSError:
                pass
            finally:
                writer.close()
            kind = reply[9:12].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"
            self.outcomes[f"slowloris:{kind}:{'bounded' if time.monotonic() - t0 < 60 else 'held_over_60s'}"] += 1

    async def disconnecting(self, http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            body = {"messages": [{"role": "user", "content": rng.choice(GOOD_PROMPTS)}], "max_tokens": 200,
                    "stream": True, "ignore_eos": True}
            try:
                async with http.stream("POST", self.url + "/v1/chat/completions", json=body,
                                       headers=bearer(GOOD_KEY)) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= rng.randint(1, 6):
                            break  # leaving the block closes the connection mid-stream
                self.outcomes["disconnecting:dropped"] += 1
            except httpx.HTTPError as e:
                self.outcomes[f"disconnecting:{type(e).__name__}"] += 1


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def sample(url: str, pid: int, deadline: float, out: list[dict[str, Any]], t_start: float) -> None:
    async with httpx.AsyncClient(timeout=10, headers=bearer(ADMIN_KEY)) as http:
        while time.monotonic() < deadline:
            try:
                kv = (await http.get(url + "/debug/kv")).json()
            except httpx.HTTPError as e:  # the sample is lost (the machine's load), the soak goes on
                kv = {"num_used_blocks": None, "open_requests": None, "error": type(e).__name__}
            out.append({"t_s": round(time.monotonic() - t_start), "rss_mib": round(rss_mib(pid), 1),
                        "used_blocks": kv["num_used_blocks"], "open_requests": kv["open_requests"]})
            await asyncio.sleep(10)


async def run(args: argparse.Namespace, url: str, pid: int) -> tuple[Soak, list[dict[str, Any]]]:
    t_start = time.monotonic()
    soak = Soak(url, t_start + args.minutes * 60)
    samples: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits) as http:
        tasks = [soak.good(http, i) for i in range(args.good)]
        tasks += [soak.abusive(http, 100 + i) for i in range(args.abusive)]
        tasks += [soak.disconnecting(http, 200 + i) for i in range(args.disconnecting)]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        tasks += [soak.slowloris(host, int(port)) for _ in range(args.slowloris)]
        await asyncio.gather(sample(url, pid, soak.deadline, samples, t_start), *tasks)
    return soak, samples


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1e3 if xs else float("nan")


def report(soak: Soak, samples: list[dict[str, Any]], end_kv: dict[str, Any], base_kv: dict[str, Any]) -> None:
    print("\n## outcomes by kind")
    for k, v in sorted(soak.outcomes.items()):
        print(f"- {k}: {v}")
    print(f"\ngood clients: {soak.outcomes['good:ok']} completed, {soak.mismatches} outputs differed from the first "
          f"answer to the same prompt")
    print(f"good TTFT p50/p99: {pct(soak.good_ttft, 50):.0f} / {pct(soak.good_ttft, 99):.0f} ms; "
          f"E2E p50/p99: {pct(soak.good_latency, 50):.0f} / {pct(soak.good_latency, 99):.0f} ms")
    rss = [s["rss_mib"] for s in samples]
    if rss:
        print(f"RSS: start {rss[0]:.0f} MiB, max {max(rss):.0f}, end {rss[-1]:.0f}; "
              f"median of the last quarter {statistics.median(rss[-max(1, len(rss) // 4):]):.0f}")
    print("RSS/KV samples (every 10th): " + json.dumps(samples[::10]))
    print(f"KV at baseline: used {base_kv['num_used_blocks']} -> {end_kv['num_used_blocks']}, open requests "
          f"{end_kv['open_requests']}")
    print(f"abusive outcomes outside their case's expectation: {dict(soak.unexpected) or 'none'}")


def keys_in_logs(log_dir: Path) -> dict[str, int]:
    """How many times each key's value appears in the server's logs (server log with access and request-log lines
    at info level, audit log): must be none."""
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(log_dir.rglob("*")) if p.is_file())
    return {name: text.count(key) for name, key in KEYS.items() if key in text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--good", type=int, default=8)
    ap.add_argument("--abusive", type=int, default=2)
    ap.add_argument("--disconnecting", type=int, default=2)
    ap.add_argument("--slowloris", type=int, default=4, help="connections trickling their headers")
    ap.add_argument("--server-args", default="", help="extra `pdserve serve` flags")
    args = ap.parse_args()
    info = machine_info()
    print(f"# soak: {args.minutes} min, {args.good} good / {args.abusive} abusive / {args.disconnecting} "
          f"disconnecting clients; {info.get('cpu')}, {info.get('date')}")
    with tempfile.TemporaryDirectory() as d:
        keys_file = Path(d) / "keys.txt"  # outside the log dir: the only file allowed to hold the keys
        keys_file.write_text(f"good:{GOOD_KEY}\nabuser:{ABUSER_KEY}\n")
        logs = Path(d) / "logs"
        logs.mkdir()
        srv = start_server(logs, "--log-level", "info", "--api-key-file", str(keys_file), "--admin-api-key",
                           ADMIN_KEY, "--audit-log", str(logs / "audit.jsonl"), *args.server_args.split())
        admin = bearer(ADMIN_KEY)
        try:
            base_kv = httpx.get(srv.base_url + "/debug/kv", headers=admin).json()
            soak, samples = asyncio.run(run(args, srv.base_url, srv.proc.pid))
            time.sleep(2)  # aborts of the last dropped streams land within a step
            end_kv = httpx.get(srv.base_url + "/debug/kv", headers=admin).json()
            report(soak, samples, end_kv, base_kv)
            alive = srv.proc.poll() is None
        finally:
            srv.stop()
        leaked = keys_in_logs(logs)
        print(f"API keys found in the logs ({sum(p.stat().st_size for p in logs.rglob('*'))} bytes): "
              f"{leaked or 'none'}")
        ok = (end_kv["num_used_blocks"] == base_kv["num_used_blocks"] and end_kv["open_requests"] == 0
              and soak.mismatches == 0 and alive and not soak.unexpected
              and not leaked and soak.outcomes["good:ok"] > 0
              and not any(k.startswith("good:") and k != "good:ok" for k in soak.outcomes))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
