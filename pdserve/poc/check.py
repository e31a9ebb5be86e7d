"""What every check returns (`CheckResult`: pass / fail / skipped with its evidence), the run's request log that
the per-tenant table and the plots read, and the prompts every check draws from (English and Chinese)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.client import RequestRecord
from pdserve.bench.diagnose.stats import RunStats

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "请用两句话解释为什么天空是蓝色的。",
    "List three uses of a paperclip.",
    "写一首关于秋天的短诗。",
    "What is the capital of France? Answer briefly.",
    "用中文介绍一下长城的历史。",
)
FILLER = ("The quick brown fox jumps over the lazy dog while the scheduler keeps every block of the cache busy. "
          "大语言模型推理服务需要在长上下文下保持稳定的首字延迟和吞吐。")


@dataclass
class CheckResult:
    """One checklist item. `evidence` holds the numbers and samples behind the status (JSON-serialisable);
    `summary` is the one line the report's table shows."""

    name: str
    title: str
    status: str = SKIPPED
    summary: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "status": self.status, "summary": self.summary,
                "duration_s": round(self.duration_s, 3), "evidence": self.evidence}


@dataclass
class LoggedRequest:
    check: str
    tenant: str | None
    record: RequestRecord
    version: str | None = None  # the x-pdserve-model-version header, when the server sends it


@dataclass
class RunLog:
    """Every timed request of the run, for the per-tenant numbers and the plots."""

    requests: list[LoggedRequest] = field(default_factory=list)
    sweep: list[RunStats] = field(default_factory=list)  # the concurrency sweep's levels, for its plot
    knee: dict[str, Any] | None = None  # the sweep's knee finding: {"knee_concurrency", "kind"}

    def add(self, check: str, tenant: str | None, rec: RequestRecord, version: str | None = None) -> RequestRecord:
        self.requests.append(LoggedRequest(check, tenant, rec, version))
        return rec

    def records(self, check: str | None = None) -> list[RequestRecord]:
        return [r.record for r in self.requests if check is None or r.check == check]


def prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]


def error_counts(records: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if not r.success:
            out[r.error[:160]] = out.get(r.error[:160], 0) + 1
    return out


def has_mojibake(text: str) -> bool:
    """U+FFFD in a text means a multi-byte character (CJK) was cut and decoded wrongly somewhere."""
    return "\ufffd" in text


async def timed(result: CheckResult, body: Callable[[CheckResult], Awaitable[None]]) -> CheckResult:
    """Run a check body that fills `result`; an exception is the check's failure, never the run's."""
    t0 = time.perf_counter()
    try:
        await body(result)
    except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check with the error as evidence
        result.status, result.summary = FAIL, f"the check itself failed: {type(e).__name__}: {e}"[:300]
        result.evidence["exception"] = repr(e)[:1000]
    result.duration_s = time.perf_counter() - t0
    return result
