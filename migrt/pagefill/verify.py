"""Verify as filled: the page filler checks each 64 MiB chunk of a pages image against the checkpoint's
manifest before it installs any page from that chunk, so the restored tree need not wait for the
whole image to be hashed. The rule it keeps: no restored task ever runs on (or can observe) a byte
that was not verified against the manifest.

- A lazy page reaches a task only through UFFDIO_COPY from the filler, and the filler calls
  `Verifier.ensure()` for the range first (its background copies and the page faults it serves
  alike). A fault on a chunk not verified yet waits for that one chunk's hash.
- The rest of a pages image is read by CRIU itself while it restores (non-lazy pages: each thread's
  stack page, file-backed private pages, images no process plan lists such as shared memory). Every
  chunk holding a byte that is not lazy (the complement of the plan's lazy segments, so nothing
  CRIU may read is missed) is "eager": the sweep hashes those first, and the restore's gate holds the
  tree until they are all verified (status `verify.eager_done`: ops/pages.py EagerVerified). A chunk
  every such byte of which a restore by reference verified by its blocks (the hand-over's "partly":
  `verified_ranges`) is not eager: the gate does not wait for it.
- The sweep threads then verify the remaining chunks ahead of the copies, in the copy order (a
  process's first ranges, then the biggest segments), so that copies seldom wait.
- The "first" chunks (those holding a process's first ranges: the GPU driver's host copy of its GPU
  memory, images.py) come right after the eager ones. With a source (a restore by reference) the
  sweep fetches them whole, several at once (registry/fillwork.py's processes), and claims no other
  chunk before they are all in (`t_first`, status `verify.first_s`), nor, until the filler sets
  `rest_after` (CRIU's restore finished), any chunk neither eager nor first; so each process's GPU
  restore starts as soon as it can and the rest never takes the CPU from CRIU's restore. Faults are
  still served meanwhile.
- Each chunk is hashed once: the first caller that needs it claims it; any other (a copy thread, a
  fault, the sweep) waits for that verdict. A mismatch is final: every later `ensure()` fails too,
  and the filler fails (the guard kills the restored tasks before they can touch the chunk).

A chunk that is not on disk yet (a lazy restore by reference) is fetched by the Verifier's `source`
instead of read: from the registry, hashed as it arrives against the same digest, and only then
counted as verified (registry/fill.py); a fault's chunk is fetched by the thread that needs it, and
a fault's few pages in a chunk whose block digests the source has (one the create fetched blocks of)
are verified by those blocks alone (`ensure_range`), the whole chunk still hashed later.

Only files the restore hands over with their chunk digests (the manifest's per-chunk record, or the
plain sha256 of a file of one chunk) are checked here; the restore hashes every other file itself.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from migrt.kernel.files import TREE_CHUNK  # the manifest's chunk size


class VerifyError(Exception):
    pass


@dataclass(eq=False)
class FileChunks:
    """One pages image: its digests, and per chunk None (not claimed), an Event (being hashed), True (verified)."""
    path: str                     # as the plan names it (the key of `Verifier.files`)
    rel: str                      # as the manifest names it, for messages
    size: int
    digests: list[bytes]
    state: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = [None] * len(self.digests)

    def span(self, i: int) -> tuple[int, int]:
        return i * TREE_CHUNK, min(self.size, (i + 1) * TREE_CHUNK)


def mmap_reader(base: int) -> Callable[[int, int], bytes | memoryview]:
    """A reader of n bytes at offset from a file mapped at `base` (what the filler copies from)."""
    def read(offset: int, n: int) -> memoryview:
        return memoryview((ctypes.c_char * n).from_address(base + offset)).cast("B")
    return read


class Verifier:
    def __init__(self, files: list[FileChunks], *, what: str = "the checkpoint",
                 eager: list[tuple[FileChunks, int]] | None = None,
                 order: list[tuple[FileChunks, int]] | None = None,
                 first: list[tuple[FileChunks, int]] | None = None) -> None:
        self.files = {f.path: f for f in files}
        self.what = what
        self.lock = threading.Lock()
        self.error: str | None = None
        self.readers: dict[str, Callable[[int, int], bytes | memoryview]] = {}
        self.eager = list(eager or [])
        eager_keys = {(id(f), i) for f, i in self.eager}
        self._firsts = list({(id(f), i): (f, i) for f, i in first or [] if (id(f), i) not in eager_keys}.values())
        self.first = {(id(f), i) for f, i in self._firsts}  # (a chunk both eager and first stays eager)
        self._eager_keys = eager_keys  # the sweep claims them while the first chunks arrive too
        self._first_in = threading.Event()  # every first chunk is in (or the fill failed)
        todo = self.eager + list(first or []) + list(order or []) + [(f, i) for f in files
                                                                     for i in range(len(f.digests))]
        seen: set[tuple[int, int]] = set()
        self.order = []  # the sweep's order: eager chunks first, then as the copies will need them
        for f, i in todo:
            if (id(f), i) not in seen:
                seen.add((id(f), i))
                self.order.append((f, i))
        self._next = 0
        self.counts = {"chunks": len(self.order), "eager": len(self.eager), "verified": 0, "bytes": 0,
                       "waits": 0, "by_sweep": 0, "by_copy": 0}
        self.hash_s = 0.0
        self.t_eager: float | None = None
        self.t_first: float | None = None
        self.t_all: float | None = None
        self.on_eager_done: Callable[[], None] | None = None
        # where chunks not on disk yet come from (a lazy restore by reference: registry/fill.py):
        # has(path, i) -> bool, fetch(f, i, fault=) verifies as it fetches, or raises VerifyError
        self.source: Any = None
        # with a source: the rest (neither eager nor first) waits for this (the filler sets it once the
        # restore finished), so that fetching it never takes the CPU from CRIU's restore
        self.rest_after: threading.Event | None = None
        self._t0 = time.monotonic()
        if not self.eager:
            self.t_eager = self._t0
        if not self.first:
            self.t_first = self._t0
            self._first_in.set()

    def reader(self, path: str, read: Callable[[int, int], bytes | memoryview]) -> None:
        """Where the bytes of `path` are read from (the filler's mapping of it)."""
        self.readers[path] = read

    def checks(self, path: str) -> bool:
        return path in self.files

    @property
    def eager_done(self) -> bool:
        return self.t_eager is not None

    # -- one chunk ---------------------------------------------------------------------------------
    def ensure(self, path: str, offset: int, length: int) -> None:
        """Return once every chunk of [offset, offset+length) of `path` is verified (hashing those no
        one has claimed, waiting for those another thread is hashing); VerifyError on a mismatch (of
        these chunks or any earlier one). A file not handed over passes."""
        f = self.files.get(path)
        if f is None or length <= 0:
            return
        for i in range(offset // TREE_CHUNK, (offset + length - 1) // TREE_CHUNK + 1):
            if not self._by_blocks(f, i, max(offset, i * TREE_CHUNK), min(offset + length, (i + 1) * TREE_CHUNK)):
                self._chunk(f, i, "by_copy")

    def _by_blocks(self, f: FileChunks, i: int, s: int, e: int) -> bool:
        """A source that verifies a fault's few pages of chunk i by the chunk's block digests (a lazy
        restore by reference: registry/fill.py ensure_range) instead of the whole chunk: True once it did."""
        ensure_range = getattr(self.source, "ensure_range", None)
        if ensure_range is None or f.state[i] is True:
            return False
        with self.lock:
            if self.error:
                raise VerifyError(self.error)
        try:
            return bool(ensure_range(f, i, s, e))
        except VerifyError as exc:  # final, as a chunk's mismatch
            with self.lock:
                self.error = self.error or str(exc)
            raise

    def _chunk(self, f: FileChunks, i: int, who: str) -> None:
        with self.lock:
            if self.error:
                raise VerifyError(self.error)
            st = f.state[i]
            if st is True:
                return
            mine = st is None
            if mine:
                st = f.state[i] = threading.Event()
            else:
                self.counts["waits"] += 1
        if not mine:
            st.wait()
            with self.lock:
                if f.state[i] is True:
                    return
                raise VerifyError(self.error or f"{self.what}: chunk {i} of {f.rel} could not be verified")
        self._hash(f, i, st, who)

    def _hash(self, f: FileChunks, i: int, ev: threading.Event, who: str) -> None:
        a, b = f.span(i)
        ok, why, told = False, None, None
        t0 = time.monotonic()
        try:
            if self.source is not None and not self.source.has(f.path, i):
                # a fault's chunk in ranges over the source's connections, hashed as it arrives; a sweep's
                # (the first chunks too: several at once) whole
                self.source.fetch(f, i, fault=who == "by_copy")
                ok = True
            else:
                read = self.readers.get(f.path)
                data = read(a, b - a) if read else _pread(f.path, a, b - a)
                ok = len(data) == b - a and hashlib.sha256(data).digest() == f.digests[i]
                del data
        except VerifyError as exc:  # the source's own reason (a chunk that did not match, a registry gone)
            told = str(exc)
        except (OSError, ValueError) as exc:
            why = f"cannot read it: {exc}"
        finally:
            with self.lock:
                self.hash_s += time.monotonic() - t0
                if ok:
                    f.state[i] = True
                    self.counts["verified"] += 1
                    self.counts["bytes"] += b - a
                    self.counts[who] += 1
                elif not self.error:
                    self.error = told or (f"{self.what}: sha256 mismatch in {f.rel} at bytes {a}-{b - 1} (64 MiB "
                                          f"chunk {i} of {len(f.digests)})" + (f": {why}" if why else "")
                                          + "; no restored process ran on it")
                eager_now = ok and self.t_eager is None and all(g.state[j] is True for g, j in self.eager)
                if eager_now:
                    self.t_eager = time.monotonic()
                if ok and self.t_first is None and (id(f), i) in self.first and self._firsts_in():
                    self.t_first = time.monotonic()
                    self._first_in.set()
                if self.error:
                    self._first_in.set()  # (no sweep waits for first chunks that will never come)
                if ok and self.counts["verified"] == len(self.order):
                    self.t_all = time.monotonic()
                ev.set()
                error = self.error
        if eager_now and self.on_eager_done is not None:
            self.on_eager_done()
        if not ok:
            raise VerifyError(error)

    def _firsts_in(self) -> bool:
        """Under self.lock: every first chunk verified."""
        return all(f.state[i] is True for f, i in self._firsts)

    # -- the sweep ---------------------------------------------------------------------------------
    def _claim(self) -> tuple[FileChunks, int, threading.Event] | None | bool:
        """The next chunk to verify; None: none left; False: the first chunks are still arriving from
        the source, wait before claiming any other."""
        with self.lock:
            while self._next < len(self.order) and not self.error:
                f, i = self.order[self._next]
                key = (id(f), i)
                if self.source is not None and key not in self.first and key not in self._eager_keys and (
                        self.t_first is None or (self.rest_after is not None and not self.rest_after.is_set())):
                    return False
                self._next += 1
                if f.state[i] is None:
                    ev = f.state[i] = threading.Event()
                    return f, i, ev
            return None

    def sweep_one(self) -> bool:
        """Verify the next unclaimed chunk in the sweep's order; False when none is left (run it in
        several threads). VerifyError on a mismatch."""
        got = self._claim()
        if got is False:
            (self._first_in if self.t_first is None or self.rest_after is None else self.rest_after).wait(0.05)
            return True
        if got is None:
            with self.lock:
                if self.error:
                    raise VerifyError(self.error)
            return False
        assert got is not True
        self._hash(*got, "by_sweep")
        return True

    def sweep(self, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop() and self.sweep_one():
            pass

    def snapshot(self) -> dict:
        with self.lock:
            out: dict[str, object] = {**self.counts, "eager_done": self.t_eager is not None,
                                      "hash_s": round(self.hash_s, 3), "files": len(self.files)}
            if self.t_eager is not None:
                out["eager_s"] = round(self.t_eager - self._t0, 3)
            if self.first:
                out["first"] = len(self.first)
                if self.t_first is not None:
                    out["first_s"] = round(self.t_first - self._t0, 3)
            if self.t_all is not None:
                out["all_s"] = round(self.t_all - self._t0, 3)
            if self.error:
                out["error"] = self.error
        return out


def _pread(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = bytearray()
        while len(out) < n:
            buf = os.pread(fd, n - len(out), offset + len(out))
            if not buf:
                break
            out += buf
        return bytes(out)
    finally:
        os.close(fd)


def build(plan, spec: dict) -> Verifier | None:
    """The verifier of a restore from its plan (images.py) and the restore's hand-over (`spec`:
    {"checkpoint": name, "files": {basename: {"rel", "size", "chunks": hex concatenated}}}); None when
    nothing is handed over. Eager chunks: those with a byte outside every process's lazy segments;
    first chunks: those holding a process's first ranges; then the chunks in the copy order (first
    ranges, then the biggest segments). A file record's "partly" (verified_ranges) takes those ranges'
    chunks out of the eager ones where every byte CRIU reads of them lies in the ranges."""
    files: dict[str, FileChunks] = {}
    held: dict[str, list[tuple[int, int]]] = {}
    for base, rec in (spec.get("files") or {}).items():
        if os.path.basename(base) != base or not base:
            raise VerifyError(f"bad file name {base!r} in the restore's verify hand-over")
        hexs = rec["chunks"]
        digests = [bytes.fromhex(hexs[k:k + 64]) for k in range(0, len(hexs), 64)]
        size = int(rec["size"])
        if len(digests) != max(1, -(-size // TREE_CHUNK)):
            raise VerifyError(f"{rec.get('rel') or base}: {len(digests)} chunk digests for {size} bytes")
        path = os.path.join(plan.images, base)
        files[path] = FileChunks(path=path, rel=rec.get("rel") or base, size=size, digests=digests)
        held[path] = [r for ranges in verified_ranges(rec).values() for r in ranges]
    if not files:
        return None
    lazy: dict[str, list[tuple[int, int]]] = {p: [] for p in files}
    ranked = []
    firsts: list[tuple[FileChunks, int]] = []
    for proc in plan.processes.values():
        if proc.pages_file not in files:
            continue
        f = files[proc.pages_file]
        for s in proc.segments:
            lazy[proc.pages_file].append((s.offset, s.offset + s.length))
            first = any(a < s.end and s.start < b for a, b in proc.first)  # (segments are cut at their edges)
            ranked.append((0 if first else 1, -s.length, s.offset, proc.pages_file))
            if first and s.length:
                firsts += [(f, i) for i in range(s.offset // TREE_CHUNK, (s.offset + s.length - 1) // TREE_CHUNK + 1)]
    eager = []
    for path, f in files.items():
        eager += [(f, i) for i in eager_chunks(f.size, lazy[path] + held[path])]
    order = []
    for _rank, neg, off, path in sorted(ranked):
        f = files[path]
        order += [(f, i) for i in range(off // TREE_CHUNK, (off - neg - 1) // TREE_CHUNK + 1)]
    return Verifier(list(files.values()), what=f"checkpoint {spec.get('checkpoint') or '?'}", eager=eager,
                    order=order, first=firsts)


def eager_chunks(size: int, lazy: list[tuple[int, int]]) -> list[int]:
    """The chunks of a file of `size` bytes that hold a byte outside the `lazy` [start, end) ranges."""
    merged: list[list[int]] = []
    for a, b in sorted(lazy):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = []
    k = 0
    for i in range(max(1, -(-size // TREE_CHUNK))):
        a, b = i * TREE_CHUNK, min(size, (i + 1) * TREE_CHUNK)
        while k < len(merged) and merged[k][1] <= a:
            k += 1
        # covered iff one merged range spans [a, b) (merged ranges never touch each other)
        if not (k < len(merged) and merged[k][0] <= a and merged[k][1] >= b) or a == b:
            out.append(i)
    return out


def verified_ranges(rec: dict) -> dict[int, list[tuple[int, int]]]:
    """A hand-over file record's "partly": {chunk index: [start, end) ranges of the file} of chunks only
    those bytes of which are on disk, verified by the restore (registry/blocks.py: the blocks holding
    the bytes CRIU reads); VerifyError if malformed."""
    size = int(rec["size"])
    out: dict[int, list[tuple[int, int]]] = {}
    for key, ranges in (rec.get("partly") or {}).items():
        i = int(key) if isinstance(key, str) and key.isdigit() else -1
        a, b = i * TREE_CHUNK, min(size, (i + 1) * TREE_CHUNK)
        ok = 0 <= a < b and isinstance(ranges, list)
        got = [(r[0], r[1]) for r in ranges if isinstance(r, list) and len(r) == 2
               and all(isinstance(x, int) and not isinstance(x, bool) for x in r)] if ok else []
        if not ok or len(got) != len(ranges) or any(not a <= s < e <= b for s, e in got):
            raise VerifyError(f"{rec.get('rel')}: bad verified ranges of chunk {key!r} in the restore's verify "
                              "hand-over")
        out[i] = sorted(got)
    return out
