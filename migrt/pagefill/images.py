"""What the page filler has to copy, read from a checkpoint's CRIU images: for every process of
pstree.img, the lazy ranges of its pagemap (PE_LAZY), cut at the VMA boundaries of mm-<pid>.img
(one UFFDIO_COPY may not cross a VMA), each with its offset in pages-<id>.img.

The rule is CRIU's own (criu/uffd.c collect_iovs): a pagemap entry flagged PE_LAZY is left out by
`criu restore --lazy-pages`, whose restorer registers every lazy VMA (private anonymous, not locked,
not vDSO/vsyscall) with the task's userfaultfd; pages of a lazy VMA that no entry covers were never
dumped and read as zeros. A normal dump marks all private anonymous pages lazy except the current
stack page of each thread. Pages of an entry live in pages-<id>.img in pagemap order, entry after
entry, for every entry with PE_PRESENT; entries in a parent image (PE_PARENT, pre-dump chains) are
not supported here: the plan refuses them and the restore copies eagerly.

A checkpoint's manifest records the outcome of plan() (`survey()`, field `pagefill`, taken while the
store commits the checkpoint: `record_beside()`): a restore decides eager or lazy from it without
reading the images. The plan the filler works from is always made again from the images themselves
(by the guard), and the restore's tree waits for it (ops/pages.py PlanCheck).

GPU checkpoints add one thing: the driver keeps a checkpointed process's GPU memory in its host
memory (one big private anonymous mapping), which is what its restore reads. The checkpoint's GPU
record (migrt-gpu.json beside the images, written by migrt's GPU checkpoint: gpu/backing.py) says
where, per process (`gpu_backing`, with the process's pid in its namespace, `ns_pid`, CRIU's key).
plan() gives those ranges to their process (`ProcessPlan.first`, segments cut at their edges), and
the filler copies them before anything else, over every copy thread, so that the process's GPU
restore can start as soon as they are in (engine.py). Only an order: a record without it, or with
ranges that are not lazy memory, changes nothing, and a malformed one is ignored.

A small protobuf reader of our own (stdlib only, criu/protobuf.py) instead of pycriu: it reads the three message types
needed in milliseconds, while importing pycriu costs ~0.25 s on the restore path; the unit tests
check it against pycriu on images CRIU made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TypeGuard

from migrt.criu.protobuf import (
    ImageError,
    read_entries,
    split_entries,  # noqa: F401 - pagedump splits its images with it
)
from migrt.criu.protobuf import fields as _fields
from migrt.criu.protobuf import varint as varint  # re-exported: pagedump (below criu/) reads its varints with it

PAGE = 4096
# The version of plan()'s rules (what it refuses, what it counts as lazy). A recorded survey counts
# only under the same rules: raise it whenever plan() would judge some images differently.
RULES = 1
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
MAP_PRIVATE, MAP_ANONYMOUS, MAP_LOCKED, MAP_HUGETLB = 0x02, 0x20, 0x2000, 0x40000
VMA_AREA_VSYSCALL, VMA_AREA_VDSO = 1 << 2, 1 << 3
MADV_DONTFORK, MADV_WIPEONFORK = 10, 18  # VmaEntry.madv holds 1 << MADV_* of what the VMA had


# -- the three images ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PagemapEntry:
    vaddr: int
    nr_pages: int
    flags: int


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    flags: int
    status: int
    madv: int = 0

    @property
    def inherited(self) -> bool:
        """Does a fork child get this VMA's contents (not MADV_DONTFORK, not MADV_WIPEONFORK)?"""
        return not self.madv & (1 << MADV_DONTFORK | 1 << MADV_WIPEONFORK)

    @property
    def lazy(self) -> bool:
        """CRIU's vma_entry_can_be_lazy(): registered with userfaultfd at a lazy restore."""
        return bool(self.flags & MAP_ANONYMOUS and self.flags & MAP_PRIVATE and not self.flags & MAP_LOCKED
                    and not self.status & (VMA_AREA_VDSO | VMA_AREA_VSYSCALL))


def read_pids(images: str) -> list[int]:
    return [int(dict(_fields(e)).get(1, 0)) for e in read_entries(os.path.join(images, "pstree.img"))]


