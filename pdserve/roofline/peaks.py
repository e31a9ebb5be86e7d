"""Peaks for the live roofline: `--device-peaks auto | off | PRESET | FLOPS,BYTES_PER_S` as a DeviceSpec.

`auto` measures this machine once and caches the figures in `<cache root>/device-peaks.json`, keyed by what they
depend on (CPU model, torch's ISA path, threads, torch version and build). Invariants:
  * a measurement taken while the machine was busy is never cached (it would understate the peaks for good);
  * a cached figure is re-validated at each start by a quick probe; when the probe beats it, the figure was taken
    under load, so the machine is measured again (and the new figures cached if the machine is quiet now).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import torch

from pdserve.cache import cache_root
from pdserve.roofline.devices import (
    DEVICE_PRESETS,
    DeviceSpec,
    PeaksProvenance,
    cpu_name,
    device_preset,
    torch_build,
)
from pdserve.roofline.measure import COPY_BYTES, measure_device, probe_device

logger = logging.getLogger("pdserve.roofline")

CACHE_VERSION = 2  # files of another version are ignored and rewritten
PROBE_MARGIN = 1.10  # the probe must beat a cached figure by this factor: run-to-run noise stays below it


def peaks_cache_file() -> str:
    return str(cache_root() / "device-peaks.json")


def peaks_key(threads: int) -> str:
    """What a measurement is valid for: another CPU, ISA path, thread count or torch build measures anew."""
    return (f"{cpu_name()}|{torch.backends.cpu.get_cpu_capability()}|{threads} threads|torch {torch.__version__}|"
            f"build {torch_build()}")


def _read_entries() -> dict[str, Any]:
    try:
        with open(peaks_cache_file(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def load_cached_device(threads: int) -> DeviceSpec | None:
    """The cached quiet measurement for this machine with `threads` threads, or None."""
    entry = _read_entries().get(peaks_key(threads))
    try:
        device = DeviceSpec.from_json(entry) if entry else None
    except (KeyError, TypeError, ValueError):
        return None
    if device is None or device.provenance is None or device.provenance.busy:
        return None
    return dataclasses.replace(device, provenance=dataclasses.replace(device.provenance, source="cached"))


def save_measured_device(device: DeviceSpec, threads: int) -> str | None:
    """Cache a measurement for `resolve_device_peaks("auto")`; returns the file written (atomically), or None
    when the measurement was taken on a busy machine and so is not cached."""
    prov = device.provenance or PeaksProvenance("measured")
    if prov.busy:
        return None
    key = peaks_key(threads)
    entries = _read_entries()
    entries[key] = dataclasses.replace(device, provenance=dataclasses.replace(prov, key=key, probe="")).to_json()
    path = peaks_cache_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1)
    os.replace(tmp, path)
    return path


def _probe(cached: DeviceSpec, threads: int) -> tuple[bool, str]:
    """(whether a quick probe beats the cached figures by PROBE_MARGIN, what it read)."""
    dtypes = [name for name, _ in cached.flops_by_dtype if hasattr(torch, name)]
    flops, bandwidth = probe_device(threads, dtypes, COPY_BYTES)
    cached_flops = dict(cached.flops_by_dtype)
    beaten = [name for name, f in flops.items() if f > PROBE_MARGIN * cached_flops[name]]
    if bandwidth > PROBE_MARGIN * cached.mem_bandwidth:
        beaten.append("copy")
    read = ", ".join([f"{name} {f / 1e9:.4g} GFLOP/s" for name, f in flops.items()]
                     + [f"copy {bandwidth / 1e9:.4g} GB/s"])
    return bool(beaten), f"start-up probe read {read}" + (f": beats the cache ({', '.join(beaten)})" if beaten
                                                          else ": cache confirmed")


# per process: a process that builds several engines probes or measures once (keyed by cache file and threads)
_resolved: dict[tuple[str, int], DeviceSpec] = {}


def auto_device_peaks(threads: int) -> DeviceSpec:
    """This machine with `threads` torch threads: the cached measurement if a quick probe confirms it, else measured
    now (about two seconds) and cached unless the machine is busy. Once per process."""
    key = (peaks_cache_file(), threads)
    if key not in _resolved:
        _resolved[key] = _auto_device_peaks(threads)
    return _resolved[key]


def _auto_device_peaks(threads: int) -> DeviceSpec:
    cached = load_cached_device(threads)
    probe_note = ""
    if cached is not None and cached.provenance is not None:
        beaten, probe_note = _probe(cached, threads)
        if not beaten:
            device = dataclasses.replace(cached, provenance=dataclasses.replace(cached.provenance, probe=probe_note))
            logger.info("device peaks: %s", device.describe_source())
            return device
        logger.warning("cached device peaks (%s) look taken under load: %s; measuring again",
                       cached.describe_source(), probe_note)
    device = measure_device(threads, budget_s=0.5)
    prov = dataclasses.replace(device.provenance or PeaksProvenance("measured"), key=peaks_key(threads),
                               probe=probe_note)
    device = dataclasses.replace(device, provenance=prov)
    try:
        path = save_measured_device(device, threads)
    except OSError as e:
        path = None
        logger.warning("could not cache device peaks: %s", e)
    if prov.busy:
        logger.warning("device peaks %s; a quiet start (or `pdserve calc --measure`) measures again",
                       prov.describe())
    else:
        logger.info("device peaks: %s%s", prov.describe(), f"; cached in {path}" if path else "")
    return device


def resolve_device_peaks(spec: str, threads: int | None = None, device: str = "cpu") -> DeviceSpec | None:
    """Peaks for the live roofline. "auto": this machine with `threads` torch threads (default: torch's current
    count), see auto_device_peaks, or on `device` cuda the preset of the GPU's name (gpu_preset); "off": none; a
    preset name; or "FLOPS,BYTES_PER_S" (e.g. "170e9,17e9")."""
    spec = spec.strip()
    if spec.lower() in ("off", "none", ""):
        return None
    if "," in spec:
        flops, bw = (float(x) for x in spec.split(",", 1))
        return DeviceSpec("given peaks", flops, bw, 0.0, provenance=PeaksProvenance("given"))
    if spec.lower() != "auto":
        return device_preset(spec)
    if device == "cuda":
        return gpu_preset(torch.cuda.get_device_name())
    return auto_device_peaks(threads or torch.get_num_threads())


def gpu_preset(device_name: str) -> DeviceSpec | None:
    """The preset whose key occurs in the GPU's name ("NVIDIA H200" -> h200; longest key first), or None (with a
    warning: the live roofline shows no MFU/MBU; give `--device-peaks FLOPS,BYTES_PER_S`)."""
    key = "".join(c for c in device_name.lower() if c.isalnum())
    for name in sorted(DEVICE_PRESETS, key=len, reverse=True):
        if name in key:
            return DEVICE_PRESETS[name]
    logger.warning("no peaks preset matches GPU %r; pass --device-peaks FLOPS,BYTES_PER_S for MFU/MBU", device_name)
    return None
