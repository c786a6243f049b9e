"""What the lower runtime says, read back: its stderr lines (runc writes logfmt there), the error lines
of its JSON `--log`, and its `state` output, parsed here once into a ContainerState.

Only reading: running the lower runtime is runc.py's LowerRuntime, which quotes these in its errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from migrt import jsonsafe


def last_error(log_path: str | None) -> str | None:
    """The msg of the last error line runc wrote to its --log (JSON)."""
    if not log_path:
        return None
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = jsonsafe.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") == "error":
            return str(rec.get("msg"))
    return None


_LOGFMT_MSG = re.compile(r'\blevel=\w+\s+msg="((?:[^"\\]|\\.)*)"')


def runc_message(line: str) -> str:
    """The message of one line runc wrote to stderr: `time="..." level=error msg="container does not
    exist"` (logfmt) gives `container does not exist`; any other line comes back as it is."""
    m = _LOGFMT_MSG.search(line)
    return re.sub(r'\\(.)', r"\1", m.group(1)) if m else line


_STAMP = re.compile(r'time="[^"]*"\s*|"time":"[^"]*",?|^\S+Z\s+')


def collapse_lines(text: str | None, *, limit: int = 4) -> str:
    """A lower runtime's stderr in one message: repeated lines (runc's "Failed to write to log ...
    no space left on device", once per log line it could not write) become one, with a count."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for line in (text or "").splitlines():
        line = line.strip()
        if not line:
            continue
        key = _STAMP.sub("", line)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, line)
    parts = [first[k] + (f" (x{n})" if n > 1 else "") for k, n in counts.items()]
    if len(parts) > limit:
        parts = parts[:limit] + [f"... {len(parts) - limit} more distinct line(s)"]
    return " | ".join(parts)


def stderr_message(stderr: str | None, returncode: int) -> str:
    """A failed call's stderr as one message: each line's logfmt msg, repeats collapsed."""
    msgs = "\n".join(runc_message(line) for line in (stderr or "").splitlines())
    return collapse_lines(msgs) or f"exit status {returncode}"


@dataclass(frozen=True)
class ContainerState:
    """`<runtime> state ID` (runc's JSON: id, pid, status, bundle, rootfs, created, annotations).
    pid is None where the runtime names none (a stopped container says 0)."""

    id: str
    status: str | None
    pid: int | None
    bundle: str
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        """Running or paused: there are tasks to checkpoint, migrate or stop."""
        return self.status in ("running", "paused")

    @classmethod
    def parse(cls, text: str) -> ContainerState:
        """ValueError when `text` is not a JSON object."""
        rec = jsonsafe.loads(text)
        if not isinstance(rec, dict):
            raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
        pid = rec.get("pid")
        status = rec.get("status")
        annotations = rec.get("annotations")
        return cls(id=str(rec.get("id") or ""), status=status if isinstance(status, str) else None,
                   pid=pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None,
                   bundle=str(rec.get("bundle") or ""),
                   annotations={str(k): str(v) for k, v in annotations.items()} if isinstance(annotations, dict)
                   else {})
