"""What differs between the container engines that write checkpoint archives (kubelet through
containerd or CRI-O, and podman), so that `migrt import` makes the same store checkpoint of each.

- Who wrote it: read from the annotations of spec.dump (podman: `io.container.manager: libpod`;
  CRI-O: `io.kubernetes.cri-o.*`; containerd's CRI: `io.kubernetes.cri.*`).
- Engine-private bind mounts: podman binds `/run/.containerenv` (its "you are in a container" marker)
  into every container. runc records every bind mount as external, so a restore needs a mount at the
  same destination in the new container, which no Kubernetes pod has. Such a mount is removed from
  the CRIU mount image when no file of the checkpointed processes lies on it (the process then finds
  no marker, as in any other pod); when one does, it is kept and the restore names the missing mount.
- /dev/shm: a bind mount as well, so CRIU does not dump its files; podman adds them to the archive as
  `devshm-checkpoint.tar`. migrt keeps them (`devshm.tar`) and puts them back into the new container's
  /dev/shm before CRIU restores (migrt.pods.rootfs.apply_devshm).
"""

from __future__ import annotations

import glob
import os
import tarfile

from migrt.errors import CheckpointInvalid
from migrt.kernel.files import atomic_file
from migrt.pods import rootfs

PODMAN = "podman"
ENGINE_MOUNTS = {PODMAN: ("/run/.containerenv",)}
DEVSHM_SRC = "devshm-checkpoint.tar"
DEVSHM_TAR = "devshm.tar"
MAX_DEVSHM_MEMBERS = 100_000


def producer(annotations: dict) -> str:
    """The engine that wrote a checkpoint archive, from spec.dump's annotations."""
    if annotations.get("io.container.manager") == "libpod":
        return PODMAN
    if any(k.startswith("io.kubernetes.cri-o.") for k in annotations):
        return "cri-o"
    if any(k.startswith("io.kubernetes.cri.") for k in annotations):
        return "containerd"
    return "unknown"


def _load(path: str) -> dict:
    import pycriu

    with open(path, "rb") as fh:
        return pycriu.images.load(fh)


def _dump(path: str, img: dict) -> None:
    import pycriu

    with atomic_file(path, 0o644, durable=False) as fh:  # a restore view's image: replaces the hard link
        pycriu.images.dump(img, fh)


def drop_engine_mounts(images: str, engine: str) -> tuple[list[str], list[str]]:
    """Remove the engine's private bind mounts from the CRIU mount images in `images` (a staging
    copy). Returns (dropped, kept): kept are those a file of the processes lies on."""
    dests = ENGINE_MOUNTS.get(engine, ())
    if not dests:
        return [], []
    try:
        used = {e.get("reg", {}).get("mnt_id") for e in _load(os.path.join(images, "files.img"))["entries"]
                if e.get("type") == "REG"}
    except FileNotFoundError:
        used = set()
    dropped: list[str] = []
    kept: list[str] = []
    for path in sorted(glob.glob(os.path.join(images, "mountpoints-*.img"))):
        try:
            img = _load(path)
        except Exception as exc:  # pycriu raises plain Exceptions on bad images
            raise CheckpointInvalid(f"the CRIU mount image {os.path.basename(path)} cannot be read: {exc}") from exc
        keep = []
        for entry in img["entries"]:
            dest = entry.get("mountpoint")
            if dest in dests and entry.get("ext_key") and not any(
                    e.get("parent_mnt_id") == entry.get("mnt_id") for e in img["entries"]):
                if entry.get("mnt_id") in used:
                    kept.append(dest)
                else:
                    dropped.append(dest)
                    continue
            keep.append(entry)
        if len(keep) != len(img["entries"]):
            img["entries"] = keep
            _dump(path, img)
    return dropped, kept


def convert_devshm(src: str, dest: str, take=None) -> dict:
    """podman's devshm-checkpoint.tar -> dest: regular files, directories and symlinks under relative
    names; anything else (devices, fifos, hard links, '..', absolute names) refuses the archive.
    take(nbytes, what) is called before each entry is written (import_cri._Space.take): a sparse
    member is written out whole."""
    count = entries = size = 0
    try:
        with tarfile.open(src, "r:") as tar, tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as out:
            for member in tar:
                count += 1
                if count > MAX_DEVSHM_MEMBERS:
                    raise CheckpointInvalid(f"{DEVSHM_SRC}: more than {MAX_DEVSHM_MEMBERS} entries")
                parts = [p for p in member.name.split("/") if p not in ("", ".")]
                if member.name.startswith("/") or ".." in parts:
                    raise CheckpointInvalid(f"{DEVSHM_SRC}: member {member.name!r} leaves /dev/shm")
                if not parts:
                    continue  # /dev/shm itself
                member.name = "/".join(parts)
                entries += 1
                if take and (member.isreg() or member.isdir() or member.issym()):
                    take(rootfs.written_size(member), f"{DEVSHM_SRC} entry {member.name!r}")
                if member.isreg():
                    data = tar.extractfile(member)  # reads a sparse member's holes as zeros
                    rootfs.dense(member)
                    out.addfile(member, data)
                    size += member.size
                elif member.isdir() or member.issym():
                    out.addfile(member)
                else:
                    raise CheckpointInvalid(f"{DEVSHM_SRC}: member {member.name!r} is not a file, directory or symlink")
    except tarfile.TarError as exc:
        raise CheckpointInvalid(f"{DEVSHM_SRC} in the archive is unreadable ({exc})") from exc
    return {"entries": entries, "bytes": size}
