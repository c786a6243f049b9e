"""A checkpoint waits for memory that is still arriving.

After a lazy restore (docs/restore-pages.md) a process's private memory stays registered with a
userfaultfd for missing pages until migrt's page filler has copied all of it; the pages not copied
yet exist only in the checkpoint the filler reads from. CRIU's dump takes the pages that
/proc/PID/pagemap shows present (or swapped) and skips the others, so a dump taken then is silently
incomplete: its restore reads zeros wherever the fill had not arrived. The kernel shows such a range
as `um` in the VmFlags of /proc/PID/smaps until the last holder of the userfaultfd closes it (the
filler and its guard do once the process is complete). Hence the rule: before a dump, wait until no
process of the container has such a range; give up when the resident memory of those ranges has not
changed for `STALL_S` (a stuck filler, or an application serving a userfaultfd of its own).

Standard library only: migrt-runc's `checkpoint` calls it before deciding anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from migrt.errors import Conflict

STALL_S = 30.0
_KB = 1024


def registered(pid: int) -> int | None:
    """Resident bytes of pid's ranges registered for missing-page faults (`um`); None when it has
    none (or is gone)."""
    try:
        with open(f"/proc/{pid}/smaps", "rb") as fh:
            text = fh.read()
    except OSError:
        return None
    found, total, rss = False, 0, 0
    for line in text.splitlines():
        if line.startswith(b"Rss:"):
            rss = int(line.split()[1]) * _KB
        elif line.startswith(b"VmFlags:"):
            if b"um" in line.split()[1:]:
                found = True
                total += rss
            rss = 0
    return total if found else None


def pending(pids: list[int]) -> dict[int, int]:
    """pid -> resident bytes of its registered ranges, for those of pids that have any."""
    out = {}
    for pid in pids:
        n = registered(pid)
        if n is not None:
            out[pid] = n
    return out


def wait_filled(list_pids: Callable[[], list[int]], what: str, *, stall_s: float = STALL_S,
                interval: float = 0.1, clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> float:
    """Until no process list_pids() returns has memory still arriving; returns the seconds waited
    (0.0 at once when none has). Raises Conflict once that memory has not grown for stall_s."""
    t0 = clock()
    last, changed = None, t0
    while True:
        left = pending(list_pids())
        now = clock()
        if not left:
            return 0.0 if last is None else round(now - t0, 3)
        total = sum(left.values())
        if total != last:
            last, changed = total, now
        elif now - changed >= stall_s:
            raise Conflict(
                f"{what}: the memory of process(es) {', '.join(map(str, sorted(left)))} is still being restored "
                f"(ranges registered with a userfaultfd; {total >> 20} MiB in, no progress for {stall_s:.0f} s) and "
                "a checkpoint now would lose the pages not yet in; if migrt's page filler is still running "
                "(docs/restore-pages.md), try again once it is done")
        sleep(interval)
