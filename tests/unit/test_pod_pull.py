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


# -- GPU containers in the cut (issue 29's GPU target) -----------------------------------------------
class _Gpu(podpull.GpuSource):
    """A container's CUDA processes as the migration's preflight found them; suspend/resume recorded."""

    def __init__(self, cid: str, log: list, fail: bool = False) -> None:
        super().__init__(None, cid, None, None)
        self.pids, self.section, self.log, self.fail = [int(cid[-1]) * 100], {"processes": [{}]}, log, fail

    def suspend(self, progress=None) -> None:
        if self.fail:
            raise PreconditionFailed(f"lock of {self.cid} timed out")
        self.log.append(("gpu-lock", self.cid))
        self.suspension = object()  # type: ignore[assignment]

    def resume(self) -> str:
        self.log.append(("gpu-resume", self.cid))
        self.suspension = None
        return f"; {self.cid}'s CUDA processes were resumed on their GPU"


class _Prep:
    def __init__(self, gpu: _Gpu | None) -> None:
        self.gpu, self.gpu_offer = gpu, ({"processes": [{}]} if gpu else None)


class _ArmedGuard(_Guard):
    armed: list = []

    def __init__(self, name: str, log_file: str) -> None:
        super().__init__()
        self.name = name

    def arm(self, action: dict) -> None:
        _ArmedGuard.armed.append((self.name, action))


def _gpu_pod(tmp_path, monkeypatch, log: list, *, fail_gpu: str = "", fail_freeze: bool = False) -> dict:
    members = [Member(cid=f"id-{n}{i}", name=n, image=f"reg/{n}:1", root="/r",
                      bundle=str(_bundle(tmp_path, n).path), running=True)
               for i, n in enumerate(("app1", "app2", "side"), start=1)]
    gpus = {m.name: _Gpu(m.cid, log, fail=m.cid == fail_gpu) for m in members if m.name != "side"}

    class Freeze:
        def __init__(self, runtime, ms, pod) -> None:
            self.ms = ms

        def freeze(self) -> float:
            if fail_freeze:
                raise podpull.PreconditionFailed("cannot freeze container side")
            log.extend(("freeze", m.cid) for m in self.ms)
            return 0.0

    monkeypatch.setattr(podpull, "pod_members", lambda cfg, ns, pod: members)
    monkeypatch.setattr(podpull, "PodFreeze", Freeze)
    monkeypatch.setattr(podpull, "Guard", _ArmedGuard)
    _ArmedGuard.armed = []
    parts = {m.name: m.image for m in members}
    return {"cfg": Config(path="x"), "namespace": "team-a", "pod": "web-0", "parts": parts, "to": "b:1",
            "eligible": lambda b: None, "prepare": lambda req: _Prep(gpus.get(req.container_id[3:-1]))}


def test_the_cut_locks_every_gpu_container_before_the_one_freeze(tmp_path, monkeypatch):
    log: list = []
    cut = podpull.cut_pod(**_gpu_pod(tmp_path, monkeypatch, log))
    assert log == [("gpu-lock", "id-app11"), ("gpu-lock", "id-app22"),
                   ("freeze", "id-app11"), ("freeze", "id-app22"), ("freeze", "id-side3")]
    gpu_pids = {name.split(":")[1]: a["gpu_pids"] for name, a in _ArmedGuard.armed}
    assert gpu_pids == {"id-app11": [100], "id-app22": [200], "id-side3": []}  # a killed agent: GPU resumed too
    monkeypatch.setattr(podpull.control, "resume", lambda rt, root, cid: log.append(("thaw", cid)))
    cut.take("app1")
    cut.hand("app1")  # its migration has it: its rollback resumes its GPU (migrate.py _Source)
    cut.fail("container app2: the target's GPU preflight refused")
    assert log[5:] == [("thaw", "id-app22"), ("gpu-resume", "id-app22"), ("thaw", "id-side3")]


def test_a_failed_gpu_lock_or_freeze_resumes_every_gpu_container_and_nothing_stays_frozen(tmp_path, monkeypatch):
    log: list = []
    with pytest.raises(PreconditionFailed, match="lock of id-app22 timed out") as info:
        podpull.cut_pod(**_gpu_pod(tmp_path, monkeypatch, log, fail_gpu="id-app22"))
    assert log == [("gpu-lock", "id-app11"), ("gpu-resume", "id-app11")]
    assert any("id-app11's CUDA processes were resumed" in d for d in info.value.details)
    log.clear()
    with pytest.raises(PreconditionFailed, match="cannot freeze"):
        podpull.cut_pod(**_gpu_pod(tmp_path, monkeypatch, log, fail_freeze=True))
    assert log == [("gpu-lock", "id-app11"), ("gpu-lock", "id-app22"),
                   ("gpu-resume", "id-app11"), ("gpu-resume", "id-app22")]


def test_a_gpu_part_is_restored_running_then_paused_before_it_joins_the_hold(tmp_path, monkeypatch):
    monkeypatch.delenv("CRIU_CONFIG_FILE", raising=False)
    paused: list = []
    monkeypatch.setattr(podpull.LowerRuntime, "pause", lambda self, root, cid: paused.append(cid))
    cpu = _part(tmp_path, "native")
    assert "CRIU_CONFIG_FILE" in __import__("os").environ
    cpu.arrived("c-native")
    gpu = _part(tmp_path, "app")
    gpu.unheld()  # its offer had CUDA processes: no freeze at CRIU's pre-resume
    assert "CRIU_CONFIG_FILE" not in __import__("os").environ
    assert gpu.arrived("c-app") is False and paused == ["c-app"]  # paused, then in the hold
    assert hold.Hold(str(tmp_path / "root"), "sb42").state() == hold.HOLDING
