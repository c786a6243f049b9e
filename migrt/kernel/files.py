"""Durable files: the one atomic write (borg's rule: a temporary file in the same directory, fsync,
os.replace, fsync the directory) and TREE_CHUNK, the 64 MiB unit of large-file work: the store's tree
digests, the parallel dump's pieces, a transfer's chunks, the page filler's verification.

durable=False keeps the all-or-nothing rename but skips both fsyncs: for files on tmpfs (/run) or
that live for seconds (status files, lists rewritten under a lock), where only a torn read matters."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import IO, Any

TREE_CHUNK = 64 << 20  # a multiple of the 2 MiB huge page


def fsync_path(path: str, flags: int = 0) -> None:
    """fsync a file (or, with O_DIRECTORY, a directory) by its path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fsync_path(path, os.O_DIRECTORY)


SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a range of a file to disk now, without waiting (sync_file_range WRITE): what a
    later fsync must wait for is then mostly written already. On a machine with much memory the kernel
    would otherwise write nothing before that fsync (dirty_background_ratio), which then writes it all.
    A best effort: a file system that cannot do it is left to the fsync."""
    from migrt.kernel.libc import libc

    libc.sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)


@contextlib.contextmanager
def atomic_file(path: str, mode: int = 0o600, *, text: bool = False, durable: bool = True) -> Iterator[IO[Any]]:
    """Write `path` all or nothing: the block writes a temporary file in the same directory (a hidden
    name: no glob of the directory picks it up), which is fsynced, given `mode` and renamed over `path`
    when the block ends, then the directory is fsynced. On any exception the temporary file goes and
    `path` is as it was."""
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")  # not tempfile: the shim's imports
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w" if text else "wb", encoding="utf-8" if text else None) as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(d)

