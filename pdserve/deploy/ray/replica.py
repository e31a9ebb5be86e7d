"""EngineReplica: the Ray Serve deployment of one engine. Each replica runs one `pdserve serve` process bound to its
node's address, so streaming, aborts (a closed connection aborts the request), the KV connectors and the OpenMP
thread model are exactly those of `pdserve serve`; the replica advertises the process's URL in the application's
ReplicaDirectory, and the ingress talks HTTP to it. Ray places the replica (its `num_cpus`), health-checks it (the
process must be alive and answer /health) and restarts it when it dies.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.ray.directory import HEARTBEAT_S, get_directory
from pdserve.launch import PDSERVE_ENV, ServerProc, free_port, pdserve_command, start_process

logger = logging.getLogger("pdserve.ray")


def _replica_id() -> str:
    from ray import serve

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - outside Serve (tests of the class itself)
        return os.urandom(4).hex()


def _signals(text: str) -> dict[str, float]:
    """The autoscaling signals in one /metrics exposition."""
    names = {"pdserve:num_requests_waiting": "waiting", "pdserve:num_requests_running": "running",
             "pdserve:kv_cache_usage_perc": "kv_usage"}
    out = {v: 0.0 for v in names.values()}
    for fam in text_string_to_metric_families(text):
        if fam.name in names:
            out[names[fam.name]] = sum(s.value for s in fam.samples)
    return out


class EngineReplica:
    """One engine: `pdserve serve <serve_args> --role ROLE` on this node. `threads` sets --num-threads and
    OMP_NUM_THREADS (one OpenMP team per engine, sized to the CPUs Ray reserved)."""

    def __init__(self, app_name: str, role: str, serve_args: list[str], threads: int,
                 startup_timeout_s: float = 300.0) -> None:
        self.app_name, self.role = app_name, role
        self.replica_id = _replica_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        port, kv_port = free_port(self.node_ip), free_port(self.node_ip)
        self.url = f"http://{self.node_ip}:{port}"
        args = ["serve", *serve_args, "--role", role, "--host", self.node_ip, "--port", str(port),
                "--kv-host", self.node_ip, "--kv-port", str(kv_port), "--num-threads", str(threads)]
        # the process dies with this replica's worker, also when Ray kills it without running __del__
        prefix = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        log = Path(tempfile.gettempdir()) / "pdserve-ray" / f"{app_name}-{role}-{self.replica_id}.log"
        env = {**PDSERVE_ENV, "OMP_NUM_THREADS": str(threads)}
        self.server: ServerProc = start_process(pdserve_command(args, prefix), self.url, log, env=env,
                                                timeout=startup_timeout_s)
        self.entry = {"replica_id": self.replica_id, "role": role, "url": self.url, "node_id": self.node_id,
                      "node_ip": self.node_ip, "pid": self.server.proc.pid, "log": str(log)}
        self._directory = get_directory(app_name)
        ray.get(self._directory.register.remote(self.entry))
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="pdserve-heartbeat", daemon=True)
        self._beat.start()
        logger.info("replica %s (%s) serves at %s on node %s", self.replica_id, role, self.url, self.node_id)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.server.proc.poll() is None:  # a dead process is not advertised (the health check fails)
                self._directory.register.remote(self.entry)

    def info(self) -> dict[str, Any]:
        return dict(self.entry)

    async def check_health(self) -> None:
        """Ray Serve's health check: raising makes Ray replace this replica."""
        rc = self.server.proc.poll()
        if rc is not None:
            raise RuntimeError(f"pdserve process of replica {self.replica_id} exited with {rc}")
        async with httpx.AsyncClient(timeout=5.0) as c:
            r = await c.get(self.url + "/health")
        if r.status_code != 200:
            raise RuntimeError(f"pdserve process of replica {self.replica_id}: /health answered {r.status_code}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Waiting requests and KV usage for engine_signal_policy (autoscaling.py)."""
        async with httpx.AsyncClient(timeout=5.0) as c:
            r = await c.get(self.url + "/metrics")
        return _signals(r.text)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            try:
                self._directory.unregister.remote(self.replica_id)
            except Exception:  # noqa: BLE001 - the directory may be gone with the application
                pass
        if getattr(self, "server", None) is not None:
            self.server.stop(timeout=10.0)
