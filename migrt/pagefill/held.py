"""Whether a pod part's filler is still held (pods/hold.py writes the record; the filler only reads it).

A part of a multi-container pod is restored frozen and stays so until its pod's last part is in. Its
filler then copies nothing in the background (its tasks cannot fault, and the copies would compete
with the restores of the pod's next parts for the node's CPUs). The record's path reaches the filler
in HOLD_ENV; the filler asks `holding(path)` now and then, and never again once it says no.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

HOLD_ENV = "MIGRT_FILL_HOLD"
HOLDING = "holding"


def holding(path: str) -> bool:
    """Whether the hold record at `path` still holds its pod (its deadline not passed): read under a
    shared lock, never written. False for a record that is absent or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        rec = json.loads(os.pread(fd, 1 << 20, 0) or b"{}")
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    return isinstance(rec, dict) and rec.get("state") == HOLDING and time.time() <= rec.get("deadline", 0)
