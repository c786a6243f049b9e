"""`migrt export`: a store checkpoint as the checkpoint archive Podman, CRI-O and kubelet write, so
that `checkpointctl show/inspect`, `podman container restore --import` and `migrt import` read it.

  checkpoint/          the CRIU images (+ descriptors.json, migrt-gpu.json for a GPU checkpoint)
  config.dump          container metadata (id, name, rootfsImageName, runtime, createdTime, checkpointedTime)
  spec.dump            the container's OCI config (the imported one, else one made from the manifest:
                       annotations, mounts, process.terminal)
  rootfs-diff.tar      the writable layer, deletions in deleted.files (the Podman/CRI-O form);
  deleted.files        opaque directories as `.wh..wh..opq` entries in the tar
  stats-dump, dump.log CRIU's statistics and log when the checkpoint has them
  migrt-manifest.json  migrt's own manifest (CRIU options, GPU section, digests), read by nothing else

The tar is plain (uncompressed, PAX, mode 0600), written to a temporary file beside the target and
renamed into place; members are sorted with fixed times and owners, so the same checkpoint exports to the
same bytes (a registry layer that does not change is not sent again). The checkpoint's files are
checked against its manifest while they are read (verify=True), so a corrupted checkpoint is not
exported.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time

from migrt import jsonsafe
from migrt.errors import CheckpointInvalid, UsageError
from migrt.gpu import records
from migrt.pods import rootfs
from migrt.progress import Progress, null_progress
from migrt.store.fsutil import TreeHasher, atomic_file, digest_of
from migrt.store.manifest import Manifest

MIGRT_MANIFEST = "migrt-manifest.json"


class _HashingWriter:
    """File object for tarfile that hashes what it writes (the layer digest, without a second pass)."""

    def __init__(self, fh, progress: Progress = null_progress) -> None:
        self.fh = fh
        self.h = hashlib.sha256()
        self.size = 0
        self.progress = progress
        self.pending = 0

    def write(self, data) -> int:
        self.h.update(data)
        self.size += len(data)
        n = self.fh.write(data)
        self.pending += len(data)
        if self.pending >= 4 << 20:  # tar headers are 512-byte writes: report in MiBs, not per write
            self.flush_progress()
        return n

    def flush_progress(self) -> None:
        if self.pending:
            self.progress("bytes", bytes=self.pending)
            self.pending = 0

    def tell(self) -> int:
        return self.size


def _info(name: str, size: int, mode: int = 0o600) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, mode, 0, 0, 0, "root", "root"
    return ti


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_info(name, len(data)), io.BytesIO(data))


class _VerifyingReader:
    def __init__(self, fh, entry: dict, rel: str, ckpt_name: str) -> None:
        self.fh, self.entry, self.rel, self.name = fh, entry, rel, ckpt_name
        self.h = TreeHasher()

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.h.update(data)
        return data

    def check(self) -> None:
        if self.h.hexdigest() != digest_of(self.entry):
            raise CheckpointInvalid(f"checkpoint {self.name}: sha256 mismatch in {self.rel}; not exporting a corrupted "
                                    f"checkpoint (run 'migrt inspect --verify {self.name}')")


def _add_file(tar: tarfile.TarFile, ckpt, rel: str, arcname: str, verify: bool) -> None:
    path = os.path.join(ckpt.path, rel)
    entry = ckpt.manifest.files[rel]
    size = os.path.getsize(path)
    if size != entry.get("size"):
        raise CheckpointInvalid(f"checkpoint {ckpt.name}: size mismatch in {rel}")
    with open(path, "rb") as fh:
        if not verify:
            tar.addfile(_info(arcname, size), fh)
            return
        reader = _VerifyingReader(fh, entry, rel, ckpt.name)
        tar.addfile(_info(arcname, size), reader)
        reader.check()


def config_dump(manifest: Manifest) -> dict:
    src, cri = manifest.source, manifest.source.cri
    created = manifest.created or "1970-01-01T00:00:00Z"
    return {"id": src.container_id or manifest.name,
            "name": cri.container_name or src.container_id or manifest.name,
            "rootfsImage": src.image_ref or "", "rootfsImageRef": src.image_ref or "",
            "rootfsImageName": src.image or cri.image_name or "", "runtime": "migrt-runc",
            "createdTime": created, "checkpointedTime": created}


def spec_dump(manifest: Manifest) -> dict:
    ann = dict(manifest.source.annotations)
    cri = manifest.source.cri
    # the CRI-O/Podman form of the Kubernetes labels, which checkpointctl shows
    for value, a in ((cri.pod_name, "io.kubernetes.pod.name"), (cri.pod_namespace, "io.kubernetes.pod.namespace"),
                     (cri.container_name, "io.kubernetes.container.name")):
        if value and a not in ann:
            ann[a] = value
    mounts = [{"destination": m.destination, "type": m.type or "bind", "source": m.source or "",
               "options": ["rbind"] if (m.type or "bind") == "bind" else []}
              for m in manifest.mounts if m.destination]
    return {"ociVersion": "1.0.2", "annotations": ann, "mounts": mounts,
            "process": {"terminal": bool(manifest.options.get("shell_job")), "cwd": "/"},
            "root": {"path": "rootfs"}}


def _rootfs(tar: tarfile.TarFile, ckpt, verify: bool) -> None:
    files = ckpt.manifest.files
    if rootfs.DIFF_TAR not in files:
        return
    meta = {}
    if rootfs.DIFF_META in files:
        with open(os.path.join(ckpt.path, rootfs.DIFF_META), "rb") as fh:
            meta = jsonsafe.load(fh)
    opaque = [p for p in meta.get("opaque") or [] if isinstance(p, str)]
    deleted = [p for p in meta.get("deleted") or [] if isinstance(p, str)]
    if not opaque:
        _add_file(tar, ckpt, rootfs.DIFF_TAR, "rootfs-diff.tar", verify)
    else:  # rewrite: migrt's tar + opaque markers
        buf = io.BytesIO()
        with tarfile.open(os.path.join(ckpt.path, rootfs.DIFF_TAR), "r") as src, \
                tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
            for m in src:
                out.addfile(m, src.extractfile(m) if m.isreg() else None)
            for d in opaque:
                out.addfile(_info(f"{d.strip('/')}/.wh..wh..opq", 0))
        _add_bytes(tar, "rootfs-diff.tar", buf.getvalue())
    if deleted:
        _add_bytes(tar, "deleted.files", json.dumps(["/" + p.lstrip("/") for p in deleted]).encode())


def export(ckpt, out_path: str, *, verify: bool = True, progress: Progress = null_progress) -> dict:
    """Write the archive; returns {"path", "size", "sha256" ("sha256:..."), "members"}. Progress: one
    phase `export` (total_bytes: the checkpoint's size, about the archive's), bytes as they are written."""
    manifest = ckpt.manifest
    if "pod" in manifest:  # ops/pod_checkpoint.py
        raise UsageError(f"checkpoint {ckpt.name} is a whole pod's: the archive podman and kubelet read holds one "
                         f"container; push it in migrt's format instead (migrt push {ckpt.name} REF)")
    files = manifest.files
    images = sorted(rel for rel in files if rel.startswith("images/"))
    if not any(rel == "images/inventory.img" for rel in images):
        raise CheckpointInvalid(f"checkpoint {ckpt.name}: images/inventory.img is missing; nothing to export")
    out_dir = os.path.dirname(os.path.abspath(out_path)) or "."
    if not os.path.isdir(out_dir):
        raise UsageError(f"-o {out_path}: directory {out_dir} does not exist")
    members = 0
    t0 = time.monotonic()
    progress("phase", name="export", total_bytes=manifest.size_bytes or 0)
    # 0600 like the store's files and podman's exports: the archive holds the processes' memory
    with atomic_file(out_path, 0o600) as fh:
        w = _HashingWriter(fh, progress)
        # TarFile itself: what tarfile.open(mode="w") returns, with copybufsize (open's stubs lack it); a
        # TarFile writing only writes and tells (the stubs' file object also reads, seeks and closes)
        with tarfile.TarFile(fileobj=w, mode="w", format=tarfile.PAX_FORMAT,  # type: ignore[arg-type]
                             copybufsize=4 << 20) as tar:
            tar.addfile(_dir("checkpoint"))
            have_gpu_record = "images/" + records.IMAGE_FILE in files
            for rel in images:
                if rel == "images/stats-dump":
                    continue
                _add_file(tar, ckpt, rel, "checkpoint/" + rel[len("images/"):], verify)
                members += 1
            if manifest.gpu and not have_gpu_record:
                _add_bytes(tar, "checkpoint/" + records.IMAGE_FILE, json.dumps(manifest.gpu).encode())
            _add_bytes(tar, "config.dump", _cri_file(ckpt, "config.dump") or _json(config_dump(manifest)))
            _add_bytes(tar, "spec.dump", _cri_file(ckpt, "spec.dump") or _json(spec_dump(manifest)))
            _rootfs(tar, ckpt, verify)
            if "images/stats-dump" in files:
                _add_file(tar, ckpt, "images/stats-dump", "stats-dump", verify)
            if "logs/dump.log" in files:
                _add_file(tar, ckpt, "logs/dump.log", "dump.log", verify)
            _add_bytes(tar, MIGRT_MANIFEST, _json(manifest.raw))
            members += 4
        w.flush_progress()
    progress("done", name="export", seconds=round(time.monotonic() - t0, 3))
    return {"path": os.path.abspath(out_path), "size": w.size, "sha256": "sha256:" + w.h.hexdigest(),
            "members": members}


def _dir(name: str) -> tarfile.TarInfo:
    ti = _info(name, 0, 0o700)
    ti.type = tarfile.DIRTYPE
    return ti


def _json(data: object) -> bytes:
    return json.dumps(data, indent=2, sort_keys=True).encode()


def _cri_file(ckpt, key: str) -> bytes | None:
    """An imported checkpoint keeps the archive's metadata under cri/: exported as it was."""
    rel = f"cri/{key}"
    if rel not in ckpt.manifest.files:
        return None
    with open(os.path.join(ckpt.path, rel), "rb") as fh:
        return fh.read()
