"""Start a real `pdserve serve` process for tests and stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProc:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_pdserve(tmp_dir: Path, name: str, cli_args: list[str], base_url: str, timeout: float = 180.0,
                  prefix: list[str] | None = None, env: dict[str, str] | None = None,
                  healthy: Callable[[], bool] | None = None) -> ServerProc:
    """Run `[*prefix] python -m pdserve.cli *cli_args` (log in tmp_dir/name.log) and wait until it is healthy
    (`healthy()`, default: GET base_url/health answers 200); raise with the log's tail if it exits or times out."""
    log_path = tmp_dir / f"{name}.log"
    cmd = [*(prefix or []), sys.executable, "-m", "pdserve.cli", *cli_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)

    def http_healthy() -> bool:
        try:
            return httpx.get(base_url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if (healthy or http_healthy)():
            return ServerProc(proc, base_url, log_path)
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{name} did not become healthy:\n{log_path.read_text()[-3000:]}")


def start_server(tmp_dir: Path, *args: str, timeout: float = 180.0) -> ServerProc:
    port = free_port()
    return start_pdserve(tmp_dir, f"server-{port}", ["serve", "--port", str(port), *args],
                         f"http://127.0.0.1:{port}", timeout)
