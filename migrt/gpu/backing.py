"""Where a checkpointed CUDA process's GPU memory waits for its restore: the rule, then the code.

The driver's checkpoint (cuCheckpointProcessCheckpoint) copies the process's device memory into
freshly allocated host memory of the process itself, one big private anonymous mapping, and its
restore reads it back from there. So the ranges of private anonymous memory that the process holds
after the checkpoint and did not hold before it are that copy (plus, at most, what the process's own
threads allocated meanwhile: harmless, see below). migrt records them per process in the GPU record
(`gpu_backing`: [[start, end], ...], addresses in the process, which a restore keeps), and a lazy
restore's page filler copies them before any other memory (pagefill/images.py, engine.py), so that
each process's GPU restore can start as soon as they are in.

The record is an order, never a promise: a range that is not the driver's costs only its place in
the queue; a copy the rule missed is read through page faults, as before. Ranges under MIN_BYTES are
left out (a thread's new guard page, small arenas), and at most MAX_RANGES are kept, the biggest.
Standard library only, /proc alone.
"""

from __future__ import annotations

MIN_BYTES = 1 << 20
MAX_RANGES = 64
_NAMED_OK = ("[anon:",)  # named anonymous memory counts; [heap], [stack], [vdso] and files do not


def anon_ranges(pid: int) -> list[tuple[int, int]] | None:
    """The process's writable private anonymous ranges, sorted and merged; None when its maps cannot
    be read. Writable only: CUDA reserves large PROT_NONE ranges, and memory the driver commits inside
    such a reservation during the checkpoint must count as appeared."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    out: list[tuple[int, int]] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 5 or len(parts[1]) < 4 or parts[1][1] != "w" or parts[1][3] != "p" or parts[4] != "0":
            continue
        name = parts[5].strip() if len(parts) > 5 else ""
        if name and not name.startswith(_NAMED_OK):
            continue
        a, _, b = parts[0].partition("-")
        try:
            start, end = int(a, 16), int(b, 16)
        except ValueError:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def appeared(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[list[int]]:
    """The parts of `after` that no range of `before` covered (both sorted, merged), as [start, end]
    lists: those of at least MIN_BYTES, at most MAX_RANGES of them (the biggest), in address order."""
    out = []
    i = 0
    for start, end in after:
        cur = start
        while i < len(before) and before[i][1] <= cur:
            i += 1
        j = i
        while cur < end:
            if j < len(before) and before[j][0] < end:
                b0, b1 = before[j]
                if b0 > cur:
                    out.append([cur, b0])
                cur = max(cur, b1)
                j += 1
            else:
                out.append([cur, end])
                cur = end
    out = [r for r in out if r[1] - r[0] >= MIN_BYTES]
    if len(out) > MAX_RANGES:
        out = sorted(sorted(out, key=lambda r: r[0] - r[1])[:MAX_RANGES])
    return out


def snapshot(pids: list[int]) -> dict[int, list[tuple[int, int]] | None]:
    """Before the driver's checkpoint: each process's private anonymous ranges."""
    return {pid: anon_ranges(pid) for pid in pids}


def found(before: dict[int, list[tuple[int, int]] | None]) -> dict[int, list[list[int]]]:
    """After the driver's checkpoint: per process, the ranges that appeared (see the module doc);
    processes whose maps could not be read, before or now, get none."""
    out = {}
    for pid, was in before.items():
        now = anon_ranges(pid)
        if was is not None and now is not None:
            got = appeared(was, now)
            if got:
                out[pid] = got
    return out
