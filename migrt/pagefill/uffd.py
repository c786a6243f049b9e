"""userfaultfd from Python: the ioctls the filler needs (ctypes; the GIL is released during each
call, so several threads copy at once) and the messages a task's userfaultfd delivers.

Every call returns or raises UffdError carrying errno and, for UFFDIO_COPY/ZEROPAGE, how many bytes
were done before the error (the kernel may stop part way: EAGAIN while the address space changes,
EEXIST at a page already present)."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long

SYS_userfaultfd = {"x86_64": 323, "aarch64": 282, "ppc64le": 364, "s390x": 355}.get(os.uname().machine, 323)

UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
UFFDIO_REGISTER = 0xC020AA00
UFFDIO_UNREGISTER = 0x8010AA01
UFFDIO_WAKE = 0x8010AA02
UFFDIO_COPY = 0xC028AA03
UFFDIO_ZEROPAGE = 0xC020AA04
UFFDIO_REGISTER_MODE_MISSING = 1

UFFD_FEATURE_EVENT_FORK = 1 << 1
UFFD_FEATURE_EVENT_REMAP = 1 << 2
UFFD_FEATURE_EVENT_REMOVE = 1 << 3
UFFD_FEATURE_EVENT_UNMAP = 1 << 6
NONCOOP_FEATURES = (UFFD_FEATURE_EVENT_FORK | UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE
                    | UFFD_FEATURE_EVENT_UNMAP)

EVENT_PAGEFAULT, EVENT_FORK, EVENT_REMAP, EVENT_REMOVE, EVENT_UNMAP = 0x12, 0x13, 0x14, 0x15, 0x16
MSG_SIZE = 32


class UffdError(OSError):
    errno: int  # always given

    def __init__(self, err: int, op: str, done: int = 0) -> None:
        super().__init__(err, f"{op}: {os.strerror(err)}")
        self.done = done


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("ioctls", ctypes.c_uint64)]


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _Zero(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("zeropage", ctypes.c_int64)]


def _ioctl(fd: int, req: int, arg) -> int:
    if _libc.ioctl(fd, req, ctypes.byref(arg)) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def copy(fd: int, dst: int, src: int, length: int) -> None:
    """UFFDIO_COPY length bytes from our address src to the task's address dst (wakes faulters)."""
    c = _Copy(dst, src, length, 0, 0)
    err = _ioctl(fd, UFFDIO_COPY, c)
    if err:
        raise UffdError(err, "UFFDIO_COPY", max(int(c.copy), 0))
    if c.copy != length:
        raise UffdError(errno.EIO, f"UFFDIO_COPY copied {c.copy} of {length} bytes", max(int(c.copy), 0))


def zeropage(fd: int, start: int, length: int) -> None:
    z = _Zero(start, length, 0, 0)
    err = _ioctl(fd, UFFDIO_ZEROPAGE, z)
    if err:
        raise UffdError(err, "UFFDIO_ZEROPAGE", max(int(z.zeropage), 0))


def unregister(fd: int, start: int, length: int) -> None:
    err = _ioctl(fd, UFFDIO_UNREGISTER, _Range(start, length))
    if err:
        raise UffdError(err, "UFFDIO_UNREGISTER")


def wake(fd: int, start: int, length: int) -> None:
    err = _ioctl(fd, UFFDIO_WAKE, _Range(start, length))
    if err:
        raise UffdError(err, "UFFDIO_WAKE")


def open_uffd(features: int = 0) -> tuple[int, int]:
    """A new userfaultfd of our own (checks, tests): (fd, features the kernel granted)."""
    fd = _libc.syscall(SYS_userfaultfd, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        err = ctypes.get_errno()
        raise UffdError(err, "userfaultfd")
    api = _Api(UFFD_API, features, 0)
    err = _ioctl(fd, UFFDIO_API, api)
    if err:
        os.close(fd)
        raise UffdError(err, "UFFDIO_API")
    return fd, int(api.features)


def register(fd: int, start: int, length: int) -> None:
    err = _ioctl(fd, UFFDIO_REGISTER, _Register(start, length, UFFDIO_REGISTER_MODE_MISSING, 0))
    if err:
        raise UffdError(err, "UFFDIO_REGISTER")


@dataclass(frozen=True)
class Msg:
    event: int
    a: int = 0  # PAGEFAULT: address | FORK: new fd | REMAP: from | REMOVE/UNMAP: start
    b: int = 0  # REMAP: to | REMOVE/UNMAP: end
    c: int = 0  # REMAP: len


def parse(buf: bytes) -> list[Msg]:
    """struct uffd_msg (32 bytes, packed): u8 event, 7 reserved bytes, a 24-byte union."""
    out = []
    for i in range(0, len(buf) - len(buf) % MSG_SIZE, MSG_SIZE):
        event = buf[i]
        if event == EVENT_PAGEFAULT:
            _flags, addr = struct.unpack_from("<QQ", buf, i + 8)
            out.append(Msg(event, addr))
        elif event == EVENT_FORK:
            (ufd,) = struct.unpack_from("<I", buf, i + 8)
            out.append(Msg(event, ufd))
        elif event == EVENT_REMAP:
            out.append(Msg(event, *struct.unpack_from("<QQQ", buf, i + 8)))
        elif event in (EVENT_REMOVE, EVENT_UNMAP):
            out.append(Msg(event, *struct.unpack_from("<QQ", buf, i + 8)))
        else:
            out.append(Msg(event))
    return out


def usable() -> str | None:
    """Why a lazy restore through the filler cannot work in this process, or None."""
    try:
        fd, features = open_uffd(NONCOOP_FEATURES)
    except UffdError as exc:
        return f"userfaultfd is not usable ({exc.strerror}; the kernel needs CONFIG_USERFAULTFD and the caller " \
               "CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1)"
    os.close(fd)
    missing = NONCOOP_FEATURES & ~features
    if missing:
        return f"the kernel's userfaultfd lacks the fork/remap/remove/unmap events (features {features:#x})"
    return None
