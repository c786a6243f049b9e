"""Store layout (root from config, default /var/lib/migrt; directories 0700, files 0600):

  <root>/<name>/manifest.json      a committed checkpoint (visible only once complete)
  <root>/<name>/images/...          CRIU images (+ descriptors.json from runc)
  <root>/.staging/<name>.<pid>.<n>  checkpoints being written
  <root>/.locks/<name>.lock         flock held by the one writer (or remover) of a name
  <root>/.tmp/                      restore views (hard links) and imports

Commit: hash + fsync every file, write manifest (temp, fsync, rename), fsync the staging directory,
rename it to <root>/<name>, fsync the root.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator

from migrt import names
from migrt.errors import CheckpointInvalid, Conflict, MigrtError, NotFound
from migrt.store import manifest as mf
from migrt.store.fsutil import fsync_dir, hash_tree

HIDDEN = (".staging", ".locks", ".tmp")


class StoreError(MigrtError):
    exit_code = 1


def _mkdir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def secure_tree(path: str) -> None:
    """Directories 0700, files 0600, owned by root (when we are root)."""
    root_owned = os.geteuid() == 0
    for dirpath, dirnames, filenames in os.walk(path):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o700)
        for f in filenames:
            full = os.path.join(dirpath, f)
            os.chmod(full, 0o600)
            if root_owned:
                os.chown(full, 0, 0)


def fsync_tree_dirs(path: str) -> None:
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            fsync_dir(os.path.join(dirpath, d))
    fsync_dir(path)


def publish(staging: str, root: str, name: str) -> None:
    """Rename a complete staging directory to <root>/<name>: the checkpoint becomes visible whole."""
    try:
        os.rename(staging, os.path.join(root, name))
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise Conflict(f"checkpoint {name} already exists") from exc
        raise


class Checkpoint:
    def __init__(self, store: "Store", name: str) -> None:
        self.store = store
        self.name = name
        self.path = os.path.join(store.root, name)
        self.images = os.path.join(self.path, "images")
        self._manifest: dict | None = None

    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            self._manifest = mf.load(self.path, self.name)
        return self._manifest

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        mf.verify(self.path, self.manifest, self.name, progress=progress)


class Staging:
    """A checkpoint being written. Nothing here is visible to readers until commit()."""

    def __init__(self, store: "Store", name: str, path: str) -> None:
        self.store = store
        self.name = name
        self.path = path
        self.images = os.path.join(path, "images")
        self.work = os.path.join(path, "work")
        self.committed = False
        _mkdir(path)  # makedirs would give the intermediate directory the umask's mode, not 0700
        _mkdir(self.images)
        _mkdir(self.work)

    def commit(self, fields: dict, *, progress: Callable[[int], None] | None = None,
               fault: Callable[[str], None] | None = None) -> dict:
        """Hash, fsync and publish. `fault(step)` is a test seam to simulate a crash between steps."""
        step = fault or (lambda _s: None)
        shutil.rmtree(self.work, ignore_errors=True)
        rels = mf.list_payload(self.path)
        secure_tree(self.path)
        t0 = time.monotonic()
        files = hash_tree(self.path, rels, fsync=True, progress=progress)
        step("hashed")
        data = dict(fields)
        data.update(schema=mf.SCHEMA, name=self.name, files=files,
                    size_bytes=sum(f["size"] for f in files.values()))
        data.setdefault("timings", {})["checksum_s"] = round(time.monotonic() - t0, 3)
        mf.write(self.path, data)
        step("manifest-written")
        fsync_tree_dirs(self.path)
        step("synced")
        publish(self.path, self.store.root, self.name)
        self.committed = True
        step("renamed")
        fsync_dir(self.store.root)
        return data

    def discard(self) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)


class Store:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    # -- layout ------------------------------------------------------------------------------
    def ensure(self) -> None:
        _mkdir(self.root)
        for d in HIDDEN:
            _mkdir(os.path.join(self.root, d))

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.root, ".locks", f"{name}.lock")

    @contextlib.contextmanager
    def lock(self, name: str, what: str = "written") -> Iterator[None]:
        names.validate(name)
        self.ensure()
        fd = os.open(self._lock_path(name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise Conflict(f"checkpoint {name} is being {what} by another process; try again later") from exc
            yield
        finally:
            os.close(fd)

    def _locked(self, name: str) -> bool:
        try:
            fd = os.open(self._lock_path(name), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    # -- reading -----------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return os.path.isdir(os.path.join(self.root, names.validate(name)))

    def get(self, name: str) -> Checkpoint:
        names.validate(name)
        ckpt = Checkpoint(self, name)
        if not os.path.isdir(ckpt.path) or os.path.islink(ckpt.path):
            raise NotFound(f"checkpoint {name}: not found in {self.root} (run 'migrt ls')")
        return ckpt

    def list(self) -> list[Checkpoint]:
        try:
            entries = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            if entry.startswith(".") or not os.path.isdir(os.path.join(self.root, entry)):
                continue
            try:
                names.validate(entry)
            except MigrtError:
                continue
            out.append(Checkpoint(self, entry))
        return out

    # -- writing -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[Staging]:
        """Lock `name`, give a staging directory, discard it unless committed."""
        with self.lock(name):
            if self.exists(name):
                raise Conflict(f"checkpoint {name} already exists (choose another --name or 'migrt rm {name}')")
            path = os.path.join(self.root, ".staging", f"{name}.{os.getpid()}.{time.monotonic_ns()}")
            staging = Staging(self, name, path)
            try:
                yield staging
            finally:
                staging.discard()

    def remove(self, name: str) -> None:
        with self.lock(name, "used"):
            ckpt = self.get(name)
            # Rename first so a half-removed checkpoint is never visible under its name.
            trash = os.path.join(self.root, ".tmp", f"rm.{name}.{os.getpid()}.{time.monotonic_ns()}")
            os.rename(ckpt.path, trash)
            fsync_dir(self.root)
            shutil.rmtree(trash, ignore_errors=True)

    def gc(self) -> list[str]:
        """Remove staging and temporary entries left by crashed writers (whose lock is free)."""
        removed = []
        for d in (".staging", ".tmp"):
            top = os.path.join(self.root, d)
            try:
                entries = os.listdir(top)
            except FileNotFoundError:
                continue
            for entry in entries:
                owner = entry.rsplit(".", 2)[0] if d == ".staging" else None
                if owner and self._locked(owner):
                    continue
                if d == ".tmp" and _pid_alive(entry):
                    continue
                shutil.rmtree(os.path.join(top, entry), ignore_errors=True)
                removed.append(os.path.join(d, entry))
        return removed

    # -- restore view ------------------------------------------------------------------------
    @contextlib.contextmanager
    def restore_view(self, ckpt: Checkpoint) -> Iterator[str]:
        """A private directory of hard links to the checkpoint's images: CRIU writes its
        stats-restore file into the image directory, and the checkpoint must stay untouched."""
        self.ensure()
        view = os.path.join(self.root, ".tmp", f"view.{os.getpid()}.{time.monotonic_ns()}")
        _mkdir(view)
        try:
            for rel in sorted(ckpt.manifest["files"]):
                if not rel.startswith("images/"):
                    continue
                src = os.path.join(ckpt.path, rel)
                dst = os.path.join(view, os.path.relpath(rel, "images"))
                os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
            yield view
        finally:
            shutil.rmtree(view, ignore_errors=True)

    def check_images_dir(self, ckpt: Checkpoint) -> None:
        if not os.path.isdir(ckpt.images):
            raise CheckpointInvalid(f"checkpoint {ckpt.name}: images/ directory is missing")


def _pid_alive(entry: str) -> bool:
    """.tmp entries are named <kind>[.<name>].<pid>.<n>; keep those whose process still runs."""
    parts = entry.split(".")
    return len(parts) >= 3 and parts[-2].isdigit() and os.path.exists(f"/proc/{parts[-2]}")
