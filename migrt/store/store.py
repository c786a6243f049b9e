"""Store layout (root from config, default /var/lib/migrt; directories 0700, files 0600):

  <root>/<name>/manifest.json      a committed checkpoint (visible only once complete)
  <root>/<name>/images/...          CRIU images (+ descriptors.json from runc)
  <root>/.staging/<name>.<pid>.<n>  checkpoints being written
  <root>/.locks/<name>.lock         flock on a name: shared by its readers (restore, inspect, verify,
                                    transfer), exclusive for its one writer or remover
  <root>/.tmp/                      restore views (hard links) and imports
  <root>/.journal/                  operations in progress (store/journal.py), for recovery
  <root>/.incomplete/<entry>        images kept from an interrupted write whose workload is gone
                                    (never deleted by migrt; see 'migrt recover')

Locking rule: readers share, writers exclude. Any number of processes may read one checkpoint at
once; a writer (checkpoint, import, receive) or `rm` waits for the readers to go (bounded) or
refuses with the pids holding it. Nothing is ever deleted under a reader.

Commit: hash + fsync every file, write manifest (temp, fsync, rename), fsync the staging directory,
rename it to <root>/<name>, fsync the root.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator

from migrt import jsonsafe, names, trust
from migrt.errors import CheckpointInvalid, Conflict, MigrtError, NotFound
from migrt.store import journal
from migrt.store import manifest as mf
from migrt.store.beside import Beside
from migrt.store.fsutil import (
    StoreError,
    fsync_dir,
    fsync_files,
    hash_tree,
    lock_is_free,
    open_nofollow,
    write_json_atomic,
)

HIDDEN = (".staging", ".locks", ".tmp", journal.DIR, ".incomplete")
READ_WAIT_S = 10.0    # a reader waits this long for a writer or remover of the same name
REMOVE_WAIT_S = 10.0  # `rm` waits this long for the readers of a checkpoint


def private_dir(path: str) -> None:
    """A directory of ours, 0700, created if missing; never a symbolic link (one planted inside the
    store would send locks, staging and restore views elsewhere): StoreError instead of following it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if os.path.islink(path) else "not a directory"
            raise StoreError(f"{path} is {kind}; migrt never follows links inside its store (remove it, then "
                             "run the command again)") from exc
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StoreError(f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}; refusing a store directory "
                             "another user could change (remove it, or chown it if you trust its content)")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)



def secure_tree(path: str) -> None:
    """Directories 0700, files 0600, owned by root (when we are root). Links are refused, never
    followed (a commit publishes plain files and directories only)."""
    root_owned = os.geteuid() == 0
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            full = os.path.join(dirpath, n)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointInvalid(f"{full}: a symbolic link; a checkpoint holds plain files and directories")
            os.chmod(full, 0o700 if stat.S_ISDIR(st.st_mode) else 0o600)
            if root_owned and not stat.S_ISDIR(st.st_mode):
                os.chown(full, 0, 0)


