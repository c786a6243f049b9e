"""What the parallel dump writes, planned from the images of a lazy dump (`runc checkpoint --lazy-pages`),
and the pagemap a normal dump would have written (a small protobuf encoder: field 4 of each entry).

The rule (CRIU 4.2, criu/page-xfer.c ppb_xfer_flags and the restore's page reader): a normal dump flags
the pages it may restore lazily PE_LAZY and, since it writes them to the image, PE_PRESENT too; a lazy
dump leaves PE_PRESENT off those entries and writes no data for them. Every other entry is the same
in both. pages-<id>.img holds the data of every PE_PRESENT entry, in pagemap order, back to back. So
completing a lazy dump is: every entry flagged PE_LAZY without PE_PRESENT gets PE_PRESENT, and
pages-<id>.img is rewritten with, in pagemap order, CRIU's own pages (the entries it wrote, read from
its file) and the lazy ones (read from the frozen task at the entry's address).

Anything else is refused (PlanError) rather than guessed: entries in a parent image (PE_PARENT, pre-dump
chains), unknown flags, a pages file whose size is not what its pagemap says, two processes naming one
pages file, entries without the flags field (images older than CRIU 3.x).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from migrt.pagefill.images import PAGE, PE_LAZY, PE_PARENT, PE_PRESENT, ImageError, read_pids, split_entries
from migrt.pagefill.images import varint as _read_varint

# PagemapEntry.flags (criu/images/pagemap.proto: vaddr 1, compat_nr_pages 2, in_parent 3, flags 4, nr_pages 5)
_FLAGS = 4
_NR_PAGES, _COMPAT_NR_PAGES, _VADDR = 5, 2, 1
NEW_SUFFIX = ".migrt-new"  # files being written; renamed over CRIU's once all pages are in


class PlanError(Exception):
    """The lazy dump's images are not something the parallel dump completes (the reason says why)."""


# -- protobuf, as protobuf-c writes it ----------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    """pagefill's reader, its errors as this module's."""
    try:
        return _read_varint(buf, i)
    except ImageError as exc:
        raise PlanError(f"{exc} in a pagemap entry") from exc


def encode_varint(value: int) -> bytes:
    if value < 0:
        raise ValueError("protobuf varints here are unsigned")
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _spans(msg: bytes) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start of the field, end) for every field of one message."""
    out = []
    i = 0
    while i < len(msg):
        start = i
        key, i = _varint(msg, i)
        wt = key & 7
        if wt == 0:
            _, i = _varint(msg, i)
        elif wt == 1:
            i += 8
        elif wt == 2:
            n, i = _varint(msg, i)
            i += n
        elif wt == 5:
            i += 4
        else:
            raise PlanError(f"unsupported protobuf wire type {wt} in a pagemap entry")
        if i > len(msg):
            raise PlanError("truncated field in a pagemap entry")
        out.append((key >> 3, wt, start, i))
    return out


def _varint_field(msg: bytes, spans: list, num: int) -> int | None:
    for n, wt, start, _end in spans:
        if n == num and wt == 0:
            _, i = _varint(msg, start)  # skip the key
            return _varint(msg, i)[0]
    return None


def with_flags(msg: bytes, flags: int) -> bytes:
    """The pagemap entry `msg` with its flags field set to `flags`, every other byte as it was."""
    out = bytearray()
    found = False
    for n, wt, start, end in _spans(msg):
        if n == _FLAGS and wt == 0:
            out += encode_varint(_FLAGS << 3) + encode_varint(flags)
            found = True
        else:
            out += msg[start:end]
    if not found:
        raise PlanError("a pagemap entry has no flags field (images older than CRIU 3.x)")
    return bytes(out)


def split_image(data: bytes, name: str) -> tuple[bytes, list[bytes]]:
    """(the magic header, the entries) of a CRIU image file: magic(s), then u32 size + message, repeated."""
    if len(data) < 8:
        raise PlanError(f"{name} is too short")
    try:
        return split_entries(data, name)
    except ImageError as exc:
        raise PlanError(str(exc)) from exc


def join_image(head: bytes, entries: list[bytes]) -> bytes:
    return head + b"".join(struct.pack("<I", len(e)) + e for e in entries)


# -- the plan ------------------------------------------------------------------------------------------
@dataclass
class Copy:
    """`length` bytes to `dst` of the new pages file: from the task (vpid) at address `src`, or from
    CRIU's pages file at offset `src` (vpid None)."""
    dst: int
    length: int
    src: int
    vpid: int | None = None


