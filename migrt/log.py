"""migrt's own debug log: JSON lines appended to the configured file.
Never stdout/stderr from the runtime path; the CLI adds a console view of warnings.

One line per event, keys in this order: the bound context (component, pid), the event's own
fields, then "event", "level" and "timestamp" (ISO 8601, UTC, "Z"), e.g.

    {"component": "migrt-runc", "pid": 812, "checkpoint": "web-1", "event": "restored", "level": "info",
     "timestamp": "2026-11-24T06:58:05.766701Z"}

This is the line structlog's JSONRenderer wrote here before; it is written with the standard
library because migrt-runc logs on its restore path before the first CRIU call, where importing
structlog (which pulls in asyncio) cost more than the rest of the shim's imports together.
Values json cannot encode are written as their repr(); `exception()` adds the traceback.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import Any

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class Logger:
    """A bound logger: debug/info/warning/error/exception(event, **fields), bind(**context)."""

    def __init__(self, sink: _Sink, context: dict[str, Any], min_level: int) -> None:
        self._sink, self._context, self._min = sink, context, min_level

    def bind(self, **context: Any) -> Logger:
        return Logger(self._sink, {**self._context, **context}, self._min)

    def _log(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if _LEVELS[level] < self._min:
            return
        record = {**self._context, **fields, "event": event, "level": level,
                  "timestamp": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        self._sink.write(json.dumps(record, default=repr))

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, fields)

    warn = warning

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        if sys.exc_info()[0] is not None:
            import traceback  # only when there is one to write (1 ms of every migrt-runc start)

            fields = {**fields, "exception": traceback.format_exc()}
        self._log("error", event, fields)


class _Sink:
    """The log file (line-buffered, appended, one write per line so concurrent writers interleave
    whole lines); nothing at all when it cannot be opened."""

    def __init__(self, path: str | None) -> None:
        self._fh = None
        self._lock = threading.Lock()
        if path:
            try:
                os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
                self._fh = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives with the process
            except OSError:
                self._fh = None

    def write(self, line: str) -> None:
        if self._fh is None:
            return
        with self._lock:
            try:
                self._fh.write(line + "\n")
            except (OSError, ValueError):
                pass


_current = Logger(_Sink(None), {}, _LEVELS["info"])  # before setup(): nowhere (never stdout)


def setup(log_file: str | None, level: str = "info", *, component: str = "migrt") -> Logger:
    global _current
    _current = Logger(_Sink(log_file), {"component": component, "pid": os.getpid()},
                      _LEVELS.get(level, _LEVELS["info"]))
    return _current


def get() -> Logger:
    """The logger of the last setup() (with its component and pid)."""
    return _current


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
