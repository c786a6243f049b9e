"""Blobs from a registry into file ranges: several blobs at once, and a blob cut into byte ranges
fetched in parallel when there are too few blobs to keep every connection busy.

The rule: a blob counts as arrived (the caller journals it) only once every byte of it on disk has
been hashed and matched its digest. A blob fetched whole is hashed as it streams in. A blob fetched
in ranges is hashed in order as its ranges land: whichever thread lands the range that extends the
contiguous prefix hashes it from the file (the page cache), so every byte is hashed once and a
mismatch shows as soon as the last range lands. Nothing of a blob that fails is journaled.

When to cut: only when fewer blobs above 2 x PIECE are to be fetched than there are connections (a
small image, or a CRI-O archive layer that is one blob), into PIECE-sized ranges; with more, whole
blobs keep the connections busy and need no second read. (Measured on 2 cores with the registry on
loopback, bench notes in docs/registry.md: one 512 MiB blob came at 441 MB/s in ranges against 380
whole; five 64 MiB blobs over four connections at 0.37 s whole against 0.48 s in ranges, since there
the CPU, not an idle connection, sets the pace and ranges cost a second read for the hash.)
Whether the registry serves ranges is asked once (client.serves_ranges); one that does not gets one
stream per blob, said once in the node's log. A registry that stops serving ranges midway (a 200 to
a range request) has that blob fetched whole.

Whole blobs may be fetched by processes instead (`remote`: registry/fillwork.py Workers, one
connection each, each running this module's fetch of one blob; a pull of REMOTE_MIN or more,
registry/pull.py; a lazy fill's sweep hands them chunks directly), ranges staying in these threads.
With `write_behind`, each verified blob's range is handed to writeback at once (kernel/files.py
start_writeback), so that a commit's fsync does not write the whole image after the transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field

from migrt.errors import CheckpointInvalid
from migrt.registry.client import BUF, Client

TYPE_CHECKING = False  # (typing stays off the create's path)
if TYPE_CHECKING:
    from migrt.registry.fillwork import Workers as Remote  # whole blobs fetched, verified, by processes

PIECE = 16 << 20


@dataclass
class Blob:
    """One blob to land at `offset` in the file at `path` (which exists, at its final size)."""
    digest: str
    size: int
    path: str
    offset: int = 0


WriteError = Callable[[OSError], BaseException | None]  # a write's OSError -> the error to raise (None: as is)



@dataclass
class _Assembly:
    """A blob being fetched in ranges: which have landed, and the hash of the contiguous prefix."""
    blob: Blob
    pieces: list[tuple[int, int]]
    landed: set[int] = field(default_factory=set)
    hashed: int = 0  # pieces hashed so far, in order
    hashing: bool = False
    whole: bool = False  # fetched whole instead (the registry stopped serving ranges)
    lock: threading.Lock = field(default_factory=threading.Lock)
    h: hashlib._Hash = field(default_factory=hashlib.sha256)

    def land(self, index: int, fd: int) -> bool:
        """Piece `index` is on disk; hash what now extends the prefix. True once the whole blob is
        hashed and matches (for exactly one caller); CheckpointInvalid if it does not."""
        with self.lock:
            self.landed.add(index)
            if self.hashing or self.whole:
                return False
            self.hashing = True
        while True:
            with self.lock:  # (checked and released in one step: a piece landing now is seen or hashes itself)
                if self.whole or self.hashed not in self.landed:
                    self.hashing = False
                    return False
                start, length = self.pieces[self.hashed]
            _hash_range(self.h, fd, self.blob.offset + start, length)
            with self.lock:
                self.hashed += 1
                if self.hashed == len(self.pieces):
                    self.hashing = False
                    return _verified(self.blob, self.h.hexdigest())


def _hash_range(h, fd: int, pos: int, length: int) -> None:
    end = pos + length
    while pos < end:
        buf = os.pread(fd, min(BUF, end - pos), pos)
        if not buf:
            raise OSError(f"file shrank while its blob was verified (at {pos})")
        h.update(buf)
        pos += len(buf)


def _verified(blob: Blob, hexd: str) -> bool:
    if "sha256:" + hexd != blob.digest:
        raise CheckpointInvalid(f"blob {blob.digest}: the data received has sha256 {hexd[:16]}...; it was altered "
                                "in the registry or in transit (nothing was committed)")
    return True


def _writer(fd: int, pos: int, write_error: WriteError) -> Callable[[memoryview], None]:
    """A sink writing a stream at pos onwards (an empty view rewinds it to pos: a retry)."""
    at = [pos]

    def sink(view: memoryview) -> None:
        if not len(view):
            at[0] = pos
            return
        _write_at(fd, at[0], view, write_error)
        at[0] += len(view)
    return sink


def _write_at(fd: int, pos: int, view: memoryview, write_error: WriteError) -> None:
    n = 0
    try:
        while n < len(view):
            n += os.pwrite(fd, view[n:], pos + n)
    except OSError as exc:  # a full store is not a network error: never retried
        err = write_error(exc)
        if err is None:
            raise
        raise err from exc


class _Units:
    """The work: whole blobs, or (blob's assembly, piece index) when cut."""

    def __init__(self, client: Client, blobs: list[Blob], parallel: int) -> None:
        self.units: list[tuple[Blob, _Assembly | None, int]] = []
        big = [b for b in blobs if b.size > 2 * PIECE]
        cut = 0 < len(big) < parallel and client.serves_ranges(big[0].digest, big[0].size)
        for b in blobs:
            if not cut or b.size <= 2 * PIECE:
                self.units.append((b, None, 0))
                continue
            asm = _Assembly(b, [(s, min(PIECE, b.size - s)) for s in range(0, b.size, PIECE)])
            self.units.extend((b, asm, i) for i in range(len(asm.pieces)))

    def __iter__(self) -> Iterator[tuple[Blob, _Assembly | None, int]]:
        return iter(self.units)


def _one(client: Client, unit: tuple[Blob, _Assembly | None, int], write_error: WriteError,
         on_blob: Callable[[Blob], None], write_behind: bool, remote: Remote | None) -> None:
    """Fetch a unit; on_blob(blob) once the blob is whole and verified."""
    blob, asm, _index = unit
    if remote is not None and asm is None:  # whole, by a fetching process (written behind there)
        try:
            client.stats.add(received=remote.fetch(blob.digest, blob.size, blob.path, blob.offset))
        except OSError as exc:
            err = write_error(exc)
            if err is None:
                raise
            raise err from exc
        on_blob(blob)
        return
    done = _fetch_unit(client, unit, write_error)
    if done is not None:
        if write_behind:
            _write_behind(done)
        on_blob(done)


def _write_behind(blob: Blob) -> None:
    """The verified blob's range on its way to disk (the commit's fsync then has little left to wait for)."""
    from migrt.kernel.files import start_writeback

    with contextlib.suppress(OSError):
        fd = os.open(blob.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            start_writeback(fd, blob.offset, blob.size)
        finally:
            os.close(fd)


def _fetch_unit(client: Client, unit: tuple[Blob, _Assembly | None, int], write_error: WriteError) -> Blob | None:
    """Fetch a unit; the blob once it is whole and verified (None: more of it to come)."""
    blob, asm, index = unit
    fd = os.open(blob.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if asm is None:
            client.fetch_blob(blob.digest, blob.size, _writer(fd, blob.offset, write_error))
            return blob
        if asm.whole:
            return None
        start, length = asm.pieces[index]
        if client.fetch_range(blob.digest, blob.size, start, length, _writer(fd, blob.offset + start, write_error)):
            return blob if asm.land(index, fd) else None
        with asm.lock:  # a 200 to a range: the first piece to see it fetches the blob whole
            if asm.whole:
                return None
            asm.whole = True
        client.fetch_blob(blob.digest, blob.size, _writer(fd, blob.offset, write_error))
        return blob
    finally:
        os.close(fd)


def fetch(client: Client, blobs: list[Blob], parallel: int, *, on_blob: Callable[[Blob], None],
          write_error: WriteError = lambda exc: None, on_bytes: Callable[[int], None] = lambda n: None,
          pool: Executor | None = None, write_behind: bool = False, remote: Remote | None = None) -> None:
    """Every blob into its file range over `parallel` connections; on_blob(blob) once each is whole and
    verified (from the worker thread that verified it, one call per blob). A digest listed at several
    places is fetched once and copied to the others. The first failure cancels
    what has not started and is raised; blobs verified before it have had their on_blob. pool: the
    caller's threads (kept: their connections are reused by its next call), else a pool of our own.
    write_behind: each verified blob's range starts on its way to disk at once (a pull whose commit
    fsyncs: kernel/files.py start_writeback). remote: the whole blobs are fetched by these processes
    instead (registry/fillwork.py Workers: hashed and written there), ranges still here."""
    first: dict[str, Blob] = {}
    again: list[tuple[Blob, Blob]] = []  # (a blob, the same digest at another place)
    for b in blobs:
        if b.digest in first:
            again.append((first[b.digest], b))
        else:
            first[b.digest] = b
    units = _Units(client, list(first.values()), parallel)
    with contextlib.nullcontext(pool) if pool is not None else ThreadPoolExecutor(max_workers=parallel) as run:
        futures = {run.submit(_one, client, u, write_error, on_blob, write_behind, remote): u for u in units}
        try:
            for fut in as_completed(futures):
                fut.result()
                blob, asm, index = futures[fut]
                on_bytes(blob.size if asm is None else asm.pieces[index][1])
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)  # (a pool of the caller's is not shut down: nothing of ours may still write)
            raise
    for src, dst in again:  # identical chunks (zero pages) are fetched once, then copied here
        copy_blob(src, dst, write_error)
        on_bytes(dst.size)
        on_blob(dst)


def copy_blob(src: Blob, dst: Blob, write_error: WriteError = lambda exc: None) -> None:
    """A verified blob's bytes to the other place of the same digest, on this file system."""
    fin = os.open(src.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fout = os.open(dst.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            done = 0
            while done < src.size:
                buf = os.pread(fin, min(BUF, src.size - done), src.offset + done)
                if not buf:
                    raise OSError(f"{src.path} shrank while copied")
                _write_at(fout, dst.offset + done, memoryview(buf), write_error)
                done += len(buf)
        finally:
            os.close(fout)
    finally:
        os.close(fin)


class InThread(Executor):
    """Runs each unit in the calling thread (a fill's fetching process: one whole blob on its connection)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(exc)
        return fut
