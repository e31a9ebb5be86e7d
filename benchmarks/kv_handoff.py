"""The PD hand-off alone: how fast the ZeroMQ connector moves a request's KV blocks from a prefill instance's cache
into a decode instance's, over loopback, with no engine around it.

    .venv/bin/python benchmarks/kv_handoff.py [--shape 1.7b] [--tokens 512,4096] [--reps 3] [--dtype bfloat16]

Two connectors in one process, each with its own cache of the shape's layout (random contents): the prefill side
pins the blocks of one request, the decode side pulls them into other block ids (one LoadJob, as the engine starts
it; in id order, as a request's fresh blocks mostly are, or reversed with --scattered: one frame per block) and the
benchmark checks every byte arrived. Reported per prompt length: the bytes of KV moved, the pull's wall
time (median of --reps) and the rate, next to a plain in-memory copy of the same bytes (the memory-speed floor).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pdserve.kv_transfer.connector import LoadJob, Pin, PinTable
from pdserve.kv_transfer.zmq_connector import ZmqConnector

# layers, KV heads, head_dim
SHAPES = {"135m": (30, 3, 64), "1.7b": (24, 32, 64), "7b": (32, 32, 128)}
BLOCK = 16


def cache(shape: str, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    layers, heads, dim = SHAPES[shape]
    blocks = 2 * (tokens // BLOCK) + 2  # room for the request at two different places
    return torch.randn(layers, 2, blocks, BLOCK, heads, dim).to(dtype)


def pull_once(src: ZmqConnector, dst: ZmqConnector, n: int, rid: str, scattered: bool) -> float:
    remote = list(range(1, n + 1))
    # other ids: in order (a request's fresh blocks: one frame per layer's K and V) or reversed (one frame per block)
    local = list(range(n + 1, 2 * n + 1))
    if scattered:
        local.reverse()
    src.pins.add(rid, Pin(remote, time.monotonic() + 60, n * BLOCK))
    params = {"remote_host": "127.0.0.1", "remote_port": src.port, "remote_request_id": rid}
    t0 = time.perf_counter()
    dst.start_load(LoadJob(rid, local, remote, params, time.monotonic() + 60))
    while True:
        done = dst.get_finished()
        if done:
            break
        dst.wait(0.01)
    secs = time.perf_counter() - t0
    assert done[0].ok, done[0].error
    assert torch.equal(dst.kv_cache[:, :, local], src.kv_cache[:, :, remote]), "the pulled blocks differ"
    return secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--scattered", action="store_true", help="local blocks in reverse order: every block a frame")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; shape {args.shape} {SHAPES[args.shape]}, {args.dtype} KV, local blocks "
          f"{'reversed' if args.scattered else 'in order'}")
    print("| prompt tokens | KV MiB | pull ms (median) | GB/s | memcpy GB/s |")
    print("|---:|---:|---:|---:|---:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        n = tokens // BLOCK
        src_cache, dst_cache = cache(args.shape, tokens, dtype), cache(args.shape, tokens, dtype)
        src = ZmqConnector("prefill", src_cache, "127.0.0.1", 0, PinTable(), 60.0)
        dst = ZmqConnector("decode", dst_cache, "127.0.0.1", 0, PinTable(), 60.0)
        src.start()
        dst.start()
        try:
            pull_once(src, dst, n, "warm", args.scattered)
            times = [pull_once(src, dst, n, f"r{i}", args.scattered) for i in range(args.reps)]
        finally:
            src.close()
            dst.close()
        nbytes = src_cache[:, :, :n].numel() * src_cache.element_size()
        block = src_cache[:, :, 1:n + 1].contiguous()
        out = torch.empty_like(block)
        out.copy_(block)  # out's pages committed: the floor is the copy, not the first touch
        t0 = time.perf_counter()
        out.copy_(block)
        copy_s = time.perf_counter() - t0
        med = statistics.median(times)
        print(f"| {tokens} | {nbytes / 2**20:.1f} | {med * 1e3:.1f} | {nbytes / med / 1e9:.2f} | "
              f"{nbytes / copy_s / 1e9:.2f} |")


if __name__ == "__main__":
    main()
