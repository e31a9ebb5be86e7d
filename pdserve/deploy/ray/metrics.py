"""Every replica's Prometheus metrics in one exposition, each sample labelled with its replica, role and node
(served by the ingress at /metrics/replicas)."""

from __future__ import annotations

import re
from typing import Any

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def relabel(text: str, labels: dict[str, str]) -> list[str]:
    """The sample lines of one exposition with `labels` added (comment lines are dropped: the caller writes one
    HELP/TYPE per family)."""
    extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if line.startswith("#") or not m:
            continue
        name, lbl, rest = m.groups()
        inner = lbl[1:-1] if lbl else ""
        out.append(f"{name}{{{extra}{',' if inner else ''}{inner}}}{rest}")
    return out


def merge(expositions: list[tuple[dict[str, Any], str]]) -> str:
    """One exposition from (replica entry, its /metrics text) pairs: HELP/TYPE once per family (from the first
    replica that has it), then each replica's samples with replica, role and node labels."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    family = ""
    for entry, text in expositions:
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                if line not in headers.setdefault(family, []):
                    headers[family].append(line)
        labels = {"replica": str(entry["replica_id"]), "role": str(entry["role"]), "node": str(entry["node_id"])}
        for line in relabel(text, labels):
            fam = _family_of(line.split("{", 1)[0], headers)
            samples.setdefault(fam, []).append(line)
    lines: list[str] = []
    for fam in dict.fromkeys([*headers, *samples]):
        lines += headers.get(fam, []) + samples.get(fam, [])
    return "\n".join(lines) + "\n"


def _family_of(sample: str, headers: dict[str, list[str]]) -> str:
    """The family a sample belongs to (histogram and counter samples carry suffixes)."""
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created", ""):
        if suffix and sample.endswith(suffix) and sample[: -len(suffix)] in headers:
            return sample[: -len(suffix)]
    return sample
