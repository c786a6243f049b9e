"""What the kernel shows of a process without touching it, read under a proc root ("/proc"; the
tests give a directory laid out the same way): mapped files, open files, the initial environment,
its network namespace's unix sockets, its threads' names, and files inside its root. Standard
library only (the CRIU hook and migrt-runc's decision use it).

Paths in /proc/PID/maps, /proc/PID/fd and /proc/PID/net/unix are as the process sees them (inside
its container). Files inside a container's root are opened component by component from
/proc/PID/root with O_NOFOLLOW, refusing '..' and symbolic links: a container cannot point migrt
(root, on the host) at a host file.
"""

from __future__ import annotations

import os
import re
import stat

PROC = "/proc"  # the tests point it (or the proc= arguments) at a tree of their own
_DELETED = " (deleted)"
SO_ACCEPTCON = 0x00010000  # /proc/net/unix Flags of a listening socket
SOCK_STREAM, SOCK_DGRAM = 1, 2


def at(proc: str | None) -> str:
    """The proc root to read: the one given, else PROC (read at call time)."""
    return proc or PROC


def _read(path: str, limit: int = 1 << 24) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode(errors="replace")
    except OSError:
        return None


def mapped_files(pid: int, proc: str | None = None) -> list[str]:
    """The files pid maps (each once, in order of first mapping), ' (deleted)' stripped."""
    seen: dict[str, None] = {}
    for line in (_read(f"{at(proc)}/{pid}/maps") or "").splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5]
            seen.setdefault(path[: -len(_DELETED)] if path.endswith(_DELETED) else path)
    return list(seen)


def fd_targets(pid: int, proc: str | None = None) -> list[str]:
    """readlink of every open descriptor of pid ('socket:[123]', '/dev/nvidia0', ...)."""
    out: list[str] = []
    try:
        fds = os.listdir(f"{at(proc)}/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            out.append(os.readlink(f"{at(proc)}/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def thread_names(pid: int, proc: str | None = None) -> list[str]:
    """The names of pid's threads (/proc/PID/task/TID/comm, at most 15 characters each), sorted."""
    try:
        tids = os.listdir(f"{at(proc)}/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        name = _read(f"{at(proc)}/{pid}/task/{tid}/comm", 64)
        if name is not None:
            out.append(name.rstrip("\n"))
    return sorted(out)


def socket_inodes(pid: int, proc: str | None = None) -> set[int]:
    out = set()
    for target in fd_targets(pid, proc):
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            out.add(int(m.group(1)))
    return out


def environ(pid: int, proc: str | None = None) -> dict[str, str]:
    """The environment pid started with (what a process sets later with setenv is not there)."""
    try:
        with open(f"{at(proc)}/{pid}/environ", "rb") as fh:
            raw = fh.read(1 << 20)
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep and key:
            out.setdefault(key, value)
    return out


def unix_sockets(pid: int, proc: str | None = None) -> list[tuple[int, str, int, bool]]:
    """(inode, path, type, listening) of the bound unix sockets of pid's network namespace; an
    abstract name is given as '@name'."""
    out = []
    lines = (_read(f"{at(proc)}/{pid}/net/unix") or "").splitlines()
    for line in lines[1:]:
        f = line.split(None, 7)
        if len(f) < 8:
            continue
        try:
            flags, typ, inode = int(f[3], 16), int(f[4], 16), int(f[6])
        except ValueError:
            continue
        out.append((inode, f[7], typ, bool(flags & SO_ACCEPTCON)))
    return out


def safe_path(path: str) -> list[str]:
    """The components of an absolute path inside a container root; ValueError for '..', '.' or a
    relative path (a container must not lead migrt out of its root)."""
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts) or not parts:
        raise ValueError(f"{path!r} is not a plain path")
    return parts


def open_in_root(pid: int, path: str, *, proc: str | None = None, want: str = "file") -> int:
    """An O_PATH descriptor of `path` inside pid's root, walked with O_NOFOLLOW: every directory a
    real directory, the last component a regular file (want='file') or a socket (want='socket').
    OSError or ValueError when it is anything else; the caller closes the descriptor."""
    parts = safe_path(path)
    fd = os.open(f"{at(proc)}/{pid}/root", os.O_PATH | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        last = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)
    mode = os.fstat(last).st_mode
    if (want == "file" and not stat.S_ISREG(mode)) or (want == "socket" and not stat.S_ISSOCK(mode)):
        os.close(last)
        raise ValueError(f"{path} in the root of process {pid} is not a {want}")
    return last


def read_in_root(pid: int, path: str, *, proc: str | None = None, limit: int = 1 << 16) -> str | None:
    """A small regular file inside pid's root (None when it is missing or not a plain file)."""
    try:
        fd = open_in_root(pid, path, proc=proc)
    except (OSError, ValueError):
        return None
    try:
        with open(f"/proc/self/fd/{fd}", "rb") as fh:
            return fh.read(limit).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)
