"""PagesPlan (ops/pages.py): the page mode of one restore from its decision to its filler's end, as
ops/restore.py walks it: the pages images a filler verifies as it fills taken out of the background
hashing, the checks the gate waits for, the filler started (or not: eager after all, those images
then hashed before the tree runs), runc's flag, and who lets the filler go."""

from __future__ import annotations

import hashlib

import pytest

from migrt.errors import RuntimeFailed
from migrt.ops import pages
from migrt.store import fsutil
from migrt.store import manifest as mf

CH = 64 << 20
PAGES, FS = "images/pages-1.img", "images/fs-1.img"


class Checks:
    """The restore's checks as a plan sees them: added by name, and the gate's post-restore file."""

    ran_path = "/work/gate.ran"

    def __init__(self) -> None:
        self.added: list[tuple[str, object, bool]] = []

    def add(self, name: str, fn, *, deferred: bool = False) -> None:
        self.added.append((name, fn, deferred))


class Fill:
    threads = 4

    def __init__(self) -> None:
        self.detached = False

    def detach(self) -> None:
        self.detached = True


def _manifest() -> dict:
    c = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
    return {"files": {PAGES: {"size": 2 * CH, "sha256_tree": fsutil.fold_chunks(c)},
                      FS: {"size": 2 * CH, "sha256_tree": fsutil.fold_chunks(c)}},
            mf.CHUNKS: {PAGES: fsutil.chunk_record(c)}}


def _lazy(requested: str = "auto") -> pages.PagesPlan:
    return pages.PagesPlan({"mode": "lazy", "requested": requested, "threads": 2}, "ck", images="/ck/images")


@pytest.fixture(autouse=True)
def _as_filled(monkeypatch):
    monkeypatch.delenv(pages.VERIFY_ENV, raising=False)


def test_a_lazy_restore_hands_its_pages_images_to_the_filler_and_waits_for_its_plan(monkeypatch):
    started = {}
    fill = Fill()

    def start(decision, images, **kw):
        started.update(kw, images=images)
        return fill

    monkeypatch.setattr(pages, "start", start)
    plan, checks = _lazy(), Checks()
    assert plan.verified_as_filled(_manifest(), [FS, PAGES]) == [FS]  # left for the background
    plan.add_checks(checks, fill_first=None)
    assert [(n, d) for n, _, d in checks.added] == [("pages_plan", True), ("pages_verify_eager", True)]
    assert plan.start_filler(checks, container_id="c1", root="/r", runc_log=None, log_format="json",
                             log_file=None) == []
    assert started["images"] == "/ck/images" and started["post_restore"] == Checks.ran_path
    assert sorted(started["verify"]["files"]) == ["pages-1.img"]
    assert all(fn.fill is fill for _, fn, _ in checks.added)  # the checks read the filler they wait on
    assert plan.runc_args() == ["--lazy-pages"]
    assert plan.decision["verify"] == {"as_filled": [PAGES], "before_run": [FS]}
    plan.let_go()
    assert fill.detached


def test_a_filler_that_cannot_start_leaves_the_restore_eager_its_pages_hashed_before_the_tree_runs(monkeypatch):
    def start(decision, images, **kw):  # as pages.start under auto: the restore goes eager
        decision.update(mode="eager", reason="the page filler could not start (no uffd); copied eagerly")

    monkeypatch.setattr(pages, "start", start)
    plan, checks = _lazy(), Checks()
    plan.verified_as_filled(_manifest(), [FS, PAGES])
    plan.add_checks(checks, fill_first=None)
    late = plan.start_filler(checks, container_id="c1", root="/r", runc_log=None, log_format="json", log_file=None)
    assert late == [PAGES]
    assert plan.decision["verify"] == {"as_filled": [], "before_run": [FS, PAGES]}
    assert plan.fill is None and plan.runc_args() == [] and plan.mode == "eager"
    assert plan.memory_ready() is None and plan.failed(RuntimeFailed("x")) is None
    plan.after_restore(1234)  # nothing to tell
    plan.let_go()


def test_a_migrations_filler_is_the_callers(monkeypatch):
    monkeypatch.setattr(pages, "start", lambda *a, **kw: pytest.fail("a migration's restore starts no filler"))
    fill = Fill()
    ckpt = type("Ckpt", (), {"name": "ck", "images": "/ck/images", "manifest": _manifest()})()
    plan, checks = pages.PagesPlan.decide(None, ckpt, fill, other_lazy=False), Checks()
    assert plan.decision["requested"] == "migration" and plan.decision["threads"] == Fill.threads
    assert plan.verified_as_filled(ckpt.manifest, [FS, PAGES]) == [FS, PAGES]  # it verifies nothing itself
    plan.add_checks(checks, fill_first=30.0)  # a direct migration: nothing runs before all memory is in
    assert [(n, d) for n, _, d in checks.added] == [("pages_in", True)]
    assert plan.decision["fill_first"] is True
    assert plan.start_filler(checks, container_id="c1", root="/r", runc_log=None, log_format="json",
                             log_file=None) == []
    assert plan.runc_args() == ["--lazy-pages"]
    plan.let_go()
    assert not fill.detached


def test_an_eager_restore_has_no_page_checks_and_no_filler(monkeypatch):
    monkeypatch.setattr(pages, "start", lambda decision, images, **kw: None)
    plan, checks = pages.PagesPlan({"mode": "eager", "requested": "eager"}, "ck", images="/ck/images"), Checks()
    assert plan.verified_as_filled(_manifest(), [FS, PAGES]) == [FS, PAGES]
    plan.add_checks(checks, fill_first=None)
    assert checks.added == []
    assert plan.start_filler(checks, container_id="c1", root="/r", runc_log=None, log_format="json",
                             log_file=None) == []
    assert plan.runc_args() == []
