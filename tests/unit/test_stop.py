"""runtime/stop.py: a frozen container is killed task by task while still frozen, then thawed, then
deleted; failures leave it frozen (never running) and say so. A fake runc keeps the container's
status in a file; os.kill is recorded in the same log, so the order of kills and runc calls shows."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from migrt.errors import RuntimeFailed
from migrt.runtime import control, stop
from migrt.runtime.runc import LowerRuntime
from tests.unit.support import make_executable

FAKE = """\
#!{python} -S
import json, os, sys
args = sys.argv[1:]
cmd, cid = args[2], args[-1]
here = {here!r}
def status():
    try:
        return open(os.path.join(here, "status")).read()
    except OSError:
        return None
def set_status(s):
    if s is None:
        if status() is not None:
            os.unlink(os.path.join(here, "status"))
    else:
        open(os.path.join(here, "status"), "w").write(s)
with open(os.path.join(here, "log"), "a") as fh:
    fh.write(json.dumps([cmd, status()]) + "\\n")
fail = os.environ.get("FAKE_FAIL", "").split(",")
if cmd in fail:
    sys.stderr.write('time="now" level=error msg="fake %s failure"\\n' % cmd)
    if cmd == "resume" and os.environ.get("FAKE_DIES_FROZEN"):
        set_status("stopped")  # cgroup v2: SIGKILL lands in the frozen cgroup, nothing is left to resume
    sys.exit(1)
if cmd == "state":
    if status() is None:
        sys.stderr.write('time="now" level=error msg="container does not exist"\\n')
        sys.exit(1)
    print(json.dumps({{"id": cid, "status": status()}}))
elif cmd == "ps":
    print(os.environ.get("FAKE_PS", "[101, 102, 103]"))
elif cmd == "resume":
    set_status("running")
elif cmd == "delete":
    set_status(None)
"""


@pytest.fixture
def rig(tmp_path, monkeypatch):
    runc = make_executable(tmp_path / "runc", FAKE.format(python=sys.executable, here=str(tmp_path)))
    log = tmp_path / "log"
    monkeypatch.delenv("FAKE_FAIL", raising=False)
    monkeypatch.delenv("FAKE_DIES_FROZEN", raising=False)

    def kill(pid, sig):
        with open(log, "a") as fh:
            fh.write(json.dumps([f"kill {pid} {signal.Signals(sig).name}", None]) + "\n")
        if pid == 102:
            raise ProcessLookupError(pid)

    monkeypatch.setattr(stop.os, "kill", kill)

    class Rig:
        path = str(runc)

        @staticmethod
        def status(s: str) -> None:
            (tmp_path / "status").write_text(s)

        @staticmethod
        def calls() -> list[str]:
            return [json.loads(x)[0] for x in log.read_text().splitlines()] if log.exists() else []

        @staticmethod
        def gone() -> bool:
            return not (tmp_path / "status").exists()

    return Rig


def test_frozen_container_is_killed_before_it_is_thawed(rig):
    rig.status("paused")
    LowerRuntime(rig.path).stop("/r", "c1")
    # every task gets SIGKILL while frozen (102 already gone: ignored), only then resume, then delete
    assert rig.calls() == ["state", "ps", "kill 101 SIGKILL", "kill 102 SIGKILL", "kill 103 SIGKILL", "resume",
                           "delete"]
    assert rig.gone()


def test_running_container_is_just_deleted(rig):
    rig.status("running")
    LowerRuntime(rig.path).stop("/r", "c1")
    assert rig.calls() == ["state", "delete"] and rig.gone()


def test_a_container_the_runtime_does_not_know_is_nothing_to_stop(rig):
    LowerRuntime(rig.path).stop("/r", "c1")
    assert rig.calls() == ["state", "delete"]  # delete --force still removes a state directory without state.json


def test_cgroup_v2_kill_lands_while_frozen_so_a_failed_resume_is_fine(rig, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "resume")
    monkeypatch.setenv("FAKE_DIES_FROZEN", "1")
    rig.status("paused")
    LowerRuntime(rig.path).stop("/r", "c1")
    assert rig.calls()[-3:] == ["resume", "state", "delete"] and rig.gone()


def test_a_container_that_cannot_be_thawed_stays_frozen_and_is_not_deleted(rig, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "resume")
    rig.status("paused")
    with pytest.raises(RuntimeFailed, match=r"container c1 was killed while frozen but cannot be thawed for "
                                            r"the kill to land \(fake resume failure\); it stays frozen: run 'migrt recover'"):
        LowerRuntime(rig.path).stop("/r", "c1")
    assert "delete" not in rig.calls()


def test_unlisted_processes_are_never_thawed(rig, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "ps")
    rig.status("paused")
    with pytest.raises(RuntimeFailed, match=r"cannot list the processes of frozen container c1 \(fake ps failure\)"):
        LowerRuntime(rig.path).stop("/r", "c1")
    assert rig.calls() == ["state", "ps"]  # no kill of a partial list, no resume, no delete


def test_garbage_from_ps_is_no_list(rig, monkeypatch):
    monkeypatch.setenv("FAKE_PS", '["1", -3]')
    rig.status("paused")
    with pytest.raises(RuntimeFailed, match="cannot list the processes"):
        LowerRuntime(rig.path).stop("/r", "c1")
    assert "resume" not in rig.calls()


def test_failed_delete_names_the_container_and_the_next_step(rig, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "delete")
    rig.status("running")
    with pytest.raises(RuntimeFailed, match=r"cannot delete container c1 under /r: fake delete failure; "
                                            r"run 'migrt recover', or 'runc --root /r delete --force c1'"):
        LowerRuntime(rig.path).stop("/r", "c1")


def test_lower_runtime_and_control_destroy_use_it(rig):
    rig.status("paused")
    LowerRuntime(rig.path).stop("/r", "c1")
    assert rig.calls()[-2:] == ["resume", "delete"] and "kill 101 SIGKILL" in rig.calls()
    rig.status("paused")
    control.destroy(rig.path, "/r", "c2")
    assert rig.calls()[-2:] == ["resume", "delete"] and rig.calls().count("kill 103 SIGKILL") == 2