def read_pagemap(images: str, pid: int) -> tuple[int, list[PagemapEntry]]:
    """(pages_id, entries) of pagemap-<pid>.img."""
    entries = read_entries(os.path.join(images, f"pagemap-{pid}.img"))
    if not entries:
        raise ImageError(f"pagemap-{pid}.img has no header")
    pages_id = int(dict(_fields(entries[0])).get(1, 0))
    out = []
    for raw in entries[1:]:
        f = dict(_fields(raw))
        nr = int(f.get(5) or f.get(2) or 0)  # nr_pages (CRIU >= 3.x) or compat_nr_pages
        if 4 in f:
            flags = int(f[4])
        else:  # images without flags: in_parent or present
            flags = PE_PARENT if f.get(3) else PE_PRESENT
        out.append(PagemapEntry(vaddr=int(f.get(1, 0)), nr_pages=nr, flags=flags))
    return pages_id, out


def read_vmas(images: str, pid: int) -> list[Vma]:
    entries = read_entries(os.path.join(images, f"mm-{pid}.img"))
    if not entries:
        raise ImageError(f"mm-{pid}.img is empty")
    vmas = []
    for num, raw in _fields(entries[0]):
        if num == 14 and isinstance(raw, bytes):
            f = dict(_fields(raw))
            vmas.append(Vma(start=int(f.get(1, 0)), end=int(f.get(2, 0)), flags=int(f.get(6, 0)),
                            status=int(f.get(7, 0)), madv=int(f.get(9, 0))))
    return sorted(vmas, key=lambda v: v.start)


