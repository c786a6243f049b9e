"""The helpers that read the process table and the mount table through psutil (outside migrt-runc's
pass-through path, which stays standard-library only: tests/unit/test_shim.py)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from migrt.ops import gpu_preempt
from migrt.pods import rootfs
from migrt.store import store


def test_pid_alive_counts_processes_not_threads():
    assert store._pid_alive(f"view.{os.getpid()}.1")
    done, started = threading.Event(), threading.Event()
    tids: list[int] = []

    def worker() -> None:
        tids.append(threading.get_native_id())
        started.set()
        done.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert started.wait(10)
        assert os.path.exists(f"/proc/{tids[0]}")  # what the former check looked at
        assert not store._pid_alive(f"view.{tids[0]}.1")  # a thread id is not a live owner
    finally:
        done.set()
        t.join()
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not store._pid_alive(f"restore.ck.{gone.pid}.3")
    assert not store._pid_alive("junk")


def test_cmdline_and_rss_of_a_process():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        # Popen returns once the child exists; its exec may still be under way (cmdline empty or the
        # parent's for a moment): wait for it, bounded, then the helper must read the exec'd argv
        deadline = time.monotonic() + 10
        while store._cmdline(proc.pid) != ["sleep", "30"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._cmdline(proc.pid) == ["sleep", "30"]
        assert gpu_preempt._rss(proc.pid) > 0
    finally:
        proc.kill()
        proc.wait()
    assert store._cmdline(proc.pid) == [] and gpu_preempt._rss(proc.pid) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts an overlay (root only)")
def test_overlay_upperdir_decodes_the_mount_table(tmp_path):
    base = tmp_path / "with space"  # the mount table escapes it (\040)
    dirs = {n: base / n for n in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        d.mkdir(parents=True)
    opts = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(dirs["merged"])], check=True)
    try:
        assert rootfs.overlay_upperdir(str(dirs["merged"])) == str(dirs["upper"])
        assert rootfs.overlay_upperdir(str(dirs["lower"])) is None  # not a mount point
    finally:
        subprocess.run(["umount", str(dirs["merged"])], check=True)
    assert rootfs.overlay_upperdir(str(dirs["merged"])) is None
