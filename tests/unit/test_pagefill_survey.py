"""The manifest's record of the page filler's survey (`pagefill`): taken when the store commits a
checkpoint (locally, or received file by file), used by the restore's eager/lazy decision instead of
planning the images, never trusted beyond that choice: a malformed or altered record is ignored or
bounded, and the guard's own plan of the images decides whether the restore may go on (PlanCheck)."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from migrt.config import Config
from migrt.errors import CheckpointInvalid, PreconditionFailed, RuntimeFailed
from migrt.ops import pages as pages_mod
from migrt.pagefill import images, uffd
from migrt.store import Store
from migrt.store.importer import importing
from tests.unit.test_pagefill import PAGE, _pm, _vma, make_images

MiB = 1 << 20
BASE = 0x7F0000000000


def _fillable(d, pages=4):
    return make_images(d, [_vma(BASE, BASE + pages * PAGE)], [_pm(BASE, pages, "PE_LAZY | PE_PRESENT")])


def _unfillable(d):
    """Lazy pages in a parent image (a pre-dump chain): the filler refuses them."""
    return make_images(d, [_vma(BASE, BASE + 4 * PAGE)], [_pm(BASE, 4, "PE_LAZY | PE_PARENT")])


# -- the survey ------------------------------------------------------------------------------------
def test_survey_of_fillable_and_refused_images(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert images.survey(_fillable(tmp_path / "a")) == {"rules": images.RULES, "fillable": True,
                                                         "lazy_bytes": 4 * PAGE}
    refused = images.survey(_unfillable(tmp_path / "b"))
    assert refused["fillable"] is False and "parent image" in refused["reason"]
    assert images.survey(str(tmp_path / "missing"))["reason"].startswith("cannot read pstree.img")


@pytest.mark.parametrize("raw", [b"\x09\x01\x02", b"\x0a\x7fx", b"\x0d\x01"])
def test_a_truncated_protobuf_field_is_an_image_error(raw):
    """A fixed64, length-delimited or fixed32 field running past its message: a refusal with a reason
    (the restore then copies eagerly), never struct.error (a crash) or a silently short value."""
    with pytest.raises(images.ImageError, match="truncated"):
        images._fields(raw)


# -- recorded by the store's commits ---------------------------------------------------------------
def _copy_images(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())


def test_a_local_commit_records_the_survey(tmp_path):
    (tmp_path / "src").mkdir()
    src = _fillable(tmp_path / "src")
    store = Store(str(tmp_path / "store"))
    with store.writer("ck") as w:
        _copy_images(src, w.images)
        images.record_beside(w)
        data = w.commit({"created": "now", "pagefill": {"rules": 1, "fillable": True, "lazy_bytes": 1 << 40}})
    assert data["pagefill"] == {"rules": images.RULES, "fillable": True, "lazy_bytes": 4 * PAGE}  # not the caller's
    assert store.get("ck").manifest["pagefill"] == data["pagefill"]
    assert data["timings"]["pagefill_s"] >= 0
    with store.writer("junk") as w:
        with open(os.path.join(w.images, "pages-1.img"), "wb") as fh:
            fh.write(b"x" * 100)
        images.record_beside(w)
        junk = w.commit({"created": "now"})
    assert junk["pagefill"]["fillable"] is False and "pstree.img" in junk["pagefill"]["reason"]


def test_a_field_computed_beside_that_fails_is_left_out(tmp_path):
    """The store knows nothing of the field: a function that fails drops it (an inherited one too)."""
    store = Store(str(tmp_path / "store"))
    with store.writer("ck") as w:
        w.beside("pagefill", lambda: 1 / 0)
        w.beside("other", lambda: {"x": 1})
        data = w.commit({"created": "now", "pagefill": {"rules": 1, "fillable": True, "lazy_bytes": 1}})
    assert "pagefill" not in data and data["other"] == {"x": 1}


def _receive(store: Store, name: str, src: str, *, sender: dict, survey: bool) -> dict:
    with importing(store, name) as imp:
        declared = {}
        for f in sorted(os.listdir(src)):
            data = open(os.path.join(src, f), "rb").read()
            rel = f"images/{f}"
            with imp.open(rel) as fd:
                os.write(fd, data)
            digest = hashlib.sha256(data).hexdigest()
            imp.record(rel, len(data), digest)
            declared[rel] = {"size": len(data), "sha256": digest}
        if survey:
            images.record_beside(imp)
        return imp.commit({"created": "now", **sender}, declared)


def test_a_received_checkpoint_gets_our_survey_not_the_senders(tmp_path):
    """A registry pull surveys what arrived (registry/pull.py); a sender's record is replaced."""
    (tmp_path / "src").mkdir()
    src = _fillable(tmp_path / "src")
    store = Store(str(tmp_path / "store"))
    store.ensure()
    lie = {"pagefill": {"rules": 1, "fillable": True, "lazy_bytes": 1 << 40}}
    data = _receive(store, "pulled", src, sender=lie, survey=True)
    assert data["pagefill"] == {"rules": images.RULES, "fillable": True, "lazy_bytes": 4 * PAGE}
    assert store.get("pulled").manifest["pagefill"] == data["pagefill"]


