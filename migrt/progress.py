"""Progress reporting seam: ops call `progress(event, **fields)`; the CLI renders it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Progress = Callable[..., None]


def null_progress(event: str, **fields: Any) -> None:
    return None
