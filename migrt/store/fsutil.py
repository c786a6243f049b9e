"""Durable file-system helpers: fsync, atomic writes, hashing."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

CHUNK = 4 << 20


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, data: object, mode: int = 0o600) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def sha256_file(path: str, *, fsync: bool = False) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while True:
            buf = fh.read(CHUNK)
            if not buf:
                break
            h.update(buf)
            size += len(buf)
        if fsync:
            os.fsync(fh.fileno())
    return size, h.hexdigest()


def walk_files(top: str) -> list[str]:
    """Relative paths of all regular files under top (symlinks are refused by the caller)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(filenames):
            out.append(os.path.relpath(os.path.join(dirpath, name), top))
    return out


def hash_tree(top: str, rel_paths: list[str], *, fsync: bool = False, workers: int | None = None,
              progress=None) -> dict[str, dict]:
    """{rel: {"size", "sha256"}}; hashlib releases the GIL, so threads hash files in parallel."""
    workers = workers or min(8, (os.cpu_count() or 2))
    out: dict[str, dict] = {}

    def one(rel: str) -> tuple[str, int, str]:
        size, digest = sha256_file(os.path.join(top, rel), fsync=fsync)
        return rel, size, digest

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for rel, size, digest in pool.map(one, rel_paths):
            out[rel] = {"size": size, "sha256": digest}
            if progress:
                progress(size)
    return out
