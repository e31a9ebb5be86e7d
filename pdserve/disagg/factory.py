"""KV connectors by name (`--kv-connector`). The only module that knows every connector class, so connector.py
(the interface) imports none of its implementations."""

from __future__ import annotations

import torch

from pdserve.disagg.connector import KVConnector, PinTable
from pdserve.disagg.nixl_connector import NixlConnector
from pdserve.disagg.zmq_connector import ZmqConnector

# NixlConnector imports the NIXL package only when constructed, so listing it here costs nothing without NIXL
CONNECTORS: dict[str, type[KVConnector]] = {"zmq": ZmqConnector, "nixl": NixlConnector}


def make_connector(name: str, engine_id: str, kv_cache: torch.Tensor, host: str, port: int, pins: PinTable,
                   timeout: float) -> KVConnector:
    cls = CONNECTORS.get(name)
    if cls is None:
        raise ValueError(f"unknown kv connector {name!r}; choose {' or '.join(CONNECTORS)}")
    return cls(engine_id, kv_cache, host, port, pins, timeout)
