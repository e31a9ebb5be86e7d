"""Benchmark prompts: random token prompts, shared-prefix prompts, and JSONL / ShareGPT files in any encoding.

Every dataset yields SampleRequest(prompt, prompt_len, output_len). `prompt_len` is what our tokenizer counts (None
when no tokenizer is at hand); the report prefers the server's `usage.prompt_tokens`.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DEFAULT_FILE_OUTPUT_LEN = 128
HUMAN_ROLES = ("human", "user")
GPT_ROLES = ("gpt", "assistant", "chatgpt", "model")


class DatasetError(ValueError):
    """A dataset file or dataset option that cannot be used; the message names the file and the place."""


class Tokenizer(Protocol):
    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # token ids are sent as-is to /v1/completions
    prompt_len: int | None
    output_len: int  # sent as max_tokens
    prefix_id: int | None = None  # prefix-repetition: which shared prefix this prompt starts with


# ---- files -----------------------------------------------------------------------------------------------------
def read_text(path: str | Path, encoding: str = "utf-8") -> str:
    """The file's text; an undecodable file raises DatasetError naming the byte offset (and line) of the first bad
    byte, so a GBK file read as UTF-8 says where and suggests --encoding."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DatasetError(f"cannot read dataset file {p}: {e.strerror or e}") from e
    utf8 = encoding.lower().replace("_", "-") in ("utf-8", "utf8")
    skip = len(codecs.BOM_UTF8) if utf8 and data.startswith(codecs.BOM_UTF8) else 0  # offsets stay file offsets
    try:
        return data[skip:].decode(encoding)
    except LookupError:
        raise DatasetError(f"unknown --encoding {encoding!r}") from None
    except UnicodeDecodeError as e:
        start, end = skip + e.start, skip + e.end
        line = data.count(b"\n", 0, start) + 1
        hint = "e.g. --encoding gbk" if utf8 else "with --encoding"
        raise DatasetError(f"{p}: cannot decode as {encoding} at byte offset {start} (line {line}, bytes "
                           f"{data[start:end].hex(' ')}: {e.reason}); pass the file's encoding, {hint}") from None


def _json_rows(text: str, path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, object) for a JSON array file or a JSON-lines file."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        yield from ((0, r) for r in rows)
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {lineno} is not valid JSON ({e.msg} at column {e.colno})") from None


def _count(tokenizer: Tokenizer | None, prompt: str | list[int]) -> int | None:
    if isinstance(prompt, list):
        return len(prompt)
    return None if tokenizer is None else len(tokenizer.encode(prompt))


def parse_jsonl(text: str, path: str | Path, tokenizer: Tokenizer | None, output_len: int | None) -> list[
        SampleRequest]:
    """Rows {"prompt": str | [token ids], "output_len"?: int}; --output-len overrides every row."""
    samples: list[SampleRequest] = []
    for lineno, row in _json_rows(text, path):
        where = f"{path}: line {lineno}" if lineno else f"{path}: entry {len(samples)}"
        if not isinstance(row, dict) or "prompt" not in row:
            raise DatasetError(f"{where}: expected an object with a 'prompt' field")
        prompt = row["prompt"]
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise DatasetError(f"{where}: 'prompt' must be a non-empty string or a list of token ids")
        n = output_len or row.get("output_len") or DEFAULT_FILE_OUTPUT_LEN
        if not isinstance(n, int) or n < 1:
            raise DatasetError(f"{where}: 'output_len' must be a positive integer, got {n!r}")
        samples.append(SampleRequest(prompt, _count(tokenizer, prompt), n))
    return samples


def _first_exchange(turns: Any) -> tuple[str, str] | None:
    """The first human turn and the gpt turn that answers it, or None."""
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") in HUMAN_ROLES and turn.get("value"):
            for reply in turns[i + 1:]:
                if isinstance(reply, dict) and reply.get("from") in GPT_ROLES and reply.get("value"):
                    return str(turn["value"]), str(reply["value"])
            return None
    return None