# -- the decision ----------------------------------------------------------------------------------
@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.delenv(pages_mod.ENV, raising=False)
    monkeypatch.setattr(uffd, "usable", lambda: None)
    c = Config(path="x")
    c.fill_min_mib = 1
    return c


def _files(pages_bytes: int) -> dict:
    return {"images/pages-1.img": {"size": pages_bytes}, "images/pagemap-1.img": {"size": 100}}


def _no_planning(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the images were planned")

    monkeypatch.setattr(images, "plan", refuse)


def test_decide_takes_the_recorded_figure_without_reading_the_images(cfg, monkeypatch, tmp_path):
    _no_planning(monkeypatch)
    rec = {"rules": images.RULES, "fillable": True, "lazy_bytes": 2 * MiB}
    lazy = pages_mod.decide(cfg, str(tmp_path / "nowhere"), name="c", other_lazy=False,
                            manifest_files=_files(3 * MiB), recorded=rec)
    assert lazy["mode"] == "lazy" and lazy["lazy_bytes"] == 2 * MiB and lazy["lazy_bytes_from"] == "manifest"
    small = pages_mod.decide(cfg, "/nowhere", name="c", other_lazy=False, manifest_files=_files(3 * MiB),
                             recorded={**rec, "lazy_bytes": MiB // 2})
    assert small["mode"] == "eager" and "below fill_min_mib" in small["reason"]
    refused = pages_mod.decide(cfg, "/nowhere", name="c", other_lazy=False, manifest_files=_files(3 * MiB),
                               recorded={"rules": images.RULES, "fillable": False, "reason": "hugetlbfs VMA"})
    assert refused["mode"] == "eager" and refused["reason"] == "checkpoint c: hugetlbfs VMA"


@pytest.mark.parametrize("rec", [
    None, "yes", [], {}, {"rules": images.RULES + 1, "fillable": True, "lazy_bytes": 2 * MiB},
    {"rules": True, "fillable": True, "lazy_bytes": 2 * MiB},
    {"rules": images.RULES, "fillable": 1, "lazy_bytes": 2 * MiB},
    {"rules": images.RULES, "fillable": True, "lazy_bytes": "2097152"},
    {"rules": images.RULES, "fillable": True, "lazy_bytes": -1},
    {"rules": images.RULES, "fillable": True, "lazy_bytes": True},
    {"rules": images.RULES, "fillable": True},
    {"rules": images.RULES, "fillable": True, "lazy_bytes": 3 * MiB + 1},  # more than the page images hold
    {"rules": images.RULES, "fillable": False},
    {"rules": images.RULES, "fillable": False, "reason": ["x"]},
])
def test_a_record_that_cannot_be_used_means_planning_the_images(cfg, tmp_path, rec):
    """Older checkpoints (no record), other planning rules, anything malformed or impossible: the
    images decide, as before the record existed."""
    d = _fillable(tmp_path, pages=512)  # 2 MiB of lazy memory
    out = pages_mod.decide(cfg, d, name="c", other_lazy=False, manifest_files=_files(3 * MiB), recorded=rec)
    assert out["mode"] == "lazy" and out["lazy_bytes"] == 2 * MiB and out["lazy_bytes_from"] == "images"


def test_a_negative_record_never_refuses_a_lazy_restore_alone(cfg, monkeypatch, tmp_path):
    monkeypatch.setenv(pages_mod.ENV, "lazy")
    rec = {"rules": images.RULES, "fillable": False, "reason": "recorded reason"}
    ok = pages_mod.decide(cfg, _fillable(tmp_path), name="c", other_lazy=False, manifest_files=_files(MiB),
                          recorded=rec)
    assert ok["mode"] == "lazy" and ok["lazy_bytes_from"] == "images"
    (tmp_path / "b").mkdir()
    with pytest.raises(PreconditionFailed, match="parent image"):
        pages_mod.decide(cfg, _unfillable(tmp_path / "b"), name="c", other_lazy=False, manifest_files=_files(MiB),
                         recorded=rec)


def test_small_page_images_still_decide_before_any_record(cfg, monkeypatch):
    _no_planning(monkeypatch)
    cfg.fill_min_mib = 256
    out = pages_mod.decide(cfg, "/nowhere", name="c", other_lazy=False, manifest_files=_files(MiB),
                           recorded={"rules": images.RULES, "fillable": True, "lazy_bytes": MiB})
    assert out["mode"] == "eager" and "of page images is below" in out["reason"] and "lazy_bytes_from" not in out


# -- the guard's own plan, and the restore check on it -----------------------------------------------
def _start(decision: dict, d: str):
    return pages_mod.start(decision, d, container_id="c", root="/nonexistent", runc_log=None, log_format="json",
                           log_file=None)


def test_the_guard_refuses_images_it_cannot_fill_and_the_check_says_why(tmp_path):
    """auto chose the filler from the manifest's record, but the images are not fillable (altered, or
    a wrong record): the guard's own plan refuses them, PlanCheck fails the restore with the reason (the
    gate then aborts CRIU before any task ran), and the guard goes once the restore has let it go."""
    d = _unfillable(tmp_path)
    decision = {"mode": "lazy", "requested": "auto", "threads": 2, "lazy_bytes": 4 * PAGE,
                "lazy_bytes_from": "manifest"}
    fill = _start(decision, d)
    check = pages_mod.PlanCheck(decision, "ck-7")
    check.fill = fill
    try:
        with pytest.raises(CheckpointInvalid) as err:
            check()
        msg = str(err.value)
        assert "checkpoint ck-7: the page filler cannot fill its images (process 1: lazy pages in a parent image" in msg
        assert "though its manifest records them as fillable" in msg and "MIGRT_RESTORE_PAGES=eager" in msg
        assert fill.status()["plan_error"].startswith("process 1: lazy pages in a parent image")
    finally:
        fill.abort()
        fill.stop(30)
    assert fill.proc.returncode == 1
    assert not os.path.exists(fill.run_dir)  # removed once we had gone


def test_the_check_passes_once_the_guard_has_planned_and_keeps_the_real_figure(tmp_path):
    d = _fillable(tmp_path, pages=8)
    decision = {"mode": "lazy", "requested": "auto", "threads": 2, "lazy_bytes": 1 << 30,
                "lazy_bytes_from": "manifest"}
    fill = _start(decision, d)
    check = pages_mod.PlanCheck(decision, "ck")
    check.fill = fill
    try:
        check()
        # what the filler copies is in the restore's result; what chose it stays beside it
        assert decision["lazy_bytes"] == 8 * PAGE and decision["decided_on_lazy_bytes"] == 1 << 30
        assert fill.status()["state"] in ("planned", "filling")
    finally:
        fill.abort()
        fill.stop(30)
    assert fill.proc.returncode == 2  # aborted: the restore went away before CRIU came


def test_a_guard_that_dies_before_planning_fails_the_check(tmp_path):
    """pstree.img is a FIFO nobody writes: the guard blocks in its plan until it is killed."""
    os.mkfifo(tmp_path / "pstree.img")
    decision = {"mode": "lazy", "requested": "lazy", "threads": 2, "lazy_bytes": 4 * PAGE}
    fill = _start(decision, str(tmp_path))
    check = pages_mod.PlanCheck(decision, "ck")
    check.fill = fill
    try:
        with pytest.raises(RuntimeFailed, match="has not planned the images after 0 s"):
            fill.planned(timeout=0.3)
        fill.proc.kill()
        fill.proc.wait(10)
        with pytest.raises(RuntimeFailed, match="restore failed: the page filler failed"):
            check()
    finally:
        fill.abort()
        shutil.rmtree(fill.run_dir, ignore_errors=True)  # its guard, which removes it, was killed
    assert pages_mod.PlanCheck(decision, "ck")() is None  # no filler started (eager after all): nothing to wait for
