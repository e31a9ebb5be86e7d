"""Who may hand KV over: `kv_transfer_params` make an instance act (pin blocks, or connect to `remote_host:port`
and pull), so they must come from the router, never from a client that reaches an instance directly.

Every hand-off is signed: the router signs each `kv_transfer_params` it sends (an HMAC-SHA256 over the params'
canonical JSON, in the field `signature`) and an instance acts on hand-off params (`do_remote_decode` on a prefill
instance, `do_remote_prefill` on a decode instance) only with a valid signature. The key is

- the configured secret (`--kv-transfer-secret` on `serve` and `router`, or the environment variable
  PDSERVE_KV_TRANSFER_SECRET; never logged): a deployment over several hosts or users;
- else the per-user default secret, a random key in `<cache dir>/kv_transfer_secret` (or the file named by
  PDSERVE_KV_TRANSFER_SECRET_FILE), created mode 0600 by the first pdserve process that needs it: a router and
  instances run by one user on one host share it without any configuration, and a client cannot sign (it cannot
  read the file). Without a configured secret an instance also pulls only from `kv_allowed_peers` (default
  `loopback`), so what it pulls is what a local prefill instance advertised to the router.
- no key at all (the file can be neither read nor created): every hand-off is refused (PD needs a secret).

Rejected params are refused before anything happens: no pin, no outbound connection (`RequestRejected` with
`ErrorCode.KV_TRANSFER_PARAMS_REJECTED`, a 400 on the HTTP API).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cache import cache_root
from pdserve.config import KV_TRANSFER_SECRET_ENV
from pdserve.errors import ErrorCode, RequestRejected

if TYPE_CHECKING:
    from pdserve.config import EngineConfig

logger = logging.getLogger("pdserve.kv_transfer")

SIGNATURE_FIELD = "signature"
MAX_REMOTE_BLOCKS = 1 << 20  # remote_block_ids longer than this cannot be a real prompt's
_LOOPBACK = ("127.0.0.0/8", "::1/128", "localhost")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


SECRET_FILE_ENV = "PDSERVE_KV_TRANSFER_SECRET_FILE"


def configured_secret(value: str | None) -> str | None:
    """The secret given on the command line, else the environment's; empty means none."""
    return value or os.environ.get(KV_TRANSFER_SECRET_ENV) or None


def secret_from_env(value: str | None) -> str | None:
    """The key a router signs with: the configured secret, else the per-user default secret."""
    return configured_secret(value) or default_secret()


def default_secret_path() -> Path:
    return Path(os.environ.get(SECRET_FILE_ENV) or cache_root() / "kv_transfer_secret")


def default_secret() -> str | None:
    """The per-user default secret (None when its file can be neither read nor created)."""
    return _read_or_create(default_secret_path())


@functools.lru_cache(maxsize=4)
def _read_or_create(path: Path) -> str | None:
    """The key in `path`; created (0600) when missing. Processes starting at once agree: the first link wins."""
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # atomic, and never replaces a key another process wrote first
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        key = path.read_text(encoding="utf-8").strip()
        if path.stat().st_mode & 0o077:
            logger.warning("the default kv_transfer secret file %s is readable by other users (chmod 600 it)", path)
    except OSError as exc:
        logger.error("no kv_transfer_secret and the default secret file %s is unusable (%s): PD hand-offs are "
                     "refused; set --kv-transfer-secret", path, exc.strerror or exc)
        return None
    return key or None


