"""The pod-level pull's early dumps (migration/earlydump.py): made at the cut, taken by each part's pull,
cancelled (CRIU stopped first) before a given-up cut resumes any container."""

from __future__ import annotations

import os
import threading

import pytest

from migrt.errors import Conflict, RuntimeFailed
from migrt.migration import earlydump, podpull
from migrt.pods.members import Member


class _Guard:
    def __init__(self) -> None:
        self.current: dict = {"do": "resume", "cid": "id-app"}
        self.armed: list[dict] = []

    def arm(self, action: dict) -> None:
        self.current = dict(action)
        self.armed.append(self.current)


class _Crit(tuple):
    released = False

    def release(self) -> None:
        self.released = True


class _Lazy:
    """CRIU's lazy dump: writes its images and log at wait_ready; `block` holds it until set;
    `fail` makes it fail; abort() is recorded (and lets a blocked dump fail, as CRIU stopped does)."""

    made: list[_Lazy] = []
    block: threading.Event | None = None
    fail = False

    def __init__(self, runtime, root, cid, *, image_path, work_path, options, page_server, env) -> None:
        self.images, self.work, self.aborted = image_path, work_path, False
        _Lazy.made.append(self)

    def wait_ready(self, timeout: float) -> None:
        if _Lazy.block is not None:
            _Lazy.block.wait(10)
        if self.aborted or _Lazy.fail:
            raise RuntimeFailed("lazy checkpoint of container id-app failed: CRIU said no")
        for name in ("core-1.img", "pagemap-1.img"):
            with open(os.path.join(self.images, name), "w") as fh:
                fh.write(name)
        with open(os.path.join(self.work, "dump.log"), "w") as fh:
            fh.write("dumped")

    def finish(self, timeout: float) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True
        if _Lazy.block is not None:
            _Lazy.block.set()


@pytest.fixture
def lazy(monkeypatch):
    _Lazy.made, _Lazy.block, _Lazy.fail = [], None, False
    monkeypatch.setattr(earlydump.control, "LazyCheckpoint", _Lazy)
    monkeypatch.setattr(earlydump.control, "loopback_page_server", lambda: _Crit(("127.0.0.1", 4444)))
    return _Lazy


def _member(name: str = "app") -> Member:
    return Member(cid=f"id-{name}", name=name, image="", root="/r", bundle="/b", running=True)


def _dump(tmp_path, guard=None) -> earlydump.EarlyDump:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return earlydump.EarlyDump("runc", _member(), None, str(tmp_path / "tmp"), guard or _Guard()).start()


def _staging(tmp_path) -> tuple[str, str]:
    images, work = tmp_path / "staging" / "images", tmp_path / "staging" / "work"
    images.mkdir(parents=True)
    work.mkdir()
    return str(images), str(work)


def test_a_part_takes_its_early_dump_images_and_log_and_the_guard_knew_crius_page_server_meanwhile(tmp_path, lazy):
    guard = _Guard()
    dump = _dump(tmp_path, guard)
    images, work = _staging(tmp_path)
    assert dump.take(images, work) >= 0
    assert sorted(os.listdir(images)) == ["core-1.img", "pagemap-1.img"]
    with open(os.path.join(work, "dump.log")) as fh:
        assert fh.read() == "dumped"
    assert os.listdir(tmp_path / "tmp") == []  # its directory is gone
    # a kill mid-dump: the guard ends CRIU's page server before it resumes the container
    assert [a.get("page_server") for a in guard.armed] == [("127.0.0.1", 4444), None]
    assert all(a["do"] == "resume" for a in guard.armed)


def test_a_failed_early_dump_fails_its_part_and_a_cancelled_one_is_stopped_and_removed(tmp_path, lazy):
    lazy.fail = True
    images, work = _staging(tmp_path)
    with pytest.raises(RuntimeFailed, match="CRIU said no"):
        _dump(tmp_path).take(images, work)
    lazy.fail, lazy.block = False, threading.Event()
    dump = _dump(tmp_path)  # CRIU still dumping when the cut is given up
    dump.cancel()
    assert lazy.made[-1].aborted and not os.path.exists(dump.dir)
    with pytest.raises(Conflict, match="cancelled: the pod-level pull was given up"):
        dump.take(images, work)
    assert os.listdir(images) == []


def test_a_given_up_cut_stops_every_early_dump_before_it_resumes_any_container(monkeypatch):
    log: list[str] = []

    class Early:
        def __init__(self, name: str) -> None:
            self.name = name

        def cancel(self) -> None:
            log.append(f"cancel {self.name}")

    monkeypatch.setattr(podpull.control, "resume", lambda runtime, root, cid: log.append(f"resume {cid}"))
    members = {n: _member(n) for n in ("native", "app", "side")}
    cut = podpull.PodCut("team-a/web-0", "runc", members, dict.fromkeys(members),
                         early={n: Early(n) for n in members})
    cut.fail("deadline")
    assert log == ["cancel native", "cancel app", "cancel side", "resume id-native", "resume id-app", "resume id-side"]
