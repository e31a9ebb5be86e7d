"""`DiagnoseConfig`: the target server, the three ablations' lengths and levels, the SLOs and the thresholds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.bench.config import COMPLETIONS_ENDPOINT, BenchError
from pdserve.bench.diagnose.deployment import PDRules
from pdserve.bench.diagnose.rules import Thresholds

EXPERIMENTS = ("a", "b", "c")  # prompt shapes, output lengths, concurrency sweep


@dataclass
class DiagnoseConfig:
    """What `pdserve diagnose` runs: every length is scaled by `scale`; the levels are not."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS_ENDPOINT
    model: str | None = None  # None: the first model of GET /v1/models
    tokenizer: str | None = None  # None: the served model's
    api_key: str | None = None
    scale: float = 1.0  # multiplies every prompt and output length below
    experiments: tuple[str, ...] = EXPERIMENTS
    # (a) the same total prompt tokens as 1, 2 and 4 prompts
    shape_total_tokens: int = 2048
    shape_pieces: tuple[int, ...] = (1, 2, 4)
    shape_output_len: int = 16
    # (b) one stream, these output lengths
    decode_prompt_len: int = 32
    decode_output_lens: tuple[int, ...] = (128, 512, 2048)
    # (c) concurrency sweep
    concurrency_levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    sweep_prompt_len: int = 128
    sweep_output_len: int = 64
    requests_per_level: float = 2.0  # requests at a level = max(1, round(this × level))
    gauge_interval_s: float = 0.25  # /metrics sampling during (c)
    out_dir: str | None = None  # None: ./diagnose-<date>
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    rules: Thresholds = field(default_factory=Thresholds)  # the judging thresholds; the SLOs above override its
    seed: int = 0
    request_timeout: float = 600.0
    handoff_gbps: float = PDRules.handoff_gbps  # PD hand-off rate assumed when the server measured none

    @property
    def pd_rules(self) -> PDRules:
        return PDRules(handoff_gbps=self.handoff_gbps)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.experiments = tuple(e.strip().lower() for e in self.experiments if e.strip())
        bad = [e for e in self.experiments if e not in EXPERIMENTS]
        if bad or not self.experiments:
            raise BenchError(f"--experiments takes a subset of a,b,c; got {','.join(self.experiments) or 'none'}")
        if not self.scale > 0:
            raise BenchError(f"--scale must be > 0, got {self.scale}")
        if not self.concurrency_levels or min(self.concurrency_levels) < 1:
            raise BenchError(f"--concurrency-levels must be positive integers, got {self.concurrency_levels}")
        self.concurrency_levels = tuple(sorted(set(self.concurrency_levels)))
        if not self.shape_pieces or min(self.shape_pieces) < 1:
            raise BenchError("shape_pieces must be positive")
        if not self.handoff_gbps > 0:
            raise BenchError(f"--handoff-gbps must be > 0, got {self.handoff_gbps}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise BenchError(f"--{name.replace('_', '-')} must be > 0, got {v}")

    def scaled(self, n: int, minimum: int) -> int:
        return max(minimum, round(n * self.scale))

    @property
    def thresholds(self) -> Thresholds:
        slos = {k: v for k, v in (("slo_ttft_ms", self.slo_ttft_ms), ("slo_tpot_ms", self.slo_tpot_ms)) if v}
        return dataclasses.replace(self.rules, **slos)
