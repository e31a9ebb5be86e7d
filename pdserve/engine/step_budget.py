"""Step budget: how many prefill tokens may join a step that carries decodes, so the step stays short.

A decode's inter-token latency is the duration of the steps it rides in. When a long prefill chunk joins a step of
running decodes, every one of those decodes waits for the chunk: the ITL tail comes from mixed steps. pdserve
predicts a step's model time from the live roofline's cost model (the step's FLOPs and bytes, `StepCostModel`),
fitted online to the steps it actually ran:

    t ≈ c0 + c1 · bytes + c2 · FLOPs      (least squares over the last `window` steps, coefficients >= 0)

and caps a mixed step's prefill tokens so the prediction stays within `max_step_ms` — or, by default, within a bound
between `tail_ratio` times the decode step of the batch being formed and `ratio` times the same decodes alone, set by
the prompt backlog (`StepBudget.limit`). A step with no decodes has no cap (TTFT does not pay), nor by default a
step of a burst (`prefill_cap`'s `pending`), and a capped step still takes at least `min_chunk` prefill tokens so a
prompt always advances.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from pdserve.roofline import StepCostModel

MIN_OBSERVATIONS = 16  # fitted steps before the budget applies (until then: no cap)
REFIT_EVERY = 8
ACTIVATION_BYTES = 32 << 20  # a default token budget's float32 activations at most (token_budget)


def token_budget(hidden_size: int, qkv_width: int) -> int:
    """The default max_num_batched_tokens: 2048 (vLLM-CPU's server default), halved down to 512 while a step of that
    many tokens would hold more than ACTIVATION_BYTES of activations (per token its fused qkv row and ~4 rows of the
    hidden size, float32). The native program keeps its buffers at the largest step's size, so this bounds what a
    burst adds to the server's memory for good (SmolLM2-135M and Gemma 3 270M: 2048; Qwen2.5-0.5B: 1024; the 1.7B
    and 7B Llama shapes: 512, where 1024 took the 1.7B Q4_K_M server's peak RSS past file + KV + 400 MB)."""
    per_token = 4 * (qkv_width + 4 * hidden_size)
    budget = 2048
    while budget > 512 and budget * per_token > ACTIVATION_BYTES:
        budget //= 2
    return budget


class StepTimeModel:
    """Seconds of model time of a step, predicted from its (FLOPs, bytes)."""

    def __init__(self, window: int = 512) -> None:
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since_fit = 0
        self.coef: np.ndarray | None = None  # [c0 (s), c1 (s per byte), c2 (s per FLOP)]

    def observe(self, flops: float, nbytes: float, seconds: float) -> None:
        self._obs.append((flops, nbytes, seconds))
        self._since_fit += 1
        if len(self._obs) >= MIN_OBSERVATIONS and (self.coef is None or self._since_fit >= REFIT_EVERY):
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        data = np.asarray(self._obs, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 1], data[:, 0]])
        y = data[:, 2]
        scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # normalised columns: a well-conditioned solve
        keep = [0, 1, 2]
        while keep:  # non-negative least squares by dropping the most negative coefficient (3 unknowns)
            sol, *_ = np.linalg.lstsq(x[:, keep] / scale[keep], y, rcond=None)
            if (sol >= 0).all():
                break
            keep.pop(int(np.argmin(sol)))
        coef = np.zeros(3)
        if keep:
            coef[keep] = sol / scale[keep]
        self.coef = coef

    def predict(self, flops: float, nbytes: float) -> float | None:
        if self.coef is None:
            return None
        return float(self.coef[0] + self.coef[1] * nbytes + self.coef[2] * flops)


