"""Builds an engine's KV transfer: the connector named by `--kv-connector` and the manager around it. The only
module that knows every connector class, so connector.py (the protocol) imports none of its implementations and
the engine none at all. Connector modules are imported here when asked for, so that importing the factory loads
neither ZeroMQ nor NIXL."""

from __future__ import annotations

import importlib
import socket
import uuid
from typing import TYPE_CHECKING

from pdserve.kv_transfer.base import KVBlocks, KVTransfer

if TYPE_CHECKING:
    import torch

    from pdserve.config import EngineConfig
    from pdserve.kv_transfer.connector import KVConnector

# name -> (module, class); NixlConnector also imports the NIXL package only when constructed
CONNECTORS = {"zmq": ("pdserve.kv_transfer.zmq_connector", "ZmqConnector"),
              "nixl": ("pdserve.kv_transfer.nixl_connector", "NixlConnector")}


def connector_class(name: str) -> type[KVConnector]:
    if name not in CONNECTORS:
        raise ValueError(f"unknown kv connector {name!r}; choose {' or '.join(CONNECTORS)}")
    module, cls = CONNECTORS[name]
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def make_kv_transfer(config: EngineConfig, block_manager: KVBlocks, kv_cache: torch.Tensor) -> KVTransfer:
    """The KV transfer of an engine in a PD role (`config.kv_role` prefill or decode): its connector listens on
    `kv_host:kv_port` at once."""
    from pdserve.kv_transfer.connector import PinTable
    from pdserve.kv_transfer.manager import KVTransferManager

    engine_id = f"{config.kv_role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    connector = connector_class(config.kv_connector)(engine_id, kv_cache, config.kv_host, config.kv_port,
                                                     PinTable(), config.kv_transfer_timeout)
    return KVTransferManager(config, block_manager, connector)
