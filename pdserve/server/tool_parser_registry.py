"""The tool-call parsers by `--tool-call-parser` name, and `auto`: the parser read off the model's chat template.

`auto` looks for each format's own markup in the template's text, first match wins:
`<function=` and `<parameter=` -> qwen3_coder; `[TOOL_CALLS]` -> mistral; `<|python_start|>` (Llama 4) or a
list-of-calls example such as `[func_name1(` (Llama 3.2's pythonic template) -> pythonic; `<|python_tag|>` or
`"parameters"` beside Llama 3's `<|start_header_id|>` -> llama3_json; otherwise (`<tool_call>` or no tool markup at
all) hermes, the default.
"""

from __future__ import annotations

from typing import Any

from pdserve.server.tool_parsers import HermesToolParser, JsonToolParser, ToolParser
from pdserve.server.tool_parsers_json import Llama3JsonToolParser, MistralToolParser
from pdserve.server.tool_parsers_pythonic import PythonicToolParser
from pdserve.server.tool_parsers_xml import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, JsonToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
    Qwen3CoderToolParser)}
AUTO = "auto"


def parser_for_template(template: str) -> str:
    """The parser name `auto` picks for a chat template's text (the rule in the module's docstring)."""
    if "<function=" in template and "<parameter=" in template:
        return Qwen3CoderToolParser.name
    if "[TOOL_CALLS]" in template:
        return MistralToolParser.name
    if "<|python_start|>" in template or "[func_name1(" in template:
        return PythonicToolParser.name
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|start_header_id|>" in template):
        return Llama3JsonToolParser.name
    return HermesToolParser.name


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template(s) as one text ("" without one)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    return t if isinstance(t, str) else ""


def get_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser called `name`; `auto`: the one the tokenizer's chat template writes (ValueError for others)."""
    if name == AUTO:
        name = parser_for_template(template_text(tokenizer))
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {[*sorted(TOOL_PARSERS), AUTO]}")
    return TOOL_PARSERS[name]()
