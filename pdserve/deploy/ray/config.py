"""The Ray Serve application's configuration: one YAML file, loaded into dataclasses with clear errors.

    topology: colocated            # or disaggregated
    engine: {model: /models/tiny, dtype: float32}   # `pdserve serve` options by name
    engine_replicas: {num_replicas: 2, num_cpus: 1, num_threads: 1}   # colocated
    prefill: {num_replicas: 1, num_cpus: 1}          # disaggregated
    decode: {num_replicas: 1, num_cpus: 1}
    ingress: {num_cpus: 0.1}
    router: {poll_interval: 0.5, max_decode_attempts: 2}

Each replica group may carry `autoscaling` (min/max replicas and the engine-signal targets, see autoscaling.py),
`ray_actor_options` (passed to Ray as they are: resources, runtime_env ...), `max_replicas_per_node` and
`health_check_period_s`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RayConfigError(ValueError):
    """The YAML is not a valid application config; the message names the key and what was expected."""


@dataclass
class Autoscaling:
    """Engine-signal autoscaling: scale up when a replica's waiting requests or KV usage pass their target."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_waiting: float = 2.0  # waiting requests per replica
    target_kv_usage: float = 0.8  # fraction of KV blocks in use
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float = 15.0  # Ray wants it above the metrics interval
    metrics_interval_s: float = 10.0  # how often each replica reports its waiting requests and KV usage

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise RayConfigError("autoscaling: need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.target_waiting <= 0 or not 0 < self.target_kv_usage <= 1:
            raise RayConfigError("autoscaling: target_waiting must be > 0 and target_kv_usage in (0, 1]")
        if not 0 < self.metrics_interval_s < self.look_back_period_s:
            raise RayConfigError("autoscaling: need 0 < metrics_interval_s < look_back_period_s")


@dataclass
class ReplicaGroup:
    """One deployment's replicas: how many, the CPUs Ray reserves for each and the engine's OpenMP threads."""

    num_replicas: int = 1
    num_cpus: float = 1.0
    num_threads: int | None = None  # one OpenMP team per engine; default: the reserved CPUs, at least 1
    autoscaling: Autoscaling | None = None
    ray_actor_options: dict[str, Any] = field(default_factory=dict)
    max_replicas_per_node: int | None = None
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0
    startup_timeout_s: float = 300.0  # the pdserve process must answer /health within this

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.num_cpus < 0:
            raise RayConfigError("num_replicas must be >= 1 and num_cpus >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise RayConfigError("num_threads must be >= 1")

    @property
    def threads(self) -> int:
        return self.num_threads or max(1, int(self.num_cpus))


@dataclass
class IngressConfig:
    num_replicas: int = 1
    num_cpus: float = 0.1
    ray_actor_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RayServeConfig:
    topology: str = "colocated"  # colocated | disaggregated
    engine: dict[str, Any] = field(default_factory=dict)  # `pdserve serve` options by name (dtype, log_level ...)
    engine_replicas: ReplicaGroup = field(default_factory=ReplicaGroup)
    prefill: ReplicaGroup = field(default_factory=ReplicaGroup)
    decode: ReplicaGroup = field(default_factory=ReplicaGroup)
    ingress: IngressConfig = field(default_factory=IngressConfig)
    router: dict[str, Any] = field(default_factory=dict)  # RouterConfig fields (poll_interval, timeouts ...)
    name: str = "pdserve"  # the Serve application's name
    route_prefix: str = "/"
    host: str = "0.0.0.0"  # Serve's HTTP proxy
    port: int = 8000

    def __post_init__(self) -> None:
        if self.topology not in ("colocated", "disaggregated"):
            raise RayConfigError(f"topology must be colocated or disaggregated, got {self.topology!r}")
        for k in ("kv_role", "kv_host", "kv_port", "num_threads", "host", "port"):
            if k in self.engine:
                raise RayConfigError(f"engine.{k} is set per replica by the deployment; remove it")
        if self.engine.get("api_key") and not self.engine.get("metrics_public"):  # the ingress and autoscaling read it
            raise RayConfigError("engine.api_key keeps each replica's /metrics behind the key, which the ingress and "
                                 "the autoscaling policy read without it: add engine.metrics_public: true")
        from pdserve.router.serving import RouterConfig

        router_fields = {f.name for f in dataclasses.fields(RouterConfig)} - {"prefill", "decode"}
        bad = sorted(set(self.router) - router_fields)
        if bad:
            raise RayConfigError(f"router: unknown option(s) {bad}; known: {sorted(router_fields)}")

    def groups(self) -> dict[str, ReplicaGroup]:
        """{role: replica group} of the engine deployments this topology runs."""
        if self.topology == "colocated":
            return {"both": self.engine_replicas}
        return {"prefill": self.prefill, "decode": self.decode}

    def serve_args(self) -> list[str]:
        """The `pdserve serve` flags of `engine` (True: the bare flag, False/None: left out)."""
        args: list[str] = []
        for k, v in self.engine.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                args.append(flag)
            elif v is not None and v is not False:
                args += [flag, str(v)]
        return args


def check_engine_options(cfg: RayServeConfig, known: set[str]) -> None:
    """Raise unless every `engine` key is a `pdserve serve` option (`known`: the CLI passes its parser's names;
    without this check a wrong key fails at replica start-up with the server's usage error)."""
    unknown = sorted(k for k in cfg.engine if k not in known)
    if unknown:
        raise RayConfigError(f"engine: unknown pdserve serve option(s) {unknown}; see `pdserve serve --help`")


def _build(cls: type, data: Any, where: str) -> Any:
    """`cls(**data)` with nested dataclasses, turning type and key errors into RayConfigError naming `where`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RayConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise RayConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        sub = {"engine_replicas": ReplicaGroup, "prefill": ReplicaGroup, "decode": ReplicaGroup,
               "ingress": IngressConfig, "autoscaling": Autoscaling}.get(k)
        kwargs[k] = _build(sub, v, f"{where}.{k}" if where else k) if sub and v is not None else v
    try:
        return cls(**kwargs)
    except RayConfigError as exc:
        raise RayConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise RayConfigError(f"{where}: {exc}") from None


def config_from_dict(data: Any) -> RayServeConfig:
    return _build(RayServeConfig, data, "config")  # type: ignore[no-any-return]


def load_config(path: str | Path) -> RayServeConfig:
    """Read and check the YAML file at `path`."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RayConfigError(f"cannot read {p}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RayConfigError(f"{p} is not valid YAML: {exc}") from None
    try:
        return config_from_dict(data)
    except RayConfigError as exc:
        raise RayConfigError(f"{p}: {exc}") from None
