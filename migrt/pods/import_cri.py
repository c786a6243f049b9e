"""Import a Kubernetes checkpoint archive into the store, so that MIGRT_RESTORE can restore it.

kubelet's checkpoint API (CRI CheckpointContainer, served by containerd 2.1+; CRI-O and Podman write
the same layout) leaves a tar at the requested location:

  checkpoint/        CRIU images + descriptors.json (runc's --image-path)
  config.dump        container metadata: id, name, image, checkpointedTime
  spec.dump          the container's OCI config.json: annotations (pod namespace/name, container
                     name), mounts, process
  status             the runtime's status (pid, ...); status.dump: the CRI ContainerStatus
  rootfs-diff.tar    the writable layer; deletions as OCI whiteouts (`.wh.NAME`, `.wh..wh..opq`,
                     containerd) or listed in `deleted.files` (a JSON list of paths; CRI-O, Podman)
  dump.log, stats-dump   CRIU's log and statistics
  container.log      the container's log up to the checkpoint (not imported)

Podman's archives add devshm-checkpoint.tar, network.status, ctr.log and artifacts/ and are zstd by
default; what differs between the engines is in migrt.pods.engines.

The archive is read in one pass (plain, gzip, bzip2, xz or zstd; the data of a plain tar is copied by
the kernel, sendfile) and nothing in it is trusted:
every member name must be a relative path without '..'; links, devices and fifos are refused (a
checkpoint archive holds plain files and directories); metadata files are size-capped before they
are parsed; the member count is capped; written bytes are checked against the store's free space as
they arrive. Files land in a store staging directory (Store.writer) and are published by
Staging.commit (hashed, fsynced, renamed into place), so an import is all or nothing.

The store checkpoint gets: images/ (from checkpoint/, plus stats-dump), migrt's own writable-layer
format (rootfs-diff.tar + rootfs-diff.json with deleted/opaque lists, see migrt.pods.rootfs)
converted from the archive's, logs/dump.log, cri/ (config.dump, spec.dump, status, status.dump as
they were) and a manifest whose source section comes from spec.dump/config.dump. The CRIU options
are not written in the archive; the ones a restore needs are read from the images: established
TCP connections (tcp_established), external unix sockets (ext_unix_sk), file locks (file_locks),
and a terminal in spec.dump (shell_job). Versions that the archive does not record are null. A GPU
container's archive carries migrt's GPU record (checkpoint/migrt-gpu.json, written by migrt-runc's
checkpoint): it becomes the manifest's gpu section, so the restore runs the GPU steps.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import stat
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO

from migrt import jsonsafe, names
from migrt.config import Config
from migrt.errors import CheckpointInvalid, NotFound, PreconditionFailed
from migrt.gpu import records
from migrt.oci.bundle import Bundle
from migrt.pagefill.images import record_beside
from migrt.pods import engines, rootfs
from migrt.progress import Progress, null_progress
from migrt.store import Store, hugetmpfs, reserve
from migrt.store import manifest as mf
from migrt.text import printable

FORMAT = "kubernetes-checkpoint-archive"
CHECKPOINT_DIR = "checkpoint"
# Top-level metadata files: read into memory (size-capped), parsed, kept as they were under cri/.
META = ("config.dump", "spec.dump", "status", "status.dump", "deleted.files")
DIFF = "rootfs-diff.tar"
DUMP_LOG = "dump.log"
STATS = "stats-dump"
REQUIRED_META = ("config.dump", "spec.dump")

MAX_MEMBERS = 100_000          # members of the archive
MAX_DIFF_MEMBERS = 1_000_000   # entries of rootfs-diff.tar
MAX_DEPTH = 16                 # path components of a member
MAX_META_BYTES = 16 << 20      # a metadata file parsed as JSON
MAX_LOG_BYTES = 64 << 20       # dump.log / stats-dump
SPACE_MARGIN = 64 << 20        # left free in the store
CHUNK = 4 << 20
_COMPONENT = re.compile(r"[^\x00-\x1f/]{1,255}")
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"

# CRI-O writes the Kubernetes labels as annotations (containerd: io.kubernetes.cri.*)
_CRIO_ANNOTATIONS = {
    "pod_namespace": "io.kubernetes.pod.namespace",
    "pod_name": "io.kubernetes.pod.name",
    "pod_uid": "io.kubernetes.pod.uid",
    "container_name": "io.kubernetes.container.name",
}


@dataclass
class Extracted:
    """What the pass over the archive found."""
    images: int = 0
    image_bytes: int = 0
    meta: dict[str, bytes] = field(default_factory=dict)
    diff: str | None = None          # rootfs-diff.tar as extracted (in the staging work dir)
    devshm: str | None = None        # podman's devshm-checkpoint.tar as extracted (work dir)
    dump_log: str | None = None
    ignored: list[str] = field(default_factory=list)
    written: int = 0


def member_parts(name: str) -> tuple[str, ...]:
    """The components of an archive member's name; CheckpointInvalid for anything that could land
    outside the directory it is extracted into."""
    if not isinstance(name, str) or "\x00" in name:
        raise CheckpointInvalid(f"archive member {name!r}: invalid name")
    if name.startswith("/"):
        raise CheckpointInvalid(f"archive member {name!r}: absolute paths are refused")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise CheckpointInvalid(f"archive member {name!r}: '..' (path traversal) is refused")
    if len(parts) > MAX_DEPTH or not all(_COMPONENT.fullmatch(p) for p in parts):
        raise CheckpointInvalid(f"archive member {name!r}: a relative path of at most {MAX_DEPTH} plain names "
                                "is expected")
    return parts


BLOCK = 4096


def on_disk(nbytes: int, new_dirs: int = 0, alloc: hugetmpfs.Alloc | None = None) -> int:
    """What a file of nbytes takes once written in the store (alloc: whole blocks, or whole 2 MiB pages
    on a tmpfs with huge=always; one block at least), with the directories its path may create: a
    compressed archive of many tiny, deeply nested members must not pass as ~0 bytes."""
    return max(BLOCK, (alloc or hugetmpfs.Alloc(BLOCK)).file(nbytes)) + new_dirs * BLOCK


class _Space:
    """What the import writes into the store, reserved (store/reserve.py) before each write at the
    size it takes once written: a compressed archive's members decompressed, the members of a
    compressed inner tar too, a sparse member whole (the conversion writes it out in full). The first
    write that does not fit refuses the import before it is made; the caller discards what was written."""

    def __init__(self, res: reserve.Reservation) -> None:
        self.res = res
        self.used = 0
        self._pending = 0

    def take(self, nbytes: int, what: str) -> None:
        """`nbytes` are about to be written (for `what`); all that earlier takes covered is written."""
        self.res.wrote(self._pending)
        self._pending = 0
        try:
            self.res.reserve(nbytes)
        except PreconditionFailed as exc:
            raise PreconditionFailed(f"{exc} (refused at {what}: {reserve.human(nbytes)} once written, after "
                                     f"{reserve.human(self.used)})") from None
        self._pending = nbytes
        self.used += nbytes

    def take_file(self, size: int, what: str, new_dirs: int = 0) -> None:
        """A file of `size` bytes is about to be written: what it takes in this store (on_disk)."""
        self.take(on_disk(size, new_dirs, self.res.alloc), what)


_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")  # gzip, bzip2, xz: tarfile reads them
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # podman's default (`podman container checkpoint --export`)


def _open_tar(raw) -> tuple[tarfile.TarFile, int | None]:
    """The archive as a tar file, and the fd to sendfile members from (None when compressed).
    zstd is read as a stream (python-zstandard; tarfile of Python < 3.14 does not know zstd)."""
    head = raw.read(6)
    raw.seek(0)
    if head.startswith(ZSTD_MAGIC):
        import zstandard

        return tarfile.open(fileobj=zstandard.ZstdDecompressor().stream_reader(raw), mode="r|"), None
    return tarfile.open(fileobj=raw, mode="r:*"), None if head.startswith(_MAGIC) else raw.fileno()


def _stream_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean a corrupted or truncated compressed stream."""
    errors: tuple[type[BaseException], ...] = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def _copy_data(tar: tarfile.TarFile, member: tarfile.TarInfo, raw_fd: int | None, out_fd: int) -> int:
    """A member's data into out_fd. An uncompressed archive is copied in the kernel (sendfile from
    the member's offset: no Python copy, ~10x faster than tarfile's reader for GB of pages)."""
    n = 0
    if raw_fd is not None:
        while n < member.size:
            sent = os.sendfile(out_fd, raw_fd, member.offset_data + n, min(member.size - n, 1 << 30))
            if sent == 0:
                break  # end of the archive: truncated
            n += sent
        return n
    src = _member_data(tar, member)
    with os.fdopen(out_fd, "wb", closefd=False) as out:
        while buf := src.read(CHUNK):
            out.write(buf)
            n += len(buf)
    return n


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: str, raw_fd: int | None) -> int:
    """Copy a regular member's data into a new file (exclusive create, never through a link)."""
    try:
        os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
        raise CheckpointInvalid(f"archive member {member.name!r} appears twice (or as a file and a directory)") from exc
    try:
        n = _copy_data(tar, member, raw_fd, fd)
    finally:
        os.close(fd)
    if n != member.size:
        raise CheckpointInvalid(f"archive member {member.name!r}: {n} bytes read, {member.size} announced "
                                "(truncated archive)")
    return n


