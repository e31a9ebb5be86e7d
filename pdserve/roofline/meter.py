"""The live roofline: what each engine step had to compute and move (StepCostModel), summed per step kind and set
against this machine's peaks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.roofline.devices import DeviceSpec


@dataclass
class PhaseTotals:
    steps: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0


class RooflineMeter:
    """Sums model time, FLOPs and bytes per step kind (prefill | decode | mixed) and turns them into achieved FLOP/s
    and B/s, MFU (FLOP/s over peak) and MBU (B/s over bandwidth). Decode reaching a high MBU while its MFU stays
    low is the signature of a bandwidth-bound phase; prefill the other way round."""

    def __init__(self, device: DeviceSpec | None, compute_dtype: torch.dtype) -> None:
        self.device = device
        self.peak_flops = self.peak_for(device, compute_dtype) if device else 0.0
        self.totals: dict[str, PhaseTotals] = {}

    @classmethod
    def with_peak(cls, device: DeviceSpec | None, peak_flops: float) -> RooflineMeter:
        """An empty meter against a known peak (e.g. another meter's `peak_flops`), for a window's steps."""
        meter = cls(None, torch.float32)
        meter.device, meter.peak_flops = device, peak_flops if device else 0.0
        return meter

    @staticmethod
    def peak_for(device: DeviceSpec, dtype: torch.dtype) -> float:
        """The measured peak of the dtype the model computes in, when the device says; else its headline peak."""
        name = str(dtype).removeprefix("torch.")
        return dict(device.flops_by_dtype).get(name, device.peak_flops)

    def utilization(self, flops: float, nbytes: float, seconds: float) -> tuple[float, float]:
        """(MFU, MBU) of work done in `seconds`; (0, 0) without peaks."""
        if self.device is None or seconds <= 0:
            return 0.0, 0.0
        return flops / seconds / self.peak_flops, nbytes / seconds / self.device.mem_bandwidth

    def add(self, kind: str, seconds: float, flops: float, nbytes: float) -> None:
        t = self.totals.setdefault(kind, PhaseTotals())
        t.steps += 1
        t.seconds += seconds
        t.flops += flops
        t.bytes += nbytes

    def summary(self) -> dict[str, dict[str, float | int | str]]:
        """Per step kind: steps, seconds, achieved FLOP/s and B/s, MFU, MBU and which roof is nearer."""
        out: dict[str, dict[str, float | int | str]] = {}
        for kind, t in sorted(self.totals.items()):
            if t.seconds <= 0:
                continue
            mfu, mbu = self.utilization(t.flops, t.bytes, t.seconds)
            row: dict[str, float | int | str] = {
                "steps": t.steps, "seconds": round(t.seconds, 4), "flops_per_s": t.flops / t.seconds,
                "bytes_per_s": t.bytes / t.seconds, "intensity": t.flops / t.bytes if t.bytes else 0.0}
            if self.device is not None:
                row.update(mfu=mfu, mbu=mbu, nearer_roof="compute" if mfu >= mbu else "bandwidth")
            out[kind] = row
        return out