@dataclass
class PagesFile:
    pid: int                 # the process inside the container (CRIU's key)
    pages_id: int
    path: str                # pages-<id>.img (CRIU's, replaced)
    pagemap_path: str        # pagemap-<pid>.img (replaced)
    pagemap: bytes           # the new pagemap-<pid>.img
    size: int                # of the new pages file
    copies: list[Copy] = field(default_factory=list)
    lazy_bytes: int = 0      # read from the task
    criu_bytes: int = 0      # CRIU wrote them (stack pages, private file-mapped pages...)


@dataclass
class DumpPlan:
    images: str
    files: list[PagesFile]

    @property
    def lazy_bytes(self) -> int:
        return sum(f.lazy_bytes for f in self.files)

    @property
    def criu_bytes(self) -> int:
        return sum(f.criu_bytes for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def vpids(self) -> list[int]:
        return sorted({c.vpid for f in self.files for c in f.copies if c.vpid is not None})


def _add(copies: list[Copy], c: Copy) -> None:
    """Merge with the previous copy when both are contiguous in the new file and at the source."""
    if copies:
        last = copies[-1]
        if last.vpid == c.vpid and last.dst + last.length == c.dst and last.src + last.length == c.src:
            last.length += c.length
            return
    copies.append(c)


def process_plan(images: str, pid: int) -> PagesFile | None:
    """The rewrite of one process's pagemap and pages file; None when it has no pagemap (a zombie)."""
    pm_path = os.path.join(images, f"pagemap-{pid}.img")
    try:
        with open(pm_path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PlanError(f"cannot read pagemap-{pid}.img: {exc.strerror}") from exc
    head, entries = split_image(data, f"pagemap-{pid}.img")
    if not entries:
        raise PlanError(f"pagemap-{pid}.img has no header entry")
    pages_id = _varint_field(entries[0], _spans(entries[0]), 1)
    if pages_id is None:
        raise PlanError(f"pagemap-{pid}.img: its header names no pages file")
    pages_path = os.path.join(images, f"pages-{pages_id}.img")
    out = PagesFile(pid=pid, pages_id=pages_id, path=pages_path, pagemap_path=pm_path, pagemap=b"", size=0)
    new_entries = [entries[0]]
    criu_off = 0  # offset in CRIU's pages file
    for raw in entries[1:]:
        spans = _spans(raw)
        vaddr = _varint_field(raw, spans, _VADDR)
        nr = _varint_field(raw, spans, _NR_PAGES) or _varint_field(raw, spans, _COMPAT_NR_PAGES) or 0
        flags = _varint_field(raw, spans, _FLAGS)
        if vaddr is None or flags is None:
            raise PlanError(f"pagemap-{pid}.img: an entry without vaddr or flags")
        length = nr * PAGE
        if flags & PE_PARENT:
            raise PlanError(f"process {pid}: pages in a parent image (pre-dump chain) at {vaddr:#x}")
        if flags & ~(PE_LAZY | PE_PRESENT) or not flags:
            raise PlanError(f"process {pid}: pagemap entry at {vaddr:#x} has unexpected flags {flags:#x}")
        if flags & PE_PRESENT:  # CRIU wrote these pages: move them
            _add(out.copies, Copy(dst=out.size, length=length, src=criu_off))
            criu_off += length
            out.criu_bytes += length
            new_entries.append(raw)
        else:  # PE_LAZY alone: the data is still in the task
            _add(out.copies, Copy(dst=out.size, length=length, src=vaddr, vpid=pid))
            out.lazy_bytes += length
            new_entries.append(with_flags(raw, flags | PE_PRESENT))
        out.size += length
    try:
        have = os.stat(pages_path).st_size
    except FileNotFoundError:
        have = 0
    except OSError as exc:
        raise PlanError(f"cannot stat pages-{pages_id}.img: {exc.strerror}") from exc
    if have != criu_off:
        raise PlanError(f"process {pid}: pages-{pages_id}.img has {have} bytes, its pagemap says CRIU wrote {criu_off}")
    out.copies = [c for c in out.copies if c.length]
    out.pagemap = join_image(head, new_entries)
    return out


def plan(images: str) -> DumpPlan:
    """The parallel dump's work for a lazy dump's images; PlanError when it cannot do it."""
    try:
        pids = read_pids(images)
    except ImageError as exc:
        raise PlanError(str(exc)) from exc
    if not pids:
        raise PlanError("pstree.img lists no process")
    files = []
    seen: dict[int, int] = {}
    for pid in pids:
        f = process_plan(images, pid)
        if f is None:
            continue
        if f.pages_id in seen:
            raise PlanError(f"processes {seen[f.pages_id]} and {pid} share pages-{f.pages_id}.img")
        seen[f.pages_id] = pid
        files.append(f)
    return DumpPlan(images=images, files=files)
