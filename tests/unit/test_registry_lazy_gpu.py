"""A GPU checkpoint restored lazily by reference (registry/lazy.py, pagefill/verify.py): no fallback to
the full pull any more, and the filler's order, as in lazy GPU migration: the chunks holding a
process's first ranges (the driver's host copy of its GPU memory) come right after the eager ones,
each fetched in ranges over every connection (as a fault's), and the sweep fetches no other chunk
before they are all in. The whole path on simulated GPU nodes: tests/integration/test_registry_lazy_gpu.py."""

from __future__ import annotations

import threading
import time

from migrt.pagefill import images, verify
from migrt.pagefill.verify import FileChunks, Verifier, VerifyError
from migrt.registry import lazy
from migrt.registry.blocks import Eager
from tests.helpers.fake_registry import migrt_image
from tests.unit.test_pagefill_verify import CH, small_chunks  # noqa: F401 - fixture
from tests.unit.test_registry_lazy import FILES, _prepare
from tests.unit.test_registry_pull import Log, cfg, reg, tls  # noqa: F401 - fixtures

GPU = {"gpu": {"processes": [{"pid": 7, "ns_pid": 1, "gpu_backing": [[4096, 8192]]}]}}


def test_a_gpu_checkpoint_is_restored_lazily_not_after_a_full_pull(cfg, reg, monkeypatch):  # noqa: F811
    monkeypatch.setattr(lazy, "_eager_chunks", lambda images, pages: {rel: Eager([], []) for rel in pages})
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES, extra=GPU)
    log = Log()
    out = _prepare(cfg, host, log)
    try:
        assert out is not None and not [e for e in log.events if e[1] == lazy.EVENT_FALLBACK]
        assert out.ckpt.manifest.get("gpu") == GPU["gpu"]  # the restore takes the GPU path from it
    finally:
        if out is not None:
            out.release()


def _plan(tmp_path) -> images.Plan:
    """One process: a big lazy segment [0, 4 CH) of the file and its host copy [4 CH, 5 CH), smaller
    (the biggest-first order alone would take the big one first)."""
    seg = images.Segment
    proc = images.ProcessPlan(pid=1, pages_file=str(tmp_path / "pages-1.img"),
                              segments=[seg(0x100000, 0x100000 + 4 * CH, 0), seg(0x900000, 0x900000 + CH, 4 * CH)],
                              first=[(0x900000, 0x900000 + CH)])
    return images.Plan(images=str(tmp_path), processes={1: proc})


def test_build_puts_the_host_copy_chunks_first(tmp_path, small_chunks):  # noqa: F811
    spec = {"checkpoint": "ck", "files": {"pages-1.img": {"rel": "images/pages-1.img", "size": 5 * CH,
                                                          "chunks": "ab" * 32 * 5}}}
    v = verify.build(_plan(tmp_path), spec)
    assert v.eager == [] and [i for _f, i in v.order] == [4, 0, 1, 2, 3]
    assert v.snapshot()["first"] == 1 and "first_s" not in v.snapshot()


class _Slow:
    """A registry source that takes a while over each chunk and records when each fetch began and ended."""

    parallel = 3

    def __init__(self, fail_on: int | None = None) -> None:
        self.events: list[tuple[str, int, bool]] = []
        self.lock = threading.Lock()
        self.fail_on = fail_on

    def has(self, path: str, i: int) -> bool:
        return False

    def fetch(self, f: FileChunks, i: int, *, fault: bool = False) -> None:
        with self.lock:
            self.events.append(("start", i, fault))
        time.sleep(0.2 if i in (4, 5) else 0.01)
        if i == self.fail_on:
            raise VerifyError("registry r went away while filling container c's memory")
        with self.lock:
            self.events.append(("end", i, fault))


def _sweep(v: Verifier, n: int = 3) -> list[BaseException]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            v.sweep()
        except VerifyError as exc:
            errors.append(exc)
    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors


def _verifier(tmp_path, src: _Slow) -> Verifier:
    f = FileChunks(path=str(tmp_path / "pages-1.img"), rel="images/pages-1.img", size=6 * CH, digests=[b"\0" * 32] * 6)
    v = Verifier([f], order=[(f, 0), (f, 1), (f, 2), (f, 3)], first=[(f, 4), (f, 5)])
    v.source = src
    return v


def test_the_sweep_fetches_the_host_copy_whole_and_nothing_else_before_it_is_in(tmp_path, small_chunks):  # noqa: F811
    src = _Slow()
    v = _verifier(tmp_path, src)
    assert not _sweep(v)
    ev = src.events
    firsts_end = max(k for k, e in enumerate(ev) if e[0] == "end" and e[1] in (4, 5))
    others_start = min(k for k, e in enumerate(ev) if e[0] == "start" and e[1] not in (4, 5))
    assert firsts_end < others_start, ev                     # the host copy in before any other chunk starts
    # every chunk the sweep fetches goes whole (by the fill's fetching processes), the host copy's too
    assert {(i, fault) for what, i, fault in ev if what == "start"} == {(4, False), (5, False), (0, False),
                                                                        (1, False), (2, False), (3, False)}
    st = v.snapshot()
    assert st["verified"] == 6 and st["first"] == 2 and 0 < st["first_s"] <= st["all_s"]


def test_a_fault_is_served_while_the_host_copy_arrives(tmp_path, small_chunks):  # noqa: F811
    src = _Slow()
    v = _verifier(tmp_path, src)
    sweeper = threading.Thread(target=v.sweep)
    sweeper.start()
    time.sleep(0.05)
    v.ensure(v.order[-1][0].path, 0, 1)                      # chunk 0 faulted while 4 is in flight
    assert ("end", 0, True) in src.events and ("end", 4, True) not in src.events
    sweeper.join(10)
    assert v.snapshot()["verified"] == 6


def test_a_source_gone_before_the_host_copy_is_in_ends_every_sweep_with_its_reason(tmp_path, small_chunks):  # noqa: F811
    src = _Slow(fail_on=4)
    v = _verifier(tmp_path, src)
    errors = _sweep(v)
    assert errors and all("went away" in str(e) for e in errors)
    assert not [e for e in src.events if e[1] not in (4, 5)]  # nothing else fetched meanwhile or after
    st = v.snapshot()
    assert "went away" in st["error"] and "first_s" not in st
