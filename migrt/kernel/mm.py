"""Memory-management numbers of the Linux ABI (the same on x86-64 and arm64; userfaultfd's syscall
number per architecture): mmap's protections and flags, madvise's advice, fallocate's modes,
userfaultfd's ioctls and features. Plain integers: no ctypes here, so the restore path may read them."""

from __future__ import annotations

import os

# mmap(2)
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
MAP_FAILED = (1 << 64) - 1  # (void *) -1 as ctypes.c_void_p gives it back

# madvise(2)
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22   # Linux 5.14
MADV_POPULATE_WRITE = 23

# fallocate(2)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

# userfaultfd(2), linux/userfaultfd.h
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
