"""BenchConfig: every option of `pdserve bench`, validated once, so the CLI and `run_benchmark` share one shape."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DATASETS = ("random", "prefix-repetition", "jsonl", "sharegpt")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


class BenchError(RuntimeError):
    """A benchmark that cannot run (server unreachable, bad options); the CLI prints it without a traceback."""


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds), as `vllm bench serve --goodput`."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise BenchError(f"--goodput takes NAME:MS with NAME in {', '.join(GOODPUT_METRICS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise BenchError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise BenchError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


@dataclass
class BenchConfig:
    # target
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS_ENDPOINT
    model: str | None = None  # None: the first model of GET /v1/models
    tokenizer: str | None = None  # None: the served model's tokenizer
    api_key: str | None = None
    # dataset (None: random, or the file format detected from dataset_path)
    dataset_name: str | None = None
    dataset_path: str | None = None
    encoding: str = "utf-8"
    num_prompts: int = 100
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    output_len: int | None = None  # file datasets: overrides each row's output length
    prompt_token_ids: bool = False  # random/prefix datasets: send token ids (exact lengths; completions only)
    # load
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0  # sent when below 1
    seed: int = 0
    request_timeout: float = 600.0  # seconds without a byte from the server before a request fails
    # report
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    metric_percentiles: tuple[float, ...] = (90.0, 99.0)
    server_metrics: bool = True  # scrape /metrics before and after
    disable_tqdm: bool = False
    save_result: str | None = None
    plot_dir: str | None = None

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.endpoint.startswith("/"):
            self.endpoint = "/" + self.endpoint
        if self.endpoint not in (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT):
            raise BenchError(f"--endpoint must be {COMPLETIONS_ENDPOINT} or {CHAT_ENDPOINT}, got {self.endpoint}")
        if self.dataset_name is not None and self.dataset_name not in DATASETS:
            raise BenchError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {self.dataset_name!r}")
        if self.dataset_name in ("jsonl", "sharegpt") and not self.dataset_path:
            raise BenchError(f"--dataset-name {self.dataset_name} needs --dataset-path")
        if self.prompt_token_ids and self.is_chat:
            raise BenchError("--prompt-token-ids works only with /v1/completions (chat takes text messages)")
        positive = {"num_prompts": self.num_prompts, "random_input_len": self.random_input_len,
                    "random_output_len": self.random_output_len,
                    "prefix_repetition_num_prefixes": self.prefix_repetition_num_prefixes,
                    "prefix_repetition_output_len": self.prefix_repetition_output_len}
        for name, value in positive.items():
            if value < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.prefix_repetition_prefix_len + self.prefix_repetition_suffix_len < 1:
            raise BenchError("prefix-repetition prompts need prefix_len + suffix_len >= 1")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise BenchError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}")
        if not self.request_rate > 0:
            raise BenchError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise BenchError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.output_len is not None and self.output_len < 1:
            raise BenchError(f"--output-len must be >= 1, got {self.output_len}")
        if self.num_warmups < 0:
            raise BenchError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if any(not 0 < p < 100 for p in self.metric_percentiles):
            raise BenchError(f"--metric-percentiles must lie in (0, 100), got {self.metric_percentiles}")
        bad = set(self.goodput) - set(GOODPUT_METRICS)
        if bad:
            raise BenchError(f"unknown goodput metric(s) {sorted(bad)}; use {', '.join(GOODPUT_METRICS)}")

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_ENDPOINT

    @property
    def dataset_kind(self) -> str:
        """The dataset to build: the explicit name, else 'file' (format detected) with a path, else 'random'."""
        return self.dataset_name or ("file" if self.dataset_path else "random")