def unsafe_root(root: str) -> str | None:
    """Why migrt must not use the store at `root` (the tail of a message), or None. The rule is the
    node's one for everything it acts on (migrt/trust.py): the store directory and every directory
    above it, on the path as given and once links are resolved, owned by root and writable by nobody
    else (sticky directories such as /tmp excepted above it). In addition migrt's own directories in
    it are plain directories of root, never links (locks, journal entries, staging and restore views
    would be written wherever they point)."""
    try:
        if not stat.S_ISDIR(os.stat(root).st_mode):
            return None  # not a store at all (or none yet): whoever reads or writes it says so
    except OSError:
        return None
    why = trust.problem(root)
    if why:
        return why
    me = os.geteuid()
    for d in (*HIDDEN, ".pulls"):
        path = os.path.join(root, d)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            return (f"{path} is a symbolic link (to {_readlink(path)!r}); migrt never follows links inside its "
                    "store: remove it")
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or st.st_mode & 0o022:
            return (f"{path} is not a directory of uid {me} that only it can write (uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):o}); remove it, or chown and 'chmod 700' it if you trust its content")
    return None
    if not stat.S_ISDIR(st.st_mode):
        return None  # not a store at all: whoever reads or writes it says so
    if st.st_uid != me:
        return f"{root} is owned by uid {st.st_uid}, not {me}"
    if st.st_mode & 0o022:
        return f"{root} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    for d in (*HIDDEN, ".pulls"):  # migrt's own directories: never links (locks, journal, views would go there)
        try:
            dst = os.lstat(os.path.join(root, d))
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(dst.st_mode):
            return f"{os.path.join(root, d)} is a symbolic link (to {_readlink(os.path.join(root, d))!r})"
        if not stat.S_ISDIR(dst.st_mode) or dst.st_uid != me or dst.st_mode & 0o022:
            return (f"{os.path.join(root, d)} is not a directory of uid {me} that only it can write (uid "
                    f"{dst.st_uid}, mode {stat.S_IMODE(dst.st_mode):o})")
    for path in {os.path.abspath(root), os.path.realpath(root)}:
        parent = os.path.dirname(path)
        while True:
            try:
                pst = os.stat(parent)
            except OSError as exc:
                return f"{parent}: {exc.strerror or exc}"
            if pst.st_uid not in (0, me):
                return f"{parent} (above the store) is owned by uid {pst.st_uid}"
            if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
                return f"{parent} (above the store) is writable by group or others (mode {stat.S_IMODE(pst.st_mode):o})"
            if parent == os.path.dirname(parent):
                break
            parent = os.path.dirname(parent)
    return None


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
    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.path = os.path.join(store.root, name)
        self.images = os.path.join(self.path, "images")
        self._manifest: mf.Manifest | None = None

    @property
    def manifest(self) -> mf.Manifest:
        if self._manifest is None:
            self._manifest = mf.load(self.path, self.name)
        return self._manifest

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        mf.verify(self.path, self.manifest, self.name, progress=progress)

    def verify_structure(self) -> None:
        mf.verify_structure(self.path, self.manifest, self.name)

    def verify_hashes(self, rels: list[str], progress: Callable[[int], None] | None = None) -> None:
        mf.verify_hashes(self.path, self.manifest, self.name, rels, progress=progress)


