"""What a step with drafts really costs beyond the step time model's prediction, learned from the steps run.

The step time model (engine/step_budget.py) predicts a step's model time from its FLOPs and bytes. For a draft
token that is its layer FLOPs and attention: a fraction of a millisecond for a small model. A step that verifies
drafts also pays what the roofline does not see: the kernels for several query rows instead of one, the
verification sampler over 1 + k rows (probabilities over the vocabulary at temperature > 0), the proposer's own work
(its index updates, its lookups) and the rollback. On a small model on CPU that is several milliseconds, so a policy
that trusted the roofline alone drafts at acceptance rates that lose time.

So the policy measures it. For every decode-only step the engine reports the residual: measured step duration (the
whole step, scheduling and bookkeeping included) minus the prediction for the rows it ran, drafts included. Steps
without drafts give the bias b (what every step costs beyond the model). Steps with n drafts are fitted as

    residual = b + e0 + e1 · n        (e0: a step that carries any draft; e1: each draft token; both >= 0)

over the medians of the residuals of each n (robust to the odd slow step), by least squares weighted by count.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

WINDOW = 128  # recent steps of each kind
MIN_PLAIN = 8
MIN_SPEC = 8
REFIT_EVERY = 8


class DraftOverhead:
    def __init__(self) -> None:
        self.plain: deque[float] = deque(maxlen=WINDOW)  # residuals of steps without drafts
        self.spec: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (drafts, residual) of steps with drafts
        self.bias = 0.0  # b (s)
        self.fixed = 0.0  # e0 (s)
        self.per_draft = 0.0  # e1 (s)
        self._since_fit = 0

    @property
    def fitted(self) -> bool:
        return len(self.plain) >= MIN_PLAIN and len(self.spec) >= MIN_SPEC

    def observe(self, num_drafts: int, residual: float) -> None:
        if num_drafts:
            self.spec.append((num_drafts, residual))
        else:
            self.plain.append(residual)
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY and len(self.plain) >= MIN_PLAIN:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        self.bias = float(np.median(self.plain))
        if len(self.spec) < MIN_SPEC:
            return
        groups: dict[int, list[float]] = defaultdict(list)
        for n, r in self.spec:
            groups[n].append(r - self.bias)
        ns = np.array(sorted(groups), dtype=np.float64)
        med = np.array([np.median(groups[int(n)]) for n in ns])
        w = np.sqrt(np.array([len(groups[int(n)]) for n in ns], dtype=np.float64))
        if len(ns) == 1:  # one draft count seen: all of it is the step's
            self.fixed, self.per_draft = max(float(med[0]), 0.0), 0.0
            return
        x = np.column_stack([np.ones(len(ns)), ns]) * w[:, None]
        (e0, e1), *_ = np.linalg.lstsq(x, med * w, rcond=None)
        if e1 < 0:  # more drafts never cost less: the whole residual is per step
            e0, e1 = float(np.average(med, weights=w * w)), 0.0
        if e0 < 0:  # no per-step part: per draft only, through the origin
            e0, e1 = 0.0, float(np.sum(w * w * ns * med) / np.sum(w * w * ns * ns))
        self.fixed, self.per_draft = max(float(e0), 0.0), max(float(e1), 0.0)


__all__ = ["DraftOverhead"]
