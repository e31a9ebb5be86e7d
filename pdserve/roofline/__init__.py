"""Roofline: device peaks (presets, measurement, cache), cost models, the live meter and `pdserve calc`.

    devices  DeviceSpec, PeaksProvenance, DEVICE_PRESETS, machine_info
    measure  measuring this machine's peaks, and whether it was busy while measuring
    peaks    --device-peaks resolution: cached measurements, re-validated by a probe at start
    cost     FLOPs and bytes of a prefill / decode step (`calc`) and of any engine step (StepCostModel)
    meter    RooflineMeter: achieved FLOP/s and B/s per step kind, MFU and MBU
    calc_cli model presets, the `pdserve calc` report and its command line

measure, peaks and meter use torch and load on first use of their names, so that the command line (which lists
`calc` among its commands) does not import torch for commands that never run a model (`pdserve router`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pdserve.roofline.calc_cli import (
    MODEL_PRESETS,
    CalcResult,
    ModelPreset,
    add_calc_parser,
    calc,
    format_report,
    model_params,
    model_shape_from,
    result_json,
    run_calc,
)
from pdserve.roofline.cost import (
    Cost,
    StepCostModel,
    count_params,
    decode_compute_bound_batch,
    decode_cost,
    dtype_bytes,
    kv_bytes_per_token,
    kv_capacity,
    kv_element_bytes,
    prefill_cost,
)
from pdserve.roofline.devices import DEVICE_PRESETS, DeviceSpec, PeaksProvenance, device_preset, machine_info

if TYPE_CHECKING:
    from pdserve.roofline.measure import measure_copy_bandwidth, measure_device, measure_matmul_flops, probe_device
    from pdserve.roofline.meter import PhaseTotals, RooflineMeter
    from pdserve.roofline.peaks import load_cached_device, peaks_key, resolve_device_peaks, save_measured_device

_LAZY = {**dict.fromkeys(("measure_copy_bandwidth", "measure_device", "measure_matmul_flops", "probe_device"),
                         "pdserve.roofline.measure"),
         **dict.fromkeys(("PhaseTotals", "RooflineMeter"), "pdserve.roofline.meter"),
         **dict.fromkeys(("load_cached_device", "peaks_key", "resolve_device_peaks", "save_measured_device"),
                         "pdserve.roofline.peaks")}

__all__ = [
    "DEVICE_PRESETS", "MODEL_PRESETS", "CalcResult", "Cost", "DeviceSpec", "ModelPreset", "PeaksProvenance",
    "PhaseTotals", "RooflineMeter", "StepCostModel", "add_calc_parser", "calc", "count_params",
    "decode_compute_bound_batch", "decode_cost", "device_preset", "dtype_bytes", "format_report",
    "kv_bytes_per_token", "kv_capacity", "kv_element_bytes", "load_cached_device", "machine_info",
    "measure_copy_bandwidth", "measure_device", "measure_matmul_flops", "model_params", "model_shape_from",
    "peaks_key", "prefill_cost", "probe_device", "resolve_device_peaks", "result_json", "run_calc",
    "save_measured_device",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve.roofline' has no attribute {name!r}")
