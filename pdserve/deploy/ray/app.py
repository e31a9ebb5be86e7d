"""The Ray Serve application of a RayServeConfig, and `pdserve ray-serve CONFIG.yaml`.

    serve run pdserve.deploy.ray.app:app_builder config=pdserve-ray.yaml   # Ray's own CLI (serve deploy too)
    pdserve ray-serve pdserve-ray.yaml [more.yaml ...] [--address auto]    # deploy, wait until RUNNING

One engine deployment per role (colocated: `engine`; disaggregated: `prefill` and `decode`, each with its own
replicas and resources) and the OpenAI ingress in front of them.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from pdserve.deploy.ray.autoscaling import autoscaling_config
from pdserve.deploy.ray.config import (
    RayConfigError,
    RayServeConfig,
    ReplicaGroup,
    check_engine_options,
    config_from_dict,
    load_config,
)

logger = logging.getLogger("pdserve.ray")
DEPLOYMENT_NAMES = {"both": "engine", "prefill": "prefill", "decode": "decode"}


def _engine_options(role: str, g: ReplicaGroup) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "name": DEPLOYMENT_NAMES[role],
        "ray_actor_options": {**g.ray_actor_options, "num_cpus": g.num_cpus},
        "health_check_period_s": g.health_check_period_s, "health_check_timeout_s": g.health_check_timeout_s,
        "graceful_shutdown_timeout_s": 30.0,
    }
    if g.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = g.max_replicas_per_node
    if g.autoscaling is not None:
        opts["autoscaling_config"] = autoscaling_config(g.autoscaling)
    else:
        opts["num_replicas"] = g.num_replicas
    return opts


def build_app(cfg: RayServeConfig) -> Any:
    """The Serve application (a bound ingress deployment) for `serve.run` / `serve deploy`."""
    from ray import serve

    from pdserve.deploy.ray.ingress import OpenAIIngress
    from pdserve.deploy.ray.replica import EngineReplica

    engines = {}
    for role, g in cfg.groups().items():
        dep = serve.deployment(**_engine_options(role, g))(EngineReplica)
        engines[DEPLOYMENT_NAMES[role]] = dep.bind(cfg.name, role, cfg.serve_args(), g.threads, g.startup_timeout_s)
    ingress = serve.deployment(name="ingress", num_replicas=cfg.ingress.num_replicas,
                               ray_actor_options={**cfg.ingress.ray_actor_options, "num_cpus": cfg.ingress.num_cpus},
                               )(serve.ingress()(OpenAIIngress))
    # the engines are bound as arguments so that Serve deploys them with the application; the ingress finds
    # their replicas in the ReplicaDirectory (it routes by HTTP, not through the handles)
    roles = ["decode"] if cfg.topology == "colocated" else ["prefill", "decode"]  # the router's pool names
    return ingress.bind(cfg.name, cfg.router, roles, model=cfg.engine.get("model"), engines=engines)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run pdserve.deploy.ray.app:app_builder config=FILE.yaml`, or in a Serve config file (KubeRay's
    serveConfigV2) `args:` holding either `config: PATH` or the application's YAML itself."""
    if set(args) == {"config"}:
        return build_app(load_config(args["config"]))
    return build_app(config_from_dict(args))


def deploy(cfg: RayServeConfig, address: str | None = None, timeout: float = 900.0) -> float:
    """Start Serve (HTTP on cfg.host:cfg.port) on the cluster at `address`, deploy the application and wait
    until it is RUNNING; returns the seconds that took."""
    return deploy_all([cfg], address, timeout)[cfg.name]


def check_together(cfgs: list[RayServeConfig]) -> None:
    """Applications deployed together share the cluster's one Serve HTTP proxy: the same host and port, and
    distinct names and route prefixes (RayConfigError otherwise)."""
    for what, key in (("name", lambda c: c.name), ("route_prefix", lambda c: c.route_prefix)):
        seen = [key(c) for c in cfgs]
        dup = sorted({v for v in seen if seen.count(v) > 1})
        if dup:
            raise RayConfigError(f"applications deployed together need distinct {what}s; repeated: {dup}")
    ports = sorted({(c.host, c.port) for c in cfgs})
    if len(ports) > 1:
        raise RayConfigError(f"applications deployed together share one Serve HTTP proxy: host and port must be "
                             f"the same in every file, got {ports}")


