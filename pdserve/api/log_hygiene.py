"""What reaches a log line: never a secret, never a line break a client chose. Shared by the server and the router.

- `redact_query`: the values of query parameters that may carry a secret (`?key=`, `api_key`, `token`, `secret`,
  `password`, `auth`, `signature`, ...) become `***` (the dashboard's `/dashboard?key=KEY` would otherwise put the
  API key into uvicorn's access log).
- `OneLineFilter`: CR and LF in a record's message become `\\r` and `\\n`, so a model name, a path or any other
  client-chosen text cannot split a line or forge one (tracebacks, added by the formatter, keep their lines).
`install_log_hygiene` puts both on uvicorn's access log and the one-line filter on the other handlers.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote

_SECRET_NAME = re.compile(r"key|token|secret|pass|auth|sig|credential|session", re.IGNORECASE)
REDACTED = "***"


def redact_query(path: str) -> str:
    """`path?query` with the values of secret-looking parameters replaced (names kept, order kept)."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        parts.append(f"{name}={REDACTED}" if eq and _SECRET_NAME.search(unquote(name)) else item)
    return f"{base}?{'&'.join(parts)}"


def one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


class OneLineFilter(logging.Filter):
    """Escapes CR/LF in the formatted message (the record keeps its level, name and exception)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "\n" in msg or "\r" in msg:
            record.msg, record.args = one_line(msg), None
        return True


class AccessLogFilter(OneLineFilter):
    """uvicorn's access record (`'%s - "%s %s HTTP/%s" %d'`: client, method, path with query, version, status):
    the secret query values redacted (uvicorn quotes the path itself), any line break escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (args[0], args[1], redact_query(args[2]), *args[3:])
        return super().filter(record)


def install_log_hygiene() -> None:
    """Once uvicorn's logging is configured (uvicorn.Config): the access log redacted and on one line, every other
    pdserve and uvicorn record on one line. Idempotent."""
    targets = [logging.getLogger("uvicorn.access"), logging.getLogger("uvicorn.error"), logging.getLogger(),
               logging.getLogger("uvicorn")]
    for logger in targets:
        want = AccessLogFilter if logger.name == "uvicorn.access" else OneLineFilter
        if not any(type(f) is want for f in logger.filters):
            logger.addFilter(want())
        for handler in logger.handlers:  # records propagated from child loggers pass the handlers' filters only
            if not any(type(f) is OneLineFilter for f in handler.filters):
                handler.addFilter(OneLineFilter())
