"""Reasoning parsers (`--reasoning-parser`): a reasoning model's `<think> ... </think>` text goes to the message's
`reasoning_content` (streamed: `delta.reasoning_content`), the rest to `content`, as vLLM's parsers do.

- `qwen3`: reasoning only inside an explicit `<think> ... </think>`; output without `</think>` is all content (Qwen3
  with `enable_thinking: false`, or a reply that never thinks).
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so everything up to `</think>` is reasoning, and
  output that never closes it is all reasoning (it ran out of tokens while thinking).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # deepseek_r1: the prompt opened <think>

    def extract(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content or None, content) of a whole reply: the streamed split, joined (one definition)."""
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        return (reasoning if any(kind == "reasoning" for kind, _ in pieces) else None,
                "".join(t for kind, t in pieces if kind == "content"))

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)


class ReasoningStream:
    """Splits streamed deltas into ("reasoning" | "content", text) pieces; a partial tag at a delta's end is held
    until the next delta says whether it is one (so no tag text ever reaches the client)."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self.seen_start = in_reasoning
        self.done = False  # </think> seen: the rest is content
        self.held = ""
        self.strip = False  # just after a tag: its newlines are dropped (however the deltas split them)

    def feed(self, delta: str) -> list[tuple[str, str]]:
        text, self.held = self.held + delta, ""
        out: list[tuple[str, str]] = []
        while text:
            if self.strip:
                text = text.lstrip("\n")
                if not text:
                    break
                self.strip = False
            if self.done:
                out.append(("content", text))
                break
            tag = END if self.in_reasoning else START
            pos = text.find(tag)
            if pos >= 0:
                self._emit(out, text[:pos])
                text = text[pos + len(tag):]
                if tag == END:
                    self.in_reasoning, self.done = False, True
                else:
                    self.in_reasoning = self.seen_start = True
                self.strip = True
                continue
            keep = _partial_suffix(text, tag)
            if not self.in_reasoning and not self.seen_start and text[:len(text) - keep].strip():
                self.done = True  # content before any <think>: no reasoning in this reply
                out.append(("content", text))
                break
            self._emit(out, text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        """At the end of the reply: what was held goes out as it is."""
        out: list[tuple[str, str]] = []
        self._emit(out, self.held)
        self.held = ""
        return out

    def _emit(self, out: list[tuple[str, str]], text: str) -> None:
        if text:
            out.append(("reasoning" if self.in_reasoning else "content", text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {"qwen3": ReasoningParser("qwen3", False), "deepseek_r1": ReasoningParser("deepseek_r1", True)}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None or name == "none":
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
