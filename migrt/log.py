"""migrt's own debug log: structlog JSON lines appended to the configured file.
Never stdout/stderr from the runtime path; the CLI adds a console view of warnings."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def setup(log_file: str | None, level: str = "info", *, component: str = "migrt") -> structlog.typing.FilteringBoundLogger:
    stream = None
    if log_file:
        try:
            os.makedirs(os.path.dirname(log_file) or ".", mode=0o755, exist_ok=True)
            stream = open(log_file, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives with the process
        except OSError:
            stream = None
    if stream is None:
        stream = open(os.devnull, "w")  # noqa: SIM115
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(component=component, pid=os.getpid())


def get() -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger()


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
