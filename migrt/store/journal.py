"""The journal: a durable record of every operation in progress that changes a workload or the store,
so that whoever comes next knows what was interrupted and can bring the workload back.

  <store>/.journal/<id>.json   the record: op, phase, pid, container, root, name, staging, ... (0600,
                               rewritten atomically at every phase change: temp, fsync, rename)
  <store>/.journal/<id>.lock   flock held by the live owner for its whole life (O_CLOEXEC: never
                               inherited by runc or CRIU)

An entry whose lock can be taken belongs to a process that is gone (killed, crashed, node reboot):
it is *stale*, and recovery (ops/recover.py) takes its lock, acts on the recorded phase and removes
it. The record is written BEFORE each step it names (e.g. `frozen` before `runc pause`), so
recovery always knows the furthest step that may have happened. A live owner's entries are never
touched: its lock cannot be taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from migrt import faults, jsonsafe
from migrt.store.fsutil import fsync_dir, lock_is_free, open_nofollow, write_json_atomic

DIR = ".journal"


def _dir(store_root: str) -> str:
    return os.path.join(store_root, DIR)


class Entry:
    """One operation's record, owned (locked) by this process or taken over by recovery."""

    def __init__(self, store_root: str, entry_id: str, data: dict, lock_fd: int) -> None:
        self.store_root = store_root
        self.id = entry_id
        self.data = data
        self._fd = lock_fd
        self.keep = False  # set when an undo failed: the entry must outlive this process for recovery

    @property
    def path(self) -> str:
        return os.path.join(_dir(self.store_root), f"{self.id}.json")

    @property
    def lock_fd(self) -> int:
        return self._fd

    @property
    def op(self) -> str:
        return self.data.get("op", "?")

    @property
    def phase(self) -> str:
        return self.data.get("phase", "?")

    def update(self, phase: str | None = None, **fields) -> None:
        """Record the next phase (durably) before doing it; then the test seam may act on it."""
        if phase:
            self.data["phase"] = phase
            self.data.setdefault("phases", []).append(phase)
        self.data.update(fields)
        self.data["updated"] = time.time()
        write_json_atomic(self.path, self.data)
        if phase:
            faults.point(f"{self.op}:{phase}")

    def end(self) -> None:
        """The operation is over (done or fully undone): the record goes, then the lock."""
        for suffix in (".json", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_dir(self.store_root), self.id + suffix))
        with contextlib.suppress(OSError):
            fsync_dir(_dir(self.store_root))
        self.release()

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def begin(store_root: str, op: str, phase: str = "started", **fields) -> Entry:
    """A new entry, locked by this process, recorded durably before the caller does anything."""
    d = _dir(store_root)
    os.makedirs(d, mode=0o700, exist_ok=True)
    entry_id = f"{op}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{os.urandom(3).hex()}"
    fd = open_nofollow(os.path.join(d, f"{entry_id}.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    data = {"id": entry_id, "op": op, "pid": os.getpid(), "started": time.time(), **fields}
    entry = Entry(store_root, entry_id, data, fd)
    entry.update(phase)
    return entry


@contextlib.contextmanager
def recording(store_root: str, op: str, **fields) -> Iterator[Entry]:
    """begin(); end() when the block finishes, whichever way (its own undo has run by then).
    A process killed inside leaves the entry for recovery: that is the point."""
    entry = begin(store_root, op, **fields)
    try:
        yield entry
    finally:
        entry.end()


def _read(path: str) -> dict | None:
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), encoding="utf-8") as fh:
            data = jsonsafe.load(fh, max_bytes=16 << 20)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def entries(store_root: str) -> list[dict]:
    """Every record, live or stale (for `doctor` and `recover --list`); each with 'stale': bool."""
    d = _dir(store_root)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        data = _read(os.path.join(d, n))
        if data is None:
            continue
        data["stale"] = lock_is_free(os.path.join(d, n[:-5] + ".lock"))
        out.append(data)
    return out


def take_stale(store_root: str) -> Iterator[Entry]:
    """Yield each stale entry with its lock now held by the caller (so two recoveries never act on
    one entry); the caller calls end() once recovered, or release() to leave it for later."""
    d = _dir(store_root)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    except FileNotFoundError:
        return
    for n in names:
        entry_id = n[:-5]
        lock_path = os.path.join(d, f"{entry_id}.lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            if not os.path.exists(os.path.join(d, n)):
                continue  # ended meanwhile
            try:  # a record without its lock file (removed by hand): nobody can own it
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError:
                continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # its owner is alive
            continue
        data = _read(os.path.join(d, n))
        if data is None:  # ended meanwhile, or torn beyond use (written atomically: should not happen)
            if not os.path.exists(os.path.join(d, n)):
                os.close(fd)
                continue
            data = {"id": entry_id, "op": "?", "phase": "?"}
        yield Entry(store_root, entry_id, data, fd)


def staging_paths(store_root: str) -> set[str]:
    """Staging directories named by any journal entry (gc leaves those to recovery)."""
    return {e["staging"] for e in entries(store_root) if e.get("staging")}
