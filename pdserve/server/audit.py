"""The append-only audit log of model lifecycle changes: one JSON line per load, unload, sleep, wake, switch and
rollback, with who (the admin key's id, never the key), what, before/after version and config hash, the outcome and
how long it took. Lines are only ever appended (O_APPEND) and flushed at once."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def key_id(key: str | None) -> str | None:
    """An admin key's id: the first 8 hex digits of its sha256 (None: a change made at start-up)."""
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass
class AuditEntry:
    action: str  # load | unload | sleep | wake | switch | rollback
    model: str  # the model, or the alias for switch / rollback
    key_id: str | None = None
    before_version: str | None = None
    after_version: str | None = None
    before_config_hash: str | None = None
    after_config_hash: str | None = None
    outcome: str = "ok"  # ok | error
    error: str | None = None
    duration_s: float = 0.0
    detail: dict[str, Any] | None = None  # switch: {"previous", "target", "canary"}


class AuditLog:
    """Appends entries to a JSONL file (None: kept in memory only) and answers the newest ones."""

    def __init__(self, path: str | Path | None, keep: int = 1000) -> None:
        self.path = Path(path) if path is not None else None
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)  # what /admin/audit answers from
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, entry: AuditEntry) -> dict[str, Any]:
        now = time.time()
        rec = {"time": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds"), "ts": now,
               **asdict(entry), "duration_s": round(entry.duration_s, 6)}
        line = json.dumps(rec, ensure_ascii=False)
        with self._lock:
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            self._recent.append(rec)
        return rec

    def tail(self, limit: int) -> list[dict[str, Any]]:
        """The newest `limit` entries, oldest first: the file's last lines (every server that wrote it), else
        this process's entries."""
        if limit <= 0:
            return []
        if self.path is not None and self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                lines = deque(f, maxlen=limit)
            return [json.loads(x) for x in lines if x.strip()]
        with self._lock:
            return list(self._recent)[-limit:]