def parse_sharegpt(text: str, path: str | Path, tokenizer: Tokenizer | None, output_len: int | None) -> list[
        SampleRequest]:
    """ShareGPT entries {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}: the first human
    turn is the prompt; the answering gpt turn's token count is the output length (unless --output-len)."""
    if tokenizer is None and output_len is None:
        raise DatasetError("ShareGPT output lengths are counted with a tokenizer: pass --tokenizer or --output-len")
    samples: list[SampleRequest] = []
    for _, row in _json_rows(text, path):
        pair = _first_exchange(row.get("conversations") if isinstance(row, dict) else None)
        if pair is None:
            continue  # entries without a human -> gpt exchange carry no benchmark request
        prompt, answer = pair
        if output_len is not None:
            n = output_len
        else:
            assert tokenizer is not None  # checked above
            n = max(1, len(tokenizer.encode(answer, add_special_tokens=False)))
        samples.append(SampleRequest(prompt, _count(tokenizer, prompt), n))
    if not samples:
        raise DatasetError(f"{path}: no ShareGPT entry has a human turn followed by a gpt turn")
    return samples


def detect_format(text: str) -> str:
    """'sharegpt' when the first entry has `conversations`, else 'jsonl'."""
    for _, row in _json_rows(text, "<detect>"):
        return "sharegpt" if isinstance(row, dict) and "conversations" in row else "jsonl"
    return "jsonl"


def load_file(path: str | Path, fmt: str, encoding: str, tokenizer: Tokenizer | None, output_len: int | None,
              num_prompts: int) -> list[SampleRequest]:
    """`num_prompts` samples from a JSONL or ShareGPT file (fmt 'file' detects which), in file order, cycled when
    the file holds fewer."""
    text = read_text(path, encoding)
    fmt = detect_format(text) if fmt == "file" else fmt
    parse = parse_sharegpt if fmt == "sharegpt" else parse_jsonl
    samples = parse(text, path, tokenizer, output_len)
    if not samples:
        raise DatasetError(f"{path}: no prompts")
    return [samples[i % len(samples)] for i in range(num_prompts)]


# ---- synthetic -------------------------------------------------------------------------------------------------
def _allowed_ids(tokenizer: Tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)


def _random_ids(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return [int(x) for x in rng.choice(allowed, size=n)] if n > 0 else []


def text_of_len(tokenizer: Tokenizer, rng: np.random.Generator, allowed: np.ndarray, target: int) -> tuple[str,
                                                                                                          list[int]]:
    """Text that re-encodes to (about) `target` tokens: random ids are decoded, re-encoded, then truncated or
    extended until decode -> encode is stable at the target length (as vLLM's random dataset does). Returns the text
    and its token ids."""
    ids = _random_ids(rng, allowed, target)
    text = tokenizer.decode(ids)
    for _ in range(10):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        ids = ids[:target] if len(ids) > target else ids + _random_ids(rng, allowed, target - len(ids))
        text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """n integers uniform in [mean*(1-ratio), mean*(1+ratio)], at least 1."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_dataset(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0, token_ids: bool = False) -> list[SampleRequest]:
    """Prompts of random tokens. With token_ids the prompt is the id list itself (exact length); otherwise text that
    re-encodes to the requested length."""
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    samples = []
    for n_in, n_out in zip(in_lens, out_lens):
        if token_ids:
            ids = _random_ids(rng, allowed, n_in)
            samples.append(SampleRequest(ids, n_in, n_out))
        else:
            text, ids = text_of_len(tokenizer, rng, allowed, n_in)
            samples.append(SampleRequest(text, len(ids), n_out))
    return samples


def prefix_repetition_dataset(tokenizer: Tokenizer, num_prompts: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int, seed: int = 0,
                              token_ids: bool = False) -> list[SampleRequest]:
    """`num_prefixes` random prefixes, each shared by about num_prompts / num_prefixes prompts with their own random
    suffix, shuffled (seeded): a prefix cache should serve every repeat of a prefix."""
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    prefixes = [text_of_len(tokenizer, rng, allowed, prefix_len) if prefix_len else ("", [])
                for _ in range(num_prefixes)]
    samples = []
    for i in range(num_prompts):
        k = i % num_prefixes
        p_text, p_ids = prefixes[k]
        if token_ids:
            ids = p_ids + _random_ids(rng, allowed, suffix_len)
            samples.append(SampleRequest(ids, len(ids), output_len, k))
        else:
            s_text, _ = text_of_len(tokenizer, rng, allowed, suffix_len) if suffix_len else ("", [])
            prompt = p_text + s_text
            samples.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)),
                                         output_len, k))
    order = rng.permutation(num_prompts)
    return [samples[int(j)] for j in order]
