"""migrt/pods/hold.py: one pod's hold record (who is in, the last part releases all, the deadline
abandons) and the freeze script CRIU runs at pre-resume. The freeze itself, with runc and CRIU:
tests/integration/test_pod_hold.py."""

from __future__ import annotations

import json
import os

import pytest

from migrt.errors import Conflict, PreconditionFailed, RuntimeFailed, UsageError
from migrt.pods import hold


class Thaws:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = fail or set()

    def __call__(self, root: str, cid: str) -> None:
        self.calls.append((root, cid))
        if cid in self.fail:
            raise RuntimeFailed(f"runc resume {cid}: no")


def _hold(tmp_path, thaws=None, sandbox="sb1") -> hold.Hold:
    return hold.Hold(str(tmp_path), sandbox, resume=thaws or Thaws())


def test_the_last_part_releases_every_part_together(tmp_path):
    thaws = Thaws()
    first, second, third = (_hold(tmp_path, thaws) for _ in range(3))  # each create opens its own
    first.join(["sidecar", "app", "log"], 30)
    assert first.arrived("sidecar", "c1") is False
    second.join(["app", "log", "sidecar"], 30)  # the same pod, listed in another order
    assert second.arrived("app", "c2") is False
    assert thaws.calls == [] and first.state() == hold.HOLDING
    third.join(["log", "app", "sidecar"], 30)
    assert third.arrived("log", "c3") is True
    parts = third.release()
    assert [(p.name, p.cid) for p in parts] == [("app", "c2"), ("log", "c3"), ("sidecar", "c1")]
    assert thaws.calls == [(str(tmp_path), "c2"), (str(tmp_path), "c3"), (str(tmp_path), "c1")]
    assert first.wait() == hold.RELEASED and first.abandon("late") is False  # released stays released
    rec = json.loads((tmp_path / ".migrt-hold-sb1.json").read_text())
    assert rec["state"] == "released" and rec["expected"] == ["app", "log", "sidecar"]


def test_the_deadline_abandons_the_hold_and_a_late_part_is_refused(tmp_path):
    h = _hold(tmp_path)
    h.join(["app", "side"], 0.2)
    h.arrived("side", "c1")
    assert h.wait(poll=0.01) == hold.ABANDONED  # the owner of "side" sees it and removes its copy
    with pytest.raises(PreconditionFailed, match=r"given up \(deadline passed without containers \['app'\]\)"):
        h.arrived("app", "c2")
    with pytest.raises(Conflict, match="not every part is in"):
        h.release()


def test_an_abandoned_hold_never_releases(tmp_path):
    thaws = Thaws()
    h = _hold(tmp_path, thaws)
    h.join(["app", "side"], 30)
    h.arrived("side", "c1")
    assert h.abandon("the source pod resumed") is True
    with pytest.raises(PreconditionFailed, match="the source pod resumed"):
        h.arrived("app", "c2")
    assert thaws.calls == [] and h.state() == hold.ABANDONED


def test_parts_must_expect_the_same_pod_and_be_one_of_it(tmp_path):
    h = _hold(tmp_path)
    h.join(["app", "side"], 30)
    with pytest.raises(Conflict, match=r"expects containers \['app'\], the pod's first part \['app', 'side'\]"):
        _hold(tmp_path).join(["app"], 30)
    with pytest.raises(UsageError, match="'other' is not one of"):
        h.arrived("other", "c9")
    for bad in ([], ["../x"], [""]):
        with pytest.raises(UsageError):
            _hold(tmp_path, sandbox="sb2").join(bad, 30)
    with pytest.raises(UsageError, match="invalid sandbox id"):
        hold.Hold(str(tmp_path), "../../etc")


def test_a_part_that_cannot_be_thawed_is_named(tmp_path):
    h = _hold(tmp_path, Thaws(fail={"c2"}))
    h.join(["a", "b"], 30)
    h.arrived("a", "c1")
    assert h.arrived("b", "c2") is True
    with pytest.raises(RuntimeFailed, match=r"could not thaw b \(c2\).*resume ID"):
        h.release()


