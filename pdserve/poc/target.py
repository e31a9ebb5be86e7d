"""The server under test as `pdserve poc` sees it: OpenAI requests, the KV/running gauges, and the admin API.

Every probe degrades to "unknown" (None) on servers that lack the endpoint — vLLM and llama-server have no
/debug/kv and no admin API — so the checks can say what they could not see instead of failing on it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.bench.client import RequestRecord, Target, error_message, send_request
from pdserve.bench.config import BenchError
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.server_metrics import parse_metrics

VERSION_HEADER = "x-pdserve-model-version"


@dataclass(frozen=True)
class LoadState:
    """What the server holds right now: KV usage (0..1), requests running/waiting, blocks held by requests
    (/debug/kv), open API requests. None: the server does not tell."""

    kv_usage: float | None
    running: float | None
    waiting: float | None
    used_blocks: int | None = None
    requests_holding_blocks: int | None = None
    open_requests: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def is_idle(self, baseline: LoadState) -> bool:
        """Back where `baseline` was: nothing running or waiting, KV usage and held blocks not above it."""
        busy = [self.running, self.waiting, self.requests_holding_blocks, self.open_requests]
        if any(v for v in busy if v is not None):
            return False
        if self.used_blocks is not None and baseline.used_blocks is not None:
            return self.used_blocks <= baseline.used_blocks
        if self.kv_usage is not None and baseline.kv_usage is not None:
            return self.kv_usage <= baseline.kv_usage + 1e-9
        return True

    @property
    def known(self) -> bool:
        return any(v is not None for v in (self.kv_usage, self.running, self.used_blocks))


class PocTarget:
    """One httpx client against `base_url` with the API key; the admin key goes only on /admin calls."""

    def __init__(self, base_url: str, api_key: str | None, admin_api_key: str | None, timeout: float) -> None:
        self.base_url = base_url
        self.admin_api_key = admin_api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), headers=headers,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.timeout = timeout
        self.model = ""
        self.max_model_len: int | None = None
        self.models: list[dict[str, Any]] = []

    async def close(self) -> None:
        await self.http.aclose()

    # ---- discovery -------------------------------------------------------------------------------------------
    async def discover(self, model: str | None) -> None:
        """GET /v1/models: the model under test (given, else the first listed) and its max_model_len."""
        try:
            resp = await self.http.get(self.base_url + "/v1/models", timeout=30.0)
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach {self.base_url}: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise BenchError(f"GET /v1/models: {error_message(resp.status_code, resp.content)}")
        self.models = list(resp.json().get("data") or [])
        if not self.models and model is None:
            raise BenchError(f"{self.base_url}/v1/models lists no model; pass --model")
        self.model = model or str(self.models[0]["id"])
        entry = self.model_entry(self.model) or {}
        mml = entry.get("max_model_len") or entry.get("meta", {}).get("n_ctx_train")
        self.max_model_len = int(mml) if mml else None

    def model_entry(self, name: str) -> dict[str, Any] | None:
        return next((m for m in self.models if m.get("id") == name), None)

    async def get_json(self, path: str, admin: bool = False) -> dict[str, Any] | None:
        """GET path as JSON; None when the server answers anything but 200 (endpoint missing, auth, not JSON)."""
        try:
            resp = await self.http.get(self.base_url + path, headers=self._admin() if admin else None, timeout=30.0)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` by the server's own /tokenize (pdserve, vLLM); None when it has none."""
        try:
            resp = await self.http.post(self.base_url + "/tokenize", json={"model": self.model, "prompt": text},
                                        timeout=60.0)
            if resp.status_code == 200:
                body = resp.json()
                return int(body.get("count", len(body.get("tokens", []))))
        except (httpx.HTTPError, ValueError):
            pass
        return None

    # ---- generation ------------------------------------------------------------------------------------------
    @staticmethod
    def tenant_fields(tenant: str | None) -> tuple[dict[str, str], dict[str, str]]:
        """(headers, body fields) naming the tenant: the body's `user` always (any text, CJK included), the
        X-Tenant header too when the id is ASCII (HTTP headers carry no other text)."""
        if not tenant:
            return {}, {}
        return ({"X-Tenant": tenant} if tenant.isascii() else {}), {"user": tenant}

    def target(self, tenant: str | None = None, model: str | None = None) -> Target:
        headers, extra = self.tenant_fields(tenant)
        return Target(self.base_url + "/v1/completions", model or self.model, chat=False, ignore_eos=True,
                      headers=headers, extra_body=extra)

    async def stream(self, prompt: str, max_tokens: int, tenant: str | None = None, index: int = 0,
                     t0: float | None = None, model: str | None = None) -> RequestRecord:
        """One streamed completion timed by the bench client (TTFT, ITL, E2EL); never raises."""
        rec = RequestRecord(index, None, max_tokens)
        return await send_request(self.http, self.target(tenant, model), SampleRequest(prompt, None, max_tokens), rec,
                                  t0 if t0 is not None else time.perf_counter())

    async def complete(self, body: dict[str, Any], tenant: str | None = None) -> httpx.Response:
        headers, extra = self.tenant_fields(tenant)
        return await self.http.post(self.base_url + "/v1/completions", json={"model": self.model, **extra, **body},
                                    headers=headers)

    async def raw_stream(self, body: dict[str, Any], tenant: str | None = None) -> tuple[int, list[str], str | None]:
        """(status, every `data:` payload in order, the served-by version header) of one streamed completion."""
        headers, extra = self.tenant_fields(tenant)
        async with self.http.stream("POST", self.base_url + "/v1/completions", headers=headers,
                                    json={"model": self.model, **extra, **body, "stream": True}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return resp.status_code, [resp.text], resp.headers.get(VERSION_HEADER)
            events = [line[5:].strip() async for line in resp.aiter_lines() if line.startswith("data:")]
            return 200, events, resp.headers.get(VERSION_HEADER)

    # ---- server state ----------------------------------------------------------------------------------------
    async def load_state(self) -> LoadState:
        """KV usage and running/waiting from /metrics (pdserve:/vllm: gauges, summed over models), held blocks and
        open requests from /debug/kv when the server has it."""
        values: dict[str, float] = {}
        try:
            resp = await self.http.get(self.base_url + "/metrics", timeout=10.0)
            if resp.status_code == 200:
                values = parse_metrics(resp.text).values
        except (httpx.HTTPError, ValueError):
            pass

        def gauge(name: str) -> float | None:
            return next((values[f"{p}:{name}"] for p in ("pdserve", "vllm") if f"{p}:{name}" in values), None)

        kv = await self.get_json("/debug/kv")
        return LoadState(gauge("kv_cache_usage_perc"), gauge("num_requests_running"), gauge("num_requests_waiting"),
                         kv.get("num_used_blocks") if kv else None,
                         kv.get("num_requests_holding_blocks") if kv else None,
                         kv.get("open_requests") if kv else None)

    async def wait_idle(self, baseline: LoadState, timeout: float) -> tuple[bool, LoadState, float]:
        """Poll until the server is back at `baseline` (LoadState.is_idle); (back, last state, seconds waited)."""
        t0 = time.monotonic()
        state = await self.load_state()
        while not state.is_idle(baseline) and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.2)
            state = await self.load_state()
        return state.is_idle(baseline), state, time.monotonic() - t0

    # ---- admin API (the lifecycle contract) ------------------------------------------------------------------
    def _admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_api_key}"} if self.admin_api_key else {}

    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None,
                    timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) of an admin call; (0, {"error": ...}) when the server could not be reached."""
        try:
            resp = await self.http.request(method, self.base_url + path, headers=self._admin(), json=body,
                                           timeout=timeout or self.timeout)
        except httpx.HTTPError as e:
            return 0, {"error": f"{type(e).__name__}: {e}"}
        try:
            data = resp.json()
        except ValueError:
            data = {"text": resp.text[:300]}
        return resp.status_code, data if isinstance(data, dict) else {"body": data}

    async def has_admin_api(self) -> tuple[bool, str]:
        """(usable, why not): the key is given and GET /admin/audit answers 200."""
        if not self.admin_api_key:
            return False, "no --admin-api-key given"
        status, body = await self.admin("GET", "/admin/audit?limit=1")
        if status == 200:
            return True, ""
        if status == 404:
            return False, "the server has no admin API (GET /admin/audit answered 404)"
        return False, f"GET /admin/audit answered {status}: {json.dumps(body)[:200]}"
