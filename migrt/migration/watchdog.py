"""Deadlines derived from progress, for the CRIU processes a migration waits on.

A restore of many GB may take minutes, and a deadlocked one never ends (docs/migration.md, "Lazy
pages: what hung"): a fixed timeout is either too short for the first or far too long for the
second. So the rule is: a child that has made no progress for `stall` seconds is stuck. Progress is
any I/O or CPU time of the child or its descendants (bytes and system calls counted in /proc/PID/io:
reading images, receiving pages) plus those of what the caller adds (e.g. the lazy-pages daemon).
A stuck child is killed with its whole process tree; `unmount_under` then removes what CRIU left
mounted in its work directory (its cgroup "yard"), so that the directory can be deleted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable

import psutil

from migrt.errors import RuntimeFailed

POLL = 0.1


class Stuck(RuntimeFailed):
    """A child made no progress for the stall deadline (or lost a process it depends on) and was killed."""


def tree(pid: int) -> list[psutil.Process]:
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def activity(pids: Iterable[int]) -> int:
    """A number that grows while these processes or their descendants work: bytes and system calls
    of I/O, and CPU time in centiseconds (a deadlocked process does neither)."""
    total = 0
    for pid in pids:
        for proc in tree(pid):
            try:
                io = proc.io_counters()
                cpu = proc.cpu_times()
            except psutil.Error:
                continue
            total += io.read_chars + io.write_chars + io.read_count + io.write_count
            total += int((cpu.user + cpu.system) * 100)
    return total


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a child started with start_new_session=True, its process group and every descendant."""
    victims = tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def supervise(proc: subprocess.Popen, *, stall: float, what: str, also: Callable[[], list[int]] = list,
              check: Callable[[], str | None] = lambda: None) -> int:
    """Wait for `proc`; return its exit status. Kill it and raise Stuck when it made no progress (its
    I/O and that of `also()`'s pids) for `stall` seconds, or at once when `check()` names a reason."""
    last, t_last = -1, time.monotonic()
    while True:
        try:
            return proc.wait(POLL)
        except subprocess.TimeoutExpired:
            pass
        reason = check()
        if reason:
            kill_tree(proc)
            raise Stuck(f"{what}: {reason}; killed it")
        now = activity([proc.pid, *also()])
        if now != last:
            last, t_last = now, time.monotonic()
        elif time.monotonic() - t_last > stall:
            kill_tree(proc)
            raise Stuck(f"{what}: no progress for {stall:g} s (no I/O or CPU time by it or its children); killed it "
                        f"(deadline: 'migration_stall_timeout' in the config)")


_libc = None


def unmount_under(path: str) -> list[str]:
    """Detach every mount at or below `path` (deepest first); return them."""
    global _libc
    path = os.path.realpath(path)
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                mnt = line.split()[4].encode().decode("unicode_escape")
                if mnt == path or mnt.startswith(path + "/"):
                    found.append(mnt)
    except OSError:
        return []
    if found and _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    for mnt in sorted(found, key=len, reverse=True):
        _libc.umount2(mnt.encode(), 2)  # MNT_DETACH
    return found


def clear_container(runtime: str, root: str, cid: str) -> None:
    """Remove container `cid` from runtime root `root` whatever state a killed restore left it in.

    First unmount what the killed runc left in its state directory: runc bind-mounts the bundle's
    rootfs on `<root>/<id>/criu-root` for CRIU and unmounts it when it returns, which a killed runc
    never does; and `runc delete` of a container without state.json removes that directory with
    RemoveAll, which walks into the bind mount and deletes the bundle's rootfs. Then `delete
    --force`, then the state directory if runc had not written state.json yet."""
    state_dir = os.path.join(root, cid)
    unmount_under(state_dir)
    subprocess.run([runtime, "--root", root, "delete", "--force", cid], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=60)
    deadline = time.monotonic() + 5
    while os.path.isdir(state_dir) and not os.path.exists(os.path.join(state_dir, "state.json")):
        unmount_under(state_dir)
        if not unmount_under(state_dir):  # never remove through a mount that will not go
            shutil.rmtree(state_dir, ignore_errors=True)
        if time.monotonic() > deadline:
            raise RuntimeFailed(f"cannot remove {state_dir} left by a killed restore; unmount what is mounted "
                                "under it and remove it by hand")
        time.sleep(0.05)
