"""pdserve on Ray Serve (pdserve.deploy.ray) on a real two-node Ray cluster: the head and a worker node started in
two network namespaces joined by veth pairs (tests/netns.py; this host reaches both over a bridge), sized for 2
cores (replicas reserve 0.5 CPU and run one thread). One colocated application (2 engine replicas, at most one per
node) and one 1P1D application (prefill on the head, decode on the worker) run side by side behind Serve's proxy.

Fast tests (no cluster) check the YAML loader's errors and the autoscaling mapping and policy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from pdserve.launch import ServerProc, start_server

import netns
from test_disagg import PROMPTS, TINY, complete

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'pdserve[ray]'; make install does)")

from pdserve.deploy.ray.app import check_together  # noqa: E402
from pdserve.deploy.ray.autoscaling import autoscaling_config, desired_replicas, engine_signal_policy  # noqa: E402
from pdserve.deploy.ray.config import (  # noqa: E402
    Autoscaling,
    RayConfigError,
    check_engine_options,
    config_from_dict,
    load_config,
)

REPO = Path(__file__).resolve().parent.parent
WAIT = 300.0  # seconds: the bound of a wait for Ray to act (polled: a passing run waits as long as Ray takes)
READ = 60.0  # seconds: an HTTP read of a status endpoint while the replicas are busy
RAY_BIN = str(Path(sys.executable).parent / "ray")
GCS_PORT = 6390
SECRET = "ray-test-secret"
# Ray 2.60 `ray start --head` turns token authentication on; every node and driver of the cluster sends this token
RAY_TOKEN = os.urandom(16).hex()


# ---- fast: config and autoscaling ---------------------------------------------------------------------------
@pytest.mark.parametrize("data, message", [
    ({"topology": "mesh"}, "topology must be colocated or disaggregated"),
    ({"prefill": {"num_cpu": 1}}, "config.prefill: unknown key(s) ['num_cpu']"),
    ({"engine": {"kv_port": 5}}, "engine.kv_port is set per replica"),
    ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas <= max_replicas"),
    ({"router": {"poll": 1}}, "router: unknown option(s) ['poll']"),
    ({"engine_replicas": [1]}, "config.engine_replicas: expected a mapping"),
    ({"engine": {"api_key": "k"}}, "add engine.metrics_public: true"),  # its readers send no key
])
def test_config_errors_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(RayConfigError) as exc:
        config_from_dict(data)
    assert message in str(exc.value)


def test_engine_keys_are_checked_against_pdserve_serve() -> None:
    from pdserve.cli import serve_option_names

    known = serve_option_names()
    check_engine_options(config_from_dict({"engine": {"model": "m", "log_level": "warning", "kv_connector": "zmq"}}),
                         known)
    with pytest.raises(RayConfigError, match=r"unknown pdserve serve option\(s\) \['modle'\]"):
        check_engine_options(config_from_dict({"engine": {"modle": "x"}}), known)


def test_ray_serve_cli_reports_a_bad_config(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("topology: colocated\nengine: {modle: x}\n")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "ray-serve", str(p)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "unknown pdserve serve option(s) ['modle']" in r.stderr, r.stderr


def test_applications_deployed_together_share_the_proxy(tmp_path: Path) -> None:
    """Several files deploy together only with one host and port and distinct names and route prefixes: checked
    before anything connects to Ray (the CLI exits 2 naming the clash)."""
    a = config_from_dict({"name": "a", "route_prefix": "/a", "engine": {"model": "m"}})
    check_together([a, config_from_dict({"name": "b", "route_prefix": "/b", "engine": {"model": "m"}})])
    with pytest.raises(RayConfigError, match=r"distinct names; repeated: \['a'\]"):
        check_together([a, config_from_dict({"name": "a", "route_prefix": "/b", "engine": {"model": "m"}})])
    with pytest.raises(RayConfigError, match="distinct route_prefixs; repeated"):
        check_together([a, config_from_dict({"name": "b", "route_prefix": "/a", "engine": {"model": "m"}})])
    with pytest.raises(RayConfigError, match="host and port must be the same"):
        check_together([a, config_from_dict({"name": "b", "route_prefix": "/b", "port": 8001,
                                             "engine": {"model": "m"}})])
    for name, prefix in (("a", "/a"), ("a", "/b")):
        (tmp_path / f"{name}{prefix[1]}.yaml").write_text(
            f"name: {name}\nroute_prefix: {prefix}\nengine: {{model: m}}\n")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "ray-serve", str(tmp_path / "aa.yaml"),
                        str(tmp_path / "ab.yaml")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "distinct names" in r.stderr, r.stderr


def test_load_config_reads_yaml_and_reports_bad_files(tmp_path: Path) -> None:
    p = tmp_path / "app.yaml"
    p.write_text("topology: disaggregated\nengine: {model: m, dtype: float32}\nprefill: {num_cpus: 2}\n")
    cfg = load_config(p)
    assert cfg.serve_args() == ["--model", "m", "--dtype", "float32"]
    assert cfg.groups()["prefill"].threads == 2 and set(cfg.groups()) == {"prefill", "decode"}
    p.write_text("topology: [unclosed\n")
    with pytest.raises(RayConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(RayConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_autoscaling_maps_onto_ray_serve_and_follows_engine_signals() -> None:
    from ray.serve.config import AutoscalingConfig

    a = Autoscaling(min_replicas=1, max_replicas=4, target_waiting=2, target_kv_usage=0.5)
    ray_cfg = AutoscalingConfig(**autoscaling_config(a))  # Ray's own validation of the mapping
    assert ray_cfg.max_replicas == 4 and ray_cfg.policy.policy_kwargs["target_kv_usage"] == 0.5
    assert (ray_cfg.metrics_interval_s, ray_cfg.look_back_period_s) == (10.0, 15.0)
    with pytest.raises(RayConfigError):  # Ray averages the reports over the look-back window: it must hold some
        Autoscaling(metrics_interval_s=20.0)
    assert desired_replicas([0, 0], [0.1, 0.1], 2, 0.5) == 1
    assert desired_replicas([3, 4], [0.1, 0.1], 2, 0.5) == 4  # 7 waiting / 2 per replica
    assert desired_replicas([0, 0], [0.9, 0.8], 2, 0.5) == 4  # KV 1.7 / 0.5 per replica

    def ctx(waiting: list[float], kv: list[float]) -> Any:
        ids = [f"r{i}" for i in range(len(waiting))]
        return SimpleNamespace(config=ray_cfg, target_num_replicas=2, policy_state={},
                               capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
                               aggregated_metrics={"waiting": dict(zip(ids, waiting, strict=True)),
                                                   "kv_usage": dict(zip(ids, kv, strict=True))})
    assert engine_signal_policy(ctx([10, 10], [0.2, 0.2]))[0] == 4  # capped at max_replicas
    assert engine_signal_policy(ctx([0, 0], [0.0, 0.0]))[0] == 1
    assert engine_signal_policy(ctx([], []))[0] == 2  # no report yet: keep the target


@pytest.mark.slow
def test_autoscaling_scales_up_under_load_and_back_down(tiny_dir: Path) -> None:
    """On a local one-node Ray (before the two-node cluster starts): waiting requests and KV usage reported by the
    replica drive Ray Serve from 1 to 2 replicas under load and back to 1 when idle."""
    from pdserve.deploy.ray.app import delete_app, deploy

    cfg = config_from_dict({
        "name": "auto", "topology": "colocated", "host": "127.0.0.1", "port": 8932, "ingress": {"num_cpus": 0},
        "engine": {"model": str(tiny_dir), "dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 32},
        "engine_replicas": {"num_cpus": 0.5, "num_threads": 1, "autoscaling": {
            "min_replicas": 1, "max_replicas": 2, "target_waiting": 1, "target_kv_usage": 0.3, "upscale_delay_s": 1,
            "downscale_delay_s": 5, "look_back_period_s": 2, "metrics_interval_s": 0.5}}})
    ray.init(num_cpus=2, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    base = "http://127.0.0.1:8932"
    stop = [time.monotonic() + 2 * WAIT]

    def load() -> None:
        while time.monotonic() < stop[0]:
            httpx.post(base + "/v1/completions", json={"prompt": "hello " * 40, "max_tokens": 200,
                                                       "ignore_eos": True}, timeout=120)

    try:
        deploy(cfg)
        assert len(replicas(base)) == 1
        threads = [threading.Thread(target=load) for _ in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT
        while len(replicas(base)) < 2:
            assert time.monotonic() < deadline, "no scale-up under load"
            time.sleep(1.0)
        stop[0] = 0.0
        for t in threads:
            t.join(WAIT)
        deadline = time.monotonic() + WAIT
        while len(replicas(base)) > 1:
            assert time.monotonic() < deadline, "no scale-down when idle"
            time.sleep(1.0)
        assert_baseline(base)
    finally:
        stop[0] = 0.0
        delete_app("auto")
        ray.shutdown()


# ---- the two-node cluster ----------------------------------------------------------------------------------
@dataclass
class Cluster:
    head: str  # namespace names
    worker: str
    head_ip: str
    worker_ip: str
    ref: ServerProc  # one plain `pdserve serve` for the reference outputs

    @property
    def colo(self) -> str:
        return f"http://{self.head_ip}:8000/colo"

    @property
    def pd(self) -> str:
        return f"http://{self.head_ip}:8000/pd"


def _env() -> dict[str, str]:
    # the raylets pass this on to every replica: the pdserve processes import this checkout and sign hand-offs
    return {**os.environ, "PYTHONPATH": str(REPO), "PDSERVE_KV_TRANSFER_SECRET": SECRET, "NO_PROXY": "*",
            "no_proxy": "*", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": RAY_TOKEN}


def _in_ns(ns: str, *cmd: str, timeout: float = 120) -> str:
    r = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=timeout,
                       env=_env())
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _start_nodes(head: str, worker: str, head_ip: str, worker_ip: str, tmp: Path) -> None:
    common = ["--num-cpus", "2", "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
    _in_ns(head, RAY_BIN, "start", "--head", "--node-ip-address", head_ip, "--port", str(GCS_PORT),
           "--include-dashboard=false", "--temp-dir", str(tmp / "ray"), "--resources", '{"head": 4}', *common)
    _in_ns(worker, RAY_BIN, "start", "--address", f"{head_ip}:{GCS_PORT}", "--node-ip-address", worker_ip,
           "--resources", '{"worker": 4}', *common)


def _app_configs(tiny_dir: Path) -> dict[str, dict[str, Any]]:
    engine = {"model": str(tiny_dir), "dtype": "float32", "num_kv_blocks": 256, "max_num_batched_tokens": 32}
    group = {"num_cpus": 0.5, "num_threads": 1, "health_check_period_s": 1.0}
    base = {"engine": engine, "ingress": {"num_cpus": 0, "ray_actor_options": {"resources": {"head": 0.01}}},
            "router": {"poll_interval": 0.2}, "port": 8000}
    return {
        "colo": {**base, "name": "colo", "route_prefix": "/colo", "topology": "colocated",
                 "engine_replicas": {**group, "num_replicas": 2, "max_replicas_per_node": 1}},
        "pd": {**base, "name": "pd", "route_prefix": "/pd", "topology": "disaggregated",
               "prefill": {**group, "ray_actor_options": {"resources": {"head": 1}}},
               "decode": {**group, "ray_actor_options": {"resources": {"worker": 1}}}},
    }


def _wait_proxy(base: str, timeout: float = 180.0) -> None:
    """Until the head node's Serve HTTP proxy answers: the controller may start it after the applications report
    RUNNING (a request sent at once is refused)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base + "/-/routes", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the Serve proxy at {base} did not answer within {timeout:.0f} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    # a short directory of its own: Ray's unix sockets live under it, and a socket path may not exceed 107 bytes
    # (pytest's own temp dirs are deeper under pytest-xdist)
    tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    with netns.netns_pair("ray", "10.78.0", reach_from_host=True) as (head, worker, head_ip, worker_ip):
        ref = start_server(tmp, "--model", str(tiny_dir), *TINY)
        try:
            t0 = time.monotonic()
            _start_nodes(head, worker, head_ip, worker_ip, tmp)
            paths = []
            for name, cfg in _app_configs(tiny_dir).items():
                paths.append(tmp / f"{name}.yaml")
                paths[-1].write_text(yaml.safe_dump(cfg))
            # one `pdserve ray-serve` from the head node deploys both applications together
            out = _in_ns(head, sys.executable, "-m", "pdserve.cli", "ray-serve", *map(str, paths), "--address",
                         f"{head_ip}:{GCS_PORT}", "--detach", timeout=600)
            for name in _app_configs(tiny_dir):
                assert f"application {name!r} RUNNING" in out, out
            _wait_proxy(f"http://{head_ip}:8000")
            print(f"two-node cluster and both applications up in {time.monotonic() - t0:.1f} s")
            yield Cluster(head, worker, head_ip, worker_ip, ref)
        finally:
            ref.stop()
    shutil.rmtree(tmp, ignore_errors=True)  # after the namespaces (and the Ray processes in them) are gone


