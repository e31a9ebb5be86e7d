"""pdserve/api/log_hygiene.py: secret query values redacted, client-chosen line breaks escaped (issue 31, items 3
and 6; tests/test_abuse.py checks a real server's log end to end)."""

from __future__ import annotations

import logging

import pytest

from pdserve.api.log_hygiene import AccessLogFilter, OneLineFilter, redact_query


@pytest.mark.parametrize("path,want", [
    ("/dashboard?key=sk-1", "/dashboard?key=***"),
    ("/v1/models?api_key=a&window=60&Token=b", "/v1/models?api_key=***&window=60&Token=***"),
    ("/x?x%5Fsecret=1&client_secret=2&sig=3&password=4&authorization=5", "/x?x%5Fsecret=***&client_secret=***&sig=***"
     "&password=***&authorization=***"),
    ("/v1/stats?window=900", "/v1/stats?window=900"),
    ("/health", "/health"),
    ("/a?flag&key=", "/a?flag&key=***"),
])
def test_redact_query(path: str, want: str) -> None:
    assert redact_query(path) == want


def record(msg: str, *args: object, name: str = "pdserve.server") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args or None, None)


def test_one_line_filter_escapes_line_breaks_of_the_message_only() -> None:
    r = record("model %s: load failed", 'x\n2026-01-01 ERROR forged {"a": 1}\r')
    assert OneLineFilter().filter(r)
    assert r.getMessage() == 'model x\\n2026-01-01 ERROR forged {"a": 1}\\r: load failed'
    plain = record("loaded %s", "tiny")
    OneLineFilter().filter(plain)
    assert plain.getMessage() == "loaded tiny" and plain.args == ("tiny",)


def test_access_log_filter() -> None:
    r = record('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/dashboard?key=sk-1", "1.1", 200,
               name="uvicorn.access")
    AccessLogFilter().filter(r)
    assert r.getMessage() == '127.0.0.1:1 - "GET /dashboard?key=*** HTTP/1.1" 200' and "sk-1" not in r.getMessage()
