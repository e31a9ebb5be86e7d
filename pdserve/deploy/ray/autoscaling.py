"""Autoscaling on the engines' own signals. Each EngineReplica reports its waiting requests and KV usage
(`record_autoscaling_stats`, read from its /metrics); `engine_signal_policy` asks for enough replicas that neither
signal passes its target per replica. `autoscaling_config` maps the YAML's `autoscaling` onto Ray Serve's."""

from __future__ import annotations

import math
from typing import Any

from pdserve.deploy.ray.config import Autoscaling

POLICY = "pdserve.deploy.ray.autoscaling:engine_signal_policy"


def autoscaling_config(a: Autoscaling) -> dict[str, Any]:
    return {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s, "metrics_interval_s": a.metrics_interval_s,
            "policy": {"policy_function": POLICY,
                       "policy_kwargs": {"target_waiting": a.target_waiting, "target_kv_usage": a.target_kv_usage}}}


def desired_replicas(waiting: list[float], kv_usage: list[float], target_waiting: float,
                     target_kv_usage: float) -> int:
    """Replicas needed so that the total waiting requests and KV usage, spread evenly, stay at their targets."""
    need = max(sum(waiting) / target_waiting, sum(kv_usage) / target_kv_usage)
    return max(1, math.ceil(need - 1e-9))


def engine_signal_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve custom autoscaling policy (AutoscalingContext -> (replicas, policy state))."""
    kwargs = dict(ctx.config.policy.policy_kwargs or {}) if ctx.config is not None else {}
    metrics = ctx.aggregated_metrics or {}
    waiting = list((metrics.get("waiting") or {}).values())
    kv = list((metrics.get("kv_usage") or {}).values())
    if not waiting and not kv:  # no report yet (replicas starting): keep the current target
        return ctx.target_num_replicas, ctx.policy_state
    n = desired_replicas(waiting, kv, float(kwargs.get("target_waiting", 2.0)),
                         float(kwargs.get("target_kv_usage", 0.8)))
    n = min(max(n, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
    return n, ctx.policy_state
