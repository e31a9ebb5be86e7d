"""The API keys of a shared server: each key has a name (its tenant) and optional limits (key_limiter.py).

Keys come from `--api-key KEY` (repeatable; the name is `key-` + the first 8 hex digits of the key's SHA-256) and
from `--api-key-file PATH`, in one of two formats:

- text, one key a line: `NAME:KEY [rpm=N] [tpm=N] [concurrent=N]`; blank lines and lines starting with `#` are
  skipped. NAME is 1-64 of `A-Z a-z 0-9 . _ -`; KEY is everything after the first `:` up to the first space.
- JSON: `{"keys": [{"name": NAME, "key": KEY, "requests_per_minute": N, "tokens_per_minute": N,
  "max_concurrent": N}]}` (or just the list); the limits are optional.

Tenant rule (a key cannot speak for another key's tenant): with several keys, or any key from a file, a request's
tenant is its key's name and `X-Tenant` / the body's `user` are ignored, except with the admin key, which may set
`X-Tenant`. A server with exactly one `--api-key` and no file has one client, which picks tenants as before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("pdserve.api")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_LIMIT_WORDS = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute", "concurrent": "max_concurrent"}


@dataclass(frozen=True)
class KeyLimits:
    """A key's limits; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + max_tokens reserved at admission, settled at finish
    max_concurrent: int | None = None  # requests open at once (a stream counts until its last byte)

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: bytes = field(repr=False)
    limits: KeyLimits = KeyLimits()


def default_name(key: str) -> str:
    """A flag key's name: short, stable, and not the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _parse_text_line(line: str, where: str) -> ApiKey:
    head, *words = line.split()
    name, sep, key = head.partition(":")
    if not sep:
        raise ValueError(f"{where}: expected NAME:KEY [rpm=N] [tpm=N] [concurrent=N]")
    limits: dict[str, object] = {}
    for word in words:
        k, eq, v = word.partition("=")
        if not eq or k not in _LIMIT_WORDS or not v.isdigit():
            raise ValueError(f"{where}: unknown limit {word!r} (rpm=N, tpm=N, concurrent=N)")
        limits[_LIMIT_WORDS[k]] = int(v)
    return _make(name, key, limits, where)


def _make(name: object, key: object, limits: dict[str, object], where: str) -> ApiKey:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: key name must be 1-64 of A-Z a-z 0-9 . _ -, got {name!r}")
    if not isinstance(key, str) or not key or any(c.isspace() for c in key):
        raise ValueError(f"{where}: key {name!r} must be a non-empty string without spaces")
    try:
        return ApiKey(name, key.encode(), KeyLimits(**limits))  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: key {name!r}: {e}") from None


def parse_key_file(text: str, source: str = "api key file") -> list[ApiKey]:
    """The keys of a key file (text or JSON, by its first character)."""
    if text.lstrip().startswith(("{", "[")):
        data = json.loads(text)
        entries = data.get("keys") if isinstance(data, dict) else data
        if not isinstance(entries, list):
            raise ValueError(f"{source}: expected {{\"keys\": [...]}} or a list of keys")
        keys = []
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise ValueError(f"{source}: keys[{i}] must be an object")
            rest = {k: v for k, v in e.items() if k not in ("name", "key")}
            keys.append(_make(e.get("name"), e.get("key"), rest, f"{source}: keys[{i}]"))
        return keys
    return [_parse_text_line(line, f"{source}:{n}") for n, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("#")]


class KeyRing:
    """The server's keys; `match` compares a presented token with every key in constant time."""

    def __init__(self, keys: Sequence[ApiKey], pins_tenant: bool) -> None:
        if len({k.key for k in keys}) != len(keys):
            raise ValueError("the same API key is given twice")
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate API key name in {sorted(names)}")
        self.keys, self.pins_tenant = list(keys), pins_tenant

    @classmethod
    def from_options(cls, flag_keys: Sequence[str], key_file: str | None) -> KeyRing | None:
        """`--api-key` (each) and `--api-key-file`; None when neither is given (the API is open)."""
        keys = [ApiKey(default_name(k), k.encode()) for k in flag_keys]
        if key_file:
            path = Path(key_file)
            keys += parse_key_file(path.read_text(encoding="utf-8"), key_file)
            if path.stat().st_mode & 0o077:
                logger.warning("the API key file %s is readable by other users (chmod 600 it)", key_file)
        if not keys:
            return None
        return cls(keys, pins_tenant=len(keys) > 1 or key_file is not None)

    def match(self, token: bytes) -> ApiKey | None:
        found = None
        for k in self.keys:  # every key compared: the time does not tell which one matched
            if hmac.compare_digest(token, k.key):
                found = k
        return found