# -- the plan --------------------------------------------------------------------------------------
@dataclass
class Segment:
    """[start, end) of a task's address space, filled from pages file offset `offset`."""
    start: int
    end: int
    offset: int
    inherited: bool = True  # a fork child has these pages too (see Vma.inherited)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class ProcessPlan:
    pid: int                      # the pid inside the container (CRIU's images are keyed by it)
    pages_file: str               # pages-<id>.img
    segments: list[Segment] = field(default_factory=list)
    # [start, end) ranges to fill before any other (the GPU driver's host copy of its GPU memory)
    first: list[tuple[int, int]] = field(default_factory=list)

    @property
    def first_bytes(self) -> int:
        """Lazy bytes inside `first` (the segments are cut at its edges)."""
        return sum(s.length for s in self.segments if in_ranges(self.first, s.start, s.end))

    @property
    def lazy_bytes(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass
class Plan:
    images: str
    processes: dict[int, ProcessPlan]

    @property
    def lazy_bytes(self) -> int:
        return sum(p.lazy_bytes for p in self.processes.values())


def process_plan(images: str, pid: int, remote: bool = False) -> ProcessPlan:
    """remote: the images of a lazy dump (`runc checkpoint --lazy-pages`), whose lazy pages stayed in
    the source process: a segment's `offset` is then its address there (where remote.py fetches it)."""
    if not os.path.exists(os.path.join(images, f"pagemap-{pid}.img")):  # a zombie: no memory at all
        return ProcessPlan(pid=pid, pages_file="")
    pages_id, entries = read_pagemap(images, pid)
    vmas = read_vmas(images, pid)
    pages_file = os.path.join(images, f"pages-{pages_id}.img")
    plan = ProcessPlan(pid=pid, pages_file=pages_file)
    offset = 0
    v = 0
    for e in entries:
        length = e.nr_pages * PAGE
        if e.flags & PE_LAZY:
            if e.flags & PE_PARENT:
                raise ImageError(f"process {pid}: lazy pages in a parent image (pre-dump chain) at {e.vaddr:#x}")
            if not e.flags & PE_PRESENT and not remote:
                raise ImageError(f"process {pid}: lazy pagemap entry without pages at {e.vaddr:#x}")
            start, end = e.vaddr, e.vaddr + length
            while start < end:
                while v < len(vmas) and vmas[v].end <= start:
                    v += 1
                if v == len(vmas) or vmas[v].start > start:
                    raise ImageError(f"process {pid}: lazy pages at {start:#x} lie outside every VMA of mm-{pid}.img")
                vma = vmas[v]
                if not vma.lazy:
                    raise ImageError(f"process {pid}: lazy pages at {start:#x} in a VMA CRIU does not restore lazily")
                if vma.flags & MAP_HUGETLB:
                    raise ImageError(f"process {pid}: lazy pages in a hugetlbfs VMA at {start:#x}")
                stop = min(end, vma.end)
                where = start if remote else offset + (start - e.vaddr)
                _append(plan.segments, Segment(start, stop, where, vma.inherited), vma)
                start = stop
        if e.flags & PE_PRESENT and not e.flags & PE_PARENT:
            offset += length
    if remote:
        return plan
    try:
        size = os.stat(pages_file).st_size
    except OSError as exc:
        if plan.segments:
            raise ImageError(f"process {pid}: cannot open {os.path.basename(pages_file)}: {exc.strerror}") from exc
        size = 0
    if plan.segments and offset > size:
        raise ImageError(f"process {pid}: {os.path.basename(pages_file)} has {size} bytes, the pagemap needs {offset}")
    return plan


def _append(segments: list[Segment], seg: Segment, vma: Vma) -> None:
    """Merge with the previous segment when contiguous in memory and in the file, inside one VMA."""
    if segments:
        last = segments[-1]
        if last.end == seg.start and last.offset + last.length == seg.offset and last.start >= vma.start:
            last.end = seg.end
            return
    segments.append(seg)


def plan(images: str, remote: bool = False) -> Plan:
    """The filler's work for a checkpoint's images; ImageError when it cannot do it. remote: a lazy
    dump's images, whose lazy pages are fetched from the source (see process_plan). Each process's
    `first` ranges come from the GPU record beside the images (first_ranges)."""
    pids = read_pids(images)
    if not pids:
        raise ImageError("pstree.img lists no process")
    out = Plan(images=images, processes={pid: process_plan(images, pid, remote) for pid in pids})
    for pid, ranges in first_ranges(images).items():
        proc = out.processes.get(pid)
        if proc is not None and proc.segments:
            proc.first = ranges
            proc.segments = cut(proc.segments, ranges)
    return out


GPU_RECORD = "migrt-gpu.json"  # gpu/records.py IMAGE_FILE (read here as plain JSON: pagefill stays below gpu/)
MAX_FIRST_RANGES = 256


def first_ranges(images: str) -> dict[int, list[tuple[int, int]]]:
    """{pid inside the container: sorted, merged [start, end) ranges} of the GPU driver's host copy of
    each checkpointed process's GPU memory, from the checkpoint's GPU record (`processes[].ns_pid`,
    `processes[].gpu_backing`). {} without a record or when it is malformed: an order, never a reason
    to refuse a restore."""
    from migrt import jsonsafe

    try:
        with open(os.path.join(images, GPU_RECORD), encoding="utf-8") as fh:
            record = jsonsafe.load(fh)
    except (OSError, ValueError):
        return {}
    out: dict[int, list[tuple[int, int]]] = {}
    procs = record.get("processes") if isinstance(record, dict) else None
    for p in procs if isinstance(procs, list) else []:
        if not isinstance(p, dict):
            continue
        vpid, ranges = p.get("ns_pid"), p.get("gpu_backing")
        if not _int(vpid) or vpid <= 0 or not isinstance(ranges, list) or not 0 < len(ranges) <= MAX_FIRST_RANGES:
            continue
        good: list[tuple[int, int]] = []
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 2 and _int(r[0]) and _int(r[1]) and 0 <= r[0] < r[1] < 1 << 64):
                good = []
                break
            good.append((r[0] & ~(PAGE - 1), -(-r[1] // PAGE) * PAGE))
        if good:
            out[vpid] = _merge(out.get(vpid, []) + good)
    return out


def _int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def in_ranges(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) overlaps any of the ranges."""
    return any(a < end and start < b for a, b in ranges)


def cut(segments: list[Segment], ranges: list[tuple[int, int]]) -> list[Segment]:
    """The segments cut at every edge of the ranges that falls inside one, so that each segment lies
    wholly inside or wholly outside them (offsets follow: file offsets and source addresses alike)."""
    edges = sorted({e for r in ranges for e in r})
    out = []
    for s in segments:
        start = s.start
        for e in edges:
            if start < e < s.end:
                out.append(Segment(start, e, s.offset + (start - s.start), s.inherited))
                start = e
        out.append(Segment(start, s.end, s.offset + (start - s.start), s.inherited))
    return out


FIELD = "pagefill"  # the manifest field that holds survey()


def record_beside(writer) -> None:
    """Have a checkpoint being written (the store's Staging or Import, its images complete) record
    survey() in its manifest, taken in a thread while the commit hashes or syncs the files."""
    path = writer.images
    writer.beside(FIELD, lambda: survey(path))


def survey(images: str) -> dict:
    """What a checkpoint's manifest records about its images (field `pagefill`, written when the store
    commits it), so that a restore can choose eager or lazy without planning them:
    {"rules", "fillable": True, "lazy_bytes"} or {"rules", "fillable": False, "reason"}. Only a
    choice: the restore's guard plans the images again and refuses what it cannot fill."""
    try:
        lazy = plan(images).lazy_bytes
    except ImageError as exc:
        return {"rules": RULES, "fillable": False, "reason": str(exc)}
    return {"rules": RULES, "fillable": True, "lazy_bytes": lazy}
