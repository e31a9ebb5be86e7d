"""Server-sent events as the OpenAI streaming API writes them: `data: <JSON>` then a blank line, `data: [DONE]` last.

JSON goes out as UTF-8 (`ensure_ascii=False`, as OpenAI's API does): Chinese text streams as characters, and the
server and the router write the same bytes for the same event.
"""

from __future__ import annotations

import json
from typing import Any


def sse(obj: dict[str, Any] | str, event: str | None = None) -> str:
    """One event: a dict is encoded as JSON; a string (already-encoded JSON, or `[DONE]`) goes out as it is.
    With `event`, an `event:` line names it first (typed streams: the Responses API)."""
    head = f"event: {event}\n" if event else ""
    if isinstance(obj, str):
        return f"{head}data: {obj}\n\n"
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (e.g. in an instance's error message): escaped, still valid JSON
        text = json.dumps(obj)
    return f"{head}data: {text}\n\n"
