"""gpu_checkpoint_thp (migrt/gpu/thp.py): transparent huge pages switched to `always` only while the
driver writes its checkpoint, put back after, across several migrt processes and killed ones; the
config key, `migrt doctor`, and the window around the fake backend's checkpoint calls. A temporary
file stands in for /sys/kernel/mm/transparent_hugepage/enabled; nothing here writes to /sys."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from migrt import config as config_mod
from migrt import log as log_mod
from migrt.errors import ConfigError
from migrt.gpu import session, thp
from migrt.gpu.backend import CHECKPOINTED, RUNNING
from migrt.gpu.fake import FakeGpuBackend, FileFakeGpuBackend
from migrt.node import doctor_gpu
from migrt.ops import gpu_preempt
from tests.unit.test_gpu_fake import U0, h100, inventory
from tests.unit.test_gpu_ops import CHILD, INIT, cfg, node, take_checkpoint  # noqa: F401 - fixtures
from tests.unit.test_gpu_preempt import CID, gpu_node  # noqa: F401 - fixture
from tests.unit.test_gpu_preempt import cfg as node_config

REPO = Path(__file__).resolve().parents[2]
KERNEL_TEXT = "always [madvise] never\n"  # what the kernel's file reads under madvise

HOLDER = """
import os, sys, time
from migrt.gpu import thp
thp.ENABLED, thp.STATE_DIR, flag = sys.argv[1], sys.argv[2], sys.argv[3]
with thp.Window("always") as w:
    open(flag + ".in", "w").write(w.applied)
    while not os.path.exists(flag + ".go"):
        time.sleep(0.01)
"""


class Recorder:
    """Stands in for migrt's logger: (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **fields: self.events.append((level, event, fields))

    def of(self, level: str) -> list[tuple[str, dict]]:
        return [(e, f) for lv, e, f in self.events if lv == level]


