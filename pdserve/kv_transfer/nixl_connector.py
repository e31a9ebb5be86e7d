"""NIXL KV connector: the decode side READs the pinned remote blocks straight into its own KV tensor.

The whole KV tensor is registered with NIXL at start-up, as host memory (DRAM) or, when the KV cache lives on a GPU
(`--device cuda`), as device memory (VRAM, with the GPU's index: `nixl_memory`); each side tells the other its type
in the handshake. UCX carries the bytes (over TCP unless the environment sets `UCX_TLS`; with GPUs, UCX's cuda
transports move VRAM directly). The ZeroMQ side channel of ZmqConnector stays for what
NIXL does not do: the first handshake with a peer (`nixl_meta`: its agent metadata, KV base address and layout),
the pin check before each read (`nixl_prepare`, which also extends the pin so it cannot expire mid-read) and the
release after a failed read. A successful READ carries the remote request id as its NIXL notification; the prefill
side's server thread polls notifications and releases the pin.

Descriptors: per layer and K/V, one descriptor per run of consecutive blocks on both sides, so a request's whole
prompt moves in one NIXL transfer of at most 2 * layers * runs descriptors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.connector import KVTransferError, LoadJob, PinTable, check_compatible
from pdserve.kv_transfer.zmq_connector import ZmqConnector, encode_json

logger = logging.getLogger("pdserve.kv_transfer")


def nixl_memory(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id for a tensor on `device`: ("VRAM", GPU index) on cuda, ("DRAM", 0) in
    host memory."""
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    if device.type != "cpu":
        raise ValueError(f"NIXL registers host or CUDA memory, not {device.type}")
    return "DRAM", 0


