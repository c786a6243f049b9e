"""migration/podpull.py's pieces: the migrate-pod list, which containers of the new pod are parts,
a part's own checks and its place in the hold, and the source's cut (who resumes what, the deadline).
The whole pull through CRI on two nodes: tests/integration/test_pod_level_pull.py."""

from __future__ import annotations

import time

import pytest

from migrt.config import Config
from migrt.errors import Conflict, PreconditionFailed, UsageError
from migrt.migration import podpull
from migrt.oci.bundle import Bundle
from migrt.pods import hold
from migrt.pods.members import Member

from .support import write_bundle

POD = "n/team-a/web-0"
LIST = "native=reg/native:1,app=reg/app:1,side=reg/side:1"


def _bundle(tmp_path, name: str, **ann) -> Bundle:
    annotations = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": name,
                   "io.kubernetes.cri.sandbox-name": "web-0-moved", "io.kubernetes.cri.sandbox-namespace": "team-a",
                   "io.kubernetes.cri.sandbox-id": "sb42", "io.kubernetes.cri.image-name": f"reg/{name}:1", **ann}
    return Bundle.load(str(write_bundle(tmp_path / f"bundle-{name}", annotations=annotations)))


def test_the_list_is_read_strictly():
    assert podpull.parse_parts(" native = reg/n:1 ,app=reg/app@sha256:ab") == {"native": "reg/n:1",
                                                                             "app": "reg/app@sha256:ab"}
    assert podpull.parse_parts("app") == {"app": ""}  # no image: the name alone is checked
    for bad in ("", " ", "app=a,app=b", "App=x", "a/b=x", "app=x y", ",", None, 3):
        with pytest.raises(UsageError, match="migrt.io/migrate-pod"):
            podpull.parse_parts(bad)


def test_listed_containers_are_parts_and_the_others_start_fresh(tmp_path):
    ann = {"migrt.io/migrate-from": POD, "migrt.io/migrate-pod": LIST}
    app = _bundle(tmp_path, "app", **ann).migrate_request()
    assert (app.value, app.pod) == (POD, LIST)
    assert _bundle(tmp_path, "init-db", **ann).migrate_request() is None  # an init container: runs again
    single = _bundle(tmp_path, "side", **{"migrt.io/migrate-from": POD}).migrate_request()
    assert single.value == POD and single.pod is None  # without the list: today's pull of one container


def _part(tmp_path, name: str = "app", *, source: dict | None = None, deadline: float = 30, **ann):
    cfg = Config(path="x", pod_pull_deadline=deadline)
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    bundle = _bundle(tmp_path, name, **ann)
    src = source or {"namespace": "team-a", "pod": "web-0", "container": name}
    return podpull.TargetPart(cfg, bundle, str(root), LIST, src)


def test_a_part_joins_the_pod_hold_first_then_not(tmp_path, monkeypatch):
    monkeypatch.delenv("CRIU_CONFIG_FILE", raising=False)
    first = _part(tmp_path, "native")
    assert first.first and first.message() == {"parts": podpull.parse_parts(LIST), "sandbox": "sb42", "first": True}
    assert "CRIU_CONFIG_FILE" in __import__("os").environ  # this worker's restore runs the hold's freeze
    assert first.arrived("c-native") is False
    second = _part(tmp_path, "app")
    assert not second.first
    second.abandon("container app: refused")
    with pytest.raises(PreconditionFailed, match=r"did not all come: container app: refused"):
        first.wait()
    with pytest.raises(PreconditionFailed, match="given up earlier .*delete this pod and create it anew"):
        _part(tmp_path, "side")  # kubelet's retry of a part of a pod given up


def test_a_container_of_a_pod_already_moved_cannot_pull_again(tmp_path, monkeypatch):
    monkeypatch.delenv("CRIU_CONFIG_FILE", raising=False)
    h = hold.Hold(str(tmp_path / "root"), "sb42", resume=lambda r, c: None)
    (tmp_path / "root").mkdir()
    h.join(["native", "app", "side"], 30)
    for n in ("native", "app", "side"):
        h.arrived(n, f"c-{n}")
    h.release()
    with pytest.raises(PreconditionFailed, match="completed earlier .*remove the pod's migrt.io/migrate-from"):
        _part(tmp_path, "app")  # kubelet restarts a container of the moved pod


