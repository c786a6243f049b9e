"""The C library through ctypes: the process's own (already mapped: CDLL(None) searches nothing and
runs no ldconfig), loaded once, with the prototypes of the calls migrt makes declared once here.
Callers read errno with ctypes.get_errno() (use_errno) and raise their own errors.

ctypes costs the restore path measurably before CRIU runs (tests/unit/test_restore_imports.py): import
this module only where a call is about to be made, or from modules that are off that path."""

from __future__ import annotations

import ctypes

c_void_p, c_size_t, c_int, c_long = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_long


class Iovec(ctypes.Structure):
    """struct iovec (process_vm_readv, readv/writev)."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc = ctypes.CDLL(None, use_errno=True)

libc.mmap.restype = c_void_p
libc.mmap.argtypes = [c_void_p, c_size_t, c_int, c_int, c_int, c_long]
libc.munmap.argtypes = [c_void_p, c_size_t]
libc.madvise.argtypes = [c_void_p, c_size_t, c_int]
libc.fallocate.argtypes = [c_int, c_int, ctypes.c_int64, ctypes.c_int64]
libc.fallocate.restype = c_int
libc.process_vm_readv.argtypes = [c_int, ctypes.POINTER(Iovec), ctypes.c_ulong, ctypes.POINTER(Iovec),
                                  ctypes.c_ulong, ctypes.c_ulong]
libc.process_vm_readv.restype = ctypes.c_ssize_t
libc.ioctl.argtypes = [c_int, ctypes.c_ulong, c_void_p]
libc.ioctl.restype = c_int
libc.syscall.restype = c_long  # variadic: no argtypes
libc.umount2.argtypes = [ctypes.c_char_p, c_int]
libc.setns.argtypes = [c_int, c_int]
libc.free.argtypes = [c_void_p]
libc.free.restype = None
libc.sync_file_range.argtypes = [c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
libc.sync_file_range.restype = c_int
