"""Progress reporting seam: ops call `progress(event, **fields)`; the CLI renders it."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[..., None]


def null_progress(event: str, **fields: object) -> None:
    return None
