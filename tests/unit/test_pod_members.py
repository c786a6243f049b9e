"""migrt/pods/members.py: a pod's containers on this node, the name/image match, and one freeze for all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from migrt.config import Config
from migrt.errors import PreconditionFailed, RuntimeFailed, UsageError
from migrt.pods import members
from migrt.pods.members import Member, PodFreeze, mismatch, pod_members

from .support import write_bundle


def _ann(name: str, pod: str = "web-0", kind: str = "container", image: str = "") -> dict:
    ann = {"io.kubernetes.cri.container-type": kind, "io.kubernetes.cri.container-name": name,
           "io.kubernetes.cri.sandbox-name": pod, "io.kubernetes.cri.sandbox-namespace": "team-a"}
    if image:
        ann["io.kubernetes.cri.image-name"] = image
    return ann


def _node(tmp_path: Path, containers: list[tuple[str, dict, str]]) -> Config:
    """A runc root of containers (id, annotations, runc's `created`)."""
    root = tmp_path / "root"
    root.mkdir()
    for cid, ann, created in containers:
        bundle = write_bundle(tmp_path / f"bundle-{cid}", annotations=ann)
        (root / cid).mkdir()
        (root / cid / "state.json").write_text(json.dumps({"id": cid, "created": created,
                                                           "config": {"labels": [f"bundle={bundle}"]}}))
    (root / "garbage").mkdir()  # no state.json: skipped
    return Config(path="x", runtime_roots=[str(root)])


def test_a_pods_containers_in_creation_order_without_its_sandbox_or_other_pods(tmp_path):
    cfg = _node(tmp_path, [
        ("c-app", _ann("app", image="reg/app:1"), "2026-11-27T20:00:01.5Z"),          # .500000000
        ("c-side", _ann("sidecar"), "2026-11-27T20:00:01.123456789Z"),                # earlier, longer text
        ("c-native", _ann("native"), "2026-11-27T20:00:00Z"),
        ("c-pause", _ann("web-0", kind="sandbox"), "2026-11-27T19:59:59Z"),
        ("c-other", _ann("app", pod="web-1"), "2026-11-27T19:59:58Z"),
    ])
    got = pod_members(cfg, "team-a", "web-0", running=lambda root, cid: cid != "c-side")
    assert [(m.cid, m.name, m.image, m.running) for m in got] == [
        ("c-native", "native", "", True), ("c-side", "sidecar", "", False), ("c-app", "app", "reg/app:1", True)]
    assert got[0].root == cfg.runtime_roots[0] and got[0].bundle == str(tmp_path / "bundle-c-native")


def test_a_pod_with_no_container_here_is_named_in_the_refusal(tmp_path):
    cfg = _node(tmp_path, [("c-pause", _ann("web-0", kind="sandbox"), "2026-11-27T19:59:59Z")])
    with pytest.raises(PreconditionFailed, match="pod team-a/web-0: no container of it on this node"):
        pod_members(cfg, "team-a", "web-0", running=lambda root, cid: True)


def _m(name: str, image: str = "img", running: bool = True) -> Member:
    return Member(cid=f"id-{name}", name=name, image=image, root="/r", bundle=f"/b/{name}", running=running)


def test_mismatch_names_each_difference_and_nothing_when_they_match():
    src = [_m("app", "reg/app:1"), _m("sidecar", "reg/side:1"), _m("native", "")]
    assert mismatch(src, {"app": "reg/app:1", "sidecar": "reg/side:1", "native": "reg/n:1"}) == []
    lines = mismatch(src, {"app": "reg/app:2", "sidecar": "reg/side:1", "extra": "x"})
    assert lines == [
        "container extra: the checkpoint has no container of that name (it has app, sidecar, native)",
        "container native: the new pod has no container of that name",
        "container app: image 'reg/app:2', the checkpoint's is 'reg/app:1'",
    ]


class _Runtime:
    """pause/resume recorded; pausing `fail` raises as runc's failure does."""

    def __init__(self, fail: str = "", fail_resume: str = "") -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail, self.fail_resume = fail, fail_resume

    def pause(self, root, cid):
        self.calls.append(("pause", cid))
        if cid == self.fail:
            raise RuntimeFailed(f"runc pause {cid} failed: boom")

    def resume(self, root, cid):
        self.calls.append(("resume", cid))
        if cid == self.fail_resume:
            raise RuntimeFailed(f"runc resume {cid} failed: stuck")


def test_one_freeze_pauses_every_running_member_and_thaws_them_on_leaving():
    rt = _Runtime()
    with PodFreeze(rt, [_m("a"), _m("b", running=False), _m("c")], "team-a/web-0") as pf:  # type: ignore[arg-type]
        assert rt.calls == [("pause", "id-a"), ("pause", "id-c")] and pf.freeze_s >= 0
    assert rt.calls[2:] == [("resume", "id-c"), ("resume", "id-a")]  # b was not ours to thaw


def test_a_failed_freeze_thaws_those_already_frozen_and_names_the_container():
    rt = _Runtime(fail="id-c")
    pf = PodFreeze(rt, [_m("a"), _m("b"), _m("c"), _m("d")], "team-a/web-0")  # type: ignore[arg-type]
    with pytest.raises(RuntimeFailed, match=r"pod team-a/web-0: cannot freeze container c \(id-c\)"):
        pf.freeze()
    assert rt.calls == [("pause", "id-a"), ("pause", "id-b"), ("pause", "id-c"), ("resume", "id-b"),
                        ("resume", "id-a")]
    assert pf.frozen == []


def test_an_exception_thaws_unless_kept_and_a_stuck_thaw_is_reported():
    rt = _Runtime(fail_resume="id-a")
    with pytest.raises(RuntimeFailed, match="dump failed") as info, \
            PodFreeze(rt, [_m("a"), _m("b")], "p"):  # type: ignore[arg-type]
        raise RuntimeFailed("dump failed")
    assert rt.calls[2:] == [("resume", "id-b"), ("resume", "id-a")]
    assert "container a (id-a) stays frozen" in str(info.value)
    rt = _Runtime()
    with pytest.raises(ValueError), PodFreeze(rt, [_m("a")], "p") as pf:  # type: ignore[arg-type]
        pf.keep()
        raise ValueError("the caller destroys them")
    assert rt.calls == [("pause", "id-a")]


def test_mismatch_names_what_it_compares_with_the_source_pod_for_a_pull():
    src = [_m("app", "reg/app:1")]
    assert mismatch(src, {"app": "reg/app:2", "extra": "x"}, "the source pod") == [
        "container extra: the source pod has no container of that name (it has app)",
        "container app: image 'reg/app:2', the source pod's is 'reg/app:1'",
    ]


def test_the_list_from_a_pull_request_is_held_to_the_annotations_rules():
    assert members.listed_parts({"native": "reg/n:1", "app": ""}) == {"native": "reg/n:1", "app": ""}
    assert members.listed_parts({"app": "x"}) == members.parse_listed("app=x")
    for bad in (None, {}, [], "app=x", {"app": 1}, {"../x": "i"}, {"app": "a b"}, {"app": "a,side=b"},
                {"app": "\x1b[2J"}, {1: "x"}):
        with pytest.raises(UsageError):
            members.listed_parts(bad)
