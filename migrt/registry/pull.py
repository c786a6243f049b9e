"""`migrt pull` and restore by reference: an image from a registry into the store.

Nothing is trusted before it is checked, and nothing is committed before everything is checked:
the manifest's bytes against the digest asked for (or stated), the config blob against its
descriptor, the layer list against the config's file list (every file covered, in 64 MiB chunks),
every blob's sha256 and size as it streams in. The store's importer then publishes the checkpoint
atomically after comparing what arrived with the manifest, as it does for a migration.

Resuming: blobs land in `<store>/.pulls/<manifest digest>/` (the future checkpoint directory) and
each verified blob is journaled in `<store>/.pulls/<manifest digest>.done`; a pull cut off midway
(network, kill) leaves both, and the next pull of the same image fetches only the rest (journaled
chunks are hashed again from disk, not believed). A blob that fails its digest check is never
journaled; a manifest or config that fails removes the partial directory.

Store names: `--name`, else `oci-<repository's last part>-<first 16 hex of the manifest digest>`:
the same for `migrt pull REF` ahead of time and for a `create` that restores `oci:REF`, so the
create finds the pre-pulled checkpoint. One pull per image and node at a time (a lock); a second
caller waits and then reuses what the first committed. A tag is resolved with the registry each
time (tags move); a reference pinned with `@sha256:` that this node already pulled needs no
registry at all (a restore still works while the registry is down).

A create's pull (`ensure_local`) is the pod's request, not the node operator's: its registry must be
one of the config's `restore_registries` (refused before any connection), the whole pull ends within
`registry_timeout`, and an image that says it was taken in another Kubernetes namespace than the
pod's is refused before any layer is fetched (the caller's `admit`). `migrt pull` may name any
registry; it too ends within a whole deadline (registry/connect.py deadline_for).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from migrt import names
from migrt.config import Config
from migrt.errors import CheckpointInvalid, Conflict, MigrtError, PreconditionFailed
from migrt.pagefill.images import record_beside
from migrt.progress import Progress, null_progress
from migrt.registry import image, transfer
from migrt.registry.client import Client, Deadline
from migrt.registry.connect import client_for, deadline_for
from migrt.registry.fillwork import Workers
from migrt.registry.reference import Reference, parse, registry_allowed
from migrt.store import Store, importer, reserve
from migrt.store.fsutil import fold_chunks

PULLS = ".pulls"
REMOTE_MIN = 256 << 20  # an image of at least this many bytes is fetched by processes (_fetchers)
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)


def default_name(ref: Reference, manifest_digest: str) -> str:
    stem = names.sanitize(ref.repository.rsplit("/", 1)[-1])[:60]
    return names.validate(f"oci-{stem}-{manifest_digest.split(':', 1)[1][:16]}")


Admit = Callable[[str | None], None]


@contextlib.contextmanager
def image_lock(store: Store, manifest_digest: str, deadline: Deadline) -> Iterator[None]:
    """Lock per image and node (concurrent creates restoring one reference pull once); waited for at
    most until the deadline."""
    fd = lock_image(store, manifest_digest, deadline)
    assert isinstance(fd, int)
    try:
        yield
    finally:
        os.close(fd)


def fill_marker(store: Store, manifest_digest: str) -> str:
    """Where a lazy restore's fill says it runs, while it holds the image lock (registry/lazy.py)."""
    return os.path.join(store.root, PULLS, manifest_digest.split(":", 1)[1] + ".lazy.json")


