"""Sub-block digests of a pages image's eager chunks (docs/registry.md, "Image format" and "Lazy
restore from a registry").

The rule: a byte counts as arrived only once the unit it belongs to hashed to its digest. A 64 MiB
chunk of a pages image is one blob, verified whole; of the chunks CRIU reads a few bytes of itself
while it restores ("eager": every chunk holding a byte outside the page filler's lazy segments,
pagefill/verify.py eager_chunks), a lazy restore by reference would fetch the whole blob before CRIU
starts. So `migrt push` records, for those chunks only, the sha256 of every BLOCK-sized block of the
chunk, on the chunk's layer descriptor (annotation A_BLOCKS: "<block size>:<hex digests
concatenated>"); the create then fetches only the blocks holding an eager byte, each verified against
its digest before it counts, and hands the filler which byte ranges of those chunks are in ("partly"
in the verify hand-over's file record). The filler's Verifier does not hold the restore's gate on
such a chunk (what CRIU reads of it is verified); when the filler needs the chunk, it fetches only the
missing ranges (never rewriting a verified block CRIU may be reading) and hashes the whole chunk from
disk against the chunk's digest before any page of it is installed or it is journaled.

Images without the annotation (pushed before it, or whose images the push could not plan) are read as
before: their eager chunks are fetched whole. `migrt pull` ignores it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from migrt.errors import CheckpointInvalid, RegistryError
from migrt.kernel.files import TREE_CHUNK
from migrt.pagefill.verify import FileChunks, VerifyError, verified_ranges
from migrt.store.fsutil import hash_range

if TYPE_CHECKING:
    from migrt.registry.client import Client

BLOCK = 1 << 20           # the block size push records (readers take the one in the record)
MIN_BLOCK = 4096          # what a reader accepts: a power of two in [MIN_BLOCK, TREE_CHUNK]
A_BLOCKS = "io.migrt.checkpoint.blocks"
RECORDS_MAX = 1 << 20     # the push's budget for the records in one manifest (a pull reads at most 4 MiB)
PAGES_PREFIX = "images/pages-"
PIECE = 16 << 20          # the filler's range requests for a chunk's missing part, at most this long
ZEROS = bytes(1 << 20)
Range = tuple[int, int]   # [start, end) in a file


def is_pages(rel: str) -> bool:
    base = rel.rsplit("/", 1)[-1]
    return rel == f"images/{base}" and rel.startswith(PAGES_PREFIX) and rel.endswith(".img")


# -- which bytes are eager ---------------------------------------------------------------------------

@dataclass
class Eager:
    """Of one pages image: the filler's lazy [start, end) ranges, and the chunks holding another byte."""
    lazy: list[Range]
    chunks: list[int]


def eager_plan(images: str, sizes: dict[str, int]) -> dict[str, Eager]:
    """Per pages image (rel: size), the page filler's plan of the images in `images`: what the push
    records blocks for and what the create fetches before CRIU starts. pagefill.ImageError if the
    filler cannot plan them."""
    from migrt.pagefill import plan
    from migrt.pagefill.verify import eager_chunks

    fill = plan(images)
    lazy: dict[str, list[Range]] = {rel: [] for rel in sizes}
    for proc in fill.processes.values():
        rel = "images/" + os.path.basename(proc.pages_file) if proc.pages_file else ""
        if rel in lazy:
            lazy[rel] += [(s.offset, s.offset + s.length) for s in proc.segments]
    return {rel: Eager(lazy[rel], eager_chunks(size, lazy[rel])) for rel, size in sizes.items()}


