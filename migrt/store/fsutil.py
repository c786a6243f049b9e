"""The store's file-system helpers: paths that never follow links, locks, hashing (the atomic write and
TREE_CHUNK are the kernel room's: migrt/kernel/files.py, imported here for the store's callers)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator

from migrt.errors import MigrtError
from migrt.kernel.files import TREE_CHUNK as TREE_CHUNK  # re-exported: the store's callers import them from here
from migrt.kernel.files import atomic_file as atomic_file
from migrt.kernel.files import fsync_dir as fsync_dir
from migrt.kernel.files import fsync_path

CHUNK = 4 << 20
SMALL_BYTES = 4 << 20  # hash_chunks hashes at most this much in the calling thread


class StoreError(MigrtError):
    exit_code = 1


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open that never goes through a symbolic link at `path` (O_NOFOLLOW): StoreError naming it
    instead (the directories on the way are the store's own, checked by Store.ensure)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{path} is a symbolic link; migrt never follows links inside its store (remove it, "
                             "then run the command again)") from exc
        raise


def lock_is_free(lock_path: str) -> bool:
    """Nobody holds an flock on `lock_path` (or the file is gone): its owner ended or was killed.
    A probe only: the lock is taken without waiting and let go at once."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def write_json_atomic(path: str, data: object, mode: int = 0o600) -> None:
    with atomic_file(path, mode, text=True) as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")


def sha256_file(path: str, *, fsync: bool = False) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while True:
            buf = fh.read(CHUNK)
            if not buf:
                break
            h.update(buf)
            size += len(buf)
        if fsync:
            os.fsync(fh.fileno())
    return size, h.hexdigest()


def walk_files(top: str) -> list[str]:
    """Relative paths of every non-directory under top, symbolic links included (to directories
    too: os.walk lists those as directories without entering them), for the caller to refuse."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in links]
        for name in sorted(filenames + links):
            out.append(os.path.relpath(os.path.join(dirpath, name), top))
    return out


# Files larger than one TREE_CHUNK are digested as a tree: sha256 over the sha256 digests of their
# 64 MiB chunks, so one large image (CRIU writes one pages file per process) hashes on every core.
# A file of at most one chunk keeps its plain sha256 (its tree digest is the same value).


def digest_key(size: int) -> str:
    return "sha256" if size <= TREE_CHUNK else "sha256_tree"


def digest_of(entry: dict) -> str | None:
    """The digest a manifest entry records (plain sha256 or 64 MiB tree)."""
    return entry.get("sha256_tree") or entry.get("sha256")


def make_entry(size: int, digest: str) -> dict:
    return {"size": size, digest_key(size): digest}


class TreeHasher:
    """Streaming form of the manifest digest (for data that arrives in order, e.g. over the network)."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._cur = hashlib.sha256()
        self._cur_len = 0

    def update(self, data) -> None:
        mv = memoryview(data)
        while len(mv):
            take = min(len(mv), TREE_CHUNK - self._cur_len)
            self._cur.update(mv[:take])
            self._cur_len += take
            mv = mv[take:]
            if self._cur_len == TREE_CHUNK:
                self._chunks.append(self._cur.digest())
                self._cur = hashlib.sha256()
                self._cur_len = 0

    def hexdigest(self) -> str:
        chunks = list(self._chunks)
        if self._cur_len or not chunks:
            chunks.append(self._cur.digest())
        if len(chunks) == 1:
            return chunks[0].hex()
        return hashlib.sha256(b"".join(chunks)).hexdigest()


