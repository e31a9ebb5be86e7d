"""The profile of N engine steps, by step kind: top operators by self time with FLOPs, bytes and achieved rates,
the kind's roofline (cost model vs the machine's peaks) and the reading.

Operators are attributed to a step by their outermost profiler frame (`pdserve.step`, one per engine step, in
order); the step's kind comes from its StepStats. FLOPs per aten op come from torch.profiler (`with_flops`), or
from recorded shapes for matrix products it does not count (oneDNN's linear); bytes are estimated from shapes for
matrix products (inputs + output, the operand traffic). The native kernels are one C++ call (the
`pdserve.forward.<kind>` frame's self time), whose work the step cost model (roofline.cost) counts.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pdserve.roofline import DeviceSpec, RooflineMeter

STEP_FRAME = "pdserve.step"  # the profiler frame around one engine step (phase.py)
FORWARD_FRAME = "pdserve.forward."  # engine.py's frame around the forward pass, + kind
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise",
            "aten::_weight_int8pack_mm", "aten::baddbmm")
TOP_OPS = 15


@dataclass
class OpRow:
    name: str
    calls: int = 0
    self_us: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0

    def as_dict(self, kind_us: float, steps: int) -> dict[str, Any]:
        s = self.self_us / 1e6
        return {"op": self.name, "calls": self.calls, "calls_per_step": round(self.calls / max(steps, 1), 2),
                "self_ms": round(self.self_us / 1e3, 3), "share": round(self.self_us / kind_us, 4) if kind_us else 0,
                "gflop": round(self.flops / 1e9, 4) if self.flops else None,
                "gbytes": round(self.bytes / 1e9, 4) if self.bytes else None,
                "gflop_per_s": round(self.flops / s / 1e9, 2) if self.flops and s else None,
                "gb_per_s": round(self.bytes / s / 1e9, 2) if self.bytes and s else None}


@dataclass
class KindProfile:
    steps: int = 0
    self_us: float = 0.0
    num_ops: int = 0  # leaf operator calls (no profiler frames)
    op_us: list[float] = field(default_factory=list)  # self time of each leaf call
    ops: dict[str, OpRow] = field(default_factory=dict)


def _elems(shape: Any) -> int:
    return math.prod(shape) if isinstance(shape, list) and all(isinstance(d, int) for d in shape) else 0


def gemm_cost(name: str, shapes: list[Any], itemsize: int) -> tuple[float, float]:
    """(FLOPs, bytes) of a matrix product from its recorded shapes: 2 x rows x inner x cols, and its operand traffic
    (inputs and output once each); (0, 0) for other ops or shapes not recorded."""
    if name not in GEMM_OPS or not shapes:
        return 0.0, 0.0
    mats = [s for s in shapes if isinstance(s, list) and len(s) >= 2 and all(isinstance(d, int) for d in s)]
    if len(mats) < 2:
        return 0.0, 0.0
    a, b = mats[-2], mats[-1]  # addmm/baddbmm: (bias, a, b); mm/bmm/linear: (a, b)
    rows, inner = math.prod(a[:-1]), a[-1]
    cols = b[0] if name in ("aten::linear", "mkldnn::_linear_pointwise") else b[-1]
    return 2.0 * rows * inner * cols, float((_elems(a) + _elems(b) + rows * cols) * itemsize)


def _root(ev: Any) -> Any:
    while ev.cpu_parent is not None:
        ev = ev.cpu_parent
    return ev


def aggregate(events: list[Any], kinds: list[str], itemsize: int) -> dict[str, KindProfile]:
    """Per step kind: operator rows from profiler events. `kinds[i]` is the kind of the i-th `pdserve.step`."""
    roots = sorted((e for e in events if e.name == STEP_FRAME and e.cpu_parent is None),
                   key=lambda e: e.time_range.start)
    kind_of = {id(r): kinds[i] for i, r in enumerate(roots) if i < len(kinds)}
    out: dict[str, KindProfile] = defaultdict(KindProfile)
    for k in kinds:
        out[k].steps += 1
    for ev in events:
        kind = kind_of.get(id(_root(ev)))
        if kind is None:
            continue
        prof, us = out[kind], float(ev.self_cpu_time_total)
        prof.self_us += us
        row = prof.ops.setdefault(ev.name, OpRow(ev.name))
        row.calls += 1
        row.self_us += us
        flops, nbytes = gemm_cost(ev.name, list(getattr(ev, "input_shapes", None) or []), itemsize)
        row.flops += float(getattr(ev, "flops", 0) or 0) or flops
        row.bytes += nbytes
        if not ev.name.startswith("pdserve."):
            prof.num_ops += 1
            prof.op_us.append(us)
    return dict(out)


def reading(kind: str, prof: KindProfile, roof: dict[str, Any]) -> str:
    """The roofline reading of a kind's profile: which roof it is near, and what its operators look like (many small
    ops near the bandwidth roof: bandwidth-bound decode; few big GEMMs near the compute roof: compute-bound
    prefill)."""
    per_step = prof.num_ops / max(prof.steps, 1)
    median_us = statistics.median(prof.op_us) if prof.op_us else 0.0
    gemm_us = sum(r.self_us for r in prof.ops.values() if r.name in GEMM_OPS or r.name.startswith(FORWARD_FRAME))
    gemm = gemm_us / prof.self_us if prof.self_us else 0.0
    shape = f"{per_step:.0f} ops/step (median {median_us:.0f} us), {gemm:.0%} of self time in GEMMs / fused forward"
    if "mbu" in roof:
        near = f"MBU {roof['mbu']:.0%} vs MFU {roof['mfu']:.0%}"
        bandwidth = roof["mbu"] >= roof["mfu"]
    else:
        near = f"intensity {roof.get('intensity', 0):.1f} FLOP/byte (no device peaks)"
        bandwidth = roof.get("intensity", 0) < 20  # below any CPU ridge point we measured
    verdict = ("many small ops near the bandwidth roof = bandwidth-bound decode" if bandwidth
               else "few big GEMMs near the compute roof = compute-bound prefill")
    return f"{kind}: {shape}; {near}: {verdict}"


def _attribute_native_forward(kind: str, prof: KindProfile, stats: list[Any]) -> None:
    """Native kernels run the whole forward in one C++ call, invisible to the profiler: when the forward frame's
    own time is most of the model time, it gets the step cost model's FLOPs and bytes."""
    row = prof.ops.get(FORWARD_FRAME + kind)
    model_us = sum(s.model_time for s in stats) * 1e6
    if row is not None and model_us > 0 and row.self_us >= 0.5 * model_us:
        row.flops, row.bytes = sum(s.flops for s in stats), sum(s.bytes for s in stats)


