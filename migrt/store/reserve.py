"""Space reservations: writers into the store (checkpoint, import, pull) ask before they write, so
that two of them that each fit alone do not fill the file system together.

  <root>/.locks/.space.lock    flock held while the reservations are read and rewritten
  <root>/.locks/.space.json    {id: {"pid", "start", "bytes", "slack", "what"}}: bytes each live
                               writer may still write (slack of them reserved ahead, see GRANT)

A request fits when the file system's free space, less what the other live writers have reserved
and less a margin, holds everything this writer still has to write. A writer's bytes, once written,
show in the free space; it says so (`wrote`) and its reservation shrinks, so nothing is counted
twice for long. An entry whose process is gone (no such pid, or a pid reused by a process started
at another time) is ignored and dropped: a killed writer never holds space. The file is advisory
and cheap to lose (a torn one reads as empty); it is rewritten through a temporary file and a
rename, without fsync.

Callers count what they WRITE, not what they read: a compressed or sparse archive member is
reserved at the size it takes once written, before it is written; and what a file takes is what it
takes on this store (`Reservation.alloc`, store/hugetmpfs.py): whole blocks, or whole 2 MiB pages on
a tmpfs whose every page is huge, where a one-byte file takes 2 MiB.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from collections.abc import Iterator

from migrt import jsonsafe
from migrt.errors import PreconditionFailed, StoreFull
from migrt.kernel.files import atomic_file
from migrt.store import hugetmpfs
from migrt.store.fsutil import open_nofollow
from migrt.store.store import private_dir

MARGIN = 64 << 20   # left free in the store's file system beyond every reservation
GRANT = 16 << 20    # reserved ahead of small requests (the entry's slack), so that not every small file
                    # rewrites the list; another writer may count on it (MARGIN covers two such overlaps)
LOCK = ".space.lock"
DATA = ".space.json"
_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def free_bytes(path: str) -> int:
    """Free bytes of the file system holding `path` for an unprivileged writer (the test seam)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def human(n: int) -> str:
    """A size for messages: 512 bytes, 12 KiB, 300 MiB, 1.1 GiB."""
    n = max(0, int(n))
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.1f} {unit}" if unit == "GiB" and v < 100 else f"{v:.0f} {unit}"
    return f"{n} bytes"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