def replicas(base: str) -> list[dict[str, Any]]:
    return list(httpx.get(base + "/v1/replicas", timeout=READ).json()["data"])


def kv_at_baseline(url: str, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(url + "/debug/kv", timeout=READ).json()
        if (kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and kv.get("num_pinned_blocks", 0) == 0) \
                or time.monotonic() > deadline:
            return dict(kv)
        time.sleep(0.2)


def assert_baseline(base: str) -> None:
    for r in replicas(base):
        kv = kv_at_baseline(r["url"])
        assert kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and kv.get("num_pinned_blocks", 0) == 0, \
            (r, kv)


def test_replicas_are_placed_on_both_nodes(cluster: Cluster) -> None:
    colo = replicas(cluster.colo)
    assert [r["role"] for r in colo] == ["both", "both"]
    assert len({r["node_id"] for r in colo}) == 2 and {r["node_ip"] for r in colo} == {cluster.head_ip,
                                                                                        cluster.worker_ip}
    pd = {r["role"]: r for r in replicas(cluster.pd)}
    assert set(pd) == {"prefill", "decode"} and pd["prefill"]["node_id"] != pd["decode"]["node_id"]
    assert (pd["prefill"]["node_ip"], pd["decode"]["node_ip"]) == (cluster.head_ip, cluster.worker_ip)


@pytest.mark.parametrize("app", ["colo", "pd"])
@pytest.mark.parametrize("stream", [False, True])
def test_greedy_outputs_equal_a_single_server(cluster: Cluster, app: str, stream: bool) -> None:
    base = getattr(cluster, app)
    for chat in (False, True):
        for prompt in PROMPTS:
            want = complete(cluster.ref.base_url, prompt, stream=False, chat=chat)
            assert complete(base, prompt, stream=stream, chat=chat) == want, (app, chat, prompt)
    assert_baseline(base)


def _samples(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name + "{")]


