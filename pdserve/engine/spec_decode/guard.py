"""Whether speculation pays, measured end to end: decode tokens per second with it and without it, per batch size.

The policy (policy.py) decides each step from a model: the roofline's time model, the measured overhead of a step
with drafts, the acceptance rates. What that model does not see shows only in the rate actually delivered: a draft
model's catch-up on every new prompt (a prefill of the draft), a proposer's slow path, a kernel that is slower for
several query rows at this dtype. The guard measures it.

Steps are grouped by their number of decodes into buckets (1, 2-3, 4-7, 8-15, ...). Each bucket runs in epochs of
EPOCH_STEPS of its steps, each epoch in one mode: `on` (the policy decides) or `off` (no drafts, no catch-up). A
mode's rate is the decode tokens the bucket's steps emitted over their duration (whole steps: scheduling, drafting
and catch-up included; a prefill chunk's predicted time is left out by the engine, as it is the same in both
modes), an EWMA over its epochs. The first
two epochs of a bucket measure both modes; then the faster mode runs, and the other is tried again for one epoch
after `interval` epochs. The interval doubles (up to MAX_INTERVAL) each time the trial confirms the choice and
resets when it overturns it, so a settled bucket spends at most 1 / (MAX_INTERVAL + 1) of its steps on trials.
Speculation stays on unless its measured rate is below the rate without by more than MARGIN.
"""

from __future__ import annotations

from dataclasses import dataclass

EPOCH_STEPS = 32
MARGIN = 0.03
FIRST_INTERVAL = 2
MAX_INTERVAL = 16
DECAY = 0.5  # EWMA weight of a mode's earlier epochs


@dataclass
class _Bucket:
    mode: str = "on"  # the mode of the current epoch
    best: str = "on"  # the mode chosen from the measurements
    steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0
    rate_on: float | None = None
    rate_off: float | None = None
    interval: int = FIRST_INTERVAL
    since_trial: int = 0  # epochs of the best mode since the last trial


class SpecGuard:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(num_decodes: int) -> int:
        return max(num_decodes, 1).bit_length() - 1  # 1 -> 0, 2-3 -> 1, 4-7 -> 2, ...

    def allow(self, num_decodes: int) -> bool:
        """Whether this step's decodes may speculate (the mode of their bucket's epoch)."""
        b = self.buckets.get(self.bucket_of(num_decodes))
        return b is None or b.mode == "on"

    def observe(self, num_decodes: int, tokens: int, seconds: float) -> None:
        """A step with `num_decodes` decodes emitted `tokens` decode tokens (accepted drafts included) in
        `seconds`."""
        if num_decodes <= 0 or seconds <= 0:
            return
        b = self.buckets.setdefault(self.bucket_of(num_decodes), _Bucket())
        b.steps += 1
        b.tokens += tokens
        b.seconds += seconds
        if b.steps >= EPOCH_STEPS:
            self._end_epoch(b)

    def _end_epoch(self, b: _Bucket) -> None:
        first_choice = b.rate_off is None  # until both modes are measured, `best` is the default, not a choice
        rate = b.tokens / b.seconds
        if b.mode == "on":
            b.rate_on = rate if b.rate_on is None else DECAY * b.rate_on + (1 - DECAY) * rate
        else:
            b.rate_off = rate if b.rate_off is None else DECAY * b.rate_off + (1 - DECAY) * rate
        b.steps, b.tokens, b.seconds = 0, 0.0, 0.0
        if b.rate_off is None:  # measure the plain rate once before choosing
            b.mode = "off"
            return
        assert b.rate_on is not None
        best = "off" if b.rate_on < (1 - MARGIN) * b.rate_off else "on"
        if first_choice:  # both modes measured once: the first choice, no trial to judge
            b.since_trial = 0
        elif b.mode != b.best:  # a trial just ended: it confirmed the choice (back off) or overturned it
            b.interval = min(2 * b.interval, MAX_INTERVAL) if best == b.best else FIRST_INTERVAL
            b.since_trial = 0
        else:
            b.since_trial += 1
        b.best = best
        if b.since_trial >= b.interval:
            b.mode = "off" if best == "on" else "on"
        else:
            b.mode = best

    def state(self) -> dict[int, str]:
        """Bucket (log2 of the decode count) -> the mode chosen."""
        return {k: b.best for k, b in self.buckets.items()}


__all__ = ["EPOCH_STEPS", "MARGIN", "SpecGuard"]
