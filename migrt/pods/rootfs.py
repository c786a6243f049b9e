"""The container's writable layer: changes a container made to its own root filesystem (outside
volumes) are not in CRIU's images. At checkpoint they are captured from the overlayfs upper
directory of the rootfs mount (containerd's snapshotter): files, directories and symlinks into
`rootfs-diff.tar`, deletions (whiteouts) and opaque directories into `rootfs-diff.json`. At restore
they are re-applied into the new rootfs before CRIU runs, inside a chroot so that no path can leave
the new rootfs. A layer holds regular files, directories and links only (`layer_member`): capture
writes nothing else, and an applied layer that holds a device node or fifo (an import, a pulled or
received image made by hand) has it left out; a pulled image's files lose their setuid/setgid bits.
"""

from __future__ import annotations

import grp  # noqa: F401 - loaded before the chroot (tarfile may use them)
import json
import os
import pwd  # noqa: F401
import shutil
import stat
import tarfile

from migrt import jsonsafe
from migrt.kernel.files import atomic_file
from migrt.pods.forked import run_forked
from migrt.store.manifest import Manifest

DIFF_TAR = "rootfs-diff.tar"
DIFF_META = "rootfs-diff.json"
SKIP_TOP = ("proc", "sys", "dev")  # kernel file systems: never part of the layer