def canonical(params: dict[str, Any]) -> bytes:
    """What the signature covers: every field but the signature, as sorted, compact, ASCII JSON."""
    body = {k: v for k, v in params.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_kv_transfer_params(params: dict[str, Any], secret: str | None) -> dict[str, Any]:
    """A copy of `params` with its signature (no secret: the params as they are)."""
    if not secret:
        return params
    mac = hmac.new(secret.encode(), canonical(params), hashlib.sha256).hexdigest()
    return {**params, SIGNATURE_FIELD: mac}


@dataclass(frozen=True)
class PeerAllowList:
    """Hosts an instance may pull KV from: networks, literal host names, or everything (`*`)."""

    networks: tuple[Network, ...] = ()
    names: frozenset[str] = frozenset()
    any_host: bool = False

    @classmethod
    def parse(cls, spec: str) -> PeerAllowList:
        """`loopback`, `*`, or a comma-separated list of IPs, CIDRs and host names (`loopback` may be one)."""
        items = [s.strip() for s in spec.split(",") if s.strip()]
        if "*" in items:
            return cls(any_host=True)
        nets: list[Network] = []
        names: set[str] = set()
        for item in items:
            for x in (_LOOPBACK if item == "loopback" else (item,)):
                try:
                    nets.append(ipaddress.ip_network(x, strict=False))
                except ValueError:
                    names.add(x.lower())
        return cls(tuple(nets), frozenset(names))

    def allows(self, host: str) -> bool:
        """Names are compared as written (never resolved: a DNS lookup would itself reach out)."""
        if self.any_host:
            return True
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return host.lower() in self.names
        return any(ip in net for net in self.networks)


@dataclass(frozen=True)
class KVTransferTrust:
    secret: str | None  # the configured secret, else the per-user default; None: every hand-off is refused
    peers: PeerAllowList | None  # None: any peer (only with a configured secret: the router vouches for it)
    configured: bool = True  # the secret was configured (False: the per-user default)

    @classmethod
    def create(cls, secret: str | None, allowed_peers: str | None) -> KVTransferTrust:
        """No allow-list given: `loopback` without a configured secret, any peer the router signed with one."""
        spec = allowed_peers if allowed_peers is not None else (None if secret else "loopback")
        peers = PeerAllowList.parse(spec) if spec is not None else None
        return cls(secret, peers) if secret else cls(default_secret(), peers, configured=False)

    def describe(self) -> str:
        """The start-up line (never the secret itself)."""
        if self.secret is None:
            return "refusing every KV hand-off (no kv_transfer_secret, no usable default secret file)"
        signed = ("only when signed by a router holding the shared secret" if self.configured else
                  f"only when signed by a router of this user on this host (default secret {default_secret_path()})")
        if self.peers is None:
            peers = "from any peer the router names"
        elif self.peers.any_host:
            peers = "from any peer (kv_allowed_peers=*)"
        else:
            listed = [str(n) for n in self.peers.networks] + sorted(self.peers.names)
            peers = "only from " + ", ".join(listed)
        return f"accepting KV hand-offs {signed}, {peers}"

    def verify(self, params: dict[str, Any]) -> dict[str, Any]:
        return verify_kv_transfer_params(params, self)


@functools.lru_cache(maxsize=8)
def trust_of(secret: str | None, allowed_peers: str | None) -> KVTransferTrust:
    return KVTransferTrust.create(secret, allowed_peers)


def trust_from_config(config: EngineConfig) -> KVTransferTrust:
    return trust_of(config.kv_transfer_secret, config.kv_allowed_peers)


def _reject(message: str) -> RequestRejected:
    return RequestRejected(message, "kv_transfer_params", ErrorCode.KV_TRANSFER_PARAMS_REJECTED)


def verify_kv_transfer_params(params: dict[str, Any], trust: KVTransferTrust) -> dict[str, Any]:
    """`params` when they may be acted on; raises RequestRejected (nothing done, nothing contacted) otherwise.
    Params asking for nothing (neither do_remote_prefill nor do_remote_decode) pass as they are."""
    if not isinstance(params, dict):
        raise _reject("kv_transfer_params must be an object")
    if not (params.get("do_remote_prefill") or params.get("do_remote_decode")):
        return params
    if trust.secret is None:
        raise _reject("PD hand-offs need a shared secret (--kv-transfer-secret) on this instance")
    sig = params.get(SIGNATURE_FIELD)
    want = sign_kv_transfer_params(params, trust.secret)[SIGNATURE_FIELD]
    if not isinstance(sig, str) or not hmac.compare_digest(sig, want):
        raise _reject("kv_transfer_params are accepted only from the PD router (missing or invalid signature)")
    if params.get("do_remote_prefill"):
        host, port, blocks = params.get("remote_host"), params.get("remote_port"), params.get("remote_block_ids")
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise _reject("kv_transfer_params need remote_host (a string) and remote_port (1-65535)")
        if not isinstance(params.get("remote_request_id"), str):
            raise _reject("kv_transfer_params need remote_request_id (a string)")
        if not isinstance(blocks, list) or len(blocks) > MAX_REMOTE_BLOCKS or \
                not all(type(b) is int and b >= 0 for b in blocks):
            raise _reject("kv_transfer_params.remote_block_ids must be a list of non-negative integers")
        if trust.peers is not None and not trust.peers.allows(host):
            raise _reject(f"kv_transfer_params name a peer that is not on this instance's allow-list ({host!r}); "
                          "see kv_allowed_peers and kv_transfer_secret")
    return params
