"""Run a pdserve process (`pdserve serve`, `pdserve router`) from Python, wait until it is healthy, stop it.

    from pdserve.launch import start_server
    srv = start_server(Path("logs"), "--dtype", "float32")  # `pdserve serve` on a free port, healthy
    ...  # requests to srv.base_url; srv.log() is its output so far
    srv.stop()

`start_pdserve` runs any pdserve subcommand (with an optional command prefix such as `taskset -c 0` or
`ip netns exec NS`); `start_process` runs any OpenAI-compatible server command (other engines, for comparisons) with the
same wait-for-health and stop.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

PDSERVE_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


class LaunchError(RuntimeError):
    """The process exited during start-up or did not become healthy in time; the message ends with its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pdserve_command(cli_args: Sequence[str], prefix: Sequence[str] = ()) -> list[str]:
    """The command line that runs `pdserve *cli_args` with this Python."""
    return [*prefix, sys.executable, "-m", "pdserve.cli", *cli_args]


@dataclass
class ServerProc:
    """A started server process. With `own_group` it leads its own process group, and `stop` ends the group."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    cmd: list[str]
    startup_s: float = 0.0
    own_group: bool = False

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 3000) -> str:
        return self.log()[-n:]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the server shuts down cleanly), SIGKILL after `timeout`; with `own_group`, then SIGKILL what
        is left of the group (worker processes). Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.own_group:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone already
        return int(self.proc.returncode)


def http_ok(base_url: str, paths: Sequence[str] = ("/health",), timeout: float = 1.0) -> bool:
    """Every GET base_url+path answers 200."""
    try:
        return all(httpx.get(base_url + p, timeout=timeout).status_code == 200 for p in paths)
    except httpx.HTTPError:
        return False


SECRET_FLAGS = frozenset({"--api-key", "--admin-api-key", "--instance-api-key", "--kv-transfer-secret"})


def shown_command(cmd: Sequence[str]) -> str:
    """`cmd` as a shell line for logs and errors, with the values of secret flags (both `--flag V` and `--flag=V`)
    replaced by `***`: a key must never reach a log."""
    shown: list[str] = []
    for i, arg in enumerate(cmd):
        flag, eq, _ = arg.partition("=")
        if eq and flag in SECRET_FLAGS:
            arg = f"{flag}=***"
        elif i > 0 and cmd[i - 1] in SECRET_FLAGS:
            arg = "***"
        shown.append(arg)
    return shlex.join(shown)


def start_process(cmd: Sequence[str], base_url: str, log_path: Path, *, env: dict[str, str] | None = None,
           timeout: float = 180.0, healthy: Callable[[], bool] | None = None,
           health_paths: Sequence[str] = ("/health",), own_group: bool = False,
           poll_interval: float = 0.25, probe_timeout: float = 1.0) -> ServerProc:
    """Run `cmd` (output to `log_path`, which starts with the command line) and wait until it is healthy:
    `healthy()`, by default every GET base_url+health_paths answers 200. Raises LaunchError (after killing it)
    if it exits first or is not healthy within `timeout` seconds."""
    cmd = list(cmd)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write(f"$ {shown_command(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=own_group)
    srv = ServerProc(proc, base_url, log_path, cmd, own_group=own_group)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise LaunchError(f"{shown_command(cmd)} exited with {proc.returncode} during start-up; log {log_path}:\n"
                              f"{srv.log_tail()}")
        if healthy() if healthy is not None else http_ok(base_url, health_paths, probe_timeout):
            srv.startup_s = time.monotonic() - t0
            return srv
        time.sleep(poll_interval)
    srv.stop(timeout=5.0)
    raise LaunchError(f"{shown_command(cmd)} was not healthy within {timeout:.0f} s; log {log_path}:\n{srv.log_tail()}")


def start_pdserve(log_dir: Path, name: str, cli_args: Sequence[str], base_url: str, timeout: float = 180.0,
                  prefix: Sequence[str] | None = None, env: dict[str, str] | None = None,
                  healthy: Callable[[], bool] | None = None) -> ServerProc:
    """Run `[*prefix] pdserve *cli_args` (log in log_dir/name.log) and wait until it is healthy (`healthy()`,
    by default GET base_url/health answers 200)."""
    return start_process(pdserve_command(cli_args, prefix or ()), base_url, log_dir / f"{name}.log",
                  env={**PDSERVE_ENV, **(env or {})}, timeout=timeout, healthy=healthy)


def start_server(log_dir: Path, *args: str, timeout: float = 180.0, env: dict[str, str] | None = None) -> ServerProc:
    """`pdserve serve *args` on a free port of 127.0.0.1, healthy (`env`: extra environment variables)."""
    port = free_port()
    return start_pdserve(log_dir, f"server-{port}", ["serve", "--port", str(port), *args],
                         f"http://127.0.0.1:{port}", timeout, env=env)