class StepBudget:
    def __init__(self, cost: StepCostModel, max_step_ms: float | None, ratio: float = 3.0,
                 min_chunk: int = 16, tail_ratio: float = 1.3, horizon: float = 16, burst_share: float = 0.5) -> None:
        """`max_step_ms`: absolute bound of a mixed step (None: the default rule of `limit`; 0: no cap)."""
        self.cost = cost
        self.max_step_s = None if max_step_ms is None else max_step_ms / 1000
        self.ratio = ratio
        self.tail_ratio = tail_ratio
        self.horizon = horizon
        self.burst_share = burst_share
        self.min_chunk = min_chunk
        self.model = StepTimeModel()

    @property
    def enabled(self) -> bool:
        return self.max_step_s != 0

    def observe(self, flops: float, nbytes: float, seconds: float) -> None:
        self.model.observe(flops, nbytes, seconds)

    def predict_cost(self, flops: float, nbytes: float) -> float | None:
        """Predicted model time of a step of this cost; None until the model is fitted."""
        return self.model.predict(flops, nbytes)

    def predict(self, seqs: Sequence[tuple[int, int]], num_sampled: int) -> float | None:
        """Predicted model time of a step over `seqs` ((cached, new) each); None until the model is fitted."""
        return self.model.predict(*self.cost.cost(seqs, num_sampled))

    def limit(self, decodes: Sequence[tuple[int, int]], alone: float, formed: int, backlog: int,
              max_tokens: int) -> float:
        """Bound of a mixed step's predicted time (`alone`: its decodes' predicted time without prefill).

        Default rule, between two bounds:
        - at most `ratio` x `alone`: prefill keeps at least 1 - 1/ratio of a mixed step while decodes run;
        - at least `tail_ratio` x the decode step of the batch being formed (`formed` decodes: running + waiting,
          at most max_num_seqs), or the decodes' own step plus the waiting prompts' predicted prefill time
          (`backlog` tokens) spread over `horizon` steps, whichever is longer.
        At high concurrency a step's gaps are what p99 ITL is made of, and arrivals there need little prefill per
        step: the steps stay within tail_ratio of the full batch's decode step. When prompts pile up (a burst,
        long prompts) the bound grows with the backlog, so admission keeps pace and throughput does not fall.
        """
        if self.max_step_s is not None:
            return self.max_step_s
        limit = self.ratio * alone
        ctx = sum(c for c, _ in decodes) // len(decodes)
        full = list(decodes) + [(ctx, 1)] * max(0, formed - len(decodes))
        formed_alone = self.predict(full, len(full))
        chunk = self.predict([(0, max_tokens)], 1)  # the backlog's prefill time, as chunks of the token budget
        drain = None if chunk is None else chunk * backlog / max_tokens
        if formed_alone is None or drain is None:
            return limit
        tail = self.tail_ratio * formed_alone
        return min(limit, max(tail, alone + drain / self.horizon))

    def prefill_cap(self, decodes: Sequence[tuple[int, int]], max_tokens: int, formed: int = 0,
                    backlog: int = 0, pending: int = 0) -> int | None:
        """Most prefill tokens a step with these decodes ((context, 1) each) should take; None: no cap.

        `formed`: decodes of the batch being formed (running + waiting, at most max_num_seqs); `backlog`: prompt
        tokens not yet computed (see `limit`); `pending`: requests whose prompt is not yet computed. By default a
        burst (at least `burst_share` as many pending requests as decodes) is not capped: the decodes lose one gap
        each, and the pending requests join the batch in one step instead of one at a time behind it, which leaves
        the batch decoding out of step, its last requests alone at the end."""
        if not decodes or not self.enabled or max_tokens <= self.min_chunk:
            return None
        if self.max_step_s is None and pending >= self.burst_share * len(decodes):
            return None
        alone = self.predict(decodes, len(decodes))
        if alone is None:
            return None
        limit = self.limit(decodes, alone, formed, backlog, max_tokens)
        lo, hi = self.min_chunk, max_tokens  # the largest n in [lo, hi] whose mixed step fits, else lo
        if (self.predict([*decodes, (0, hi)], len(decodes) + 1) or 0.0) <= limit:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (self.predict([*decodes, (0, mid)], len(decodes) + 1) or 0.0) <= limit:
                lo = mid
            else:
                hi = mid
        return lo