class Staging:
    """A checkpoint being written. Nothing here is visible to readers until commit()."""

    def __init__(self, store: Store, name: str, path: str) -> None:
        self.store = store
        self.name = name
        self.path = path
        self.images = os.path.join(path, "images")
        self.work = os.path.join(path, "work")
        self.committed = False
        self.journal: journal.Entry | None = None
        self._beside = Beside()
        private_dir(path)  # makedirs would give the intermediate directory the umask's mode, not 0700
        private_dir(self.images)
        private_dir(self.work)

    def payload_bytes(self) -> int:
        """What commit() will hash (every file but work/), e.g. the total of its progress."""
        return sum(os.path.getsize(os.path.join(dirpath, f)) for dirpath, dirs, fs in os.walk(self.path)
                   if not (dirpath == self.work or dirpath.startswith(self.work + os.sep)) for f in fs)

    def beside(self, field: str, fn: Callable[[], object]) -> None:
        """Manifest field `field` computed by fn in a thread from now until commit() (store/beside.py)."""
        self._beside.start(field, fn)

    def commit(self, fields: dict, *, progress: Callable[[int], None] | None = None,
               fault: Callable[[str], None] | None = None, known: dict[str, dict] | None = None,
               known_chunks: dict[str, list[bytes]] | None = None) -> dict:
        """Hash, fsync and publish. `known`: manifest entries of files whose writer hashed them as it
        wrote them (the parallel dump's pages files: pagedump/memory.py), taken instead of reading the
        files again when the file still has that size (any other is hashed here); `known_chunks`: their
        64 MiB chunk digests, for the manifest's chunk record (field `chunks`, manifest.py). `fault(step)`
        is a test seam to simulate a crash between steps."""
        step = fault or (lambda _s: None)
        shutil.rmtree(self.work, ignore_errors=True)
        rels = mf.list_payload(self.path)
        secure_tree(self.path)
        t0 = time.monotonic()
        taken = {rel: dict(e) for rel, e in (known or {}).items()
                 if rel in rels and e.get("size") == os.path.getsize(os.path.join(self.path, rel))}
        chunks = {rel: list(c) for rel, c in (known_chunks or {}).items() if rel in taken}
        hashed = hash_tree(self.path, [r for r in rels if r not in taken], fsync=True, progress=progress,
                           chunk_out=chunks)
        fsync_files(self.path, list(taken))
        for e in taken.values():
            if progress:
                progress(e["size"])
        files = {rel: taken.get(rel) or hashed[rel] for rel in rels}
        step("hashed")
        data = mf.assemble(fields, self.name, files)
        data.setdefault("timings", {})["checksum_s"] = round(time.monotonic() - t0, 3)
        record = mf.chunk_records(files, chunks)
        if record:
            data[mf.CHUNKS] = record
        else:
            data.pop(mf.CHUNKS, None)
        self._beside.record(data)
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
        self._checked = False

    # -- layout ------------------------------------------------------------------------------
    def check(self) -> None:
        """StoreError when another user could change the store (unsafe_root): every command that reads
        or writes it calls this first (once per Store). A store that does not exist yet passes."""
        if self._checked:
            return
        why = unsafe_root(self.root)
        if why:
            raise StoreError(f"store {self.root}: {why} (or point 'store:' in the migrt config at a directory only "
                             "root can write: install -d -m 0700 -o root -g root DIR)")
        self._checked = os.path.isdir(self.root)

    def ensure(self) -> None:
        try:
            if not os.path.isdir(self.root):
                os.makedirs(self.root, mode=0o700, exist_ok=True)
            self.check()
            for d in HIDDEN:
                private_dir(os.path.join(self.root, d))
        except OSError as exc:
            raise StoreError(f"store {self.root} cannot be written: {exc.strerror or exc} (check the file system "
                             "it is on: full, read-only, gone?)") from exc

    def private_dir(self, rel: str) -> str:
        """<root>/<rel>, each component a private directory of ours (created if missing, links refused)."""
        self.ensure()
        path = self.root
        for part in rel.split("/"):
            path = os.path.join(path, part)
            private_dir(path)
        return path

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.root, ".locks", f"{name}.lock")

    @contextlib.contextmanager
    def lock(self, name: str, what: str = "written", *, shared: bool = False, wait: float = 0.0) -> Iterator[None]:
        """flock on a name: shared (readers) or exclusive (writers, removers), waiting up to `wait`
        seconds for a conflicting holder, then Conflict naming the pids that hold it."""
        names.validate(name)
        self.ensure()
        path = self._lock_path(name)
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                if time.monotonic() >= deadline:
                    holders = lock_holders(fd)
                    os.close(fd)
                    who = f" (held by {', '.join(holders)})" if holders else ""
                    waited = f" after waiting {wait:g} s" if wait > 0 else ""
                    raise Conflict(f"checkpoint {name} is being {what} by another process{who}{waited}; "
                                   "try again when it ends") from exc
                os.close(fd)
                time.sleep(0.05)
                continue
            if _same_file(fd, path):
                break
            os.close(fd)  # `rm` unlinked the lock file after we opened it: take the new one
        try:
            yield
        finally:
            os.close(fd)

    def _drop_lock_file(self, name: str) -> None:
        """Called by `rm` while it holds the lock exclusively: lock files do not pile up, one per name
        ever used. Whoever opened the old file meanwhile sees it is no longer the path's and retries."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._lock_path(name))

    @contextlib.contextmanager
    def container_lock(self, root: str, container_id: str) -> Iterator[None]:
        """One checkpoint of a container at a time (the second would find it frozen by the first)."""
        self.ensure()
        key = hashlib.sha256(f"{os.path.abspath(root)}\0{container_id}".encode()).hexdigest()[:32]
        path = os.path.join(self.root, ".locks", f"container-{key}.lock")
        while True:
            fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                holders = lock_holders(fd)
                os.close(fd)
                who = f" ({', '.join(holders)})" if holders else ""
                raise Conflict(f"container {container_id} is being checkpointed by another process{who}; "
                               "try again when it ends") from exc
            if _same_file(fd, path):
                break
            os.close(fd)  # the previous holder unlinked it on its way out: take the new one
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # still held: no file per container ever checkpointed piles up
            os.close(fd)

    def _locked(self, name: str) -> bool:
        return not lock_is_free(self._lock_path(name))

    @contextlib.contextmanager
    def reading(self, name: str, *, wait: float = READ_WAIT_S) -> Iterator[Checkpoint]:
        """A committed checkpoint, held open for reading (shared lock: other readers welcome, `rm`
        and writers wait) and checked for unsafe ownership or modes first."""
        with self.lock(name, "written or removed", shared=True, wait=wait):
            ckpt = self.get(name)
            check_secure(ckpt.path, f"checkpoint {name}")
            yield ckpt

    # -- reading -----------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        self.check()
        return os.path.lexists(os.path.join(self.root, names.validate(name)))

    def get(self, name: str) -> Checkpoint:
        names.validate(name)
        self.check()
        ckpt = Checkpoint(self, name)
        if not os.path.isdir(ckpt.path) or os.path.islink(ckpt.path):
            raise NotFound(f"checkpoint {name}: not found in {self.root} (run 'migrt ls')")
        return ckpt

    def list(self) -> list[Checkpoint]:
        self.check()
        try:
            entries = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        except OSError as exc:  # not a directory, no permission (not root), an I/O error
            raise StoreError(f"store {self.root} cannot be read: {exc.strerror or exc} (the config's 'store' must be "
                             "a directory migrt owns; run 'migrt doctor')") from exc
        out = []
        for entry in entries:
            full = os.path.join(self.root, entry)
            if entry.startswith(".") or os.path.islink(full) or not os.path.isdir(full):
                continue
            try:
                names.validate(entry)
            except MigrtError:
                continue
            out.append(Checkpoint(self, entry))
        return out

    # -- writing -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def writer(self, name: str, op: str = "checkpoint", **record) -> Iterator[Staging]:
        """Lock `name`, record the operation in the journal, give a staging directory; discard the
        staging unless committed. `staging.journal` is the record (update its phase as work goes).
        A process killed inside leaves the record: recovery (ops/recover.py) decides what the
        staging directory holds. A writer whose undo failed sets `journal.keep` to leave it too."""
        with self.lock(name):
            if self.exists(name):
                raise Conflict(f"checkpoint {name} already exists (choose another --name or 'migrt rm {name}')")
            path = os.path.join(self.root, ".staging", f"{name}.{os.getpid()}.{time.monotonic_ns()}")
            entry = journal.begin(self.root, op, name=name, staging=path, **record)
            try:
                staging = Staging(self, name, path)
                staging.journal = entry
                try:
                    yield staging
                finally:
                    staging.discard()
            finally:
                if entry.keep:
                    entry.release()
                else:
                    entry.end()

    def remove(self, name: str, *, wait: float = REMOVE_WAIT_S) -> None:
        with self.lock(name, "read or written", wait=wait):
            ckpt = self.get(name)
            # Rename first so a half-removed checkpoint is never visible under its name.
            trash = os.path.join(self.root, ".tmp", f"rm.{name}.{os.getpid()}.{time.monotonic_ns()}")
            os.rename(ckpt.path, trash)
            fsync_dir(self.root)
            self._drop_lock_file(name)
            shutil.rmtree(trash, ignore_errors=True)

    def gc(self) -> builtins.list[str]:  # (`list` is the method above in this class)
        """Clear what crashed processes left (returns what it moved or removed, relative to the root):
        restore views and temporary files whose process is gone. Staging directories are NOT deleted
        here: those named by the journal are recovery's (ops/recover.py); one that nothing names and no
        live writer holds is moved to .incomplete/ (it may hold the only copy of a workload), never
        deleted."""
        moved = []
        journaled = journal.staging_paths(self.root)
        top = os.path.join(self.root, ".staging")
        for entry in _listdir(top):
            path = os.path.join(top, entry)
            if path in journaled or self._locked(entry.rsplit(".", 2)[0]):
                continue
            kept = self.keep_incomplete(path, reason="staging directory of an unknown, interrupted write")
            moved.append(os.path.relpath(kept, self.root))
        top = os.path.join(self.root, ".tmp")
        for entry in _listdir(top):
            if _pid_alive(entry):
                continue
            shutil.rmtree(os.path.join(top, entry), ignore_errors=True)
            moved.append(os.path.join(".tmp", entry))
        return moved

    def keep_incomplete(self, staging: str, *, reason: str, **info) -> str:
        """Move a staging directory out of the way, kept whole, with a note of why (for 'migrt recover')."""
        dest_dir = os.path.join(self.root, ".incomplete")
        private_dir(dest_dir)
        dest = os.path.join(dest_dir, os.path.basename(staging))
        os.rename(staging, dest)
        write_json_atomic(os.path.join(dest, "INCOMPLETE.json"), {"reason": reason, "kept": time.time(), **info})
        fsync_dir(dest_dir)
        return dest

    def incomplete(self) -> builtins.list[dict]:
        """What .incomplete/ holds: [{entry, path, reason, size_bytes, ...}]."""
        self.check()
        out: builtins.list[dict] = []
        top = os.path.join(self.root, ".incomplete")
        if os.path.islink(top):
            return out
        for entry in _listdir(top):
            path = os.path.join(top, entry)
            note = {}
            with contextlib.suppress(OSError, ValueError):
                fd = os.open(os.path.join(path, "INCOMPLETE.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with open(fd, encoding="utf-8") as fh:
                    note = jsonsafe.load(fh, max_bytes=1 << 20)
                note = note if isinstance(note, dict) else {}
            size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)
            out.append({**note, "entry": entry, "path": path, "size_bytes": size})
        return out

    # -- restore view ------------------------------------------------------------------------
    @contextlib.contextmanager
    def restore_view(self, ckpt: Checkpoint) -> Iterator[str]:
        """A private directory of hard links to the checkpoint's images: CRIU writes its
        stats-restore file into the image directory, and the checkpoint must stay untouched."""
        self.ensure()
        view = os.path.join(self.root, ".tmp", f"view.{os.getpid()}.{time.monotonic_ns()}")
        private_dir(view)
        try:
            for rel in sorted(ckpt.manifest.files):
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


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def lock_holders(fd: int) -> list[str]:
    """'pid N (command)' for each process holding a flock on the file behind fd (/proc/locks)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out: list[str] = []
    try:
        with open("/proc/locks", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK" or parts[5] != want:
            continue
        pid = parts[4]
        argv = _cmdline(int(pid)) if pid.isdigit() else []
        words = [os.path.basename(a) if i == 0 else a for i, a in enumerate(argv[:4])]
        cmd = " ".join(w.strip().splitlines()[0] if w.strip() else "''" for w in words)[:60]
        out.append(f"pid {pid} ({cmd})" if cmd else f"pid {pid}")
    return sorted(set(out))


def check_secure(path: str, what: str) -> None:
    """Refuse a checkpoint that another user could have changed: every directory and file must be
    owned by us and not writable by group or others (what commit leaves: 0700/0600)."""
    me = os.geteuid()
    for dirpath, dirnames, filenames in os.walk(path):
        for full in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointInvalid(f"{what}: {full} is a symbolic link (to {_readlink(full)!r}); a checkpoint "
                                        "holds plain files and directories only: it was altered after its commit, "
                                        "refusing to read through it (remove the checkpoint)")
            if st.st_uid != me:
                raise CheckpointInvalid(f"{what}: {full} is owned by uid {st.st_uid}, not {me}; refusing to use a "
                                        f"checkpoint another user could have changed (chown -R {me} it if you trust "
                                        "it)")
            if st.st_mode & 0o022:
                raise CheckpointInvalid(f"{what}: {full} is writable by group or others (mode "
                                        f"{stat.S_IMODE(st.st_mode):o}); refusing to use it (chmod go-w it if you "
                                        "trust its content, then 'migrt inspect --verify')")


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _cmdline(pid: int) -> list[str]:
    import psutil  # not at module level: the store is also used on migrt-runc's paths

    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def _pid_alive(entry: str) -> bool:
    """.tmp entries are named <kind>[.<name>].<pid>.<n>; keep those whose process still runs (a
    process: psutil.pid_exists, unlike /proc/<n>, is not fooled by a thread that now has that id)."""
    import psutil

    parts = entry.split(".")
    return len(parts) >= 3 and parts[-2].isdigit() and psutil.pid_exists(int(parts[-2]))