@pytest.fixture
def sysfs(tmp_path, monkeypatch) -> Path:
    enabled = tmp_path / "enabled"
    enabled.write_text(KERNEL_TEXT)
    monkeypatch.setattr(thp, "ENABLED", str(enabled))
    monkeypatch.setattr(thp, "STATE_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(thp, "_warned", False)
    return enabled


@pytest.fixture
def logged(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(log_mod, "get", lambda: rec)
    return rec


def state() -> dict | None:
    try:
        return json.loads(Path(thp.state_path()).read_text())
    except FileNotFoundError:
        return None


class Holder:
    """A migrt-like process holding a window until released (or killed)."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.flag = tmp_path / name
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, thp.ENABLED, thp.STATE_DIR, str(self.flag)],
                                     cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        end = time.monotonic() + 30
        while not Path(f"{self.flag}.in").exists():
            assert self.proc.poll() is None, f"holder {name} exited with {self.proc.returncode}"
            assert time.monotonic() < end, f"holder {name} never entered its window"
            time.sleep(0.01)
        self.applied = Path(f"{self.flag}.in").read_text()

    def release(self) -> None:
        Path(f"{self.flag}.go").touch()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


# -- the window ------------------------------------------------------------------------------------------
def test_window_switches_to_always_and_puts_the_value_back(sysfs):
    with thp.Window("always") as w:
        assert thp.current() == "always" and w.applied == "always"
        held = state()
        assert held["before"] == "madvise"
        assert [(h["pid"], h["start_time"]) for h in held["holders"]] == [
            (os.getpid(), thp.procs.start_time(os.getpid()))]
    assert thp.current() == "madvise"
    assert state() is None
    assert w.applied == "always"


def test_keep_never_touches_the_file_nor_the_state(sysfs, tmp_path):
    before = sysfs.stat()
    with thp.Window("keep") as w:
        assert thp.current() == "madvise"
    assert w.applied == "kept"
    assert sysfs.read_text() == KERNEL_TEXT and sysfs.stat().st_mtime_ns == before.st_mtime_ns
    assert not (tmp_path / "run").exists()


def test_already_always_is_left_alone(sysfs):
    sysfs.write_text("[always] madvise never\n")
    with thp.Window("always") as w:
        assert state() is None
    assert w.applied == "always" and sysfs.read_text() == "[always] madvise never\n"


def test_overlapping_windows_of_two_processes_put_the_value_back_after_the_last(sysfs, tmp_path):
    a = Holder(tmp_path, "a")
    assert a.applied == "always" and thp.current() == "always"
    b = Holder(tmp_path, "b")
    assert b.applied == "always"
    assert [h["pid"] for h in state()["holders"]] == [a.proc.pid, b.proc.pid]
    a.release()
    assert thp.current() == "always"  # b still writes its checkpoint
    assert [h["pid"] for h in state()["holders"]] == [b.proc.pid] and state()["before"] == "madvise"
    b.release()
    assert thp.current() == "madvise" and state() is None


def test_two_windows_of_one_process_are_told_apart(sysfs):
    first, second = thp.Window("always"), thp.Window("always")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert thp.current() == "always" and len(state()["holders"]) == 1
    second.__exit__(None, None, None)
    assert thp.current() == "madvise" and state() is None


def test_a_killed_holder_is_dropped_by_the_next_window(sysfs, tmp_path, logged):
    a = Holder(tmp_path, "a")
    a.kill()
    assert thp.current() == "always" and [h["pid"] for h in state()["holders"]] == [a.proc.pid]
    with thp.Window("always") as w:
        assert w.applied == "always" and thp.current() == "always"
        assert [h["pid"] for h in state()["holders"]] == [os.getpid()]
        assert state()["before"] == "madvise"  # the dead holder's record, not the `always` it left
    assert thp.current() == "madvise" and state() is None
    assert [f["holders"][0]["pid"] for e, f in logged.of("warning") if e == "gpu_checkpoint_thp_holder_gone"] == [
        a.proc.pid]


def test_a_pid_reused_by_another_process_is_a_dead_holder(sysfs):
    os.makedirs(thp.STATE_DIR)
    Path(thp.state_path()).write_text(json.dumps(
        {"before": "madvise", "holders": [{"pid": os.getpid(), "start_time": -1, "token": "x"}]}))
    sysfs.write_text("always")
    assert thp.repair()["put_back"] == "madvise"
    assert thp.current() == "madvise" and state() is None


def test_doctor_puts_back_what_a_killed_holder_left(sysfs, tmp_path):
    a = Holder(tmp_path, "a")
    a.kill()
    checks = {c["name"]: c for c in doctor_gpu.gpu_checks("/usr/bin/nvidia-container-runtime", backend=_Api(),
                                                          inv=inventory(h100(0, U0)), thp_mode="always")}
    window = checks["gpu checkpoint THP window"]
    assert window["status"] == "warn" and "THP left at always by a migrt that died" in window["detail"]
    assert f"pid {a.proc.pid}" in window["detail"] and "put back to madvise" in window["detail"]
    assert thp.current() == "madvise" and state() is None
    assert checks["transparent huge pages"]["status"] == "ok"  # always in the window: nothing to recommend
    again = {c["name"] for c in doctor_gpu.gpu_checks("/usr/bin/nvidia-container-runtime", backend=_Api(),
                                                      inv=inventory(h100(0, U0)), thp_mode="always")}
    assert "gpu checkpoint THP window" not in again  # settled: nothing to say any more


def test_doctor_says_a_live_window_is_temporary_and_recommends_the_setting(sysfs, tmp_path):
    a = Holder(tmp_path, "a")
    try:
        checks = {c["name"]: c for c in doctor_gpu.thp_checks("keep")}
        assert checks["transparent huge pages"]["status"] == "ok"
        assert f"always while migrt pid {a.proc.pid}" in checks["transparent huge pages"]["detail"]
        assert "madvise otherwise" in checks["transparent huge pages"]["detail"]
        assert thp.current() == "always"  # a live holder's window stays open
    finally:
        a.release()
    plain = {c["name"]: c for c in doctor_gpu.thp_checks("keep")}["transparent huge pages"]
    assert plain["status"] == "warn" and "gpu_checkpoint_thp: always" in plain["fix"]


class _Api:
    def available(self):
        return True

    def driver_api_version(self):
        return 13000


# -- nothing writable: warn once, the checkpoint goes on ------------------------------------------------
def test_unwritable_sysfs_warns_once_and_the_checkpoint_goes_on(sysfs, logged, monkeypatch):
    def read_only(value):
        raise OSError(errno.EROFS, "Read-only file system", thp.ENABLED)

    monkeypatch.setattr(thp, "_set", read_only)
    backend = FakeGpuBackend([1, 2])
    for _ in range(2):
        window = thp.Window("always")
        session.suspend_all([1, 2], backend, checkpoint_window=window)
        assert window.applied == "failed"
        assert [backend.states[p] for p in (1, 2)] == [CHECKPOINTED, CHECKPOINTED]
        session.resume_all([1, 2], backend)
    warnings = [f for e, f in logged.of("warning") if e == "gpu_checkpoint_thp_unchanged"]
    assert len(warnings) == 1 and "Read-only file system" in warnings[0]["error"]
    assert thp.current() == "madvise" and state() is None  # no record of a switch that did not happen


def test_unwritable_state_dir_warns_and_switches_nothing(sysfs, tmp_path, logged, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(thp, "STATE_DIR", str(tmp_path / "file" / "run"))  # not creatable, even by root
    with thp.Window("always") as w:
        assert thp.current() == "madvise"  # never switched without a record to put it back from
    assert w.applied == "failed" and len(logged.of("warning")) == 1


def test_a_failed_checkpoint_closes_the_window(sysfs):
    backend = FakeGpuBackend([1, 2])
    backend.fail("checkpoint", 2)
    window = thp.Window("always")
    with pytest.raises(session.GpuError, match="GPU checkpoint of 2 process"):
        session.suspend_all([1, 2], backend, checkpoint_window=window)
    assert [backend.states[p] for p in (1, 2)] == [RUNNING, RUNNING]
    assert thp.current() == "madvise" and state() is None


# -- through migrt checkpoint on the fake backend --------------------------------------------------------
@pytest.fixture
def watched(node, monkeypatch) -> list[tuple]:
    """(call, pid, THP setting at that moment) for every driver call."""
    seen: list[tuple] = []
    transition = node.backend._transition

    def watch(call, pid, extra=None):
        seen.append((call, pid, thp.current()))
        return transition(call, pid, extra)

    monkeypatch.setattr(node.backend, "_transition", watch)
    return seen


def test_checkpoint_with_always_writes_the_host_copy_under_huge_pages(sysfs, cfg, watched):  # noqa: F811
    cfg.gpu_checkpoint_thp = "always"
    data = take_checkpoint(cfg)
    assert sorted(w for w in watched if w[0] == "checkpoint") == [("checkpoint", INIT, "always"),
                                                                  ("checkpoint", CHILD, "always")]
    assert {w[2] for w in watched if w[0] == "lock"} == {"madvise"}  # the window opens after the locks
    assert thp.current() == "madvise" and state() is None
    assert data["gpu"]["thp"] == "always"


def test_checkpoint_by_default_leaves_thp_alone(sysfs, cfg, watched):  # noqa: F811
    data = take_checkpoint(cfg)
    assert {w[2] for w in watched} == {"madvise"}
    assert sysfs.read_text() == KERNEL_TEXT and not os.path.exists(thp.STATE_DIR)
    assert data["gpu"]["thp"] == "kept"


def test_gpu_suspend_in_place_with_always(sysfs, gpu_node, monkeypatch):  # noqa: F811
    """`migrt gpu suspend` (and migrt-runc's pause with GPU release): real processes on the simulated node."""
    seen = []
    checkpoint = FileFakeGpuBackend.checkpoint
    monkeypatch.setattr(FileFakeGpuBackend, "checkpoint",
                        lambda self, pid: (seen.append(thp.current()), checkpoint(self, pid))[1])
    box = gpu_node.box()
    c = node_config()
    c.gpu_checkpoint_thp = "always"
    rec = gpu_preempt.suspend(c, CID, str(gpu_node.runc_root))
    assert seen == ["always"] * len(box.pids()) and rec["thp"] == "always"
    assert thp.current() == "madvise" and state() is None
    gpu_preempt.resume(c, CID, str(gpu_node.runc_root))


# -- config -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["gpu_checkpoint_thp: on\n", "gpu_checkpoint_thp: madvise\n",
                                  "gpu_checkpoint_thp: [always]\n"])
def test_config_refuses_other_values(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=r"'gpu_checkpoint_thp' must be one of \('keep', 'always'\), got"):
        config_mod.load(str(p))


def test_config_default_and_always(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("gpu_backend: none\n")
    assert config_mod.load(str(p)).gpu_checkpoint_thp == "keep"
    p.write_text("gpu_checkpoint_thp: always\n")
    cfg_ = config_mod.load(str(p))
    assert cfg_.gpu_checkpoint_thp == "always" and thp.window(cfg_).setting == "always"


@pytest.mark.parametrize("content", [b"[" * 100_000 + b"]" * 100_000, b'{"holders": ' + b"[" * 60_000, b"\xff\x00",
                                     b'{"before": "madvise"}'])
def test_a_damaged_state_file_is_set_aside_with_a_clear_message(sysfs, logged, content):
    """Deeply nested JSON in /run/migrt/thp.json once raised RecursionError in repair() (migrt doctor)."""
    os.makedirs(thp.STATE_DIR)
    Path(thp.state_path()).write_bytes(content)
    found = thp.repair()
    assert found["holders"] == [] and found["put_back"] is None
    assert found["damaged"].startswith(f"{thp.state_path()} is damaged (")
    assert "set aside as" in found["damaged"] and "says madvise now" in found["damaged"]
    assert found["damaged"].isprintable() and len(found["damaged"]) < 600
    assert not os.path.exists(thp.state_path())
    assert Path(thp.state_path() + ".damaged").read_bytes() == content
    checks = {c["name"]: c for c in doctor_gpu.thp_checks("always")}
    assert "gpu checkpoint THP window" not in checks  # set aside: the next doctor has nothing to say
    Path(thp.state_path()).write_bytes(content)
    with thp.Window("always") as w:  # a window goes on as the first holder, and puts its value back
        assert w.applied == thp.ALWAYS and thp.current() == "always"
    assert thp.current() == "madvise" and state() is None


def test_doctor_shows_a_damaged_state_file(sysfs):
    os.makedirs(thp.STATE_DIR)
    Path(thp.state_path()).write_bytes(b"[" * 100_000)
    window = {c["name"]: c for c in doctor_gpu.thp_checks("always")}["gpu checkpoint THP window"]
    assert window["status"] == "warn" and "is damaged (nested deeper than 8 levels" in window["detail"]
