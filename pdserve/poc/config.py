"""`PocConfig`: the server under test, who may change it, the tenants, and how long each check runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.bench.config import BenchError


@dataclass(frozen=True)
class Profile:
    """Sizes of the checks. `quick` is for tests; the default takes a few minutes on a 2-core CPU machine."""

    short_requests: int = 8
    short_output_len: int = 16
    long_output_len: int = 16
    long_fill: float = 0.9  # long-context prompt: this share of max_model_len (minus the output)
    long_context_cap: int = 8192  # never build a longer prompt than this (a 128k model on a CPU takes forever)
    sweep_levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    sweep_prompt_len: int = 64  # words of the sweep's prompts (about as many tokens)
    sweep_output_len: int = 32
    requests_per_level: float = 2.0
    stream_output_len: int = 24
    disconnects: int = 4  # clients that close their stream after the first chunk
    burst_extra: int = 8  # burst: the admission limit (when known) + this many, else `burst_default`
    burst_default: int = 64
    burst_max: int = 400
    tenant_requests: int = 6  # per tenant
    tenant_output_len: int = 16
    tenant_concurrency: int = 4  # in flight at once, tenants interleaved
    switch_requests: int = 12  # streamed while the alias switches and rolls back
    baseline_timeout_s: float = 20.0  # KV and running requests must be back within this


PROFILES = {
    "quick": Profile(short_requests=3, short_output_len=8, long_output_len=4, long_context_cap=1024,
                     sweep_levels=(1, 2, 4), sweep_prompt_len=16, sweep_output_len=8, requests_per_level=1.0,
                     stream_output_len=12, disconnects=2, burst_extra=4, burst_default=24, tenant_requests=2,
                     tenant_output_len=6, tenant_concurrency=2, switch_requests=6, baseline_timeout_s=8.0),
    "default": Profile(),
}
CHECKS = ("short", "long_context", "concurrency", "streaming", "interruption", "switch_rollback", "reclaim",
          "tenants")


@dataclass
class PocConfig:
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    admin_api_key: str | None = None
    model: str | None = None  # the name clients use (an alias under test); None: the first of GET /v1/models
    switch_to: str | None = None  # model switch: point the alias at this model, then roll back
    tenants: tuple[str, ...] = ("tenant-a", "tenant-b", "tenant-c")
    owners: str | None = None  # owners.yaml: owner, approver, on_call per model
    out_dir: str = "poc-report"
    profile: str = "default"
    checks: tuple[str, ...] = CHECKS
    seed: int = 1234
    request_timeout: float = 120.0  # seconds without a byte from the server before a request fails
    extra: dict[str, str] = field(default_factory=dict)  # free-form labels echoed in the report (e.g. the run's owner)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if self.profile not in PROFILES:
            raise BenchError(f"--profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        bad = [c for c in self.checks if c not in CHECKS]
        if bad or not self.checks:
            raise BenchError(f"--checks takes a subset of {','.join(CHECKS)}; got {','.join(self.checks) or 'none'}")
        if not self.tenants:
            raise BenchError("--tenants needs at least one tenant id")

    @property
    def sizes(self) -> Profile:
        return PROFILES[self.profile]
