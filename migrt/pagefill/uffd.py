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

from migrt.kernel import mm
from migrt.kernel.libc import libc

NONCOOP_FEATURES = (mm.UFFD_FEATURE_EVENT_FORK | mm.UFFD_FEATURE_EVENT_REMAP | mm.UFFD_FEATURE_EVENT_REMOVE
                    | mm.UFFD_FEATURE_EVENT_UNMAP)

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
    if libc.ioctl(fd, req, ctypes.byref(arg)) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def copy(fd: int, dst: int, src: int, length: int) -> None:
    """UFFDIO_COPY length bytes from our address src to the task's address dst (wakes faulters)."""
    c = _Copy(dst, src, length, 0, 0)
    err = _ioctl(fd, mm.UFFDIO_COPY, c)
    if err:
        raise UffdError(err, "UFFDIO_COPY", max(int(c.copy), 0))
    if c.copy != length:
        raise UffdError(errno.EIO, f"UFFDIO_COPY copied {c.copy} of {length} bytes", max(int(c.copy), 0))


def zeropage(fd: int, start: int, length: int) -> None:
    z = _Zero(start, length, 0, 0)
    err = _ioctl(fd, mm.UFFDIO_ZEROPAGE, z)
    if err:
        raise UffdError(err, "UFFDIO_ZEROPAGE", max(int(z.zeropage), 0))


def unregister(fd: int, start: int, length: int) -> None:
    err = _ioctl(fd, mm.UFFDIO_UNREGISTER, _Range(start, length))
    if err:
        raise UffdError(err, "UFFDIO_UNREGISTER")


def wake(fd: int, start: int, length: int) -> None:
    err = _ioctl(fd, mm.UFFDIO_WAKE, _Range(start, length))
    if err:
        raise UffdError(err, "UFFDIO_WAKE")


def open_uffd(features: int = 0) -> tuple[int, int]:
    """A new userfaultfd of our own (checks, tests): (fd, features the kernel granted)."""
    fd = libc.syscall(mm.SYS_userfaultfd, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        err = ctypes.get_errno()
        raise UffdError(err, "userfaultfd")
    api = _Api(mm.UFFD_API, features, 0)
    err = _ioctl(fd, mm.UFFDIO_API, api)
    if err:
        os.close(fd)
        raise UffdError(err, "UFFDIO_API")
    return fd, int(api.features)


def register(fd: int, start: int, length: int) -> None:
    err = _ioctl(fd, mm.UFFDIO_REGISTER, _Register(start, length, mm.UFFDIO_REGISTER_MODE_MISSING, 0))
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