def deploy_all(cfgs: list[RayServeConfig], address: str | None = None, timeout: float = 900.0) -> dict[str, float]:
    """Deploy the applications at once (their replicas start together) and wait until every one is RUNNING;
    returns the seconds each took. A failed deploy raises RuntimeError naming it, a slow one TimeoutError."""
    import ray
    from ray import serve

    check_together(cfgs)
    if not ray.is_initialized():
        ray.init(address=address, namespace="pdserve", log_to_driver=False)
    t0 = time.monotonic()
    serve.start(http_options={"host": cfgs[0].host, "port": cfgs[0].port})
    for cfg in cfgs:
        serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    took: dict[str, float] = {}
    while True:
        apps = serve.status().applications
        for cfg in (c for c in cfgs if c.name not in took and c.name in apps):
            status = apps[cfg.name]
            if status.status == "RUNNING":
                took[cfg.name] = time.monotonic() - t0
            elif status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"application {cfg.name!r} failed to deploy: {status.message}")
        late = [c.name for c in cfgs if c.name not in took]
        if not late:
            return took
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"applications {late} not RUNNING after {timeout:.0f} s")
        time.sleep(0.5)


def delete_app(name: str) -> None:
    """Delete the application and its ReplicaDirectory."""
    import ray
    from ray import serve

    from pdserve.deploy.ray.directory import NAMESPACE, directory_name

    serve.delete(name)
    try:
        ray.kill(ray.get_actor(directory_name(name), namespace=NAMESPACE))
    except ValueError:
        pass  # no directory (nothing registered)


# ---- command line ------------------------------------------------------------------------------------------
def add_ray_serve_parser(sub: Any, serve_options: Callable[[], set[str]]) -> None:
    """`serve_options()`: the option names `pdserve serve` takes (the CLI's parser), to check `engine:` early."""
    p = sub.add_parser("ray-serve", help="deploy pdserve on a Ray cluster with Ray Serve (pip install pdserve[ray])")
    p.add_argument("config", nargs="+", help="the application's YAML (README: Going multi-node on Ray Serve); "
                   "several files deploy their applications together (one HTTP proxy: same host and port)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local one)")
    p.add_argument("--detach", action="store_true", help="return once the applications are RUNNING (they keep "
                   "running on the cluster; `serve shutdown` or --delete removes them)")
    p.add_argument("--delete", action="store_true", help="delete the applications named in CONFIG and exit")
    p.set_defaults(func=lambda args: _cmd_ray_serve(args, serve_options()))


def _cmd_ray_serve(args: argparse.Namespace, serve_options: set[str]) -> int:
    cfgs = [load_config(path) for path in args.config]  # RayConfigError is a ValueError: the CLI prints it, exits 2
    for cfg in cfgs:
        check_engine_options(cfg, serve_options)
    check_together(cfgs)
    if (args.detach or args.delete) and not (args.address or os.environ.get("RAY_ADDRESS")):
        raise ValueError("--detach and --delete need a running cluster: --address (or RAY_ADDRESS); without one "
                         "this command starts a local Ray that ends with it")
    try:
        import ray
    except ImportError:
        raise ValueError("pdserve ray-serve needs Ray Serve: pip install 'pdserve[ray]'") from None
    if args.delete:
        ray.init(address=args.address, namespace="pdserve", log_to_driver=False)
        for cfg in cfgs:
            delete_app(cfg.name)
        return 0
    took = deploy_all(cfgs, args.address)
    for cfg in cfgs:
        print(f"application {cfg.name!r} RUNNING after {took[cfg.name]:.1f} s on "
              f"http://{cfg.host}:{cfg.port}{cfg.route_prefix}", flush=True)
    if args.detach:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        for cfg in cfgs:
            delete_app(cfg.name)
    return 0
