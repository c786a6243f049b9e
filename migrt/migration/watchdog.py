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

import os
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


def kill_users(path: str) -> list[int]:
    """SIGKILL every process with its working directory or an open file at or below `path`. A CRIU
    restore detaches from runc (its own session, reparented to init: "criu: restore --rpc") and
    escapes kill_tree; it keeps its log open in the restore's work directory, which finds it."""
    path = os.path.realpath(path)
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            paths = [proc.cwd()] + [f.path for f in proc.open_files()]
        except psutil.Error:
            continue
        if any(x == path or x.startswith(path + "/") for x in paths):
            try:
                proc.kill()
                found.append(proc.pid)
            except psutil.Error:
                pass
    return found


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


# moved to the runtime room (ops/restore.py and ops/recover.py need them too); names kept here
from migrt.runtime.cleanup import clear_container, unmount_under  # noqa: E402,F401