def test_every_replica_metrics_with_replica_and_role_labels(cluster: Cluster) -> None:
    complete(cluster.pd, PROMPTS[0], stream=False)
    text = httpx.get(cluster.pd + "/metrics/replicas", timeout=10).text
    pd = {r["role"]: r for r in replicas(cluster.pd)}
    moved = _samples(text, "pdserve:kv_transfer_bytes_total")
    dec = [ln for ln in moved if f'replica="{pd["decode"]["replica_id"]}"' in ln and 'role="decode"' in ln]
    assert dec and float(dec[0].rsplit(" ", 1)[1]) > 0, moved  # the KV crossed from the head to the worker
    colo_text = httpx.get(cluster.colo + "/metrics/replicas", timeout=10).text
    running = _samples(colo_text, "pdserve:num_requests_running")
    for r in replicas(cluster.colo):
        assert any(f'replica="{r["replica_id"]}",role="both",node="{r["node_id"]}"' in ln for ln in running)
    # the dashboard's data: the ingress answers /v1/stats over the replicas, as the router over its instances
    stats = httpx.get(cluster.pd + "/v1/stats", timeout=10).json()
    assert {(i["role"], i["url"]) for i in stats["instances"]} == {(r, e["url"]) for r, e in pd.items()}
    assert httpx.get(cluster.pd + "/dashboard", timeout=10).status_code == 200


