"""Per-key limits (api_keys.KeyLimits): requests/min and tokens/min as token buckets, and concurrent requests.

A bucket holds up to a minute's allowance and refills continuously (limit/60 per second), so a key may burst its
whole minute at once and then runs at the steady rate. Tokens/min is charged in two steps: at admission the
request reserves prompt tokens + max_tokens (its most), at finish the reservation is settled with the tokens it
really used (prompt + generated) and the difference goes back. A reservation larger than the whole bucket takes a
full bucket and settles the rest as debt, so a long request waits for a full minute's allowance instead of never
running. The clock is injectable: tests step it by hand.

A refusal is an APIError 429 with a `Retry-After` header: the seconds until the bucket holds enough (at least 1).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.api.api_keys import ApiKey
from pdserve.api.errors import APIError

Clock = Callable[[], float]


class TokenBucket:
    """`per_minute` tokens at most, refilled at per_minute/60 a second. Not locked: KeyLimiter holds its lock."""

    def __init__(self, per_minute: int, clock: Clock) -> None:
        self.capacity, self.rate, self.clock = float(per_minute), per_minute / 60.0, clock
        self.level, self.t = self.capacity, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + max(now - self.t, 0.0) * self.rate)
        self.t = now

    def take(self, n: float) -> float:
        """Take n tokens: 0.0 when taken, else the seconds until n will be there (nothing taken)."""
        self._refill()
        if self.level >= n:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate

    def put(self, n: float) -> None:
        """Give n back (negative: charge n more; the level may go below 0, a debt later requests wait out)."""
        self._refill()
        self.level = min(self.capacity, self.level + n)


def rate_limited(message: str, code: str, retry_after: float) -> APIError:
    e = APIError(429, message, "rate_limit_error", code=code, kind="rate_limited")
    e.headers = {"Retry-After": str(max(1, math.ceil(retry_after)))}
    return e


@dataclass
class _KeyState:
    key: ApiKey
    requests: TokenBucket | None
    tokens: TokenBucket | None
    open: int = 0


class KeyLimiter:
    """The limits of every key with any. `enter`/`leave` bracket an HTTP request (requests/min, concurrency);
    `reserve_tokens`/`settle_tokens` bracket each engine request (tokens/min). Thread-safe: settles come from the
    engine thread."""

    def __init__(self, keys: Sequence[ApiKey], clock: Clock = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._state = {k.name: _KeyState(k, _bucket(k.limits.requests_per_minute, clock),
                                         _bucket(k.limits.tokens_per_minute, clock))
                       for k in keys if k.limits.any}

    def limits(self, name: str) -> bool:
        return name in self._state

    def open_requests(self, name: str) -> int:
        return self._state[name].open if name in self._state else 0

    def enter(self, name: str) -> None:
        """Admit one request of key `name` or raise the 429. Concurrency is checked first, so a refused request
        spends none of the key's requests/min."""
        if (s := self._state.get(name)) is None:
            return
        with self._lock:
            cap = s.key.limits.max_concurrent
            if cap is not None and s.open >= cap:
                raise rate_limited(f"API key {name!r} has {cap} requests open, its max_concurrent",
                                   "concurrency_limit_exceeded", 1.0)
            if s.requests is not None and (wait := s.requests.take(1)) > 0:
                raise rate_limited(f"API key {name!r} is over its {s.key.limits.requests_per_minute} requests per "
                                   f"minute", "rate_limit_exceeded", wait)
            s.open += 1

    def leave(self, name: str) -> None:
        if (s := self._state.get(name)) is not None:
            with self._lock:
                s.open -= 1

    def reserve_tokens(self, name: str, n: int) -> int:
        """Reserve n tokens (prompt + max_tokens) for key `name`, or raise the 429; returns what was reserved."""
        if (s := self._state.get(name)) is None or s.tokens is None:
            return 0
        with self._lock:
            take = min(float(n), s.tokens.capacity)
            if (wait := s.tokens.take(take)) > 0:
                raise rate_limited(f"API key {name!r} is over its {s.key.limits.tokens_per_minute} tokens per "
                                   f"minute (this request reserves {n}: prompt + max_tokens)",
                                   "rate_limit_exceeded", wait)
            return int(take)

    def settle_tokens(self, name: str, reserved: int, used: int) -> None:
        """A request finished having used `used` tokens of its reservation: the rest comes back (or the excess is
        charged)."""
        if (s := self._state.get(name)) is not None and s.tokens is not None:
            with self._lock:
                s.tokens.put(reserved - used)


def _bucket(per_minute: int | None, clock: Clock) -> TokenBucket | None:
    return TokenBucket(per_minute, clock) if per_minute is not None else None


@dataclass(frozen=True)
class TokenQuota:
    """One request's handle on its key's tokens/min (RequestContext.quota)."""

    limiter: KeyLimiter
    name: str

    def reserve(self, n: int) -> int:
        return self.limiter.reserve_tokens(self.name, n)

    def settle(self, reserved: int, used: int) -> None:
        self.limiter.settle_tokens(self.name, reserved, used)
