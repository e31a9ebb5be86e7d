"""Who may hand KV over: `kv_transfer_params` make an instance act (pin blocks, or connect to `remote_host:port`
and pull), so they must come from the router, never from a client that reaches an instance directly.

Two modes, chosen by whether a shared secret is set (`--kv-transfer-secret` on `serve` and `router`, or the
environment variable PDSERVE_KV_TRANSFER_SECRET; it is never logged):

- secret set: the router signs every `kv_transfer_params` it sends (an HMAC-SHA256 over the params' canonical JSON,
  in the field `signature`); an instance accepts hand-off params only with a valid signature. Peers may be anything
  the router forwards, unless `kv_allowed_peers` narrows them too.
- no secret: hand-offs that make the instance connect out (`do_remote_prefill`) are accepted only when
  `remote_host` is on `kv_allowed_peers` (default `loopback`: 127.0.0.0/8, ::1, localhost), so a single-host
  deployment works unchanged and a forged body cannot reach another machine. Instances say so at start-up.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.config import KV_TRANSFER_SECRET_ENV
from pdserve.errors import ErrorCode, RequestRejected

if TYPE_CHECKING:
    from pdserve.config import EngineConfig

logger = logging.getLogger("pdserve.kv_transfer")

SIGNATURE_FIELD = "signature"
MAX_REMOTE_BLOCKS = 1 << 20  # remote_block_ids longer than this cannot be a real prompt's
_LOOPBACK = ("127.0.0.0/8", "::1/128", "localhost")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def secret_from_env(value: str | None) -> str | None:
    """The secret given on the command line, else the environment's; empty means none."""
    return value or os.environ.get(KV_TRANSFER_SECRET_ENV) or None


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
    secret: str | None
    peers: PeerAllowList | None  # None: any peer (only with a secret: the router vouches for it)

    @classmethod
    def create(cls, secret: str | None, allowed_peers: str | None) -> KVTransferTrust:
        """No allow-list given: `loopback` without a secret, any peer the router signed with one."""
        spec = allowed_peers if allowed_peers is not None else (None if secret else "loopback")
        return cls(secret or None, PeerAllowList.parse(spec) if spec is not None else None)

    def describe(self) -> str:
        """The start-up line (never the secret itself)."""
        signed = "only when signed by a router holding the shared secret" if self.secret else "unsigned"
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
    if trust.secret:
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