@pytest.mark.parametrize("app", ["colo", "pd"])
def test_client_disconnect_aborts_on_the_replica(cluster: Cluster, app: str) -> None:
    base = getattr(cluster, app)
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                break  # a token arrived: close the connection mid-stream
    assert_baseline(base)


def _load(base: str, n: int, results: list[str]) -> list[threading.Thread]:
    def one(i: int) -> None:
        body = {"prompt": PROMPTS[i % 3], "max_tokens": 300, "ignore_eos": True, "temperature": 0.0,
                "stream": i % 2 == 0}
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as resp:
                lines = list(resp.iter_lines())
            data = [ln[6:] for ln in lines if ln.startswith("data: ")]
            if resp.status_code != 200:
                results.append(f"error {resp.status_code}: {' '.join(lines)[:300]}")
            elif not body["stream"]:
                results.append("ok")  # the whole answer (JSON) came back
            else:
                err = [json.loads(d)["error"] for d in data[:-1] if "error" in json.loads(d)]
                ok = data[-1] == "[DONE]" and (not err or "after tokens were streamed" in err[0]["message"])
                results.append(("error: " + err[0]["message"]) if err else "ok" if ok else f"bad: {data[-3:]}")
        except httpx.HTTPError as exc:
            results.append(f"transport: {exc!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _engine_metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _router_metric(base: str, sample: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0  # a labelled counter appears with its first increment


def test_killed_replica_is_restored_and_requests_complete_or_fail_clearly(cluster: Cluster) -> None:
    victim = replicas(cluster.colo)[0]
    retries0 = _router_metric(cluster.colo, 'pdserve:router_retries_total{stage="decode"}')
    results: list[str] = []
    threads = _load(cluster.colo, 8, results)
    deadline = time.monotonic() + 30
    while _engine_metric(victim["url"], "pdserve:num_requests_running") < 1:  # killed mid-load, not after it
        assert time.monotonic() < deadline, "no request reached the replica"
        time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    # non-streaming answers come back whole (the ingress retried them on the other replica); streams either
    # finished or ended with the router's clear error after their first tokens
    assert len(results) == 8 and all(r == "ok" or "after tokens were streamed" in r for r in results), results
    hit = sum("after tokens were streamed" in r for r in results)
    hit += _router_metric(cluster.colo, 'pdserve:router_retries_total{stage="decode"}') - retries0
    assert hit >= 1, results  # the kill did hit requests in flight
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = replicas(cluster.colo)
        if len(now) == 2 and victim["replica_id"] not in {r["replica_id"] for r in now}:
            break
        time.sleep(1.0)
    else:
        pytest.fail(f"Ray did not restore the replica: {replicas(cluster.colo)}")
    assert len({r["node_id"] for r in now}) == 2  # the new replica took the dead one's node
    want = complete(cluster.ref.base_url, PROMPTS[1], stream=False)
    time.sleep(0.5)  # the ingress has polled the new replica
    for _ in range(4):  # least-loaded round robin reaches both replicas
        assert complete(cluster.colo, PROMPTS[1], stream=True) == want
    assert_baseline(cluster.colo)
