"""ZeroMQ KV connector: a ROUTER side channel on the KV port, zero-copy multipart frames, one frame per layer.

Messages (multipart; the first frame names the operation, the second is JSON):

    read     {request_id, block_ids, layout} -> [{ok, num_blocks} | {ok: false, error}, layer 0, ..., layer L-1]
             each layer frame is kv_cache[l, :, block_ids] ([2, n, block_size, kv_heads, head_dim]), contiguous
    release  {request_id}                    -> [{ok}]   the decode side is done with the pin

The server gathers the pinned blocks (one index_select per layer, under the pin lock so the pin cannot expire
mid-read) and sends them with `copy=False`: libzmq reads the gathered tensors' memory directly. The loader (a
small thread pool; one DEALER socket per pull) copies each layer frame into the freshly allocated local blocks
with one `index_copy_`. Every pull ends with a `release`, whether it worked or not.

Loader capacity: at most `LOAD_WORKERS` pulls run at once and later ones queue (FIFO) behind them; a peer that
does not complete the ZeroMQ handshake within `CONNECT_TIMEOUT_S` fails the pull at once, so a dead or foreign
address cannot hold a loader thread for the whole transfer timeout. Releases run on their own thread so they never
take a loader's place.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq

from pdserve.kv_transfer.connector import KVConnector, KVTransferError, LoadJob, LoadResult, PinTable, check_compatible

logger = logging.getLogger("pdserve.kv_transfer")


LOAD_WORKERS = 4  # concurrent pulls; more queue
CONNECT_TIMEOUT_S = 2.0  # until the peer's side channel has answered the ZeroMQ handshake


class ZmqConnector(KVConnector):
    name = "zmq"
    _poll_ms = 50

    def __init__(self, engine_id: str, kv_cache: torch.Tensor, host: str, port: int, pins: PinTable,
                 timeout: float) -> None:
        super().__init__(engine_id, kv_cache, host, port, pins, timeout)
        self.ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(max_workers=LOAD_WORKERS, thread_name_prefix="pdserve-kv-load")
        self._release_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-kv-release")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pdserve-kv-server", daemon=True)
        self._sock: zmq.Socket | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.port:
            sock.bind(f"tcp://{self.host}:{self.port}")
        else:
            self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._sock = sock
        self._thread.start()
        logger.info("KV connector %s of engine %s listening on %s:%d", self.name, self.engine_id, self.host,
                    self.port)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._release_pool.shutdown(wait=False, cancel_futures=True)
        self.ctx.destroy(linger=0)

    # ---- server side (prefill) -----------------------------------------------------------------------------
    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(self._poll_ms))
                self._poll_extra()
                if sock not in events:
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                logger.exception("KV side channel failed")
                continue
            ident, op, rest = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
            try:
                msg = json.loads(rest[0]) if rest else {}
                reply = self._handle(op, msg)
            except Exception as exc:  # a bad message fails that message, never the side channel
                logger.exception("KV side-channel request %r failed", op)
                reply = [encode_json({"ok": False, "error": f"{type(exc).__name__}: {exc}"})]
            try:
                sock.send_multipart([ident, *reply], copy=False)
            except zmq.ZMQError:
                logger.warning("could not answer a KV side-channel request %r", op)
        sock.close(0)

    def _poll_extra(self) -> None:
        """Hook for subclasses, called every poll interval on the server thread."""

    def _handle(self, op: bytes, msg: dict[str, Any]) -> list[Any]:
        if op == b"read":
            return self._serve_read(msg)
        if op == b"release":
            self.pins.release(str(msg["request_id"]))
            self.notify()
            return [encode_json({"ok": True})]
        if op == b"ping":
            return [encode_json({"ok": True, "engine_id": self.engine_id, "layout": self.layout})]
        return [encode_json({"ok": False, "error": f"unknown operation {op!r}"})]

    def _serve_read(self, msg: dict[str, Any]) -> list[Any]:
        ids = [int(b) for b in msg["block_ids"]]
        err = check_compatible(self.layout, msg.get("layout", {}))
        with self.pins.lock:  # the engine thread cannot free the pin while its blocks are gathered
            err = err or self.pins.check(str(msg["request_id"]), ids)
            if err is not None:
                return [encode_json({"ok": False, "error": err})]
            idx = torch.tensor(ids, dtype=torch.long, device=self.kv_cache.device)
            layers = [self.kv_cache[layer].index_select(1, idx) for layer in range(self.layout["num_layers"])]
        # a cache on a GPU is staged through host memory (.cpu() is a no-op for a host cache)
        frames = [memoryview(t.cpu().view(torch.uint8).numpy().reshape(-1)) for t in layers]  # type: ignore[arg-type]
        return [encode_json({"ok": True, "num_blocks": len(ids)}), *frames]

    # ---- loader side (decode) ------------------------------------------------------------------------------
    def start_load(self, job: LoadJob) -> None:
        self._pool.submit(self._run_load, job)

    def send_release(self, params: dict[str, Any]) -> None:
        self._release_pool.submit(self._release_quietly, params)

    def _run_load(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        release = True
        try:
            nbytes, release = self._pull(job)
            result = LoadResult(job.request_id, True, nbytes, time.perf_counter() - t0)
        except Exception as exc:  # delivered as a failed load: the engine applies kv_load_failure_policy
            result = LoadResult(job.request_id, False, 0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
            logger.warning("KV pull for request %s from %s:%s failed: %s", job.request_id,
                           job.params.get("remote_host"), job.params.get("remote_port"), result.error)
        self.deliver(result)
        if release:
            self.send_release(job.params)

    def _pull(self, job: LoadJob) -> tuple[int, bool]:
        """Copy the job's blocks into the local cache; returns (bytes moved, whether a release must follow)."""
        _, frames = self._request(job.params, b"read", {"request_id": job.params["remote_request_id"],
                                                       "block_ids": job.remote_block_ids, "layout": self.layout},
                                  job.deadline)
        lay = self.layout
        n = len(job.local_block_ids)
        if len(frames) != lay["num_layers"]:
            raise KVTransferError(f"expected {lay['num_layers']} layer frames, got {len(frames)}")
        shape = (2, n, lay["block_size"], lay["kv_heads"], lay["head_dim"])
        expect = 2 * n * lay["block_size"] * lay["kv_heads"] * lay["head_dim"] * lay["element_size"]
        idx = torch.tensor(job.local_block_ids, dtype=torch.long, device=self.kv_cache.device)
        total = 0
        with warnings.catch_warnings(), torch.no_grad():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for layer, frame in enumerate(frames):
                buf = frame.buffer
                if buf.nbytes != expect:
                    raise KVTransferError(f"layer {layer}: expected {expect} bytes, got {buf.nbytes}")
                dst = self.kv_cache[layer]
                if dst.element_size() == 1:  # int8/fp8 rows and their scales as bytes (no fp8 index_copy_ on cpu)
                    dst = dst.view(torch.uint8)
                src = torch.frombuffer(buf, dtype=torch.uint8).view(dst.dtype).view(shape)
                dst.index_copy_(1, idx, src.to(dst.device))
                total += buf.nbytes
        return total, True

    def _release_quietly(self, params: dict[str, Any]) -> None:
        try:
            self._request(params, b"release", {"request_id": params["remote_request_id"]},
                          time.monotonic() + min(self.timeout, 5.0))
        except Exception as exc:  # the pin times out on its own
            logger.warning("could not release the KV pin of %s on %s:%s: %s", params.get("remote_request_id"),
                           params.get("remote_host"), params.get("remote_port"), exc)

    def _request(self, params: dict[str, Any], op: bytes, msg: dict[str, Any],
                 deadline: float) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """One request/reply on a fresh DEALER socket to the remote side channel."""
        addr = f"tcp://{params['remote_host']}:{int(params['remote_port'])}"
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # writable only once the handshake with the peer completed
        try:
            sock.connect(addr)
            connect_ms = max(int(min(CONNECT_TIMEOUT_S, deadline - time.monotonic()) * 1000), 1)
            if not sock.poll(connect_ms, zmq.POLLOUT):
                raise TimeoutError(f"no KV side channel answered at {addr} within {connect_ms} ms")
            sock.send_multipart([op, encode_json(msg)])
            wait_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            if not sock.poll(wait_ms, zmq.POLLIN):
                raise TimeoutError(f"no answer to {op.decode()} from {addr} within the KV transfer timeout")
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(0)
        header = json.loads(frames[0].bytes)
        if not header.get("ok"):
            raise KVTransferError(f"{addr} refused {op.decode()}: {header.get('error')}")
        return header, frames[1:]


def encode_json(obj: dict[str, Any]) -> bytes:
    """A side-channel message's JSON frame."""
    return json.dumps(obj).encode()