def import_nixl(gpu: bool = False) -> tuple[Any, Any]:
    # no RDMA NICs assumed; cuda_copy lets UCX stage VRAM through TCP (set before UCX loads)
    os.environ.setdefault("UCX_TLS", "tcp,cuda_copy" if gpu else "tcp")
    errors = []
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(mod, fromlist=["nixl_agent", "nixl_agent_config"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError as exc:
            errors.append(f"{mod}: {exc}")
    raise RuntimeError("kv_connector=nixl needs the NIXL Python package (pip install 'pdserve[nixl]', i.e. "
                       "nixl-cu12); it could not be imported: " + "; ".join(errors) + ". Use --kv-connector zmq.")


class NixlConnector(ZmqConnector):
    name = "nixl"
    _poll_ms = 5  # the server thread also polls NIXL notifications

    def __init__(self, engine_id: str, kv_cache: torch.Tensor, host: str, port: int, pins: PinTable,
                 timeout: float) -> None:
        super().__init__(engine_id, kv_cache, host, port, pins, timeout)
        self.mem_type, self.device_id = nixl_memory(kv_cache.device)
        nixl_agent, nixl_agent_config = import_nixl(gpu=self.mem_type == "VRAM")
        try:
            # no NIXL progress thread: it busy-polls a whole core, which a CPU-bound engine cannot spare; UCX
            # progresses when this connector polls (the server thread every few ms, a loader while it waits)
            self.agent = nixl_agent(engine_id, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            if "UCX" not in self.agent.backends:
                raise RuntimeError("NIXL has no UCX backend here")
            self._reg = self.agent.register_memory(kv_cache)  # the agent reads the type from the tensor's device
        except Exception as exc:
            raise RuntimeError(f"NIXL could not start a UCX agent with the KV cache registered as {self.mem_type}: "
                               f"{exc}. Use --kv-connector zmq.") from exc
        self._lock = threading.Lock()  # one NIXL call at a time (server thread + loader threads)
        self._remotes: dict[str, dict[str, Any]] = {}  # "host:port" -> {agent, base, layout}
        self._chunk = self.layout["block_size"] * self.layout["kv_heads"] * self.layout["head_dim"] * \
            self.layout["element_size"]

    def close(self) -> None:
        super().close()
        try:
            with self._lock:
                self.agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass

    # ---- server side ---------------------------------------------------------------------------------------
    def _poll_extra(self) -> None:
        with self._lock:
            notifs = self.agent.get_new_notifs()
        for msgs in notifs.values():
            for m in msgs:
                self.pins.release(m.decode())
        if notifs:
            self.notify()

    def _handle(self, op: bytes, msg: dict[str, Any]) -> list[Any]:
        if op == b"nixl_meta":
            with self._lock:
                meta = self.agent.get_agent_metadata()
            return [encode_json({"ok": True, "agent_name": self.engine_id, "base_addr": self.kv_cache.data_ptr(),
                                 "layout": self.layout, "mem_type": self.mem_type, "device_id": self.device_id}),
                    meta]
        if op == b"nixl_prepare":
            ids = [int(b) for b in msg["block_ids"]]
            err = check_compatible(self.layout, msg.get("layout", {})) or self.pins.check(
                str(msg["request_id"]), ids, extend_to=time.monotonic() + self.timeout)
            return [encode_json({"ok": err is None, "error": err})]
        return super()._handle(op, msg)

    # ---- loader side ---------------------------------------------------------------------------------------
    def _remote(self, params: dict[str, Any], deadline: float) -> dict[str, Any]:
        key = f"{params['remote_host']}:{params['remote_port']}"
        info = self._remotes.get(key)
        if info is None or info["agent_name"] != params.get("remote_engine_id", info["agent_name"]):
            header, frames = self._request(params, b"nixl_meta", {}, deadline)
            err = check_compatible(self.layout, header["layout"])
            if err is not None:
                raise KVTransferError(err)
            with self._lock:
                name = self.agent.add_remote_agent(frames[0].bytes)
            info = {**header, "agent_name": name.decode() if isinstance(name, bytes) else name}
            self._remotes[key] = info
        return info

    def _descs(self, base: int, num_blocks: int, block_ids: list[int], runs: list[tuple[int, int, int]],
               local: bool, device_id: int = 0) -> np.ndarray:
        rows = []
        for layer in range(self.layout["num_layers"]):
            for kv in (0, 1):
                plane = (layer * 2 + kv) * num_blocks
                for loc, rem, n in runs:
                    b = loc if local else rem
                    rows.append((base + (plane + b) * self._chunk, n * self._chunk, device_id))
        return np.array(rows, dtype=np.uint64)

    def _pull(self, job: LoadJob) -> tuple[int, bool]:
        p = job.params
        remote = self._remote(p, job.deadline)
        self._request(p, b"nixl_prepare", {"request_id": p["remote_request_id"], "block_ids": job.remote_block_ids,
                                           "layout": self.layout}, job.deadline)
        runs: list[tuple[int, int, int]] = []  # (local start, remote start, length) of consecutive blocks
        for loc, rem in zip(job.local_block_ids, job.remote_block_ids):
            if runs and runs[-1][0] + runs[-1][2] == loc and runs[-1][1] + runs[-1][2] == rem:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((loc, rem, 1))
        local = self._descs(self.kv_cache.data_ptr(), self.layout["num_blocks"], job.local_block_ids, runs, True,
                            self.device_id)
        rtype = str(remote.get("mem_type", "DRAM"))  # a peer of before VRAM support: host memory
        rdescs = self._descs(int(remote["base_addr"]), int(remote["layout"]["num_blocks"]), job.remote_block_ids,
                             runs, False, int(remote.get("device_id", 0)))
        nbytes = int(local[:, 1].sum())
        with self._lock:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem_type),
                                                self.agent.get_xfer_descs(rdescs, rtype), remote["agent_name"],
                                                str(p["remote_request_id"]).encode())
            state = self.agent.transfer(handle)
        try:
            while state != "DONE":
                if state == "ERR":
                    raise KVTransferError("NIXL READ failed")
                if time.monotonic() > job.deadline:
                    raise TimeoutError("NIXL READ did not finish within the KV transfer timeout")
                time.sleep(0.0005)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
        finally:
            with self._lock:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as exc:  # noqa: BLE001 - an in-flight READ may refuse release
                    logger.warning("could not release a NIXL transfer handle: %s", exc)
        return nbytes, False  # the READ's notification releases the pin on the prefill side