def hash_range(path: str, offset: int, length: int) -> bytes:
    """The sha256 of `length` bytes of the file at `path` from `offset` (one chunk of a tree digest)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < length:
            buf = os.pread(fd, min(CHUNK, length - done), offset + done)
            if not buf:
                raise OSError(f"{path}: file shrank while being hashed")
            h.update(buf)
            done += len(buf)
    finally:
        os.close(fd)
    return h.digest()


def hash_chunks(top: str, rel_paths: list[str], *, fsync: bool = False, workers: int | None = None,
                progress=None) -> dict[str, list[tuple[int, int, bytes]]]:
    """{rel: [(offset, length, sha256 digest bytes)]}: every 64 MiB chunk of every file hashed in
    parallel (hashlib and pread release the GIL). An empty file has one chunk of length 0."""
    workers = workers or max(2, min(32, os.cpu_count() or 2))
    sizes = {rel: os.path.getsize(os.path.join(top, rel)) for rel in rel_paths}
    tasks = []
    for rel in rel_paths:
        size = sizes[rel]
        offsets = range(0, size, TREE_CHUNK) if size else [0]
        for off in offsets:
            tasks.append((rel, off, min(TREE_CHUNK, size - off)))

    def one(task: tuple[str, int, int]) -> tuple[str, int, bytes, int]:
        rel, off, length = task
        digest = hash_range(os.path.join(top, rel), off, length)
        return rel, off, digest, length

    parts: dict[str, dict[int, tuple[int, bytes]]] = {rel: {} for rel in rel_paths}
    if not fsync and sum(t[2] for t in tasks) <= SMALL_BYTES:  # a restore's small files: threads cost more
        for rel, off, digest, length in map(one, tasks):
            parts[rel][off] = (length, digest)
            if progress:
                progress(length)
        return {rel: [(off, *parts[rel][off]) for off in sorted(parts[rel])] for rel in rel_paths}
    for rel, off, digest, length in _in_threads(one, tasks, workers):
        parts[rel][off] = (length, digest)
        if progress:
            progress(length)
    if fsync:
        for _ in _in_threads(lambda rel: fsync_path(os.path.join(top, rel)), rel_paths, workers):
            pass
    return {rel: [(off, *parts[rel][off]) for off in sorted(parts[rel])] for rel in rel_paths}


def _in_threads(fn, items: list, workers: int) -> Iterator:
    """fn(item) for every item, in up to `workers` threads; yields the results in the calling thread
    (in completion order) and raises the first error once the threads have stopped.

    Plain threads, not concurrent.futures: a restore hashes in a thread while its main thread forks
    (pods/forked.py), and the first import of concurrent.futures.thread (or of logging, which it
    imports) registers at-fork hooks that acquire and release a lock of its own: registered between a
    fork's before- and after-hooks, the release frees the lock the hashing thread holds in submit(),
    which then fails with "RuntimeError: release unlocked lock" (the restore failed with it)."""
    import queue
    import threading

    todo = iter(items)
    take = threading.Lock()
    results: queue.SimpleQueue = queue.SimpleQueue()
    failed = threading.Event()

    def work() -> None:
        while not failed.is_set():
            with take:
                item = next(todo, _END)
            if item is _END:
                return
            try:
                results.put((True, fn(item)))
            except BaseException as exc:  # noqa: BLE001 - raised in the calling thread
                failed.set()
                results.put((False, exc))
                return

    threads = [threading.Thread(target=work, name="migrt-hash", daemon=True)
               for _ in range(max(1, min(workers, len(items))))]
    for t in threads:
        t.start()
    error = None
    try:
        for _ in items:
            ok, value = results.get()
            if not ok:
                error = value
                break
            yield value
    finally:
        failed.set()  # a consumer that stopped early (or an error): no new work
        for t in threads:
            t.join()
    if error is not None:
        raise error


_END = object()


def fsync_files(top: str, rel_paths: list[str], *, workers: int | None = None) -> None:
    """fsync every file, in threads (the file system merges concurrent syncs into few commits)."""
    workers = workers or max(2, min(32, os.cpu_count() or 2))
    for _ in _in_threads(lambda rel: fsync_path(os.path.join(top, rel)), rel_paths, workers):
        pass


def fold_chunks(chunks: list[bytes]) -> str:
    """The manifest digest of a file from its 64 MiB chunk digests (plain sha256 for one chunk)."""
    return chunks[0].hex() if len(chunks) == 1 else hashlib.sha256(b"".join(chunks)).hexdigest()


def hash_tree(top: str, rel_paths: list[str], *, fsync: bool = False, workers: int | None = None,
              progress=None, chunk_out: dict[str, list[bytes]] | None = None) -> dict[str, dict]:
    """{rel: {"size", "sha256" | "sha256_tree"}}, every 64 MiB chunk hashed in parallel. chunk_out:
    receives {rel: [chunk digest, ...]} too (what a manifest's chunk record holds: chunk_record)."""
    chunks = hash_chunks(top, rel_paths, fsync=fsync, workers=workers, progress=progress)
    if chunk_out is not None:
        chunk_out.update({rel: [c[2] for c in chunks[rel]] for rel in rel_paths})
    return {rel: make_entry(sum(c[1] for c in chunks[rel]), fold_chunks([c[2] for c in chunks[rel]]))
            for rel in rel_paths}


# A manifest's `chunks` field keeps, for every file of more than one TREE_CHUNK, the sha256 of each of
# its 64 MiB chunks (hex, concatenated, in order): what a restore needs to verify one chunk at a time
# (the page filler verifies each chunk of a pages image before it installs a page from it). It adds
# no trust of its own: a record is used only when it folds into the file's manifest digest.


def chunk_record(chunks: list[bytes]) -> str:
    return "".join(c.hex() for c in chunks)


def chunk_digests(entry: dict, record: object) -> list[bytes] | None:
    """The 64 MiB chunk digests of the file whose manifest entry is `entry`: for a file of one chunk
    its plain sha256; for a larger one the manifest's chunk record (`record`), when it has one digest
    per chunk and folds into the entry's tree digest. None when they cannot be known (no record, or
    one that is malformed or of other content: the caller hashes the whole file instead)."""
    size, digest = entry.get("size"), digest_of(entry)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str):
        return None
    if size <= TREE_CHUNK:
        return [bytes.fromhex(digest)] if entry.get("sha256") == digest and len(digest) == 64 else None
    count = -(-size // TREE_CHUNK)
    if not isinstance(record, str) or len(record) != 64 * count:
        return None
    try:
        chunks = [bytes.fromhex(record[i:i + 64]) for i in range(0, len(record), 64)]
    except ValueError:
        return None
    return chunks if entry.get("sha256_tree") == digest and fold_chunks(chunks) == digest else None
