"""ZeroMQ KV connector: a ROUTER side channel on the KV port, zero-copy multipart frames straight from and into the
KV caches.

Messages (multipart; the first frame names the operation, the second is JSON):

    read     {request_id, runs: [[first remote block, count], ...], layout}
             -> [{ok, num_blocks} | {ok: false, error}, then per run, per layer, K then V: one frame]
             a frame is kv_cache[layer, kv, first:first + count] ([count, block_size, kv_heads, row]) as stored bytes
    release  {request_id}                    -> [{ok}]   the decode side is done with the pin

The loader splits the job's blocks into runs that are consecutive on both sides (a request's blocks mostly are:
the block manager hands out never-used blocks in id order), so a frame is one contiguous piece of each cache. The
server sends views of its cache with `copy=False` (libzmq reads the pinned blocks' memory directly; the read
extends the pin by the transfer timeout, so the blocks stay put while the frames go out) and the loader receives
each frame with `recv_into` straight into its local blocks: the bytes cross the loopback or the network once, with no
gather on one side and no staging copy on the other (a cache on a GPU is staged through host memory). Every pull
ends with a `release`, whether it worked or not.

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
        runs = [(int(first), int(count)) for first, count in msg["runs"]]
        ids = [first + i for first, count in runs for i in range(count)]
        err = check_compatible(self.layout, msg.get("layout", {}))
        if err is None and any(count < 1 for _, count in runs):
            err = "every run must hold at least one block"
        # the frames are read after this returns: the pin must outlive the transfer
        err = err or self.pins.check(str(msg["request_id"]), ids, extend_to=time.monotonic() + self.timeout)
        if err is not None:
            return [encode_json({"ok": False, "error": err})]
        frames = [block_bytes(self.kv_cache[layer, kv, first:first + count]) for first, count in runs
                  for layer in range(self.layout["num_layers"]) for kv in (0, 1)]
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
        """Receive the job's blocks into the local cache; returns (bytes moved, whether a release must follow)."""
        triples = block_runs(job.remote_block_ids, job.local_block_ids)
        msg = {"request_id": job.params["remote_request_id"], "runs": [[r, n] for r, _, n in triples],
               "layout": self.layout}
        sock, addr = self._connect(job.params, job.deadline)
        try:
            self._send_and_wait(sock, addr, b"read", msg, job.deadline)
            header = json.loads(sock.recv())
            if not header.get("ok"):
                raise KVTransferError(f"{addr} refused read: {header.get('error')}")
            total = 0
            for _, local, n in triples:
                for layer in range(self.layout["num_layers"]):
                    for kv in (0, 1):
                        total += self._receive_frame(sock, layer, kv, local, n)
            if sock.getsockopt(zmq.RCVMORE):
                raise KVTransferError(f"{addr} sent more frames than the {len(triples)} runs need")
        finally:
            sock.close(0)
        return total, True

    def _receive_frame(self, sock: zmq.Socket, layer: int, kv: int, local: int, n: int) -> int:
        """The next frame into blocks [local, local + n) of one layer's K or V; returns its bytes."""
        if not sock.getsockopt(zmq.RCVMORE):
            raise KVTransferError(f"the reply ended before layer {layer}'s blocks {local}..{local + n - 1}")
        dst = self.kv_cache[layer, kv, local:local + n]
        host = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=dst.dtype)
        buf = block_bytes(host)
        got = sock.recv_into(buf)
        if got != buf.nbytes:
            raise KVTransferError(f"layer {layer}: expected {buf.nbytes} bytes, got {got}")
        if host is not dst:
            dst.copy_(host)
        return got

    def _release_quietly(self, params: dict[str, Any]) -> None:
        try:
            self._request(params, b"release", {"request_id": params["remote_request_id"]},
                          time.monotonic() + min(self.timeout, 5.0))
        except Exception as exc:  # the pin times out on its own
            logger.warning("could not release the KV pin of %s on %s:%s: %s", params.get("remote_request_id"),
                           params.get("remote_host"), params.get("remote_port"), exc)

    def _connect(self, params: dict[str, Any], deadline: float) -> tuple[zmq.Socket, str]:
        """A fresh DEALER socket connected to the remote side channel, once its handshake is done."""
        addr = f"tcp://{params['remote_host']}:{int(params['remote_port'])}"
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # writable only once the handshake with the peer completed
        try:
            sock.connect(addr)
            connect_ms = max(int(min(CONNECT_TIMEOUT_S, deadline - time.monotonic()) * 1000), 1)
            if not sock.poll(connect_ms, zmq.POLLOUT):
                raise TimeoutError(f"no KV side channel answered at {addr} within {connect_ms} ms")
        except BaseException:
            sock.close(0)
            raise
        return sock, addr

    @staticmethod
    def _send_and_wait(sock: zmq.Socket, addr: str, op: bytes, msg: dict[str, Any], deadline: float) -> None:
        sock.send_multipart([op, encode_json(msg)])
        wait_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        if not sock.poll(wait_ms, zmq.POLLIN):
            raise TimeoutError(f"no answer to {op.decode()} from {addr} within the KV transfer timeout")

    def _request(self, params: dict[str, Any], op: bytes, msg: dict[str, Any],
                 deadline: float) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """One request/reply on a fresh DEALER socket to the remote side channel."""
        sock, addr = self._connect(params, deadline)
        try:
            self._send_and_wait(sock, addr, op, msg, deadline)
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(0)
        header = json.loads(frames[0].bytes)
        if not header.get("ok"):
            raise KVTransferError(f"{addr} refused {op.decode()}: {header.get('error')}")
        return header, frames[1:]


def block_runs(remote: list[int], local: list[int]) -> list[tuple[int, int, int]]:
    """(first remote block, first local block, count) of the maximal runs where both ids go up by one."""
    out: list[tuple[int, int, int]] = []
    for r, loc in zip(remote, local, strict=True):
        if out and out[-1][0] + out[-1][2] == r and out[-1][1] + out[-1][2] == loc:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((r, loc, 1))
    return out


def block_bytes(blocks: torch.Tensor) -> memoryview:
    """A contiguous piece of a host cache (consecutive blocks of one layer's K or V) as its stored bytes (writable
    when the tensor is); a GPU cache's piece is copied to the host first."""
    host = blocks.cpu() if blocks.device.type != "cpu" else blocks
    return memoryview(host.contiguous().view(torch.uint8).numpy().reshape(-1))  # type: ignore[arg-type]


def encode_json(obj: dict[str, Any]) -> bytes:
    """A side-channel message's JSON frame."""
    return json.dumps(obj).encode()
