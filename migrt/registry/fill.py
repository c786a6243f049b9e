"""The page filler's registry source: a lazy restore by reference (registry/lazy.py) fills the
container's memory from chunks fetched from the registry while it runs. Run as the filler's guard
(`python -m migrt.registry.fill`: pagefill/guard.py with this source; the filler sits below the
registry, so the registry plugs its source in rather than the filler importing it).

The rule: a page reaches a task only after every byte of its chunk (of its block, for a fault in a
chunk the create fetched blocks of: below) was hashed against its digest. Each
64 MiB chunk of a pages image is one blob of the image, whose digest is the chunk's digest in the
checkpoint's manifest. The Verifier (pagefill/verify.py) asks `fetch` for a chunk not on disk yet before any
page of it is copied: a page fault's chunk at once, in `registry_parallel` byte ranges over this
source's threads (its bytes hashed in order as the ranges land: registry/transfer.py); the sweep's
(the GPU host copy's too, then, once the restore finished, the rest, in the copy order) whole, by
`registry_parallel` fetching processes (registry/fillwork.py: one connection each; they hash and
write it, this source journals it). The bytes land in the pull's partial directory (the sparse pages
images the filler maps), and a chunk counts only once its digest matched: then it is journaled
(`.pulls/<digest>.done`), so the fill is also a pull that a retry resumes.

An eager chunk the create fetched only the blocks of (registry/blocks.py, the hand-over's "partly"
and "blocks"): a fault's few pages there are verified by their blocks alone (`ensure_range`: each
block hashed against its block digest; the blocks shared with the image's other fillers through
`<chunk_locks>/<n>-<i>.ranges`, so none rewrites them); the chunk's missing ranges are fetched here
later and the whole chunk hashed against its digest before it counts (blocks.fill_chunk).

Failures (the Verifier's error; the filler fails, its guard kills the restored container, and the
reason goes to the runc log and the node's log):
- a chunk (or a fault's block) whose bytes do not match its digest: what was fetched of it is zeroed
  on disk (nothing of it is journaled or committed), `... blob sha256:... does not match its digest
  ...; no restored process ran on it`;
- a fetching process that dies, or anything else (the store full): `... could not be filled from
  registry HOST: ...; the container was stopped; restore again`;
- a registry that stays away past the client's retries, or past the fill's deadline
  (registry_timeout plus the image at 8 MiB/s): `registry HOST went away while filling container
  ID's memory (N of M MiB in); the container was stopped; restore again`. The image in the registry
  is never written; what arrived stays verified and journaled.

Once every chunk is in, `commit` publishes the partial directory as the pulled checkpoint through the
store's importer (registry/pull.py commit_files: every file's digest folded from its verified chunks)
and lets go of the image lock, so later restores of the image on this node are local.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from migrt.errors import CheckpointInvalid, RegistryError
from migrt.kernel.files import TREE_CHUNK
from migrt.pagefill.engine import BACKGROUND_NICE
from migrt.pagefill.verify import FileChunks, VerifyError
from migrt.registry import blocks
from migrt.registry.fillwork import Workers, fill_deadline, make_client

if TYPE_CHECKING:
    from migrt.registry.client import Client, Deadline
    from migrt.registry.pull import Journal



class RegistrySource:
    def __init__(self, spec: dict, images: str, lock_fd: int | None = None) -> None:
        self.spec = spec
        self.images = images  # the directory the plan names files in (the Verifier's paths)
        self.partial = spec["partial"]
        self.lock_fd = lock_fd
        self.parallel = max(1, int(spec.get("parallel") or 1))
        self.present = {(os.path.join(images, base), int(i)) for base, idx in spec["present"].items() for i in idx}
        self.partly = blocks.partly_of(spec["files"], images)  # eager chunks the create fetched blocks of
        self.block_digests = blocks.digests_of(spec["files"], images)  # theirs: a fault there takes its blocks
        self.lock = threading.Lock()
        self.total = sum(int(f["size"]) for f in spec["files"].values())
        self.arrived = 0  # bytes of chunks fetched here
        self.fetched = 0  # chunks fetched here
        self.t0 = time.monotonic()
        self._client: Client | None = None
        self._workers: Workers | None = None
        self._fill_deadline: Deadline | None = None
        self._journal: Journal | None = None
        self._faults: ThreadPoolExecutor | None = None
        self._order = sorted(f["rel"] for f in spec["files"].values())
        self.taken = 0  # chunks another filler of the image fetched
        self.copied = 0  # chunks copied from one of the same digest here
        self._by_digest: dict[str, tuple[str, int, int]] = {}  # a chunk's digest -> where one such is in
        self._inflight: dict[str, threading.Event] = {}  # a digest being fetched -> set once it is done
        for base, idx in spec["present"].items():  # (the create's chunks, verified)
            rec = spec["files"][base]
            for k in idx:
                a, b = int(k) * TREE_CHUNK, min(int(rec["size"]), (int(k) + 1) * TREE_CHUNK)
                d = "sha256:" + rec["chunks"][64 * int(k):64 * int(k) + 64]
                self._by_digest.setdefault(d, (rec["rel"], a, b))
                self._inflight.setdefault(d, threading.Event()).set()

    @classmethod
    def from_handover(cls, handover: dict, images: str, lock_fd: int | None) -> RegistrySource:
        spec = dict(handover["registry"])
        spec["files"] = handover["files"]
        return cls(spec, images, lock_fd)

    # -- what the Verifier calls -------------------------------------------------------------------
    def has(self, path: str, i: int) -> bool:
        return (path, i) in self.present

    def fetch(self, f: FileChunks, i: int, *, fault: bool = False) -> None:
        """Chunk i of f into the partial directory, verified against its digest (and journaled), or
        VerifyError with the reason the container is stopped for."""
        from migrt.registry import transfer

        a, b = f.span(i)
        digest = "sha256:" + f.digests[i].hex()
        with self._chunk_locked(f, i):  # one filler of the image on this node fetches a chunk
            if self._arrived(f, i, digest):
                return
            if (f.path, i) in self.partly:  # only the rest of it, then the whole chunk hashed
                return blocks.fill_chunk(self, f, i, fault)
            with self.lock:  # the first chunk of a digest is fetched, the others copied from it
                landing = self._inflight.get(digest)
                mine = landing is None
                if landing is None:
                    landing = self._inflight[digest] = threading.Event()
            if not mine and self._same_here(f, i, digest, landing):
                return
            try:
                self._fetch(f, i, transfer.Blob(digest, b - a, os.path.join(self.partial, f.rel), a), fault)
                with self.lock:
                    self._by_digest.setdefault(digest, (f.rel, a, b))
            finally:
                if mine:
                    landing.set()

    def _same_here(self, f: FileChunks, i: int, digest: str, landing: threading.Event) -> bool:
        """(under chunk i's lock) Chunk i's bytes copied from a chunk of the same digest in the partial
        directory (zero pages: identical chunks are common), once `landing` says the one being fetched
        is in; hashed again where they land before they count. False: none (or the copy did not match)."""
        from migrt.registry import transfer
        from migrt.store.fsutil import hash_range

        landing.wait()
        with self.lock:
            src = self._by_digest.get(digest)
        a, b = f.span(i)
        if src is None or src == (f.rel, a, b):
            return False
        dst = os.path.join(self.partial, f.rel)
        try:
            transfer.copy_blob(transfer.Blob(digest, b - a, os.path.join(self.partial, src[0]), src[1]),
                               transfer.Blob(digest, b - a, dst, a))
            same = hash_range(dst, a, b - a) == f.digests[i]
        except OSError:
            same = False
        if not same:
            blocks.zero_ranges(dst, [(a, b)])  # (never counted)
            return False
        with contextlib.suppress(OSError):
            self._journal_add(digest, a, f.rel)
        with self.lock:
            self.present.add((f.path, i))
            self.copied += 1
        return True

    def ensure_range(self, f: FileChunks, i: int, s: int, e: int) -> bool:
        """A fault's few pages [s, e) of a chunk the create fetched blocks of, verified by their blocks
        alone (blocks.fill_blocks; the whole chunk follows in the sweep): True once they are; False for
        any other chunk or a longer range (the caller has the whole chunk verified)."""
        rec = self.block_digests.get((f.path, i))
        if rec is None or e - s > 2 * rec.size:
            return False
        with self._chunk_locked(f, i):
            if (f.path, i) in self.present or self._arrived(f, i, "sha256:" + f.digests[i].hex()):
                return True
            self.shared_ranges(f, i)
            blocks.fill_blocks(self, f, i, rec, s, e)
        return True

    def share_range(self, f: FileChunks, i: int, r: tuple[int, int]) -> None:
        """(under the chunk's lock) A block verified for a fault, told to the image's other fillers."""
        top = self.spec.get("chunk_locks")
        if top:
            with open(self._chunk_file(top, f, i, ".ranges"), "a", encoding="ascii") as fh:
                fh.write(f"{r[0]} {r[1]}\n")

    def shared_ranges(self, f: FileChunks, i: int) -> None:
        """(under the chunk's lock) The blocks the image's other fillers verified of chunk i, ours too."""
        top = self.spec.get("chunk_locks")
        if not top or (f.path, i) not in self.partly:
            return
        a, b = f.span(i)
        try:
            with open(self._chunk_file(top, f, i, ".ranges"), encoding="ascii") as fh:
                got = [(int(w[0]), int(w[1])) for w in (line.split() for line in fh) if len(w) == 2]
        except (OSError, ValueError):
            return
        with self.lock:
            have = self.partly[(f.path, i)]
            have += [r for r in got if a <= r[0] < r[1] <= b and r not in have]

    def _fetch(self, f: FileChunks, i: int, blob, fault: bool) -> None:
        from migrt.registry import transfer

        a, b, digest = blob.offset, blob.offset + blob.size, blob.digest
        try:
            if fault:  # in ranges over this source's own threads (their connections kept for the next)
                transfer.fetch(self.client(), [blob], self.parallel, on_blob=lambda _b: None, pool=self._pool())
            else:  # whole, by a fetching process (registry/fillwork.py)
                self.workers().fetch(digest, b - a, blob.path, a)
        except CheckpointInvalid as exc:
            blocks.zero_ranges(blob.path, [(a, b)])  # what arrived of it goes from the disk, never journaled
            got = exc.message.partition("the data received has ")[2].partition(";")[0]
            raise VerifyError(f"checkpoint {self.spec['commit']['name']}: {f.rel} bytes {a}-{b - 1} (blob {digest}) "
                              f"from registry {self.spec['registry']} does not match its digest ("
                              + (f"the data received has {got}: " if got else "") + "altered in the registry or "
                              "in transit); the container was stopped, no restored process ran on it") from exc
        except RegistryError as exc:  # (the client's retries and the fill's deadline are behind it)
            raise VerifyError(self._gone(exc)) from exc
        except Exception as exc:  # e.g. the store full: not the registry's doing (and never a silent thread)
            why = getattr(exc, "message", None) or repr(exc)
            raise VerifyError(f"checkpoint {self.spec['commit']['name']}: {f.rel} bytes {a}-{b - 1} could not be "
                              f"filled from registry {self.spec['registry']}: {why}; the container was stopped; "
                              "restore again") from exc
        with contextlib.suppress(OSError):  # (unjournaled, it is fetched again by a later restore: no harm)
            self._journal_add(digest, a, f.rel)
        with self.lock:
            self.present.add((f.path, i))
            self.arrived += b - a
            self.fetched += 1

    # -- beside the other fillers of the image ------------------------------------------------------
    @contextlib.contextmanager
    def _chunk_locked(self, f: FileChunks, i: int) -> Iterator[None]:
        """A lock per chunk shared by every filler of the image on this node: flock on a file of its own
        in the image's chunk lock directory, on a descriptor of this call's (POSIX record locks would
        belong to the whole process, and the kernel would take two fillers' threads waiting on each
        other's chunks for a deadlock). A filler that dies lets its chunks go."""
        top = self.spec.get("chunk_locks")
        if not top:
            yield
            return
        try:
            os.makedirs(top, mode=0o700, exist_ok=True)
            fd = os.open(self._chunk_file(top, f, i),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise VerifyError(f"cannot lock chunk {i} of {f.rel} in {top}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _chunk_file(self, top: str, f: FileChunks, i: int, suffix: str = "") -> str:
        """Chunk i of f's file in the image's chunk lock directory: its lock, its `.ranges`."""
        return os.path.join(top, f"{self._order.index(f.rel)}-{i}{suffix}")

    def _arrived(self, f: FileChunks, i: int, digest: str) -> bool:
        """Another filler of the image journaled the chunk (or committed the image, its journal gone):
        true when its bytes on disk hash to the digest (hashed again, not believed)."""
        from migrt.registry.pull import Journal
        from migrt.store.fsutil import hash_range

        a, b = f.span(i)
        gone = not os.path.exists(self.spec["journal"])
        if not gone and (digest, a, f.rel) not in Journal(self.spec["journal"]).done:
            return False
        try:
            ok = "sha256:" + hash_range(f.path, a, b - a).hex() == digest  # (our directory's descriptor)
        except OSError:
            ok = False
        if ok:
            with self.lock:
                self.present.add((f.path, i))
                self.taken += 1
        return ok

    # -- the rest ----------------------------------------------------------------------------------
    def _pool(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._faults is None:
                self._faults = ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="registry-fault",
                                                  initializer=_not_niced)
            return self._faults

    def client(self) -> Client:
        """One client for every thread (each keeps its own connection), its deadline the fill's."""
        with self.lock:
            if self._client is None:
                self._client = make_client(self.spec, self._deadline())
            return self._client

    def workers(self) -> Workers:
        """The fill's fetching processes (started at the first whole chunk), under the same deadline."""
        with self.lock:
            if self._workers is None:
                self._workers = Workers(self.spec, self._deadline(), self.parallel, nice=BACKGROUND_NICE)
            return self._workers

    def _deadline(self) -> Deadline:
        """(under self.lock) The fill's one deadline, from its first fetch."""
        if self._fill_deadline is None:
            self._fill_deadline = fill_deadline(self.spec, self.total)
        return self._fill_deadline

    def _gone(self, exc: BaseException) -> str:
        in_bytes = self.total - self._missing_bytes()
        cid = self.spec.get("container_id") or "?"
        return (f"registry {self.spec['registry']} went away while filling container {cid}'s memory "
                f"({in_bytes >> 20} of {self.total >> 20} MiB in); the container was stopped; restore again "
                f"({getattr(exc, 'message', None) or exc})")

    def _missing_bytes(self) -> int:
        from migrt.store.fsutil import TREE_CHUNK

        missing = 0
        for base, f in self.spec["files"].items():
            size = int(f["size"])
            for i in range(max(1, -(-size // TREE_CHUNK))):
                if (os.path.join(self.images, base), i) not in self.present:
                    missing += min(size, (i + 1) * TREE_CHUNK) - i * TREE_CHUNK
        return missing

    def _journal_add(self, digest: str, offset: int, rel: str) -> None:
        from migrt.registry.pull import Journal

        with self.lock:
            if self._journal is None:
                self._journal = Journal(self.spec["journal"])
            journal = self._journal
        journal.add(digest, offset, rel)

    def summary(self) -> dict:
        with self.lock:
            return {"fetched_chunks": self.fetched, "fetched_bytes": self.arrived, "taken_chunks": self.taken,
                    "copied_chunks": self.copied, "seconds": round(time.monotonic() - self.t0, 3)}

    def commit(self) -> dict:
        """Every chunk is in: the partial directory becomes the pulled checkpoint; the lock goes."""
        from migrt.registry import pull
        from migrt.store import Store, importer

        c = self.spec["commit"]
        store = Store(c["store"])
        if self.spec.get("join"):  # the fill this one joined commits (or, should it fail, the next restore)
            self.close()
            return {"name": c["name"], "joined": True}
        from migrt.registry.lazy import commit_gate

        # the creates that joined this fill are done restoring from the directory before it moves
        gate = commit_gate(self.spec["chunk_locks"], shared=False) if self.spec.get("chunk_locks") else -1
        try:
            with importer.importing(store, c["name"], adopt=self.partial) as imp:
                data = pull.commit_files(imp, c["plan"], c["config"], c["pulled"])
            # (a filler that joined and still looks finds the journal gone: it hashes from disk, never fetches)
            for done in (self.spec["journal"], pull.fill_marker(store, c["pulled"]["manifest_digest"])):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(done)
            if self.spec.get("chunk_locks"):
                shutil.rmtree(self.spec["chunk_locks"], ignore_errors=True)
            return {"name": c["name"], "size_bytes": data.get("size_bytes")}
        finally:
            if gate >= 0:
                os.close(gate)
            self.close()

    def close(self) -> None:
        if self._faults is not None:
            self._faults.shutdown(wait=False)
        if self._workers is not None:
            self._workers.close()
        if self._client is not None:
            self._client.close()
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None

    def log(self, event: str, **fields) -> None:
        """A line in the node's migrt log (the filler has no structlog set up)."""
        path = self.spec.get("log_file")
        if not path:
            return
        rec = {"event": event, "level": "info" if "error" not in fields else "error", "component": "migrt-pagefill",
               "container": self.spec.get("container_id"), "reference": self._reference(), **fields,
               "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")

    def _reference(self) -> str:
        return f"{self.spec['registry']}/{self.spec['repository']}@{self.spec['digest']}"


def _not_niced() -> None:
    """A fault's fetch runs at the process's priority, whichever (niced) copy thread made the pool."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, os.getpid()))


if __name__ == "__main__":
    from migrt.pagefill import guard

    sys.exit(guard.main(sys.argv[1:], source=RegistrySource.from_handover))
