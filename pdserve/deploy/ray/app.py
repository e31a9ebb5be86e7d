"""The Ray Serve application of a RayServeConfig, and `pdserve ray-serve CONFIG.yaml`.

    serve run pdserve.deploy.ray.app:app_builder config=pdserve-ray.yaml   # Ray's own CLI (serve deploy too)
    pdserve ray-serve pdserve-ray.yaml [--address auto]                    # deploy, wait until RUNNING

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
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, namespace="pdserve", log_to_driver=False)
    t0 = time.monotonic()
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    while True:
        status = serve.status().applications.get(cfg.name)
        if status is not None and status.status == "RUNNING":
            return time.monotonic() - t0
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"application {cfg.name!r} failed to deploy: {status.message}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"application {cfg.name!r} not RUNNING after {timeout:.0f} s: "
                               f"{status.status if status else 'unknown'}")
        time.sleep(1.0)


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
    p.add_argument("config", help="the application's YAML (README: Going multi-node on Ray Serve)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local one)")
    p.add_argument("--detach", action="store_true", help="return once the application is RUNNING (it keeps "
                   "running on the cluster; `serve shutdown` or --delete removes it)")
    p.add_argument("--delete", action="store_true", help="delete the application named in CONFIG and exit")
    p.set_defaults(func=lambda args: _cmd_ray_serve(args, serve_options()))


def _cmd_ray_serve(args: argparse.Namespace, serve_options: set[str]) -> int:
    cfg = load_config(args.config)  # RayConfigError is a ValueError: the CLI prints it and exits 2
    check_engine_options(cfg, serve_options)
    if (args.detach or args.delete) and not (args.address or os.environ.get("RAY_ADDRESS")):
        raise ValueError("--detach and --delete need a running cluster: --address (or RAY_ADDRESS); without one "
                         "this command starts a local Ray that ends with it")
    try:
        import ray
    except ImportError:
        raise ValueError("pdserve ray-serve needs Ray Serve: pip install 'pdserve[ray]'") from None
    if args.delete:
        ray.init(address=args.address, namespace="pdserve", log_to_driver=False)
        delete_app(cfg.name)
        return 0
    took = deploy(cfg, args.address)
    print(f"application {cfg.name!r} RUNNING after {took:.1f} s on http://{cfg.host}:{cfg.port}{cfg.route_prefix}",
          flush=True)
    if args.detach:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        delete_app(cfg.name)
    return 0