def needed(start: int, end: int, block: int, lazy: list[Range]) -> list[int]:
    """The blocks k of [start, end) (block k: [start + k*block, ...)) holding a byte outside every lazy range."""
    merged: list[list[int]] = []
    for a, b in sorted(r for r in lazy if r[1] > start and r[0] < end):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out, j = [], 0
    for k in range(-(-(end - start) // block)):
        a, b = start + k * block, min(end, start + (k + 1) * block)
        while j < len(merged) and merged[j][1] <= a:
            j += 1
        if not (j < len(merged) and merged[j][0] <= a and merged[j][1] >= b):
            out.append(k)
    return out


def runs(ks: list[int]) -> list[tuple[int, int]]:
    """Sorted block indexes merged into (first, last) runs of adjacent blocks."""
    out: list[list[int]] = []
    for k in sorted(ks):
        if out and k == out[-1][1] + 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return [(a, b) for a, b in out]


# -- the record ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Blocks:
    """A chunk's block digests: `size` bytes each (the last one shorter), in order."""
    size: int
    digests: tuple[bytes, ...]

    def span(self, k: int, length: int) -> Range:
        return k * self.size, min(length, (k + 1) * self.size)

    def value(self) -> str:
        return f"{self.size}:" + "".join(d.hex() for d in self.digests)


def hash_blocks(path: str, offset: int, length: int, block: int = BLOCK) -> Blocks:
    return Blocks(block, tuple(hash_range(path, offset + a, min(length, a + block) - a)
                               for a in range(0, max(length, 1), block)))


def parse(value: object, length: int, where: str) -> Blocks:
    """A layer's A_BLOCKS record for a blob of `length` bytes; CheckpointInvalid if malformed (the
    manifest's digest authenticates it, but a reader never trusts its shape)."""
    bad = f"{where}: the {A_BLOCKS} annotation of a {length}-byte blob is malformed"
    if not isinstance(value, str) or ":" not in value:
        raise CheckpointInvalid(f"{bad} (not '<block size>:<sha256 hex digests>'); push the checkpoint again")
    size_s, _, hexs = value.partition(":")
    size = int(size_s) if size_s.isdigit() and len(size_s) <= 9 else 0
    if not MIN_BLOCK <= size <= TREE_CHUNK or size & (size - 1):
        raise CheckpointInvalid(f"{bad} (block size {size_s[:12]!r}: not a power of two from {MIN_BLOCK} to "
                                f"{TREE_CHUNK}); push the checkpoint again")
    count = max(1, -(-length // size))
    if len(hexs) != 64 * count or hexs.strip("0123456789abcdef"):
        raise CheckpointInvalid(f"{bad} ({len(hexs)} hex digits, {count} sha256 digests expected); push the "
                                "checkpoint again")
    return Blocks(size, tuple(bytes.fromhex(hexs[k:k + 64]) for k in range(0, len(hexs), 64)))


def records(manifest: dict, where: str) -> dict[tuple[str, int], Blocks]:
    """{(rel, offset): Blocks} of a migrt image's layers that carry a record (the layers themselves
    checked by image.plan_files first)."""
    from migrt.registry.image import A_OFFSET, A_PATH

    out = {}
    for d in manifest.get("layers") or []:
        ann = d.get("annotations") or {}
        if A_BLOCKS in ann:
            out[(ann[A_PATH], int(ann.get(A_OFFSET, "0")))] = parse(ann[A_BLOCKS], d["size"], where)
    return out


def for_push(top: str, chunks: dict[str, list[tuple[int, int, bytes]]], log: Callable[..., None]
             ) -> dict[tuple[str, int], str]:
    """{(rel, offset): A_BLOCKS value} for the eager chunks of a checkpoint's pages images (top: its
    directory; chunks: fsutil.hash_chunks's), where fetching only their blocks saves bytes, within
    RECORDS_MAX. Images the filler cannot plan get none (said in `log`, not an error)."""
    from migrt.pagefill import ImageError

    pages = {rel: sum(c[1] for c in cs) for rel, cs in chunks.items() if is_pages(rel)}
    if not pages:
        return {}
    try:
        eager = eager_plan(os.path.join(top, "images"), pages)
    except ImageError as exc:
        log("push_no_blocks", reason=f"the page filler cannot plan the images ({exc})",
            detail="a lazy restore by reference fetches their eager chunks whole")
        return {}
    out: dict[tuple[str, int], str] = {}
    left = RECORDS_MAX
    for rel in sorted(eager):
        for i in eager[rel].chunks:
            off, length, _ = chunks[rel][i]
            if len(needed(off, off + length, BLOCK, eager[rel].lazy)) * BLOCK >= length:
                continue  # every block holds an eager byte: the whole blob it is
            value = hash_blocks(os.path.join(top, rel), off, length).value()
            if len(value) > left:
                log("push_blocks_budget", recorded=len(out), detail=f"records above {RECORDS_MAX} bytes left out: "
                    "those eager chunks are fetched whole by a lazy restore by reference")
                return out
            left -= len(value)
            out[(rel, off)] = value
    return out


# -- the create: an eager chunk's blocks -----------------------------------------------------------

@dataclass
class Job:
    """An eager chunk whose blocks holding an eager byte the create fetches."""
    rel: str
    index: int
    offset: int
    size: int
    digest: str
    blocks: Blocks
    want: list[int]


def fetch_blocks(client: Client, partial: str, jobs: list[Job], parallel: int,
                 write_error: Callable[[OSError], BaseException | None]) -> tuple[dict, list[Job]]:
    """The wanted blocks of each job into the partial directory, adjacent ones in one range request,
    each hashed from disk against its digest (CheckpointInvalid, the run zeroed, if not). Returns
    ({rel: {chunk index: [[start, end)...]}} of the verified ranges, the jobs the registry answered
    with whole blobs instead: fetch those whole)."""
    units = [(job, a, b) for job in jobs for a, b in runs(job.want)]
    whole: dict[int, Job] = {}
    if units:
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(units)))) as pool:
            futures = {pool.submit(_fetch_run, client, os.path.join(partial, u[0].rel), *u, write_error): u
                       for u in units}
            try:
                for fut in as_completed(futures):
                    if not fut.result():
                        whole[id(futures[fut][0])] = futures[fut][0]
            except BaseException:
                for f in futures:
                    f.cancel()
                wait(futures)
                raise
    partly: dict[str, dict[int, list[list[int]]]] = {}
    for job, a, b in units:
        if id(job) not in whole:
            s, e = job.blocks.span(a, job.size)[0], job.blocks.span(b, job.size)[1]
            partly.setdefault(job.rel, {}).setdefault(job.index, []).append([job.offset + s, job.offset + e])
    return partly, list(whole.values())


def _fetch_run(client: Client, path: str, job: Job, first: int, last: int,
               write_error: Callable[[OSError], BaseException | None]) -> bool:
    """Blocks first..last of a job's chunk; False (nothing counted) if the registry sent the whole blob."""
    start, end = job.blocks.span(first, job.size)[0], job.blocks.span(last, job.size)[1]
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not client.fetch_range(job.digest, job.size, start, end - start, _sink(fd, job.offset + start, write_error)):
            return False
        for k in range(first, last + 1):
            a, b = job.blocks.span(k, job.size)
            got = hash_range(path, job.offset + a, b - a)
            if got != job.blocks.digests[k]:
                _zero(fd, job.offset + start, end - start)
                raise CheckpointInvalid(f"blob {job.digest} ({job.rel} bytes {job.offset + a}-{job.offset + b - 1}, "
                                        f"block {k} of {len(job.blocks.digests)}): the data received has sha256 "
                                        f"{got.hex()[:16]}...; it was altered in the registry or in transit "
                                        "(nothing was committed)")
        return True
    finally:
        os.close(fd)


def _sink(fd: int, pos: int, write_error: Callable[[OSError], BaseException | None]
          ) -> Callable[[memoryview], None]:
    """Writes a range's stream at pos onwards (an empty view rewinds: a retry)."""
    at = [pos]

    def sink(view: memoryview) -> None:
        if not len(view):
            at[0] = pos
            return
        n = 0
        try:
            while n < len(view):
                n += os.pwrite(fd, view[n:], at[0] + n)
        except OSError as exc:
            err = write_error(exc)
            if err is None:
                raise
            raise err from exc
        at[0] += n
    return sink


def _zero(fd: int, pos: int, length: int) -> None:
    with contextlib.suppress(OSError):
        for off in range(0, length, len(ZEROS)):
            os.pwrite(fd, ZEROS[:min(len(ZEROS), length - off)], pos + off)


# -- the filler: the rest of a chunk the create fetched blocks of ---------------------------------

def partly_of(files: dict, images: str) -> dict[tuple[str, int], list[Range]]:
    """{(the Verifier's path, chunk index): verified ranges} from the hand-over's file records."""
    out = {}
    for base, rec in files.items():
        for i, ranges in verified_ranges(rec).items():
            out[(os.path.join(images, base), i)] = ranges
    return out


def digests_of(files: dict, images: str) -> dict[tuple[str, int], Blocks]:
    """{(the Verifier's path, chunk index): Blocks} of the partly chunks, from the hand-over's file
    records ("blocks": {chunk index: A_BLOCKS value}); VerifyError if malformed."""
    out = {}
    for base, rec in files.items():
        size = int(rec["size"])
        for key, value in (rec.get("blocks") or {}).items():
            i = int(key) if isinstance(key, str) and key.isdigit() else -1
            a, b = i * TREE_CHUNK, min(size, (i + 1) * TREE_CHUNK)
            if not 0 <= a < b:
                raise VerifyError(f"{rec.get('rel')}: block digests of no chunk ({key!r}) in the restore's hand-over")
            try:
                out[(os.path.join(images, base), i)] = parse(value, b - a, str(rec.get("rel") or base))
            except CheckpointInvalid as exc:
                raise VerifyError(exc.message) from exc
    return out


def fill_blocks(src, f: FileChunks, i: int, rec: Blocks, s: int, e: int) -> None:
    """A fault's pages [s, e) of a partly chunk i of f, by their blocks alone: each block holding them
    and not in yet fetched and hashed from disk against its block digest before it counts (added to
    the chunk's verified ranges, so that the whole chunk's fill never rewrites it, and shared with the
    image's other fillers: src.share_range); the whole chunk is hashed later all the same (fill_chunk).
    VerifyError on a mismatch (the block zeroed) or a registry gone. Under the chunk's lock."""
    a, b = f.span(i)
    have = src.partly[(f.path, i)]
    digest = "sha256:" + f.digests[i].hex()
    path = os.path.join(src.partial, f.rel)
    for k in range((s - a) // rec.size, (e - 1 - a) // rec.size + 1):
        ks, ke = (a + x for x in rec.span(k, b - a))
        if any(hs <= ks and ke <= he for hs, he in have):
            continue
        try:
            _fill_range(src.client(), path, digest, a, b, ks, ke)
            got = hash_range(path, ks, ke - ks)
        except RegistryError as exc:
            raise VerifyError(src._gone(exc)) from exc
        except (CheckpointInvalid, OSError) as exc:
            zero_ranges(path, [(ks, ke)])
            raise VerifyError(f"checkpoint {src.spec['commit']['name']}: {f.rel} bytes {ks}-{ke - 1} (block {k} of "
                              f"blob {digest}) could not be filled from registry {src.spec['registry']}: "
                              f"{getattr(exc, 'message', None) or exc}; the container was stopped") from exc
        if got != rec.digests[k]:
            zero_ranges(path, [(ks, ke)])
            raise VerifyError(f"checkpoint {src.spec['commit']['name']}: {f.rel} bytes {ks}-{ke - 1} (block {k} of "
                              f"blob {digest}) from registry {src.spec['registry']} does not match its digest (the "
                              f"data received has {got.hex()[:16]}...: altered in the registry or in transit); the "
                              "container was stopped, no restored process ran on it")
        with src.lock:
            have.append((ks, ke))
        src.share_range(f, i, (ks, ke))


def gaps(a: int, b: int, have: list[Range]) -> list[Range]:
    """[a, b) less the `have` ranges, cut into pieces of at most PIECE."""
    out, pos = [], a
    for s, e in sorted(have) + [(b, b)]:
        s, e = max(a, s), min(b, e)
        out += [(p, min(s, p + PIECE)) for p in range(pos, s, PIECE)]
        pos = max(pos, e)
    return out


def fill_chunk(src, f: FileChunks, i: int, fault: bool) -> None:
    """Chunk i of f, of which the create verified `src.partly[(f.path, i)]`: the missing ranges fetched
    (a fault's over the source's connections at once), then the whole chunk hashed from disk against its
    digest before it counts (journaled, present); VerifyError as RegistrySource.fetch's otherwise, what
    was fetched here zeroed on a mismatch."""
    a, b = f.span(i)
    src.shared_ranges(f, i)  # (blocks another filler of the image verified for its faults: never rewritten)
    todo = gaps(a, b, src.partly[(f.path, i)])
    digest = "sha256:" + f.digests[i].hex()
    path = os.path.join(src.partial, f.rel)
    name, registry = src.spec["commit"]["name"], src.spec["registry"]
    try:
        client = src.client()
        pool = src._pool() if fault and len(todo) > 1 else None
        if pool is None:
            for s, e in todo:
                _fill_range(client, path, digest, a, b, s, e)
        else:
            futures = [pool.submit(_fill_range, client, path, digest, a, b, s, e) for s, e in todo]
            wait(futures)
            for fut in futures:
                fut.result()
        got = hash_range(path, a, b - a)
    except RegistryError as exc:
        raise VerifyError(src._gone(exc)) from exc
    except CheckpointInvalid as exc:  # (a range's place or length: the registry's answer)
        zero_ranges(path, todo)
        raise VerifyError(f"checkpoint {name}: {f.rel} bytes {a}-{b - 1} (blob {digest}) from registry {registry}: "
                          f"{exc.message}; the container was stopped, no restored process ran on it") from exc
    except Exception as exc:  # e.g. the store full
        why = getattr(exc, "message", None) or repr(exc)
        raise VerifyError(f"checkpoint {name}: {f.rel} bytes {a}-{b - 1} could not be filled from registry "
                          f"{registry}: {why}; the container was stopped; restore again") from exc
    if got != f.digests[i]:
        zero_ranges(path, todo)
        raise VerifyError(f"checkpoint {name}: {f.rel} bytes {a}-{b - 1} (blob {digest}) from registry {registry} "
                          f"does not match its digest (the data received has {got.hex()[:16]}...: altered in the "
                          "registry or in transit); the container was stopped, no restored process ran on it")
    with contextlib.suppress(OSError):
        src._journal_add(digest, a, f.rel)
    with src.lock:
        src.present.add((f.path, i))
        src.arrived += sum(e - s for s, e in todo)
        src.fetched += 1


def _fill_range(client: Client, path: str, digest: str, a: int, b: int, s: int, e: int) -> None:
    """Bytes [s, e) of the file (of the chunk [a, b), blob `digest`) from the registry; a registry that
    answers with the whole blob has only those bytes of it written."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if client.fetch_range(digest, b - a, s - a, e - s, _sink(fd, s, lambda exc: None)):
            return
        client.fetch_blob(digest, b - a, _window(_sink(fd, s, lambda exc: None), s - a, e - a))
    finally:
        os.close(fd)


def _window(sink: Callable[[memoryview], None], s: int, e: int) -> Callable[[memoryview], None]:
    """A whole blob's stream, of which only bytes [s, e) reach `sink` (rewinds passed on)."""
    at = [0]

    def take(view: memoryview) -> None:
        if not len(view):
            at[0] = 0
            sink(view)
            return
        lo, hi = max(s, at[0]), min(e, at[0] + len(view))
        if lo < hi:
            sink(view[lo - at[0]:hi - at[0]])
        at[0] += len(view)
    return take


def zero_ranges(path: str, ranges: list[Range]) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for s, e in ranges:
                _zero(fd, s, e - s)
        finally:
            os.close(fd)
