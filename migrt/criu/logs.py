"""Quote CRIU's own error lines (runc does the same): the lines that say "Error" with a little context."""

from __future__ import annotations

import os

MAX_LINES = 6
# Lines CRIU logs as errors on every run here without failing (no CAP_SYS_RESOURCE for the prlimit).
BENIGN = ("Can't setup RLIMIT_NOFILE for self",)


def error_lines(log_path: str, *, limit: int = MAX_LINES) -> list[str]:
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    hits = _collapse([ln.strip() for ln in lines
                      if ("Error" in ln or "error" in ln.split(":", 1)[0]) and not any(b in ln for b in BENIGN)])
    if len(hits) <= limit:
        return hits
    # The first error is usually the cause (e.g. "No space left on device"), the last ones its
    # consequences and CRIU's summary: keep the first and the last limit-1.
    return [hits[0], f"... {len(hits) - limit} more error line(s) ...", *hits[-(limit - 1):]]


def _collapse(hits: list[str]) -> list[str]:
    """Runs of one message (CRIU's timestamp aside) become one line with a count."""
    out: list[str] = []
    last, count = None, 0
    for ln in hits:
        key = ln.split(") ", 1)[1] if ln.startswith("(") and ") " in ln else ln
        if key == last:
            count += 1
            continue
        if count > 1:
            out[-1] += f" (x{count})"
        out.append(ln)
        last, count = key, 1
    if count > 1:
        out[-1] += f" (x{count})"
    return out


def find_log(work_dir: str, names: tuple[str, ...]) -> str | None:
    for name in names:
        path = os.path.join(work_dir, name)
        if os.path.isfile(path):
            return path
    return None
