"""Huge pages in a tmpfs store: whether the store's file system gives them, and asking for them.

Every byte a receive (migration/bulk.py) or a parallel dump (pagedump/memory.py) writes into a tmpfs
store lands in a freshly allocated page of the file. In 4 KiB pages that allocation, not the copy,
bounds the writer (2 GiB through a shared mapping: 1.7-2.3 GiB/s on /dev/shm, 4.3-4.7 GiB/s and half
the CPU on a tmpfs with huge=always, docs/benchmarks.md). A tmpfs gives 2 MiB pages to a file when:

  - its mount says huge=within_size (a huge page only where it lies wholly inside the file's size:
    the tail of an odd-sized file stays in small pages), huge=always (the tail too: up to 2 MiB more
    per file, footprint()), or huge=advise and the writer's mapping asked for them with
    madvise(MADV_HUGEPAGE) (advise() below; the writers do, always);
  - /sys/kernel/mm/transparent_hugepage/shmem_enabled says `force` (every tmpfs), unless it says
    `deny` (none). Its other values (always, within_size, advise) are those of the kernel's internal
    mount (shared anonymous memory, SysV shm), not of a mounted tmpfs.

The mount is the one that holds the path: the last line of /proc/self/mountinfo whose mount point is
the longest prefix of the path's real location (mounts stacked on one point: the last one shows).

What a file takes there (Alloc, the one rule every space check of the store counts with: reserve.py
and its callers, the bulk receiver's footprint()): its size in whole blocks of the file system, or,
where every page of a file is huge (huge=always, shmem_enabled=force), in whole 2 MiB pages: a
one-byte file takes 2 MiB (200 of them from a 450 KB archive once took 400 MiB where 200 KiB were
reserved, and ate the store's 64 MiB margin). huge=within_size gives huge pages only inside the
file's size and advise only to mappings that ask: their tails stay in small pages, so the size in
whole blocks counts them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from migrt.kernel import mm

HUGE_PAGE = 2 << 20
BLOCK = 4096                                                     # where statvfs cannot say
MOUNTINFO = "/proc/self/mountinfo"                               # test seams
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE_MODES = ("always", "within_size", "advise")                 # a mount's huge= that gives huge pages to our writers


def advise(addr: int, size: int) -> None:
    """Ask for huge pages in a mapping of a store file just mapped. Where the file system cannot give
    them (a disk file system, a tmpfs without huge=, a kernel without THP: EINVAL) nothing changes."""
    if addr and size:
        from migrt.kernel.libc import libc  # ctypes: only where a file is mapped

        libc.madvise(addr, size, mm.MADV_HUGEPAGE)


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: dict[str, str]   # the super block's options (huge=, size=, ...)
    shmem_enabled: str        # the selected value of shmem_enabled ("" where unknown)

    @property
    def tmpfs(self) -> bool:
        return self.fstype == "tmpfs"

    @property
    def huge(self) -> str:
        """The mount's huge= ("never" when absent)."""
        return self.options.get("huge", "never")

    @property
    def huge_pages(self) -> bool:
        """Does a file written here (through a mapping advised with advise()) get 2 MiB pages?"""
        if not self.tmpfs or self.shmem_enabled == "deny":
            return False
        return self.shmem_enabled == "force" or self.huge in HUGE_MODES


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _existing(path: str) -> str:
    """The real location of `path`, or of its nearest existing parent (a store not made yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return os.path.realpath(path)


def _shmem_enabled() -> str:
    try:
        with open(SHMEM_ENABLED, encoding="ascii") as fh:
            m = re.search(r"\[(\w+)\]", fh.read())
    except OSError:
        return ""
    return m.group(1) if m else ""


def mount_of(path: str) -> Mount | None:
    """The mount that holds `path` (None when mountinfo cannot be read)."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    where = _existing(path)
    best: tuple[str, str, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, tail[0], tail[2])
    if best is None:
        return None
    options = dict(o.partition("=")[::2] for o in best[2].split(","))
    return Mount(best[0], best[1], options, _shmem_enabled())


@dataclass(frozen=True)
class Alloc:
    """How the file system holding a store allocates a file's data (module docstring)."""
    unit: int          # bytes a file's data is allocated in: a block, or HUGE_PAGE
    where: str = ""    # for messages: "tmpfs huge=always", ...

    def file(self, size: int) -> int:
        """What a file of `size` bytes takes (an empty one: no data block)."""
        return -(-max(0, int(size)) // self.unit) * self.unit

    def files(self, sizes) -> int:
        return sum(self.file(n) for n in sizes)


def alloc_of(path: str) -> Alloc:
    """The allocation rule of the file system holding `path` (a store, made or not)."""
    try:
        block = os.statvfs(_existing(path)).f_frsize or BLOCK
    except OSError:
        block = BLOCK
    m = mount_of(path)
    if m is not None and m.huge_pages and (m.shmem_enabled == "force" or m.huge == "always"):
        how = "shmem_enabled=force" if m.shmem_enabled == "force" else "huge=always"
        return Alloc(max(HUGE_PAGE, block), f"tmpfs {m.point} with {how}: every file takes whole 2 MiB pages")
    return Alloc(block, f"{m.fstype if m else 'file system'} in {block}-byte blocks")


def footprint(path: str, sizes) -> int:
    """What files of these sizes take in the file system holding `path` (alloc_of)."""
    return alloc_of(path).files(sizes)


def small_pages(path: str) -> Mount | None:
    """The tmpfs holding `path` when its files are written in 4 KiB pages; None otherwise (huge pages,
    or not a tmpfs: a disk file system's writes are bounded elsewhere)."""
    m = mount_of(path)
    return m if m is not None and m.tmpfs and not m.huge_pages else None


def mount_hint(point: str, size: str = "<size>") -> str:
    """How to give a store's directory its own tmpfs with huge pages (one mount, not the node)."""
    return f"mount -t tmpfs -o huge=within_size,size={size},mode=0700 tmpfs {point}"
