"""The demo in a plain chroot: make "/" a mount point at its mount namespace's root first.

A container runtime makes a container's root with pivot_root(2), which the kernel refuses unless the
caller's root is a mount point (runc: "error preparing rootfs: mount /, flags: 0x84000: invalid
argument"), and CRIU dumps a container only when its tasks' root shows as "/" from CRIU's own root
("The root task has another root than mntns"). A fresh Debian root entered with a plain `chroot`
(with /proc, /sys and /dev bound into it, as a newcomer tries an install) has neither: "/" is a
directory of the host's root filesystem. A container engine or `unshare --root` is the usual answer;
the demo takes this one, as root, only when "/" is no mount point (/proc/self/mountinfo has no entry
at "/"), in a mount namespace of its own, so that nothing it mounts is seen outside:

  1. unshare(CLONE_NEWNS); this root kept open as a descriptor;
  2. out to the namespace's real root (chroot to a directory below, then ".." up to the top: a
     chroot does not move the working directory), mounts made private;
  3. the kept directory bound onto itself, then pivot_root into it and the old root detached, as runc
     does for a container (pivot_root(".", "."), then umount2(".", MNT_DETACH));
  4. the demo started again from the top: the same paths, "/" now the namespace's root mount.

Standard library only (ctypes for unshare, mount, umount2 and pivot_root).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import tempfile

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE, MS_SLAVE = 0x1000, 0x4000, 1 << 18, 1 << 19
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


def root_is_a_mount() -> bool:
    """Is "/" a mount point here (False in a plain chroot: the host's mounts above it are hidden)?"""
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        return any(len(fields) > 4 and fields[4] == "/" for fields in (line.split() for line in fh))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _to_real_root(esc: str) -> None:
    """Leave the chroot for this mount namespace's root (the working directory stays outside the new
    root after chroot, so ".." climbs past it)."""
    os.chdir("/")
    os.chroot(esc)
    for _ in range(256):
        os.chdir("..")
    os.chroot(".")


def enter() -> None:
    """Steps 1-3 of the module doc; the caller starts itself again after."""
    libc = _libc()
    arch = platform.machine()
    if arch not in SYS_PIVOT_ROOT:
        raise OSError(f"no pivot_root number known for {arch}")
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    keep = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    esc = tempfile.mkdtemp(prefix=".migrt-demo-root.", dir="/tmp")
    try:
        _to_real_root(esc)
        _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        path = os.readlink(f"/proc/self/fd/{keep}").encode()
        _check(libc.mount(path, path, None, MS_BIND | MS_REC, None), f"mount --rbind {path.decode()}")
        old = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        os.chdir(path)
        _check(libc.syscall(SYS_PIVOT_ROOT[arch], b".", b"."), "pivot_root")
        os.fchdir(old)
        _check(libc.mount(None, b".", None, MS_SLAVE | MS_REC, None), "mount --make-rslave (old root)")
        _check(libc.umount2(b".", MNT_DETACH), "umount2 (old root)")
        os.chdir("/")
        os.close(old)
    finally:
        os.close(keep)
        try:
            os.rmdir(esc)
        except OSError:
            pass


def ensure(argv: list[str]) -> None:
    """Start this program again with "/" at its mount namespace's root when it is not (as root)."""
    if os.geteuid() != 0 or root_is_a_mount():
        return
    print('== "/" is no mount point (a chroot): making it the root of a mount namespace of the demo\'s own',
          flush=True)
    cwd, argv = os.getcwd(), [os.path.abspath(argv[0]), *argv[1:]]
    try:
        enter()
    except OSError as exc:
        print(f"demo: containers cannot start here: \"/\" is no mount point (a chroot?) and making it one "
              f"failed ({exc}); run the demo on a machine, a VM or in a container", file=sys.stderr)
        sys.exit(2)
    os.chdir(cwd)
    os.execv(sys.executable, [sys.executable, *argv])
