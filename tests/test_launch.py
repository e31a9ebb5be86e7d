"""pdserve.launch without a model: a tiny HTTP server stands in for pdserve."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from pdserve.launch import LaunchError, free_port, pdserve_command, shown_command, start_process

TINY_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_start_process_waits_for_health_and_stops(tmp_path: Path) -> None:
    port = free_port()
    srv = start_process([sys.executable, "-c", TINY_SERVER, str(port)], f"http://127.0.0.1:{port}",
                        tmp_path / "tiny.log", timeout=30, own_group=True)
    assert httpx.get(srv.base_url + "/health").status_code == 200 and srv.startup_s > 0
    assert srv.log().startswith("$ ") and "serving" in srv.log()
    srv.stop(timeout=10)
    assert srv.proc.poll() is not None


def test_start_process_reports_an_early_exit_and_a_timeout(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="exited with 3 during start-up(.|\n)*boom"):
        start_process([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], "http://127.0.0.1:1",
                      tmp_path / "exits.log", timeout=30)
    port = free_port()
    with pytest.raises(LaunchError, match="not healthy within 1 s"):  # /v1/models answers 404
        start_process([sys.executable, "-c", TINY_SERVER, str(port)], f"http://127.0.0.1:{port}",
                      tmp_path / "never.log", timeout=1, health_paths=("/health", "/v1/models"))


def test_pdserve_command_runs_this_python() -> None:
    assert pdserve_command(["serve", "--port", "1"], ["taskset", "-c", "0"]) == [
        "taskset", "-c", "0", sys.executable, "-m", "pdserve.cli", "serve", "--port", "1"]


def test_secret_flag_values_never_reach_the_launch_log_or_errors(tmp_path: Path) -> None:
    """The command line heads the log and every LaunchError: the values of --api-key, --admin-api-key,
    --instance-api-key and --kv-transfer-secret are shown as ***, in both `--flag V` and `--flag=V` forms."""
    cmd = [sys.executable, "-c", "raise SystemExit(3)", "--api-key", "k-secret-1", "--admin-api-key=k-secret-2",
           "--kv-transfer-secret", "k-secret-3", "--model", "m"]
    assert shown_command(cmd).endswith("--api-key '***' '--admin-api-key=***' --kv-transfer-secret '***' --model m")
    with pytest.raises(LaunchError) as e:
        start_process(cmd, "http://127.0.0.1:1", tmp_path / "secret.log", timeout=30)
    text = str(e.value) + (tmp_path / "secret.log").read_text()
    assert "k-secret" not in text and "--model m" in text