def build_report(events: list[Any], kinds: list[str], step_stats: list[Any], device: DeviceSpec | None, dtype: Any,
                 itemsize: int) -> dict[str, Any]:
    """The profile as JSON (`kinds`: of every profiled step frame; `step_stats`: the non-idle ones): per kind,
    the roofline of its steps (cost model over model time), top ops, reading."""
    meter = RooflineMeter(device, dtype)
    for s in step_stats:
        meter.add(s.kind.value, s.model_time, s.flops, s.bytes)
    roofs = meter.summary()
    profs = aggregate(events, kinds, itemsize)
    out: dict[str, Any] = {}
    for kind, prof in sorted(profs.items()):
        if kind == "idle":
            continue
        _attribute_native_forward(kind, prof, [s for s in step_stats if s.kind.value == kind])
        roof = roofs.get(kind, {})
        top = sorted(prof.ops.values(), key=lambda r: r.self_us, reverse=True)[:TOP_OPS]
        out[kind] = {"steps": prof.steps, "profiled_ms": round(prof.self_us / 1e3, 3),
                       "ops_per_step": round(prof.num_ops / max(prof.steps, 1), 1), "roofline": roof,
                       "top_ops": [r.as_dict(prof.self_us, prof.steps) for r in top],
                       "reading": reading(kind, prof, roof)}
    peaks = {"peak_flops": meter.peak_flops, "mem_bandwidth": device.mem_bandwidth} if device else None
    return {"num_steps": len(step_stats), "peaks": peaks, "kinds": out}


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def format_table(report: dict[str, Any]) -> str:
    """Markdown: per step kind, its roofline line, the top operators and the reading."""
    lines = [f"Profile of {report['num_steps']} engine steps"]
    if report["peaks"]:
        p = report["peaks"]
        lines[0] += f" (peaks: {p['peak_flops'] / 1e9:.0f} GFLOP/s, {p['mem_bandwidth'] / 1e9:.1f} GB/s)"
    for kind, k in report["kinds"].items():
        r = k["roofline"]
        lines += ["", f"### {kind}: {k['steps']} steps, {k['ops_per_step']} ops/step"]
        if r:
            util = f", MFU {r['mfu']:.1%}, MBU {r['mbu']:.1%}" if "mfu" in r else ""
            lines.append(f"step cost model over model time: {r['flops_per_s'] / 1e9:.1f} GFLOP/s, "
                         f"{r['bytes_per_s'] / 1e9:.2f} GB/s, {r['intensity']:.1f} FLOP/byte{util}")
        lines += ["", "| op | calls/step | self ms | share | GFLOP | GB | GFLOP/s | GB/s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for o in k["top_ops"]:
            lines.append(f"| `{o['op']}` | {o['calls_per_step']} | {o['self_ms']:.2f} | {o['share']:.1%} | "
                         f"{_fmt(o['gflop'], '.3f')} | {_fmt(o['gbytes'], '.3f')} | {_fmt(o['gflop_per_s'])} | "
                         f"{_fmt(o['gb_per_s'])} |")
        lines += ["", f"Reading: {k['reading']}"]
    return "\n".join(lines) + "\n"