def _member_data(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    src = tar.extractfile(member)
    if src is None:  # a link or a device: no data to read
        raise CheckpointInvalid(f"archive member {member.name!r} is not a regular file")
    return src


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    if member.size > limit:
        raise CheckpointInvalid(f"archive member {member.name!r} is {member.size} bytes; at most {limit} are accepted")
    data = _member_data(tar, member).read()
    if len(data) != member.size:
        raise CheckpointInvalid(f"archive member {member.name!r}: truncated archive")
    return data


def read_archive(archive: str, images_dir: str, work_dir: str, space: _Space,
                 progress: Progress = null_progress) -> Extracted:
    """One pass over the archive: CRIU images into images_dir, rootfs-diff.tar and dump.log
    into work_dir, metadata files into memory. Refuses what is unsafe (see the module docstring)."""
    out = Extracted()
    try:
        raw = open(archive, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError as exc:
        raise NotFound(f"{archive}: no such file") from exc
    except IsADirectoryError as exc:
        raise CheckpointInvalid(f"{archive}: is a directory; give the checkpoint archive (a .tar file)") from exc
    count = 0
    try:
        with raw:
            try:
                tar, raw_fd = _open_tar(raw)
            except tarfile.TarError as exc:
                # tarfile's own text lists every method it tried, one per line: one line is enough here
                raise CheckpointInvalid(f"{archive}: not a tar archive (plain, gzip, zstd, bzip2 or xz) or an empty "
                                        "file") from exc
            done = 0

            def advance(pos: int) -> None:
                """Progress in archive bytes (compressed ones for a compressed archive), the unit of the
                phase's total (the archive's size): member sizes would pass 100% on a compressed archive."""
                nonlocal done
                if pos > done:
                    progress("bytes", name="extract", bytes=pos - done)
                    done = pos

            with tar:
                for member in tar:
                    advance(member.offset if raw_fd is not None else raw.tell())
                    count += 1
                    if count > MAX_MEMBERS:
                        raise CheckpointInvalid(f"{archive}: more than {MAX_MEMBERS} members; not a checkpoint archive")
                    parts = _plain_file(member)
                    if parts:
                        _extract_member(tar, member, parts, raw_fd, out, images_dir, work_dir, space)
            advance(os.fstat(raw.fileno()).st_size)
    except _stream_errors() as exc:
        raise CheckpointInvalid(f"{archive}: unreadable, truncated or corrupted tar archive ({exc})") from exc
    _check_extracted(archive, images_dir, out)
    return out


def _plain_file(member: tarfile.TarInfo) -> tuple[str, ...]:
    """The path parts of a regular file of the archive; () for a directory (skipped); CheckpointInvalid
    for a link, a special or sparse file, or a file without a name."""
    parts = member_parts(member.name)
    if member.issym() or member.islnk():
        raise CheckpointInvalid(f"archive member {member.name!r}: links are refused (a checkpoint "
                                f"archive holds plain files and directories; it points at "
                                f"{member.linkname!r})")
    if member.isdir():
        return ()
    if not member.isreg():
        raise CheckpointInvalid(f"archive member {member.name!r}: devices, fifos and other special "
                                "files are refused")
    if member.issparse():
        raise CheckpointInvalid(f"archive member {member.name!r}: sparse members are not supported")
    if not parts:
        raise CheckpointInvalid(f"archive member {member.name!r}: a file without a name")
    return parts


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, parts: tuple[str, ...], raw_fd: int | None,
                    out: Extracted, images_dir: str, work_dir: str, space: _Space) -> None:
    """One file where it belongs: a CRIU image, the writable layer or /dev/shm (to convert), the dump's
    log or stats, a metadata file into memory; anything else is noted as ignored."""
    top = parts[0]
    if top == CHECKPOINT_DIR and len(parts) > 1:
        space.take_file(member.size, f"member {member.name!r}", len(parts) - 2)
        n = _write_member(tar, member, os.path.join(images_dir, *parts[1:]), raw_fd)
        out.images += 1
        out.image_bytes += n
        out.written += n
    elif len(parts) != 1:
        out.ignored.append("/".join(parts))
    elif top in META:
        if top in out.meta:
            raise CheckpointInvalid(f"archive member {member.name!r} appears twice")
        out.meta[top] = _read_small(tar, member, MAX_META_BYTES)
    elif top in (DIFF, engines.DEVSHM_SRC):
        space.take_file(member.size, f"member {member.name!r}")  # the conversion takes its own
        dest = os.path.join(work_dir, "src-" + top)
        if top == DIFF:
            out.diff = dest
        else:
            out.devshm = dest
        out.written += _write_member(tar, member, dest, raw_fd)
    elif top in (DUMP_LOG, STATS) and member.size <= MAX_LOG_BYTES:
        space.take_file(member.size, f"member {member.name!r}")
        dest = os.path.join(work_dir, DUMP_LOG) if top == DUMP_LOG else os.path.join(images_dir, STATS)
        out.written += _write_member(tar, member, dest, raw_fd)
        if top == DUMP_LOG:
            out.dump_log = dest
    else:
        out.ignored.append(top)


def _check_extracted(archive: str, images_dir: str, out: Extracted) -> None:
    """A checkpoint archive after all: CRIU images with their inventory, and the metadata kubelet writes."""
    if out.images == 0:
        raise CheckpointInvalid(f"{archive} has no {CHECKPOINT_DIR}/ directory with CRIU images: not a checkpoint "
                                "archive (kubelet checkpoint API / CRI CheckpointContainer, "
                                "podman checkpoint --export)")
    if not os.path.isfile(os.path.join(images_dir, "inventory.img")):
        raise CheckpointInvalid(f"{archive}: {CHECKPOINT_DIR}/inventory.img is missing (incomplete CRIU images)")
    missing = [m for m in REQUIRED_META if m not in out.meta]
    if missing:
        raise CheckpointInvalid(f"{archive} lacks {', '.join(missing)}: not a Kubernetes checkpoint archive "
                                "(kubelet checkpoint API / CRI CheckpointContainer)")


def _json(out: Extracted, key: str, kind: type, archive: str, *, strict: bool = True):
    """A metadata file parsed; strict: CheckpointInvalid when malformed, else None (informational files)."""
    raw = out.meta.get(key)
    if raw is None:
        return None
    try:
        value = jsonsafe.loads(raw)  # bounded: an archive's metadata is anyone's
    except ValueError as exc:
        if not strict:
            return None
        why = "nested too deeply" if isinstance(exc, jsonsafe.JSONRejected) else printable(exc, 200)
        raise CheckpointInvalid(f"{archive}: {key} is not valid JSON ({why})") from None
    if not isinstance(value, kind):
        if not strict:
            return None
        raise CheckpointInvalid(f"{archive}: {key} is not a JSON {kind.__name__}")
    return value


def check_mounts(spec: dict, archive: str) -> None:
    """spec.dump's mounts as the OCI spec has them: a list of objects whose destination is an absolute
    path and whose type, source and options are strings (a list of them); the manifest, the rootfs
    conversion and the restore's checks read them."""
    mounts = spec.get("mounts")
    if mounts is None:
        return
    if not isinstance(mounts, list):
        raise CheckpointInvalid(f"{archive}: spec.dump 'mounts' is not a list")
    for i, m in enumerate(mounts):
        where = f"{archive}: spec.dump mount {i}"
        if not isinstance(m, dict):
            raise CheckpointInvalid(f"{where} is not an object")
        dest = m.get("destination")
        if not isinstance(dest, str) or not dest.startswith("/") or "\x00" in dest:
            raise CheckpointInvalid(f"{where}: destination {dest!r} is not an absolute path")
        for key in ("type", "source"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise CheckpointInvalid(f"{where} ({dest}): {key} {m[key]!r} is not a string")
        opts = m.get("options")
        if opts is not None and not (isinstance(opts, list) and all(isinstance(o, str) for o in opts)):
            raise CheckpointInvalid(f"{where} ({dest}): options must be a list of strings")


# -- the writable layer -----------------------------------------------------------------------------

def _excluded(rel: str, exclude: set[str]) -> bool:
    if rel.split("/", 1)[0] in rootfs.SKIP_TOP:
        return True
    return any(rel == e or rel.startswith(e + "/") for e in exclude)


def _rel(name: str, what: str) -> str:
    try:
        return "/".join(member_parts(name))
    except CheckpointInvalid as exc:
        raise CheckpointInvalid(f"{what}: {exc}") from exc


def convert_rootfs_diff(src: str | None, deleted_files: list | None, dest_dir: str, exclude: list[str],
                       take=None) -> dict:
    """The archive's writable layer (rootfs-diff.tar with OCI whiteouts, and/or a deleted.files list)
    -> migrt's rootfs-diff.tar + rootfs-diff.json in dest_dir. Mount destinations and /proc, /sys,
    /dev are left out, as `rootfs.capture` does. Returns the manifest's rootfs summary.
    take(nbytes, what) is called before each entry is written with what it will write (_Space.take):
    the inner tar may be compressed, or hold sparse members, that are written out whole."""
    take = take or (lambda _n, _w: None)
    if src is None and not deleted_files:
        return {"captured": False, "reason": f"the archive has no {DIFF}"}
    excl = {e.strip("/") for e in exclude if e.strip("/")}
    deleted: list[str] = []
    opaque: list[str] = []
    listed = [0]  # bytes of the deleted and opaque paths (a compressed inner tar can hold a million)

    def removal(paths: list[str], rel: str) -> None:
        listed[0] += len(rel) + 4
        if listed[0] > MAX_META_BYTES:
            raise CheckpointInvalid(f"{DIFF}: its deletions and opaque directories list more than {MAX_META_BYTES} "
                                    "bytes of paths; not a container's writable layer")
        paths.append(rel)

    count = size = skipped = 0
    for path in deleted_files or []:
        if not isinstance(path, str):
            raise CheckpointInvalid("deleted.files: a list of paths is expected")
        rel = _rel(path.lstrip("/"), "deleted.files")
        if rel and not _excluded(rel, excl):
            removal(deleted, rel)
    with tarfile.open(os.path.join(dest_dir, rootfs.DIFF_TAR), "w", format=tarfile.PAX_FORMAT) as out:
        if src is not None:
            try:
                with tarfile.open(src, "r:*") as tar:
                    n = 0
                    for member in tar:
                        n += 1
                        if n > MAX_DIFF_MEMBERS:
                            raise CheckpointInvalid(f"{DIFF}: more than {MAX_DIFF_MEMBERS} entries")
                        rel = _rel(member.name, DIFF)
                        if not rel:
                            continue  # the root directory itself
                        base, parent = os.path.basename(rel), os.path.dirname(rel)
                        if base.startswith(WHITEOUT):
                            if base == OPAQUE:
                                if parent and not _excluded(parent, excl):
                                    removal(opaque, parent)
                            elif not base.startswith(WHITEOUT + WHITEOUT):  # .wh..wh.*: aufs metadata
                                target = os.path.join(parent, base[len(WHITEOUT):])
                                if not _excluded(target, excl):
                                    removal(deleted, target)
                            continue
                        if _excluded(rel, excl):
                            skipped += 1
                            continue
                        if not rootfs.layer_member(member):
                            skipped += 1  # devices, fifos: never in a layer (rootfs.layer_member)
                            continue
                        member.name = rel
                        if member.islnk():
                            member.linkname = _rel(member.linkname, f"{DIFF} hard link {rel}")
                        sparse = " (sparse)" if member.issparse() else ""
                        take(rootfs.written_size(member), f"{DIFF} entry {rel!r}{sparse}")
                        if member.isreg():
                            data = tar.extractfile(member)  # reads a sparse member's holes as zeros
                            rootfs.dense(member)
                            out.addfile(member, data)
                            size += member.size
                        else:
                            out.addfile(member)
                        count += 1
            except _stream_errors() as exc:
                raise CheckpointInvalid(f"{DIFF} in the archive is unreadable ({exc})") from exc
    text = json.dumps({"deleted": deleted, "opaque": opaque})
    take(on_disk(len(text)), rootfs.DIFF_META)
    with open(os.path.join(dest_dir, rootfs.DIFF_META), "w") as fh:
        fh.write(text)
    return {"captured": True, "entries": count, "bytes": size, "deleted": len(deleted), "opaque": len(opaque),
            "skipped": skipped, "converted_from": "whiteouts" if not deleted_files else "deleted.files"}


# -- what the images and the log say ----------------------------------------------------------------

def _load_entries(images: str, name: str) -> list:
    import pycriu

    path = os.path.join(images, name)
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as fh:
        return pycriu.images.load(fh)["entries"]


def _num(value) -> int | str:
    if isinstance(value, str):
        try:
            return int(value, 0)
        except ValueError:
            return value
    return value


def criu_options(images: str, terminal: bool) -> tuple[dict, str | None]:
    """The CRIU options a restore of these images needs (the archive does not record the dump's).
    Returns (options, note): note says why something could not be read."""
    opts = {"tcp_established": False, "ext_unix_sk": False, "shell_job": bool(terminal), "file_locks": False}
    try:
        import pycriu  # noqa: F401
    except ImportError as exc:
        return opts, (f"pycriu is not importable ({exc}): tcp_established/ext_unix_sk/file_locks not read "
                      "from the images")
    try:
        files = _load_entries(images, "files.img")
        inet = [f.get("isk") or {} for f in files if f.get("type") == "INETSK"]
        inet += _load_entries(images, "inetsk.img")
        unix = [f.get("usk") or {} for f in files if f.get("type") == "UNIXSK"]
        unix += _load_entries(images, "unixsk.img")
        locks = _load_entries(images, "filelocks.img")
    except Exception as exc:  # pycriu raises plain Exceptions on bad images
        raise CheckpointInvalid(f"the CRIU images cannot be read: {exc}") from exc
    opts["tcp_established"] = any(_num(s.get("proto")) in (6, "TCP") and _num(s.get("state")) in (1, "ESTABLISHED")
                                  for s in inet)
    opts["ext_unix_sk"] = any(isinstance(u := _num(s.get("uflags")), int) and u & 1 for s in unix)
    opts["file_locks"] = bool(locks)
    return opts, None


def recorded_root_mode(images: str) -> int | None:
    """The mode of the container's root directory as CRIU recorded it (files.img, the "/" entry):
    the manifest's root_mode, so that a restore into a root of the same mode needs no image rewrite."""
    try:
        files = _load_entries(images, "files.img")
    except Exception:  # noqa: BLE001 - pycriu missing or the image unreadable: the restore reads files.img itself
        return None
    modes = {(f.get("reg") or {}).get("mode") for f in files
             if f.get("type") == "REG" and (f.get("reg") or {}).get("name") == "/"}
    modes.discard(None)
    return modes.pop() if len(modes) == 1 else None


def log_versions(dump_log: str | None) -> dict:
    """CRIU's version and the kernel, as the dump's log records them (null when it does not)."""
    out: dict = {"migrt": None, "runtime": None, "runtime_path": None, "criu": None, "kernel": None}
    if not dump_log:
        return out
    with open(dump_log, errors="replace") as fh:
        head = fh.read(64 << 10)
    m = re.search(r"\) Version:\s*([0-9][0-9.]*)", head)
    out["criu"] = m.group(1) if m else None
    m = re.search(r"\) Running on \S+ Linux (\S+)", head)
    out["kernel"] = m.group(1) if m else None
    return out


def _iso(text: object) -> str | None:
    """containerd's RFC 3339 time (nanoseconds, any offset) -> the manifest's UTC to the second."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(Z|[+-]\d\d:\d\d)", text) \
        if isinstance(text, str) else None
    if not m or m.string.startswith("0001-"):
        return None
    try:  # a date that does not exist (month 13, hour 25) or leaves the calendar once in UTC: unknown
        dt = datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(2) == "Z" else m.group(2)))
        return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, OverflowError):
        return None


def cri_metadata(spec: Bundle) -> dict:
    meta = spec.cri_metadata()
    ann = spec.annotations
    for key, a in _CRIO_ANNOTATIONS.items():
        if key not in meta and a in ann:
            meta[key] = ann[a]
    return meta


# -- the import -------------------------------------------------------------------------------------

def default_import_name(archive: str) -> str:
    """The archive's file name without .tar (kubelet's are unique:
    checkpoint-<pod>_<namespace>-<container>-<time>.tar)."""
    stem = os.path.basename(archive)
    for ext in (".gz", ".tgz", ".bz2", ".xz", ".zst", ".zstd", ".tar"):
        stem = stem[: -len(ext)] if stem.endswith(ext) else stem
    return names.validate(names.sanitize(stem)[:100] or "import")


def import_archive(cfg: Config, archive: str, name: str | None = None, progress: Progress = null_progress) -> dict:
    """Import a Kubernetes checkpoint archive as a store checkpoint; returns its manifest."""
    t_start = time.monotonic()
    archive = os.path.abspath(archive)
    name = names.validate(name) if name else default_import_name(archive)
    try:
        st = os.stat(archive)
    except FileNotFoundError as exc:
        raise NotFound(f"{archive}: no such file") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointInvalid(f"{archive}: not a regular file; give the checkpoint archive (a .tar file)")
    store = Store(cfg.store)
    store.ensure()
    store.gc()
    with reserve.reserving(store.root, f"importing {archive}", SPACE_MARGIN) as res, \
            store.writer(name, op="import", archive=archive) as staging:
        return _import_into(store, staging, archive, st.st_size, progress, t_start, _Space(res))


def _import_into(store: Store, staging, archive: str, size: int, progress: Progress, t_start: float,
                 space: _Space) -> dict:
    timings: dict[str, float] = {}
    progress("phase", name="extract", total_bytes=size)
    t0 = time.monotonic()
    ext = read_archive(archive, staging.images, staging.work, space, progress)
    timings["extract_s"] = round(time.monotonic() - t0, 3)
    progress("done", name="extract", seconds=timings["extract_s"])
    config_dump = _json(ext, "config.dump", dict, archive)
    spec_data = _json(ext, "spec.dump", dict, archive)
    status = _json(ext, "status", dict, archive, strict=False) or {}
    deleted_files = _json(ext, "deleted.files", list, archive)
    check_mounts(spec_data, archive)
    spec = Bundle("", spec_data)

    _keep_metadata(staging, ext, space)
    t0 = time.monotonic()
    layer = convert_rootfs_diff(ext.diff, deleted_files, staging.path, [m.get("destination", "") for m in spec.mounts],
                                take=space.take)
    if ext.diff:
        os.unlink(ext.diff)
    timings["rootfs_convert_s"] = round(time.monotonic() - t0, 3)

    engine = engines.producer(spec.annotations)
    dropped, kept = engines.drop_engine_mounts(staging.images, engine)
    devshm = None
    if ext.devshm:
        devshm = engines.convert_devshm(ext.devshm, os.path.join(staging.path, engines.DEVSHM_TAR), take=space.take)
        os.unlink(ext.devshm)

    options, note = criu_options(staging.images, spec.terminal)
    try:  # GPU state: migrt-runc's checkpoint left its record next to the CRIU images
        gpu = records.read_image_file(staging.images)
    except ValueError as exc:
        raise CheckpointInvalid(f"{archive}: {exc}") from exc
    created = _iso(config_dump.get("checkpointedTime")) or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fields: dict[str, object] = {
        "created": created,
        "source": _source(config_dump, status, spec),
        "versions": log_versions(ext.dump_log),
        "options": {**options, "leave_running": None},
        "mounts": [{"destination": m.get("destination"), "type": m.get("type"), "source": m.get("source")}
                   for m in spec.mounts if m.get("destination") not in dropped],
        "rootfs": layer,
        "imported": _imported(engine, dropped, kept, archive, size, ext, note),
        "timings": timings,
    }
    if gpu:
        fields["gpu"] = gpu
    if devshm:
        fields["devshm"] = devshm
    root_mode = recorded_root_mode(staging.images)
    if root_mode is not None:
        fields["root_mode"] = root_mode
    return _commit(store, staging, fields, timings, progress, t_start)


def _keep_metadata(staging, ext: Extracted, space: _Space) -> None:
    """The archive's metadata files under cri/ (as they came), CRIU's dump log under logs/."""
    cri_dir = os.path.join(staging.path, "cri")
    space.take(sum(on_disk(len(raw), alloc=space.res.alloc) for raw in ext.meta.values()), "the metadata files (cri/)")
    os.makedirs(cri_dir, mode=0o700, exist_ok=True)
    for key, raw in sorted(ext.meta.items()):
        with open(os.path.join(cri_dir, key), "wb") as fh:
            fh.write(raw)
    if ext.dump_log:
        os.makedirs(os.path.join(staging.path, "logs"), mode=0o700, exist_ok=True)
        os.replace(ext.dump_log, os.path.join(staging.path, "logs", DUMP_LOG))
        ext.dump_log = os.path.join(staging.path, "logs", DUMP_LOG)


def _source(config_dump: dict, status: dict, spec: Bundle) -> dict:
    """The manifest's `source`: the container as the archive's metadata describes it (no runtime root,
    bundle or state: it ran on another node)."""
    return {
        "container_id": config_dump.get("id") if isinstance(config_dump.get("id"), str) else None,
        "container_name": config_dump.get("name") if isinstance(config_dump.get("name"), str) else None,
        "runtime_root": None,
        "bundle": None,
        "pid": status.get("Pid") if isinstance(status.get("Pid"), int) else None,
        "status": None,
        "image": config_dump.get("rootfsImageName") or config_dump.get("rootfsImage"),
        "image_ref": config_dump.get("rootfsImageRef"),
        "runtime": config_dump.get("runtime"),
        "cri": cri_metadata(spec),
        "annotations": spec.annotations,
    }


def _imported(engine: str, dropped: list, kept: list, archive: str, size: int, ext: Extracted,
              note: str | None) -> dict:
    """The manifest's `imported`: where the checkpoint came from and what the import left out."""
    return {
        "format": FORMAT,
        "producer": engine,
        **({"engine_mounts_dropped": dropped} if dropped else {}),
        **({"engine_mounts_kept": kept} if kept else {}),
        "archive": archive,
        "archive_bytes": size,
        "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ignored": sorted(set(ext.ignored))[:50],
        **({"note": note} if note else {}),
    }


def _commit(store: Store, staging, fields: dict, timings: dict[str, float], progress: Progress,
            t_start: float) -> dict:
    """The images' survey beside the hashing, the atomic commit, then the last timings written in."""
    record_beside(staging)  # the images' survey for the restore's eager/lazy choice, beside the hashing
    total = staging.payload_bytes()
    progress("phase", name="commit", total_bytes=total)
    t0 = time.monotonic()
    data = staging.commit(fields, progress=lambda n: progress("bytes", name="commit", bytes=n))
    timings["commit_s"] = round(time.monotonic() - t0, 3)
    progress("done", name="commit", seconds=timings["commit_s"])
    timings["total_s"] = round(time.monotonic() - t_start, 3)
    data["timings"] = {**data.get("timings", {}), **timings}
    mf.write(store.get(staging.name).path, data)  # lock still held
    return data

