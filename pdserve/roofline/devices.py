"""Devices: peak FLOP/s, memory bandwidth and capacity (datasheet presets or this machine), where each figure came
from, and a description of this machine (CPU model, ISA, cores, torch build) for cache keys and benchmark reports."""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class PeaksProvenance:
    """When and how a device's peaks were obtained. A measurement taken while the machine was busy (`busy`) is used
    for the run that took it but never cached: it would understate the peaks and overstate every MFU/MBU after."""

    source: str  # "measured" (now), "cached" (an earlier quiet measurement) or "given" (FLOPS,BYTES_PER_S)
    measured_at: str = ""  # UTC, ISO 8601
    method: str = ""  # what ran, e.g. "best of 3 runs: torch.mm float32 n=2048 ..., copy 256 MiB"
    threads: int = 0
    load_avg: float | None = None  # 1-minute load average when the measurement started
    cpu_share: float | None = None  # CPU time / (wall time x threads) while measuring: ~1 on a quiet machine
    busy: bool = False
    key: str = ""  # what a cached figure is valid for: CPU model, ISA path, threads, torch version and build
    probe: str = ""  # how start-up re-validated a cached figure

    def describe(self) -> str:
        """One line for logs and reports."""
        parts = [self.source]
        if self.measured_at:
            parts.append(f"measured {self.measured_at}")
        if self.method:
            parts.append(self.method)
        if self.load_avg is not None:
            parts.append(f"load avg {self.load_avg:.2f}")
        if self.cpu_share is not None:
            parts.append(f"CPU share {self.cpu_share:.0%}")
        if self.busy:
            parts.append("machine busy: not cached, MFU/MBU may read high")
        if self.probe:
            parts.append(self.probe)
        return "; ".join(parts)


@dataclass(frozen=True)
class DeviceSpec:
    """Peak dense FLOP/s (bf16 for GPU presets), memory bandwidth in B/s and memory capacity in bytes."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory: float
    flops_by_dtype: tuple[tuple[str, float], ...] = ()  # measured devices: peak per dtype tried
    provenance: PeaksProvenance | None = None  # None: a datasheet preset

    @property
    def balance(self) -> float:
        """FLOP per byte at which compute time equals memory time."""
        return self.peak_flops / self.mem_bandwidth

    @property
    def source(self) -> str:
        return self.provenance.source if self.provenance else "datasheet"

    def describe_source(self) -> str:
        return self.provenance.describe() if self.provenance else "datasheet"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceSpec:
        prov = data.get("provenance")
        return cls(data["name"], float(data["peak_flops"]), float(data["mem_bandwidth"]), float(data["memory"]),
                   tuple((str(k), float(v)) for k, v in data.get("flops_by_dtype", ())),
                   PeaksProvenance(**prov) if prov else None)


# Vendor datasheet numbers: bf16 tensor-core peak *dense* (no 2:4 sparsity), HBM/GDDR bandwidth, capacity in decimal
# GB as published (nvidia-smi shows a few % less usable).
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("A100 80GB SXM", 312e12, 2.039e12, 80e9),
    "h100": DeviceSpec("H100 SXM", 989e12, 3.35e12, 80e9),
    "h200": DeviceSpec("H200 SXM", 989e12, 4.8e12, 141e9),
    "l40s": DeviceSpec("L40S", 362e12, 864e9, 48e9),
    "rtx4090": DeviceSpec("RTX 4090", 165.2e12, 1.008e12, 24e9),  # bf16 with fp32 accumulate (Ada whitepaper)
}
_DEVICE_ALIASES = {"a10080gb": "a100", "a100sxm": "a100", "h100sxm": "h100", "h200sxm": "h200", "4090": "rtx4090",
                   "geforcertx4090": "rtx4090"}


def _norm_name(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def device_preset(name: str) -> DeviceSpec:
    """A preset by name, case- and punctuation-insensitive ("H100", "rtx-4090", "RTX 4090")."""
    key = _norm_name(name)
    key = _DEVICE_ALIASES.get(key, key)
    if key not in DEVICE_PRESETS:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(d.name for d in DEVICE_PRESETS.values())} "
                         "(or --measure this machine)")
    return DEVICE_PRESETS[key]


# --------------------------------------------------------------------------------------------------------------------
# This machine
# --------------------------------------------------------------------------------------------------------------------

_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides pdserve's matmul paths


def _cpuinfo_field(field: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "CPU"


def cpu_isa() -> list[str]:
    """The ISA extensions among avx2, avx512f, avx512_bf16 and amx_bf16 this CPU has."""
    flags = set(_cpuinfo_field("flags").split())
    return [f for f in _ISA_FLAGS if f in flags]


def usable_cores() -> int:
    """Cores this process may run on (its affinity), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_total() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def torch_build() -> str:
    """Short digest of torch's build configuration (BLAS, oneDNN and compiler versions, ISA levels): a new build
    can have other matmul kernels, so peaks measured with the old one no longer apply."""
    import torch  # here, not at import: presets and DeviceSpec serve `pdserve calc` and the router without torch

    config = torch.__config__.show() + (torch.version.git_version or "")
    return hashlib.sha256(config.encode()).hexdigest()[:12]


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """This machine for reports and cache keys: CPU model, ISA extensions (as a list and one flag each), cores, usable
    cores, memory, torch's CPU capability (the ISA path its kernels take), versions, torch threads and the date."""
    import torch

    isa = cpu_isa()
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "usable_cores": usable_cores(),
            "mem_gib": round(memory_total() / 2**30, 1), "isa": isa, **{f: f in isa for f in _ISA_FLAGS},
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "torch_build": torch_build(), "python": platform.python_version(),
            "threads": threads or torch.get_num_threads(), "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