def test_a_part_checks_its_own_create(tmp_path):
    with pytest.raises(UsageError, match="names the source pod, not a container"):
        _part(tmp_path, source={"namespace": "team-a", "pod": "web-0", "container": "other"})
    with pytest.raises(UsageError, match="names the source pod, not a container"):
        _part(tmp_path, source={"container_id": "abc"})
    with pytest.raises(UsageError, match=r"gives image 'reg/app:1', the container runs 'reg/app:2'"):
        _part(tmp_path, **{"io.kubernetes.cri.image-name": "reg/app:2"})


class _Guard:
    def __init__(self) -> None:
        self.disarmed = self.released = False

    def disarm(self) -> None:
        self.disarmed = True

    def release(self) -> None:
        self.released = True


def _cut(monkeypatch, resumed: list, fail_resume: str = "") -> podpull.PodCut:
    def resume(runtime, root, cid):
        if cid == fail_resume:
            raise RuntimeError("no")
        resumed.append(cid)
    monkeypatch.setattr(podpull.control, "resume", resume)
    members = {n: Member(cid=f"id-{n}", name=n, image="", root="/r", bundle="/b", running=True)
               for n in ("native", "app", "side")}
    return podpull.PodCut("team-a/web-0", "runc", members, {n: f"prep-{n}" for n in members},
                          guards={n: _Guard() for n in members})


def test_the_cut_hands_each_container_once_and_resumes_only_its_own_on_a_failure(monkeypatch):
    resumed: list[str] = []
    cut = _cut(monkeypatch, resumed)
    guards = dict(cut.guards)
    assert cut.take("native") == (cut.members["native"], "prep-native")
    cut.hand("native")  # the part's migration armed its own guard: the cut's stands down
    assert guards["native"].disarmed and "native" not in cut.guards
    with pytest.raises(Conflict, match="pulled already"):
        cut.take("native")
    cut.take("app")  # taken, but its migration failed before it froze: still the cut's to resume
    assert cut.end("app", "the target refused its mounts") is True
    assert resumed == ["id-app", "id-side"] and cut.failed.startswith("container app: the target refused")
    assert guards["app"].disarmed and guards["side"].disarmed
    with pytest.raises(Conflict, match="given up .*the source pod runs on"):
        cut.take("side")
    with pytest.raises(Conflict, match="given up .*while container app was being handed over"):
        cut.hand("app")  # taken before the failure, frozen by its migration after: it rolls back
    cut.fail("again")  # once
    assert resumed == ["id-app", "id-side"]


def test_a_container_the_cut_cannot_resume_is_left_to_its_guard(monkeypatch):
    resumed: list[str] = []
    cut = _cut(monkeypatch, resumed, fail_resume="id-side")
    guards = dict(cut.guards)
    cut.fail("agent stopping")
    assert resumed == ["id-native", "id-app"]
    assert guards["side"].released and not guards["side"].disarmed  # its guard resumes it on release


def test_the_cut_deadline_resumes_what_no_part_took(monkeypatch):
    resumed: list[str] = []
    cut = _cut(monkeypatch, resumed)
    cut.take("native")
    cut.hand("native")
    cut.start_deadline(0.1)
    time.sleep(0.4)
    assert resumed == ["id-app", "id-side"] and "never pulled" in cut.failed and "['app', 'side']" in cut.failed
    done = _cut(monkeypatch, resumed := [])
    for n in ("native", "app", "side"):
        done.take(n)
        done.hand(n)
    done.start_deadline(0.1)
    time.sleep(0.4)
    assert resumed == [] and done.failed is None  # every part taken: their migrations decide


def test_a_held_part_answers_once_its_pod_is_decided(tmp_path):
    root = tmp_path / "root"
    (root / "c1").mkdir(parents=True)
    bundle = write_bundle(tmp_path / "b", annotations={"io.kubernetes.cri.sandbox-id": "sb7"})
    (root / "c1" / "state.json").write_text(f'{{"config": {{"labels": ["bundle={bundle}"]}}}}')
    assert hold.wait_for_part(str(root), "c1", 1) is None  # no hold: any other container
    h = hold.Hold(str(root), "sb7", resume=lambda r, c: None)
    h.join(["a", "b"], 30)
    t0 = time.monotonic()
    assert hold.wait_for_part(str(root), "c1", 0.3) == hold.HOLDING and time.monotonic() - t0 >= 0.3
    h.abandon("gone")
    assert hold.wait_for_part(str(root), "c1", 5) == hold.ABANDONED