def test_sweep_removes_ended_holds_of_gone_pods_only(tmp_path):
    for sandbox, state in (("gone1", "released"), ("gone2", "holding"), ("live1", "abandoned")):
        h = _hold(tmp_path, sandbox=sandbox)
        h.join(["a"], 30)
        if state == "released":
            h.arrived("a", "c1")
            h.release()
        elif state == "abandoned":
            h.abandon("x")
    (tmp_path / "not-a-hold").write_text("")
    hold.sweep(str(tmp_path), live=lambda sb: sb.startswith("live"))
    assert sorted(os.listdir(tmp_path)) == [".migrt-hold-gone2.json", ".migrt-hold-live1.json", "not-a-hold"]


def test_the_freeze_script_steps_out_of_the_cgroup_then_freezes(tmp_path, monkeypatch):
    monkeypatch.setattr(hold, "_mounts", lambda: ("/sys/fs/cgroup/freezer", "/sys/fs/cgroup/unified"))
    env = hold.criu_env({"PATH": "/bin"}, str(tmp_path))
    with open(env["CRIU_CONFIG_FILE"]) as fh:
        conf = fh.read()
    assert conf == f"action-script {tmp_path}/pod-hold.sh\n"
    script = (tmp_path / "pod-hold.sh").read_text()
    assert '[ "$CRTOOLS_SCRIPT_ACTION" = pre-resume ] || exit 0' in script
    assert "echo FROZEN > /sys/fs/cgroup/freezer\"$v1\"/freezer.state" in script
    assert "echo 1 > /sys/fs/cgroup/unified\"$v2\"/cgroup.freeze" in script
    assert script.index("away /sys/fs/cgroup/freezer") < script.index("echo FROZEN")
    assert os.stat(tmp_path / "pod-hold.sh").st_mode & 0o777 == 0o700


def test_mounts_are_read_from_mountinfo():
    v1, v2 = hold._mounts()
    with open("/proc/self/mountinfo") as fh:
        text = fh.read()
    assert (v2 != "") == (" - cgroup2 " in text)
    assert (v1 != "") == any(" - cgroup " in line and "freezer" in line for line in text.splitlines())


def test_state_of_a_missing_record_is_abandoned(tmp_path):
    h = _hold(tmp_path)
    assert h.state() == hold.ABANDONED  # nothing joined: no part may run ahead of it


def test_the_pods_loopback_is_held_from_the_join_until_the_release_or_the_abandon(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(hold.netlock, "lock", lambda netns: calls.append(f"lock {netns}"))
    monkeypatch.setattr(hold.netlock, "unlock", lambda netns: calls.append(f"unlock {netns}"))
    thaws = Thaws()
    h = hold.Hold(str(tmp_path), "sb1", resume=lambda r, cid: (calls.append(f"thaw {cid}"), thaws(r, cid)))
    h.join(["a", "b"], 30, "/run/netns/cni-1")
    h.join(["a", "b"], 30, "/run/netns/cni-1")  # each part: idempotent in netlock
    h.arrived("a", "c1")
    h.arrived("b", "c2")
    h.release()
    assert calls == ["lock /run/netns/cni-1", "lock /run/netns/cni-1", "unlock /run/netns/cni-1", "thaw c1",
                     "thaw c2"]  # the lock goes first: the retransmissions then find both ends
    calls.clear()
    other = hold.Hold(str(tmp_path), "sb2", resume=thaws)
    other.join(["a", "b"], 0.1, "/run/netns/cni-2")
    assert other.wait(poll=0.01) == hold.ABANDONED  # the deadline: the lock goes too
    assert calls == ["lock /run/netns/cni-2", "unlock /run/netns/cni-2"]
    other.join(["a", "b"], 30, "/run/netns/cni-2")  # an abandoned pod's part locks nothing again
    assert calls == ["lock /run/netns/cni-2", "unlock /run/netns/cni-2"]


def test_holding_is_read_without_writing_and_ends_with_the_release_the_abandon_or_the_deadline(tmp_path):
    h = _hold(tmp_path)
    assert hold.holding(h.path) is False  # no record
    assert not os.path.exists(h.path)
    h.join(["app"], 30)
    assert hold.holding(h.path) is True
    h.arrived("app", "c1")
    h.release()
    assert hold.holding(h.path) is False
    late = _hold(tmp_path, sandbox="sb2")
    late.join(["app"], -1)  # its deadline passed already
    assert hold.holding(late.path) is False
    gone = _hold(tmp_path, sandbox="sb3")
    gone.join(["app"], 30)
    gone.abandon("an image could not be pulled")
    assert hold.holding(gone.path) is False
