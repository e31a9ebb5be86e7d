"""The router's instances: the prefill and decode pools, their health, the least-loaded and prefix-aware choices
(prefix.py), and `Tries`, the one loop that tries a request on the instances of a pool until one serves it.

Load is `pdserve:num_requests_running + num_requests_waiting` (or vLLM's names) from each instance's /metrics,
polled every `poll_interval`, plus the router's own requests in flight there; ties go round-robin. An instance that
fails a poll (no answer within max(poll_interval, 1s): down, or frozen) or a connection gets no new work until a
poll finds it healthy again. Only a decode pool falls back on unhealthy instances when no healthy one is left
(nothing else could serve the request); a prefill pool has the decode instance compute the prompt instead. With
prefix routing on, each poll also refreshes the instance's published prefix-cache hashes (GET /kv/prefix_hashes,
conditional; an instance without that route is routed by load only).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix import InstancePrefixes, PrefixQuery, PrefixRoutingConfig, choose

logger = logging.getLogger("pdserve.router")

_LOAD_METRICS = ("pdserve:num_requests_running", "pdserve:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:num_requests_waiting")


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    healthy: bool = True
    # running + waiting from its /metrics, less this router's requests that were on it when that poll was sent:
    # those count in `inflight` while they last, so load + inflight counts each request once, and a request that
    # ended since the poll counts nowhere (it would weigh on the instance until the next poll otherwise)
    load: float = 0.0
    inflight: int = 0  # this router's requests on it now
    prefixes: InstancePrefixes = field(default_factory=InstancePrefixes)  # its prefix-cache blocks, as published


@dataclass
class Pool:
    role: str
    instances: list[Instance]
    last_resort: bool = True  # pick an unhealthy instance when no healthy one is left
    prefix: PrefixRoutingConfig | None = None  # None: least-loaded only
    _rr: itertools.count = field(default_factory=itertools.count)

    def pick(self, exclude: set[Instance] | None = None) -> Instance | None:
        return self.choose(exclude)[0]

    def choose(self, exclude: set[Instance] | None = None,
               query: PrefixQuery | None = None) -> tuple[Instance | None, str, int]:
        """(instance, reason, expected prefix-hit tokens): with a `query` and prefix routing on, the instance of
        lowest cost (prefix.py; reason `prefix`, or `load` when that instance holds none of the prompt: the ones
        that hold some are busier by more than their hit is worth), else (reason `no_match`, or `no_prefix` without
        a query) the least loaded; healthy instances not in `exclude` (unhealthy ones only as the `last_resort`)."""
        exclude = exclude or set()
        cands = [i for i in self.instances if i not in exclude]
        healthy = [i for i in cands if i.healthy]
        cands = healthy or (cands if self.last_resort else [])
        if not cands:
            return None, "none", 0
        if query is None or self.prefix is None:
            return self._least_loaded(cands), "no_prefix", 0
        best = choose(cands, query, self.prefix)
        if best:
            got = best[next(self._rr) % len(best)]
            inst, reason, hit = got.inst, "prefix" if got.hit_tokens else "load", got.hit_tokens
        else:
            inst, reason, hit = self._least_loaded(cands), "no_match", 0
        inst.prefixes.expect(query, self.prefix.clock() + self.prefix.pending_ttl)
        return inst, reason, hit

    def _least_loaded(self, cands: list[Instance]) -> Instance:
        best = min(i.load + i.inflight for i in cands)
        ties = [i for i in cands if i.load + i.inflight == best]
        return ties[next(self._rr) % len(ties)]


class InstanceRegistry:
    """The prefill and decode pools; `poll_once` refreshes every instance's health and load from its /metrics."""

    def __init__(self, prefill: list[str], decode: list[str], metrics: RouterMetrics, poll_interval: float,
                 api_key: str | None = None, prefix: PrefixRoutingConfig | None = None) -> None:
        self.prefill = Pool("prefill", [Instance(u, "prefill") for u in prefill], last_resort=False, prefix=prefix)
        self.decode = Pool("decode", [Instance(u, "decode") for u in decode], prefix=prefix)
        self.prefix = prefix
        self.metrics, self.poll_interval = metrics, poll_interval
        # the instances' --api-key: their /metrics is behind it (unless they run with --metrics-public)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # where instances come and go (Ray Serve replicas): asked before each poll for {role: URLs}
        self.discover: Callable[[], Awaitable[dict[str, list[str]]]] | None = None

    def sync(self, urls: dict[str, list[str]]) -> None:
        """Make the pools' instances these URLs; known instances keep their state (load, in-flight count)."""
        for pool in (self.prefill, self.decode):
            known = {i.url: i for i in pool.instances}
            pool.instances[:] = [known.get(u) or Instance(u, pool.role) for u in urls.get(pool.role, [])]
            for gone in set(known) - set(urls.get(pool.role, [])):  # no stale series for instances that left
                for gauge in (self.metrics.up, self.metrics.load):
                    try:
                        gauge.remove(pool.role, gone)
                    except KeyError:
                        pass

    @property
    def instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        if self.discover is not None:
            self.sync(await self.discover())
        await asyncio.gather(*(self._poll(client, i) for i in self.instances))

    async def _poll(self, client: httpx.AsyncClient, inst: Instance) -> None:
        mine = inst.inflight  # this router's requests the instance's answer counts (see Instance.load)
        load = None
        try:
            r = await client.get(inst.url + "/metrics", timeout=max(self.poll_interval, 1.0), headers=self.headers)
            r.raise_for_status()
            load = 0.0
            for fam in text_string_to_metric_families(r.text):
                if fam.name in _LOAD_METRICS:
                    load += sum(s.value for s in fam.samples)
            inst.load, inst.healthy = max(0.0, load - mine), True
        except (httpx.HTTPError, ValueError):
            inst.healthy = False
        if inst.healthy and self.prefix is not None:
            await self._poll_prefixes(client, inst)
        self.metrics.up.labels(inst.role, inst.url).set(1 if inst.healthy else 0)
        if load is not None:
            self.metrics.load.labels(inst.role, inst.url).set(load)  # as the instance reports it

    async def _poll_prefixes(self, client: httpx.AsyncClient, inst: Instance) -> None:
        """Refresh the instance's published prefix hashes (unchanged: 304). A failure keeps what it had, and an
        instance without the route (404: vLLM, an older pdserve) is routed by load only; neither is a health issue."""
        p = inst.prefixes
        try:
            headers = {**(self.headers or {}), **({"if-none-match": p.etag} if p.etag else {})}
            r = await client.get(inst.url + "/kv/prefix_hashes", timeout=max(self.poll_interval, 1.0),
                                 headers=headers)
            if r.status_code == 304:
                return
            if r.status_code != 200:
                p.forget()
                return
            p.publish(r.json(), r.headers.get("etag"))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.debug("prefix hashes of %s: %s", inst.url, exc)

    async def poll_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                await self.poll_once(client)
            except Exception:  # noqa: BLE001 - keep polling
                logger.exception("instance poll failed")
            await asyncio.sleep(self.poll_interval)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(a decode instance is healthy, each pool's instances as /health shows them)."""
        pools = {p.role: [{"url": i.url, "healthy": i.healthy, "load": i.load, "inflight": i.inflight}
                          for i in p.instances] for p in (self.prefill, self.decode)}
        return any(i.healthy for i in self.decode.instances), pools


class InstanceFailed(Exception):
    """This instance could not serve the request, another one may. `code`: the upstream error body's code."""

    def __init__(self, reason: str, code: str | None = None) -> None:
        super().__init__(reason)
        self.code = code


class Attempt:
    """One try on one instance, used as `with attempt as inst:`. While inside, the request counts as in flight on
    `inst`. A failure another instance may not share (httpx.HTTPError, which also marks the instance unhealthy, or
    InstanceFailed) ends the block quietly and is recorded in `failure`; any other exception propagates."""

    def __init__(self, inst: Instance, tries: Tries, reason: str = "retry", hit_tokens: int = 0) -> None:
        self.inst, self._tries = inst, tries
        self.reason, self.hit_tokens = reason, hit_tokens  # why this instance (Pool.choose), its expected hit
        self.failure: str | None = None

    def __enter__(self) -> Instance:
        self.inst.inflight += 1
        return self.inst

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        self.inst.inflight -= 1
        if isinstance(exc, httpx.HTTPError):
            self.inst.healthy = False
            self._tries.failed(self, f"{type(exc).__name__}: {exc}", None)
            return True
        if isinstance(exc, InstanceFailed):
            self._tries.failed(self, str(exc), exc.code)
            return True
        return False


class Tries:
    """The instances of `pool` to try for one request: the pool's choice first (prefix-aware with a `query`, else
    least loaded), each at most once, at most `limit`.

        tries = Tries(pool, limit, on_retry, log_prefix)
        for attempt in tries:
            with attempt as inst:
                ...  # return on success; raise InstanceFailed (or let httpx errors out) to go on with the next
        ...  # none left: tries.last says why the last one failed
    """

    def __init__(self, pool: Pool, limit: int | None = None, on_retry: Callable[[], None] | None = None,
                 log_prefix: str = "", query: PrefixQuery | None = None) -> None:
        self.pool, self.limit, self.on_retry, self.log_prefix = pool, limit, on_retry, log_prefix
        self.query = query
        self.last = f"no {pool.role} instance"
        self.last_code: str | None = None  # the error code of the last failure, when the instance sent one

    def __iter__(self) -> Iterator[Attempt]:
        tried: set[Instance] = set()
        while self.limit is None or len(tried) < self.limit:
            inst, reason, hit = self.pool.choose(tried, self.query)
            if inst is None:
                return
            if tried and self.on_retry is not None:
                self.on_retry()
            tried.add(inst)
            yield Attempt(inst, self, reason, hit)

    def failed(self, attempt: Attempt, reason: str, code: str | None) -> None:
        attempt.failure = self.last = f"{self.pool.role} {attempt.inst.url}: {reason}"
        self.last_code = code
        logger.warning("%s%s", self.log_prefix, self.last)