def lock_image(store: Store, manifest_digest: str, deadline: Deadline,
               meanwhile: Callable[[], object] | None = None) -> int | object:
    """The image lock's descriptor, locked (image_lock; a lazy restore hands it to its page filler,
    which holds it until the fill has committed the image: registry/lazy.py). meanwhile(): asked while
    the lock is busy; whatever it returns other than None ends the wait and is returned instead."""
    store.ensure()
    path = os.path.join(store.root, ".locks", f".pull-{manifest_digest.split(':', 1)[1]}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                other = meanwhile() if meanwhile is not None else None
                if other is not None:
                    os.close(fd)
                    return other
                deadline.check(f"waiting for another pull of {manifest_digest} on this node")
                time.sleep(0.1)
    except BaseException:
        os.close(fd)
        raise


def pull(cfg: Config, reference: str, *, name: str | None = None, progress: Progress = null_progress,
         deadline: Deadline | None = None, admit: Admit | None = None) -> dict:
    """Pull an image into the store (or find it already there). Returns a summary with `name`.
    deadline: the end of the whole pull (None: the CLI's default, connect.deadline_for). admit(namespace):
    called before any layer is fetched with the Kubernetes namespace the image's checkpoint was taken
    in (None: none), where the image says so before its layers (a migrt image's config always, a
    CRI-O image's annotation when it has one); it raises to refuse the image."""
    t_start = time.monotonic()
    deadline = deadline or deadline_for(cfg, "migrt pull")
    ref = parse(reference)
    if name:
        names.validate(name)
    store = Store(cfg.store)
    store.ensure()
    if ref.digest:  # pinned: a copy pulled from exactly that manifest needs no registry at all
        have = present_as(store, name or default_name(ref, ref.digest), ref.digest)
        if have:
            return {"name": have, "reference": str(ref), "digest": ref.digest, "already_present": True,
                    "bytes_received": 0, "seconds": round(time.monotonic() - t_start, 3)}
    client = client_for(cfg, ref, deadline=deadline)
    try:
        raw, _ctype, mdigest = client.get_manifest()
        manifest = image.parse(raw, str(ref))
        if image.kind(manifest) == "index":
            raw, mdigest, manifest = from_index(client, manifest, ref)
        name = name or default_name(ref, mdigest)
        deadline.allow(layer_bytes(manifest))  # a wait for another pull of it moves as much (Deadline)
        with image_lock(store, mdigest, deadline):
            with contextlib.suppress(FileNotFoundError):  # a lazy fill that failed said it runs: not any more
                os.unlink(fill_marker(store, mdigest))
            if store.exists(name):
                if present_as(store, name, mdigest):
                    return {"name": name, "reference": str(ref), "digest": mdigest, "already_present": True,
                            "bytes_received": 0, "seconds": round(time.monotonic() - t_start, 3)}
                raise Conflict(f"checkpoint {name} already exists in {store.root} and was not pulled from {mdigest}; "
                               f"choose another --name or 'migrt rm {name}'")
            pulled = {"reference": str(ref), "registry": ref.registry, "repository": ref.repository,
                      "manifest_digest": mdigest, "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            if image.kind(manifest) == "migrt":
                data = _pull_chunked(cfg, client, store, manifest, mdigest, name, pulled, progress, admit)
            else:
                if admit and image.namespace(manifest) is not None:  # (unannotated: the archive may say)
                    admit(image.namespace(manifest))
                data = _pull_archive(cfg, client, store, manifest, name, pulled, progress)
    finally:
        client.close()
    return {"name": name, "reference": str(ref), "digest": mdigest, "already_present": False,
            "size_bytes": data.get("size_bytes"), "bytes_received": client.stats.received,
            "retries": client.stats.retries, "seconds": round(time.monotonic() - t_start, 3)}


def layer_bytes(manifest: dict) -> int:
    """What the image's layers say they weigh (descriptors that do not check out count nothing: the
    pull refuses them later)."""
    layers = manifest.get("layers")
    sizes = (d.get("size") for d in layers if isinstance(d, dict)) if isinstance(layers, list) else ()
    return sum(s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0)


def present_as(store: Store, name: str, manifest_digest: str) -> str | None:
    """name, if the store holds it as pulled from that manifest digest."""
    try:
        pulled = store.get(name).manifest.pulled or {}
    except MigrtError:
        return None
    return name if pulled.get("manifest_digest") == manifest_digest else None


def from_index(client: Client, index: dict, ref: Reference) -> tuple[bytes, str, dict]:
    listed = index.get("manifests")
    entries = [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
    mine = [m for m in entries if isinstance(m.get("platform") or {}, dict)
            and (m.get("platform") or {}).get("architecture") in (ARCH, None)]
    chosen = mine[0] if len(mine) >= 1 else (entries[0] if len(entries) == 1 else None)
    if not chosen:
        raise CheckpointInvalid(f"{ref}: an image index without a manifest for linux/{ARCH}")
    image.check_descriptor(chosen, str(ref))
    raw, _ctype, digest = client.get_manifest(chosen["digest"])
    manifest = image.parse(raw, str(ref))
    if image.kind(manifest) == "index":
        raise CheckpointInvalid(f"{ref}: nested image indexes are not supported")
    return raw, digest, manifest


def fetch_config(client: Client, manifest: dict, where: str) -> dict:
    desc = image.check_descriptor(manifest.get("config"), where)
    if desc["size"] > 16 << 20:
        raise CheckpointInvalid(f"{where}: the image config is {desc['size']} bytes; at most 16 MiB accepted")
    buf = bytearray()
    client.fetch_blob(desc["digest"], desc["size"], lambda v: buf.extend(v) if len(v) else buf.clear())
    data = image.load_json(bytes(buf), where, "the checkpoint manifest in the image config")
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise CheckpointInvalid(f"{where}: the image config holds no checkpoint manifest with a file list")
    schema = data.get("schema")
    from migrt.store import manifest as mf
    if not isinstance(schema, int) or isinstance(schema, bool) or not 1 <= schema <= mf.SCHEMA:
        raise CheckpointInvalid(f"{where}: checkpoint manifest schema {schema!r} is not one this migrt understands "
                                f"(1..{mf.SCHEMA}); upgrade migrt")
    return data


class Journal:
    """Verified blobs of a partial pull: lines `<digest> <offset> <path>`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.done: set[tuple[str, int, str]] = set()
        try:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), encoding="utf-8") as fh:
                for line in fh:
                    parts = line.rstrip("\n").split(" ", 2)
                    if len(parts) == 3 and parts[1].isdigit():
                        self.done.add((parts[0], int(parts[1]), parts[2]))
        except FileNotFoundError:
            pass

    def add(self, digest: str, off: int, rel: str) -> None:
        with self.lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with open(fd, "a", encoding="utf-8") as fh:
                fh.write(f"{digest} {off} {rel}\n")
        self.done.add((digest, off, rel))


@contextlib.contextmanager
def _fetchers(cfg: Config, client: Client, mdigest: str, jobs: list) -> Iterator[Workers | None]:
    """The pull's fetching processes (registry/fillwork.py), one connection each, for an image of at
    least REMOTE_MIN bytes in several blobs: receiving TLS and hashing in one interpreter capped a pull
    at about half a 16-core host's raw GET pump. None (threads here) for a small one."""
    if len(jobs) < 2 or sum(j.size for j in jobs) < REMOTE_MIN or cfg.registry_parallel < 2:
        yield None
        return
    spec = {"registry": client.ref.registry, "repository": client.ref.repository, "digest": mdigest,
            "auth_file": cfg.registry_auth_file, "ca_file": cfg.registry_ca_file}
    workers = Workers(spec, client.deadline, cfg.registry_parallel)
    try:
        yield workers
    finally:
        workers.close()


def _pull_chunked(cfg: Config, client: Client, store: Store, manifest: dict, mdigest: str, name: str,
                  pulled: dict, progress: Progress, admit: Admit | None = None) -> dict:
    where = f"{client.ref}"
    config = fetch_config(client, manifest, where)
    if admit:  # before the partial directory and any layer
        admit(image.namespace(manifest, config))
    files = config["files"]
    plan = image.plan_files(manifest, files, where)
    hexd = mdigest.split(":", 1)[1]
    # it becomes the checkpoint's directory: private like every other, no link followed on the way
    partial = os.path.dirname(store.private_dir(f"{PULLS}/{hexd}/images"))
    journal = Journal(os.path.join(store.root, PULLS, hexd + ".done"))
    try:
        with importer.importing(store, name, adopt=partial) as imp:
            total = sum(f.get("size", 0) for f in files.values())
            have = resume_from(partial, plan, journal)
            # what the files take on this store (whole 2 MiB pages each on a huge=always tmpfs)
            imp.ensure_space(imp.space.alloc.files(f.get("size", 0) for f in files.values()) - sum(have.values()))
            client.deadline.allow(total - sum(have.values()))  # (checked against free space first)
            allocate_files(partial, plan)
            imp.space.settle()  # the blocks are allocated: the free space shows them (or, without
            # fallocate, the reservation's margin covers what is left; ENOSPC then refuses, unretried)
            jobs = [transfer.Blob(digest, size, os.path.join(partial, rel), off) for rel, chunks in plan.items()
                    for off, size, digest in chunks if (digest, off, rel) not in have]
            progress("phase", name="download", total_bytes=sum(j.size for j in jobs))
            t0 = time.monotonic()
            # what arrived and verified is journaled at once: the first failure stops the pull, and
            # the next pull resumes from the journal
            with _fetchers(cfg, client, mdigest, jobs) as remote:
                transfer.fetch(client, jobs, cfg.registry_parallel,
                               on_blob=lambda b: journal.add(b.digest, b.offset, os.path.relpath(b.path, partial)),
                               write_error=lambda exc: reserve.enospc(exc, f"pulling {client.ref}", store.root),
                               on_bytes=lambda n: progress("bytes", name="download", bytes=n), write_behind=True,
                               remote=remote)
            progress("done", name="download", seconds=round(time.monotonic() - t0, 3))
            progress("phase", name="commit")
            t0 = time.monotonic()
            data = commit_files(imp, plan, config, pulled)
            progress("done", name="commit", seconds=round(time.monotonic() - t0, 3))
    except CheckpointInvalid:
        _forget(partial, journal.path)
        raise
    except BaseException:
        if not journal.done:  # nothing verified arrived (e.g. refused for space): nothing to resume
            _forget(partial, journal.path)
        raise
    _forget(partial, journal.path)  # committed: the directory was renamed away; the journal goes
    return data


def commit_files(imp: importer.Import, plan: dict, config: dict, pulled: dict) -> dict:
    """Every file of the plan, its digest folded from its verified chunks', committed by the importer
    with the image's checkpoint manifest (`config`) and where it was pulled from; the manifest."""
    for rel, chunks in plan.items():
        digest = fold_chunks([bytes.fromhex(d.split(":", 1)[1]) for _o, _s, d in chunks])
        imp.record(rel, sum(c[1] for c in chunks), digest)
    fields = {k: v for k, v in config.items() if k not in importer.OWN_FIELDS}
    fields["pulled"] = pulled
    record_beside(imp)  # our own survey of the images for the restore's choice (not the pusher's)
    return imp.commit(fields, config["files"])


def allocate_files(partial: str, plan: dict, sparse: frozenset[str] = frozenset()) -> None:
    """Every file of the plan at its final size in the partial directory, before the chunks land
    (those named in `sparse` without their blocks reserved)."""
    for rel, chunks in plan.items():
        full = os.path.join(partial, rel)
        os.makedirs(os.path.dirname(full), mode=0o700, exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if rel in sparse:
                os.ftruncate(fd, sum(c[1] for c in chunks))
            else:
                _allocate(fd, sum(c[1] for c in chunks))
        finally:
            os.close(fd)


def _allocate(fd: int, size: int) -> None:
    """The file at its final size, blocks reserved (a full disk fails here, not midway); data kept."""
    os.ftruncate(fd, size)
    if size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise PreconditionFailed(f"the store has no room for {size >> 20} MiB more; free some space") from exc
            # file systems without fallocate: a sparse file is fine


def resume_from(partial: str, plan: dict, journal: Journal) -> dict[tuple[str, int, str], int]:
    """Journaled chunks whose bytes on disk still hash to their digest (hashed again, not believed)."""
    from migrt.store.fsutil import hash_range

    have: dict[tuple[str, int, str], int] = {}
    for rel, chunks in plan.items():
        for off, size, digest in chunks:
            if (digest, off, rel) not in journal.done:
                continue
            full = os.path.join(partial, rel)
            try:
                if os.path.getsize(full) >= off + size and \
                        "sha256:" + hash_range(full, off, size).hex() == digest:
                    have[(digest, off, rel)] = size
            except OSError:
                continue
    return have


def _forget(partial: str, journal: str) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal)


def _pull_archive(cfg: Config, client: Client, store: Store, manifest: dict, name: str, pulled: dict,
                  progress: Progress) -> dict:
    """A CRI-O/Podman checkpoint image (or `push --format cri`): the one layer is a checkpoint
    archive; downloaded (digest-checked) into the store's .tmp, then imported as `migrt import` does."""
    from migrt.pods import import_cri
    from migrt.store import manifest as mf

    layer = image.check_descriptor(manifest["layers"][0], str(client.ref))
    what = f"pulling {client.ref}"
    store.ensure()
    tmpdir = tempfile.mkdtemp(dir=os.path.join(store.root, ".tmp"), prefix=f"pull.{os.getpid()}.")
    try:
        path = os.path.join(tmpdir, "checkpoint.tar")
        # the layer as it arrives (its size is checked by the client), then the import reserves what
        # the extraction writes: member by member, decompressed (pods/import_cri.py)
        with reserve.reserving(store.root, what, import_cri.SPACE_MARGIN) as res:
            res.reserve_files([layer["size"]])
            client.deadline.allow(layer["size"])
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, layer["size"])  # (sparse: ranges land anywhere; a full store fails a write)
            finally:
                os.close(fd)
            progress("phase", name="download", total_bytes=layer["size"])
            t0 = time.monotonic()
            transfer.fetch(client, [transfer.Blob(layer["digest"], layer["size"], path)], cfg.registry_parallel,
                           on_blob=lambda b: None, write_error=lambda exc: reserve.enospc(exc, what, store.root),
                           on_bytes=lambda n: progress("bytes", name="download", bytes=n))
            progress("done", name="download", seconds=round(time.monotonic() - t0, 3))
        data = import_cri.import_archive(cfg, path, name=name, progress=progress)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    with store.lock(name):
        data["pulled"] = pulled
        data.setdefault("imported", {})["archive"] = pulled["reference"]
        mf.write(store.get(name).path, data)
    return data


def check_allowed(cfg: Config, reference: str) -> Reference:
    """The parsed reference of a create's request, if its registry is one of restore_registries
    (PreconditionFailed before any connection otherwise)."""
    ref = parse(reference)
    if not registry_allowed(ref, cfg.restore_registries):
        raise PreconditionFailed(
            f"registry {ref.registry} is not one this node restores from: a restore by reference may only name "
            f"a registry listed in restore_registries in the node's migrt config ({cfg.path}); ask the cluster's "
            "administrators, or restore a checkpoint already in the node's store by its name")
    return ref


def create_deadline(cfg: Config) -> Deadline:
    """The whole deadline of a create's pull."""
    return Deadline.after(cfg.registry_timeout, "registry_timeout in the migrt config")


def ensure_local(cfg: Config, reference: str, progress: Progress = null_progress, *,
                 admit: Admit | None = None, deadline: Deadline | None = None,
                 any_registry: bool = False) -> tuple[str, bool]:
    """(store name, pulled now) of an image reference, pulled first if this node does not have it
    (the `create` path of `oci:` restore requests: a pod's request). Its registry must be in the
    config's restore_registries (PreconditionFailed before any connection otherwise) unless
    `any_registry` (the operator's `migrt restore oci:REF`, as `migrt pull`); the whole pull ends
    within registry_timeout (or the caller's deadline). Errors are MigrtErrors."""
    if not any_registry:
        check_allowed(cfg, reference)
    deadline = deadline or create_deadline(cfg)  # (a create that tried a lazy restore first: the same one)
    try:
        out = pull(cfg, reference, progress=progress, deadline=deadline, admit=admit)
        return out["name"], not out["already_present"]
    except MigrtError:
        raise
    except Exception as exc:
        raise MigrtError(f"pulling {reference}: internal error: {exc!r}") from exc