class Reservation:
    """One writer's reservation in one store. Use through `reserving()`."""

    def __init__(self, root: str, what: str, margin: int = MARGIN) -> None:
        self.root = root
        self.what = what
        self.margin = margin
        self.outstanding = 0  # reserved and not yet written
        self.slack = 0        # reserved ahead of requests not made yet (at most GRANT)
        self._filed = 0       # the bytes the list says for us (>= outstanding + slack: written since, or
        #                       granted ahead; rewritten once it overstates by more than 2 * GRANT)
        with _ids_lock:
            n = next(_ids)
        self.id = f"{os.getpid()}.{n}.{os.urandom(3).hex()}"
        self._start = _start_time(os.getpid())
        self._lock = threading.Lock()
        self._alloc: hugetmpfs.Alloc | None = None

    @property
    def alloc(self) -> hugetmpfs.Alloc:
        """How the store's file system allocates a file (read once per reservation)."""
        if self._alloc is None:
            self._alloc = hugetmpfs.alloc_of(self.root)
        return self._alloc

    def reserve_files(self, sizes, *, check: bool = True) -> int:
        """reserve() what files of these sizes take on this store (alloc); returns that."""
        nbytes = self.alloc.files(sizes)
        self.reserve(nbytes, check=check)
        return nbytes

    # -- the list, under its flock -------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        locks = os.path.join(self.root, ".locks")
        private_dir(locks)  # Store.ensure made it; a bare root (a test's) gets it here, never through a link
        fd = open_nofollow(os.path.join(locks, LOCK), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield self._read(os.path.join(locks, DATA))
        finally:
            os.close(fd)

    @staticmethod
    def _read(path: str) -> dict:
        try:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fh:
                data = jsonsafe.load(fh, max_bytes=4 << 20)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        live = {}
        for key, e in data.items():
            if isinstance(e, dict) and isinstance(e.get("pid"), int) and isinstance(e.get("bytes"), int) \
                    and e["pid"] > 0 and _start_time(e["pid"]) == e.get("start"):
                e["slack"] = e["slack"] if isinstance(e.get("slack"), int) and 0 <= e["slack"] <= e["bytes"] else 0
                live[key] = e
        return live

    def _write(self, entries: dict) -> None:
        with atomic_file(os.path.join(self.root, ".locks", DATA), text=True, durable=False) as fh:
            json.dump(entries, fh)

    def _file(self, entries: dict) -> None:
        """Our entry as we stand now, written with the others' (under the list's flock)."""
        self._filed = self.outstanding + self.slack
        entries[self.id] = {"pid": os.getpid(), "start": self._start, "bytes": self._filed, "slack": self.slack,
                            "what": self.what}
        self._write(entries)

    # -- the writer's side ---------------------------------------------------------------------
    def reserve(self, nbytes: int, *, check: bool = True) -> None:
        """`nbytes` more will be written: PreconditionFailed, with nothing reserved, when they do not
        fit (check=False records them without asking: a writer whose check the config turned off)."""
        nbytes = max(0, int(nbytes))
        with self._lock:
            if nbytes <= self.slack:  # reserved ahead already
                self.slack -= nbytes
                self.outstanding += nbytes
                return
            want = self.outstanding + nbytes
            with self._locked() as entries:
                entries.pop(self.id, None)
                free = free_bytes(self.root)
                room = free - sum(e["bytes"] - e["slack"] for e in entries.values()) - self.margin
                if check and want > room:
                    raise self._refusal(nbytes, free, entries)
                self.outstanding, self.slack = want, max(0, min(GRANT, room - want))
                self._file(entries)

    def wrote(self, nbytes: int) -> None:
        """`nbytes` of what was reserved are on disk now (they show in the free space)."""
        with self._lock:
            self.outstanding -= min(self.outstanding, max(0, int(nbytes)))
            if self._filed - (self.outstanding + self.slack) <= 2 * GRANT:
                return  # the list overstates us a little (conservative for the others)
            with self._locked() as entries:
                self._file(entries)

    def settle(self) -> None:
        """Everything reserved so far is on disk (e.g. after a dump that wrote it outside our view)."""
        self.wrote(self.outstanding)

    def release(self) -> None:
        with self._lock:
            if not self._filed and not self.outstanding:
                return
            with contextlib.suppress(OSError), self._locked() as entries:
                entries.pop(self.id, None)
                self._write(entries)
            self.outstanding = self.slack = self._filed = 0

    def _refusal(self, nbytes: int, free: int, others: dict) -> StoreFull:
        exc = StoreFull(f"{self.what}: the store {self.root} has {human(free)} free{held_text(others)}, and "
                        f"{human(self.margin)} are kept free; {human(self.outstanding + nbytes)} more would not fit"
                        f"{' (' + self.alloc.where + ')' if self.alloc.unit >= hugetmpfs.HUGE_PAGE else ''}. "
                        "Free space in the store or point 'store:' in the migrt config at a larger file system")
        exc.free, exc.reserved, exc.others = free, sum(e["bytes"] - e["slack"] for e in others.values()), others
        return exc


def held_text(others: dict, size=human) -> str:
    """', N MiB of it reserved by other writers (what (pid P) M MiB; ...)', or '' when none."""
    if not others:
        return ""
    held = {k: e["bytes"] - e.get("slack", 0) for k, e in others.items()}
    who = "; ".join(f"{others[k].get('what') or '?'} (pid {others[k]['pid']}) {size(n)}"
                    for k, n in sorted(held.items(), key=lambda kv: -kv[1])[:3])
    return f", {size(sum(held.values()))} of it reserved by other writers ({who})"


@contextlib.contextmanager
def reserving(root: str, what: str, margin: int = MARGIN) -> Iterator[Reservation]:
    """A reservation for the block's writes in the store at `root` (whose .locks/ exists: Store.ensure),
    released when the block ends, whichever way."""
    res = Reservation(root, what, margin)
    try:
        yield res
    finally:
        res.release()


def enospc(exc: OSError, what: str, root: str) -> PreconditionFailed | None:
    """A full file system met while writing: the error to raise instead (not a transient one: a
    registry client must not retry it as a network failure). None for any other error."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return PreconditionFailed(f"{what}: the store {root} is full ({exc.strerror}); nothing was kept. Free space in "
                              "the store or point 'store:' in the migrt config at a larger file system")