def overlay_upperdir(rootfs: str) -> str | None:
    """The upperdir of the overlay mounted at rootfs, or None if rootfs is not an overlay mount
    (the last mount there wins, as in the kernel's view; psutil decodes the mount table's escapes)."""
    import psutil

    target = os.path.realpath(rootfs)
    found = None
    for part in psutil.disk_partitions(all=True):
        if part.mountpoint == target and part.fstype == "overlay":
            found = next((o[len("upperdir="):] for o in part.opts.split(",") if o.startswith("upperdir=")), None)
    return found


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: str) -> bool:
    for attr in ("trusted.overlay.opaque", "user.overlay.opaque"):
        try:
            if os.getxattr(path, attr, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def capture(upper: str | None, dest_dir: str, exclude: list[str]) -> dict:
    """Write the diff held in an overlay upper directory (from overlay_upperdir(), looked up while
    the rootfs is mounted) into dest_dir; return a summary for the manifest."""
    if upper is None or not os.path.isdir(upper):
        return {"captured": False, "reason": "rootfs is not an overlay mount (no base to diff against)"}
    excl = {e.strip("/") for e in exclude if e.strip("/")}
    deleted, opaque, count, size = [], [], 0, 0
    tar_path = os.path.join(dest_dir, DIFF_TAR)
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(upper):
            rel_dir = os.path.relpath(dirpath, upper)
            rel_dir = "" if rel_dir == "." else rel_dir
            keep = []
            for d in sorted(dirnames):
                rel = os.path.join(rel_dir, d)
                if (not rel_dir and d in SKIP_TOP) or rel in excl:
                    continue
                keep.append(d)
            dirnames[:] = keep
            for name in sorted(dirnames) + sorted(filenames):
                rel = os.path.join(rel_dir, name)
                if rel in excl or (not rel_dir and name in SKIP_TOP):
                    continue
                full = os.path.join(dirpath, name)
                st = os.lstat(full)
                if _is_whiteout(st):
                    deleted.append(rel)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if _opaque(full):
                        opaque.append(rel)
                    tar.add(full, arcname=rel, recursive=False)
                elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    tar.add(full, arcname=rel, recursive=False)
                    size += st.st_size
                else:
                    continue  # sockets, fifos, devices: recreated by the workload or by CRIU
                count += 1
    meta = {"deleted": deleted, "opaque": opaque}
    with open(os.path.join(dest_dir, DIFF_META), "w") as fh:
        json.dump(meta, fh)
    return {"captured": True, "entries": count, "bytes": size, "deleted": len(deleted), "opaque": len(opaque)}


def dense(member: tarfile.TarInfo) -> None:
    """A sparse member, to be written out whole: a plain file (its holes read as zeros)."""
    member.type = tarfile.REGTYPE
    member.sparse = None
    member.pax_headers = {k: v for k, v in member.pax_headers.items() if not k.startswith("GNU.sparse.")}


def written_size(member: tarfile.TarInfo) -> int:
    """At least what writing a member into a PAX tar takes: its data in full (a sparse member's
    apparent size), rounded to blocks, and its headers (the PAX records: long names, xattrs)."""
    data = -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE if member.isreg() else 0
    meta = len(member.name.encode()) + len(member.linkname.encode()) + sum(
        len(str(k).encode()) + len(str(v).encode()) + 24 for k, v in member.pax_headers.items())
    return data + 3 * tarfile.BLOCKSIZE + -(-meta // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def layer_member(member: tarfile.TarInfo) -> bool:
    """What a writable layer may hold: regular files, directories, symbolic and hard links. Device
    nodes, fifos and sockets are left out wherever a layer is converted or applied: a device node in
    the rootfs is a way around the new container's device rules."""
    return member.isreg() or member.isdir() or member.issym() or member.islnk()


SETID = stat.S_ISUID | stat.S_ISGID


def _safe(rel: str) -> bool:
    return bool(rel) and not rel.startswith("/") and ".." not in rel.split("/")


def _apply_in_chroot(tar_file, meta: dict, strip_setid: bool = False) -> None:
    for rel in meta.get("opaque", []) + meta.get("deleted", []):
        if not _safe(rel):
            continue
        path = "/" + rel
        if rel in meta.get("opaque", []):
            if os.path.isdir(path) and not os.path.islink(path):
                for entry in os.listdir(path):
                    p = os.path.join(path, entry)
                    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        elif os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    with tarfile.open(fileobj=tar_file) as tar:
        for member in tar:
            if not _safe(member.name) or not layer_member(member):
                continue
            if strip_setid and not member.isdir():
                member.mode &= ~SETID
            path = "/" + member.name
            if member.isdir():
                if os.path.lexists(path) and not os.path.isdir(path):
                    os.unlink(path)
                os.makedirs(path, exist_ok=True)
            else:
                if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
                    os.unlink(path)
                elif os.path.isdir(path):
                    shutil.rmtree(path)
                os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
                tar.extract(member, "/", set_attrs=True, numeric_owner=True)
            if member.isdir():
                os.chmod(path, member.mode)
                os.chown(path, member.uid, member.gid)


def apply(diff_dir: str, rootfs: str, *, strip_setid: bool = False) -> int:
    """Re-apply a captured diff into rootfs (in a forked, chrooted child). Returns entries applied.
    strip_setid: files are written without setuid/setgid bits (a layer from a registry: whoever
    pushed it must not plant a setuid program in the new container)."""
    tar_path = os.path.join(diff_dir, DIFF_TAR)
    meta_path = os.path.join(diff_dir, DIFF_META)
    if not os.path.isfile(tar_path):
        return 0
    with open(meta_path) as fh:
        meta = jsonsafe.load(fh)
    return _apply_tar(tar_path, meta, rootfs, f"re-applying the container's writable-layer changes into {rootfs}",
                      strip_setid) + len(meta.get("deleted", []))


def apply_checkpoint(ckpt_path: str, manifest: Manifest, rootfs: str) -> int:
    """A checkpoint's captured diff into rootfs, as its origin allows: from a registry (`pulled` in
    its manifest), without setuid/setgid bits."""
    return apply(ckpt_path, rootfs, strip_setid=manifest.from_registry)


def _apply_tar(tar_path: str, meta: dict, root: str, what: str, strip_setid: bool = False) -> int:
    with open(tar_path, "rb") as tar_file:  # opened before the chroot

        def child() -> bytes:
            os.chroot(root)
            os.chdir("/")
            _apply_in_chroot(tar_file, meta, strip_setid)
            return b""

        run_forked(child, what)
    with tarfile.open(tar_path) as tar:
        return sum(1 for m in tar if _safe(m.name) and layer_member(m))


def apply_devshm(tar_path: str, mounts: list[dict]) -> int:
    """Put the checkpointed /dev/shm files (podman's devshm-checkpoint.tar, see migrt.pods.engines)
    into the new container's /dev/shm before CRIU restores: the source directory of its /dev/shm bind
    mount (in a pod, the sandbox's). Returns entries written; 0 when the new /dev/shm is not a bind
    mount (restore.check_target refuses that target earlier: CRIU needs the external mount)."""
    shm = [m for m in mounts if m.get("destination") == "/dev/shm" and m.get("source")
           and bind_destinations([m])]
    if not shm or not os.path.isdir(shm[-1]["source"]):
        return 0
    src = shm[-1]["source"]
    return _apply_tar(tar_path, {}, src, f"restoring the checkpointed /dev/shm files into {src}")


def bind_destinations(mounts: list[dict]) -> list[str]:
    return [m.get("destination", "") for m in mounts if m.get("type") == "bind" or
            any(o in ("bind", "rbind") for o in m.get("options") or [])]



def root_mode(rootfs: str) -> int | None:
    """The mode of a container's root directory (recorded at checkpoint as the manifest's root_mode)."""
    try:
        return os.stat(rootfs).st_mode
    except OSError:
        return None


def align_root_mode(view: str, rootfs: str, recorded: int | None = None) -> int | None:
    """CRIU checks the mode of every directory it reopens by path, the container's root (its cwd or
    root) included; the root directory comes from the engine, not from the image (containerd's
    snapshots: 0755; podman's containers/storage: 0555). So the root's mode recorded in the view's
    files.img (a copy: the checkpoint's own file is untouched) is set to the new root's. Returns the
    mode written, None when nothing changed."""
    path = os.path.join(view, "files.img")
    if not os.path.isfile(path):
        return None
    mode = os.stat(rootfs).st_mode
    if recorded is not None and recorded == mode:
        return None  # `recorded`: the manifest's root_mode, what CRIU saw; no pycriu on the restore path
    import pycriu

    with open(path, "rb") as fh:
        img = pycriu.images.load(fh)
    changed = False
    for entry in img["entries"]:
        reg = entry.get("reg") or {}
        if entry.get("type") == "REG" and reg.get("name") == "/" and "mode" in reg \
                and stat.S_ISDIR(reg["mode"]) and reg["mode"] != mode:
            reg["mode"] = mode
            changed = True
    if not changed:
        return None
    with atomic_file(path, 0o644, durable=False) as fh:  # replaces the hard link
        pycriu.images.dump(img, fh)
    return mode
