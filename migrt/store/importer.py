"""Import a checkpoint that arrives file by file (a migration from another node) into the store.

The files land in a staging directory (`<root>/.staging/<name>.<pid>.<n>`, like a local checkpoint),
each file's sha256 is computed while it is written (by the caller, on the fly), and the sender's
manifest is checked against what arrived: the same set of files, sizes and sha256. Only then does the
usual atomic commit run: permissions, fsync, manifest written atomically, directory renamed into
place, root fsynced. Nothing is visible under the name before that rename; a broken import leaves
only a staging directory, removed on the way out (or by `Store.gc` after a crash, once the name's
lock is free).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from migrt.errors import CheckpointInvalid, Conflict
from migrt.kernel.files import fsync_path
from migrt.store import journal, reserve
from migrt.store import manifest as mf
from migrt.store.beside import Beside
from migrt.store.fsutil import digest_of, fsync_dir, make_entry
from migrt.store.store import Store, fsync_tree_dirs, publish, secure_tree

MAX_DEPTH = 5
MAX_FILES = 100_000
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")
# Manifest fields the importer writes itself; every other field comes from the sender's manifest.
OWN_FIELDS = mf.OWN_FIELDS
SPACE_MARGIN = 64 << 20


def check_relpath(rel: object) -> str:
    """A relative path of plain components (images/pages-1.img, rootfs-diff.tar): no '..', no
    absolute path, no empty or hidden component, not the manifest. Refused before a file is created."""
    if not isinstance(rel, str) or not rel:
        raise CheckpointInvalid("received a file without a path")
    parts = rel.split("/")
    if len(parts) > MAX_DEPTH or rel == mf.MANIFEST or not all(_PART.fullmatch(x) for x in parts):
        raise CheckpointInvalid(f"refusing received file {rel!r}: a path inside the checkpoint made of plain names "
                                "is expected")
    return rel


class Import:
    """One checkpoint being received. Use through `importing()`."""

    def __init__(self, store: Store, name: str, path: str, *, adopt: bool = False) -> None:
        self.store = store
        self.name = name
        self.path = path
        self.images = os.path.join(path, "images")
        self.received: dict[str, dict] = {}
        self.committed = False
        self.adopted = adopt  # a directory the caller keeps between attempts (a resumable pull)
        self._beside = Beside()
        self.space = reserve.Reservation(store.root, f"checkpoint {name}", SPACE_MARGIN)
        store.ensure()
        if not adopt:
            os.mkdir(path, 0o700)
            os.mkdir(self.images, 0o700)

    def ensure_space(self, nbytes: int) -> None:
        """Reserve room for `nbytes` more that this import will write (store/reserve.py; `self.space.wrote`
        once they are on disk): PreconditionFailed when the store cannot hold them beside what the other
        writers reserved. The reservation ends with the import."""
        self.space.reserve(nbytes)

    @contextlib.contextmanager
    def open(self, rel: str, *, readable: bool = False) -> Iterator[int]:
        """A new file's descriptor (0600, exclusive create; read-write when `readable`); closed on the way
        out (fsynced at commit)."""
        check_relpath(rel)
        if rel in self.received or len(self.received) >= MAX_FILES:
            raise CheckpointInvalid(f"received file {rel} twice (or too many files)")
        full = os.path.join(self.path, rel)
        parent = os.path.dirname(full)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700)
        fd = os.open(full, (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC |
                     os.O_NOFOLLOW, 0o600)
        try:
            yield fd
        finally:
            os.close(fd)

    def create(self, rel: str, size: int) -> int:
        """A new file of `size` bytes (sparse), opened read-write for a writer that fills it out of order
        (migration/bulk.py maps it); the caller closes the descriptor, then calls record()."""
        with self.open(rel, readable=True) as fd:
            os.ftruncate(fd, size)
            return os.dup(fd)

    def record(self, rel: str, size: int, sha256: str) -> None:
        actual = os.path.getsize(os.path.join(self.path, rel))
        if actual != size:
            raise CheckpointInvalid(f"received file {rel}: {actual} bytes written, {size} announced")
        self.received[rel] = make_entry(size, sha256)

    def verify(self, files: object) -> None:
        """The sender's file list must match what arrived exactly (names, sizes, sha256)."""
        if not isinstance(files, dict):
            raise CheckpointInvalid(f"checkpoint {self.name}: the sender's manifest has no file list")
        missing = sorted(set(files) - set(self.received))
        if missing:
            raise CheckpointInvalid(f"checkpoint {self.name}: file {missing[0]} is in the sender's manifest "
                                    "but never arrived")
        extra = sorted(set(self.received) - set(files))
        if extra:
            raise CheckpointInvalid(f"checkpoint {self.name}: received file {extra[0]} is not in the sender's manifest")
        for rel in sorted(files):
            want, got = files[rel] or {}, self.received[rel]
            if want.get("size") != got["size"]:
                raise CheckpointInvalid(f"checkpoint {self.name}: size mismatch in {rel} (received {got['size']}, "
                                        f"manifest says {want.get('size')})")
            if digest_of(want) != digest_of(got):
                raise CheckpointInvalid(f"checkpoint {self.name}: sha256 mismatch in {rel} (corrupted in transit)")

    def beside(self, field: str, fn) -> None:
        """Manifest field `field` computed by fn in a thread from now until commit() (store/beside.py):
        call it once every file is in (and verified, if fn reads them)."""
        self._beside.start(field, fn)

    def commit(self, fields: dict, files: object, *, durable: bool = True) -> dict:
        """Verify against the sender's manifest (`files`: its file list as it came, refused unless it is one),
        then publish atomically. Returns the manifest. durable=False skips the fsyncs (a lazy migration's
        pageless checkpoint lives for seconds)."""
        self.verify(files)
        if durable:  # all files at once: the file system merges concurrent syncs into few commits
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(fsync_path, [os.path.join(self.path, rel) for rel in self.received]))
        secure_tree(self.path)
        data = mf.assemble(fields, self.name, dict(sorted(self.received.items())))
        self._beside.record(data)
        mf.write(self.path, data)
        if durable:
            fsync_tree_dirs(self.path)
        publish(self.path, self.store.root, self.name)
        self.committed = True
        if durable:
            fsync_dir(self.store.root)
        return data

    def discard(self) -> None:
        if not self.committed and not self.adopted:
            shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def importing(store: Store, name: str, *, adopt: str | None = None) -> Iterator[Import]:
    """Lock `name`, give an Import in a fresh staging directory, discard it unless committed.
    adopt: an existing directory to import into, kept on failure for the caller to resume (a pull's
    partial directory); it is not journaled, so recovery leaves it alone."""
    with store.lock(name):
        if store.exists(name):
            raise Conflict(f"checkpoint {name} already exists in the target store {store.root} "
                           f"(choose another --name, or 'migrt rm {name}' there)")
        if adopt is not None:
            imp = Import(store, name, adopt, adopt=True)
            try:
                yield imp
            finally:
                imp.space.release()
            return
        path = os.path.join(store.root, ".staging", f"{name}.{os.getpid()}.{time.monotonic_ns()}")
        entry = journal.begin(store.root, "receive", name=name, staging=path)  # recovery: the source has it
        try:
            imp = Import(store, name, path)
            try:
                yield imp
            finally:
                imp.discard()
                imp.space.release()
        finally:
            entry.end()
