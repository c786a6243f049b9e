"""The page filler without CRIU: its image reader against pycriu-written images, its range
bookkeeping, and the engine filling memory of this very process through a userfaultfd of our own
(faults first, then the background copy; madvise(DONTNEED), mremap and munmap during the fill)."""

from __future__ import annotations

import ctypes
import io
import os
import socket
import threading
import time

import pytest

from migrt.config import Config
from migrt.errors import PreconditionFailed
from migrt.ops import pages as pages_mod
from migrt.pagefill import engine, held, images, uffd

PAGE = 4096
MiB = 1 << 20


# -- images ----------------------------------------------------------------------------------------
def _write(path, magic, entries):
    import pycriu

    buf = io.BytesIO()
    pycriu.images.dump({"magic": magic, "entries": entries}, buf)
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())


def _vma(start, end, flags="MAP_PRIVATE | MAP_ANON", status="VMA_AREA_REGULAR | VMA_ANON_PRIVATE"):
    return {"start": hex(start), "end": hex(end), "pgoff": 0, "shmid": 0, "prot": "PROT_READ | PROT_WRITE",
            "flags": flags, "status": status, "fd": -1}


def _mm(vmas):
    z = "0x0"
    return {"mm_start_code": z, "mm_end_code": z, "mm_start_data": z, "mm_end_data": z, "mm_start_stack": z,
            "mm_start_brk": z, "mm_brk": z, "mm_arg_start": z, "mm_arg_end": z, "mm_env_start": z, "mm_env_end": z,
            "exe_file_id": 1, "vmas": vmas}


def _pm(vaddr, nr, flags):
    return {"vaddr": hex(vaddr), "compat_nr_pages": 0, "nr_pages": nr, "flags": flags}


def make_images(d, vmas, entries, *, pid=1, pages_bytes=None, extra_pids=()):
    _write(d / "pstree.img", "PSTREE", [{"pid": pid, "ppid": 0, "pgid": pid, "sid": pid, "threads": [pid]}]
           + [{"pid": p, "ppid": pid, "pgid": pid, "sid": pid, "threads": [p]} for p in extra_pids])
    _write(d / f"mm-{pid}.img", "MM", [_mm(vmas)])
    _write(d / f"pagemap-{pid}.img", "PAGEMAP", [{"pages_id": 7}] + entries)
    present = sum(e["nr_pages"] for e in entries if "PE_PRESENT" in e["flags"] and "PE_PARENT" not in e["flags"])
    (d / "pages-7.img").write_bytes(b"\0" * (pages_bytes if pages_bytes is not None else present * PAGE))
    return str(d)


def test_plan_offsets_skip_eager_pages_and_split_at_vma_boundaries(tmp_path):
    base = 0x7F0000000000
    vmas = [_vma(0x400000, 0x401000, flags="MAP_PRIVATE", status="VMA_AREA_REGULAR | VMA_FILE_PRIVATE"),
            _vma(base, base + 8 * PAGE), _vma(base + 8 * PAGE, base + 16 * PAGE)]
    entries = [_pm(0x400000, 1, "PE_PRESENT"),                        # eager: 1 page in the file first
               _pm(base, 2, "PE_LAZY | PE_PRESENT"),                   # lazy, file offset 1 page
               _pm(base + 2 * PAGE, 1, "PE_PRESENT"),                  # a stack page: eager, offset 3
               _pm(base + 6 * PAGE, 4, "PE_LAZY | PE_PRESENT")]        # crosses the VMA boundary, offset 4
    plan = images.plan(make_images(tmp_path, vmas, entries))
    segs = [(s.start - base, s.end - base, s.offset) for s in plan.processes[1].segments]
    assert segs == [(0, 2 * PAGE, PAGE), (6 * PAGE, 8 * PAGE, 4 * PAGE), (8 * PAGE, 10 * PAGE, 6 * PAGE)]
    assert plan.lazy_bytes == 6 * PAGE


def test_plan_marks_dontfork_and_wipeonfork_ranges_as_not_inherited(tmp_path):
    base = 0x7F0000000000
    vmas = [_vma(base, base + 4 * PAGE), _vma(base + 4 * PAGE, base + 8 * PAGE),
            _vma(base + 8 * PAGE, base + 12 * PAGE)]
    vmas[1]["madv"] = 1 << images.MADV_DONTFORK
    vmas[2]["madv"] = 1 << images.MADV_WIPEONFORK
    entries = [_pm(base, 12, "PE_LAZY | PE_PRESENT")]
    segs = images.plan(make_images(tmp_path, vmas, entries)).processes[1].segments
    assert [(s.start - base, s.inherited) for s in segs] == [(0, True), (4 * PAGE, False), (8 * PAGE, False)]


def test_plan_merges_contiguous_entries_inside_one_vma(tmp_path):
    base = 0x7F0000000000
    entries = [_pm(base + i * 4 * PAGE, 4, "PE_LAZY | PE_PRESENT") for i in range(4)]
    plan = images.plan(make_images(tmp_path, [_vma(base, base + 16 * PAGE)], entries))
    assert [(s.start, s.end, s.offset) for s in plan.processes[1].segments] == [(base, base + 16 * PAGE, 0)]


def test_plan_reads_what_pycriu_reads(tmp_path):
    import pycriu

    base = 0x7F0000000000
    entries = [_pm(base + i * 3 * PAGE, 2, "PE_LAZY | PE_PRESENT") for i in range(50)]
    d = make_images(tmp_path, [_vma(base, base + 200 * PAGE)], entries)
    with open(os.path.join(d, "pagemap-1.img"), "rb") as fh:
        theirs = [(e["vaddr"], e["nr_pages"]) for e in pycriu.images.load(fh)["entries"][1:]]
    _, ours = images.read_pagemap(d, 1)
    assert [(e.vaddr, e.nr_pages) for e in ours] == theirs
    assert images.read_vmas(d, 1)[0].start == base and images.read_pids(d) == [1]


@pytest.mark.parametrize("flags,why", [
    ("PE_LAZY | PE_PARENT", "parent image"),
])
def test_plan_refuses_lazy_pages_in_a_parent_image(tmp_path, flags, why):
    base = 0x7F0000000000
    d = make_images(tmp_path, [_vma(base, base + 4 * PAGE)], [_pm(base, 2, flags)])
    with pytest.raises(images.ImageError, match=why):
        images.plan(d)


def test_plan_refuses_a_short_pages_file_and_pages_outside_vmas(tmp_path):
    base = 0x7F0000000000
    d = make_images(tmp_path, [_vma(base, base + 4 * PAGE)], [_pm(base, 4, "PE_LAZY | PE_PRESENT")],
                    pages_bytes=PAGE)
    with pytest.raises(images.ImageError, match="has 4096 bytes"):
        images.plan(d)
    d2 = tmp_path / "b"
    d2.mkdir()
    make_images(d2, [_vma(base, base + 4 * PAGE)], [_pm(base + 8 * PAGE, 1, "PE_LAZY | PE_PRESENT")])
    with pytest.raises(images.ImageError, match="outside every VMA"):
        images.plan(str(d2))


def test_plan_of_a_zombie_is_empty(tmp_path):
    base = 0x7F0000000000
    d = make_images(tmp_path, [_vma(base, base + 4 * PAGE)], [_pm(base, 1, "PE_LAZY | PE_PRESENT")], extra_pids=(9,))
    plan = images.plan(d)
    assert plan.processes[9].segments == [] and plan.processes[1].lazy_bytes == PAGE


def test_truncated_image_is_an_image_error(tmp_path):
    (tmp_path / "pstree.img").write_bytes(b"\x19\x43\x56\x54\x01\x02\x03\x04\xff\x00\x00\x00")
    with pytest.raises(images.ImageError, match="truncated"):
        images.plan(str(tmp_path))


# -- ranges ----------------------------------------------------------------------------------------
def _r(segs):
    return [(s.start, s.end, s.offset) for s in segs]


def test_drop_cuts_ranges_and_keeps_file_offsets():
    segs = [engine.Seg(0, 100, 1000), engine.Seg(200, 300, 2000)]
    assert _r(engine._drop(segs, 50, 250)) == [(0, 50, 1000), (250, 300, 2050)]
    assert _r(engine._drop(segs, 20, 30)) == [(0, 20, 1000), (30, 100, 1030), (200, 300, 2000)]
    assert _r(engine._drop(segs, 0, 1000)) == []


def test_remap_moves_the_ranges_inside_the_moved_area_only():
    segs = [engine.Seg(0, 100, 1000), engine.Seg(200, 300, 2000)]
    assert _r(engine._remap(segs, 50, 1000, 200)) == [(0, 50, 1000), (250, 300, 2050), (1000, 1050, 1050),
                                                       (1150, 1200, 2000)]


# -- the decision ----------------------------------------------------------------------------------
def test_decide_eager_auto_and_lazy(tmp_path, monkeypatch):
    base = 0x7F0000000000
    d = make_images(tmp_path, [_vma(base, base + 4 * PAGE)], [_pm(base, 4, "PE_LAZY | PE_PRESENT")])
    monkeypatch.delenv(pages_mod.ENV, raising=False)
    monkeypatch.setattr(uffd, "usable", lambda: None)
    cfg = Config(path="x")
    assert cfg.restore_pages == "auto"  # the default
    cfg.restore_pages = "eager"
    assert pages_mod.decide(cfg, d, name="c", other_lazy=False)["mode"] == "eager"
    cfg.restore_pages = "auto"
    small = pages_mod.decide(cfg, d, name="c", other_lazy=False)
    assert small["mode"] == "eager" and "below fill_min_mib" in small["reason"]
    cfg.fill_min_mib = 0
    assert pages_mod.decide(cfg, d, name="c", other_lazy=False)["mode"] == "lazy"
    assert pages_mod.decide(cfg, d, name="c", other_lazy=True)["mode"] == "eager"
    monkeypatch.setenv(pages_mod.ENV, "eager")
    assert pages_mod.decide(cfg, d, name="c", other_lazy=False)["mode"] == "eager"
    monkeypatch.setenv(pages_mod.ENV, "lazy")
    monkeypatch.setattr(uffd, "usable", lambda: "no userfaultfd here")
    with pytest.raises(PreconditionFailed, match="no userfaultfd here"):
        pages_mod.decide(cfg, d, name="c", other_lazy=False)
    monkeypatch.setenv(pages_mod.ENV, "auto")
    assert pages_mod.decide(cfg, d, name="c", other_lazy=False)["reason"] == "no userfaultfd here"


# -- the engine on our own memory ------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
MADV_DONTNEED, MREMAP_MAYMOVE, MREMAP_FIXED = 4, 1, 2


@pytest.fixture
def uffd_ok():
    why = uffd.usable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture
def rigs():
    """Rigs made by a test; whatever happens, their fillers stop and their userfaultfds close (a
    registration left behind would hang this process's next fork())."""
    made = []
    yield made
    for rig in made:
        rig.close()


class Rig:
    """SIZE bytes of our own anonymous memory registered with a userfaultfd, a pages file with their
    data, and a Filler running in a thread, fed by us as the guard."""

    def __init__(self, tmp_path, size: int, threads: int = 2) -> None:
        self._memory(tmp_path, size)
        self._start(tmp_path, [images.Segment(self.addr, self.addr + size, 0)], threads)

    def _memory(self, tmp_path, size: int, on_disk: bytes | None = None) -> None:
        """Random data, written to the pages file (on_disk instead where given), and size bytes of our
        memory registered with a userfaultfd."""
        self.size = size
        self.data = os.urandom(size)
        self.src = str(tmp_path / "pages-1.img")
        with open(self.src, "wb") as fh:
            fh.write(self.data if on_disk is None else on_disk(self.data))
        self.addr = _libc.mmap(None, size, 3, 0x22, -1, 0)
        self.fd, _ = uffd.open_uffd(uffd.NONCOOP_FEATURES)
        uffd.register(self.fd, self.addr, size)

    def _start(self, tmp_path, segments, threads: int, first=None, verifier_of=None) -> None:
        """A Filler of those segments in a thread, handed our userfaultfd as the guard does;
        verifier_of(plan): its verifier (pagefill/verify.py), else none."""
        plan = images.Plan(images=str(tmp_path), processes={1: images.ProcessPlan(
            pid=1, pages_file=self.src, segments=segments, **({"first": first} if first is not None else {}))})
        extra = {"verifier": verifier_of(plan)} if verifier_of else {}
        self.guard, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.filler = engine.Filler(plan, threads=threads, guard=theirs, status_path=str(tmp_path / "status.json"),
                                    **extra)
        self.rc = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        dup = os.dup(self.fd)
        try:
            self.guard.sendmsg([b"T 1 1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, dup.to_bytes(4, "little"))])
        finally:
            os.close(dup)  # else the registration outlives the test, and this process's next fork()
            # waits forever for someone to read the FORK event

    def _run(self):
        self.rc = self.filler.run()

    def close(self):
        if self.thread.is_alive():
            self.guard.send(b"A")
            self.thread.join(30)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def finish(self, timeout=60.0):
        self.guard.send(b"F")
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the filler did not finish"
        os.close(self.fd)
        self.fd = -1
        assert all(t.closed for t in self.filler.tasks.values())  # the filler let its copy go too
        return self.rc

    def read(self, off, n):
        return ctypes.string_at(self.addr + off, n)

    def read_faulting(self, off, n):
        """Read through the kernel (a pipe write), so the fault waits with the GIL released: the
        filler runs in this process, ctypes.string_at would block it."""
        r, w = os.pipe()
        try:
            os.write(w, (ctypes.c_char * n).from_address(self.addr + off))
            return os.read(r, n)
        finally:
            os.close(r)
            os.close(w)

    def messages(self):
        self.guard.setblocking(False)
        out = []
        while True:
            try:
                out.append(self.guard.recv(4096))
            except BlockingIOError:
                return out


def test_engine_serves_faults_before_the_restore_finished_then_fills_everything(tmp_path, uffd_ok, rigs):
    rigs.append(rig := Rig(tmp_path, 16 * MiB))
    # before "F" only faults are served: reading a page in the middle must not hang
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", rig.read_faulting(5 * MiB + 123, 100)), daemon=True)
    t.start()
    t.join(10)
    assert got.get("v") == rig.data[5 * MiB + 123:5 * MiB + 223]
    assert rig.filler.copied < rig.size  # no background copy yet
    assert rig.finish() == 0
    assert rig.read(0, rig.size) == rig.data
    assert rig.filler.counts["faults"] >= 1 and rig.filler.copied == rig.size
    assert b"Z" in rig.messages()


def test_engine_handles_dontneed_mremap_and_munmap_during_the_fill(tmp_path, uffd_ok, rigs):
    rigs.append(rig := Rig(tmp_path, 32 * MiB))
    # madvise(DONTNEED) on 1 MiB: must read as zeros afterwards, never as the old data
    assert _libc.madvise(rig.addr + 2 * MiB, MiB, MADV_DONTNEED) == 0
    # mremap 4 MiB elsewhere: the data must follow
    dst = _libc.mmap(None, 4 * MiB, 3, 0x22, -1, 0)
    moved = _libc.mremap(rig.addr + 8 * MiB, 4 * MiB, 4 * MiB, MREMAP_MAYMOVE | MREMAP_FIXED, dst)
    assert moved == dst
    # munmap 1 MiB: simply gone
    assert _libc.munmap(rig.addr + 20 * MiB, MiB) == 0
    assert rig.finish() == 0
    assert rig.read(2 * MiB, MiB) == b"\0" * MiB
    assert ctypes.string_at(dst, 4 * MiB) == rig.data[8 * MiB:12 * MiB]
    assert rig.read(0, 2 * MiB) == rig.data[:2 * MiB]
    assert rig.read(3 * MiB, 5 * MiB) == rig.data[3 * MiB:8 * MiB]
    assert rig.read(12 * MiB, 8 * MiB) == rig.data[12 * MiB:20 * MiB]
    assert rig.read(21 * MiB, 11 * MiB) == rig.data[21 * MiB:]
    c = rig.filler.counts
    assert c["removes"] == 1 and c["remaps"] == 1 and c["unmaps"] >= 1


def test_engine_reports_per_process_progress(tmp_path, uffd_ok, rigs):
    import json

    rigs.append(rig := Rig(tmp_path, 8 * MiB, threads=1))
    assert rig.finish() == 0
    st = json.loads((tmp_path / "status.json").read_text())
    assert st["state"] == "done" and st["pids"]["1"]["done"] is True
    assert st["pids"]["1"]["copied_bytes"] == 8 * MiB == st["lazy_bytes"]


def test_rwlock_lets_a_waiting_writer_in_before_new_readers():
    lock = engine.RWLock()
    order = []
    lock.acquire_shared()
    w = threading.Thread(target=lambda: (lock.acquire_exclusive(), order.append("w"), lock.release_exclusive()))
    w.start()
    time.sleep(0.05)
    r = threading.Thread(target=lambda: (lock.acquire_shared(), order.append("r"), lock.release_shared()))
    r.start()
    time.sleep(0.05)
    assert order == []
    lock.release_shared()
    w.join(5)
    r.join(5)
    assert order == ["w", "r"]


def test_a_filler_that_cannot_start_falls_back_to_eager_under_auto_only(monkeypatch):
    from migrt.errors import RuntimeFailed
    from migrt.pagefill import session

    def boom(*a, **kw):
        raise RuntimeFailed("cannot start the page filler: no /run")

    monkeypatch.setattr(session.PageFill, "start", classmethod(lambda cls, *a, **kw: boom()))
    auto = {"mode": "lazy", "requested": "auto", "threads": 2}
    assert pages_mod.start(auto, "/x", container_id="c", root="/r", runc_log=None, log_format="json",
                           log_file=None) is None
    assert auto["mode"] == "eager" and "could not start" in auto["reason"]
    with pytest.raises(RuntimeFailed):
        pages_mod.start({"mode": "lazy", "requested": "lazy", "threads": 2}, "/x", container_id="c", root="/r",
                        runc_log=None, log_format="json", log_file=None)


def test_doctor_check_of_the_filler(monkeypatch):
    from migrt.node import doctor

    cfg = Config(path="x")
    monkeypatch.setattr(uffd, "usable", lambda: None)
    ok = doctor._page_filler_check(cfg, True)
    assert ok["status"] == "ok" and ok["detail"].startswith("usable (restore_pages: auto")
    monkeypatch.setattr(uffd, "usable", lambda: "userfaultfd is not usable")
    warn = doctor._page_filler_check(cfg, True)
    assert warn["status"] == "warn" and "copy eagerly" in warn["detail"] and warn["fix"]
    cfg.restore_pages = "lazy"
    assert "will fail" in doctor._page_filler_check(cfg, True)["fix"]
    cfg.restore_pages = "eager"
    assert doctor._page_filler_check(cfg, True)["status"] == "ok"


def test_wait_gives_up_when_no_page_arrives_for_the_stall_time(tmp_path):
    """A lazy migration's filler whose source went quiet: wait(stall=) ends it with the figures."""
    import json
    import subprocess

    from migrt.errors import RuntimeFailed
    from migrt.pagefill.session import PageFill

    (tmp_path / "status.json").write_text(json.dumps({"state": "filling", "copied_bytes": 3 * MiB,
                                                      "lazy_bytes": 8 * MiB, "pids": {}}))
    proc = subprocess.Popen(["sleep", "30"])
    try:
        fill = PageFill(str(tmp_path), proc, -1, 2)
        fill.control_w = None
        t0 = time.monotonic()
        with pytest.raises(RuntimeFailed, match=r"no memory page arrived for 0 s \(3 of 8 MiB in\)"):
            fill.wait(stall=0.3, interval=0.02)
        assert 0.3 <= time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()


def test_a_held_pod_parts_filler_copies_nothing_in_the_background_until_its_pod_is_released(tmp_path, uffd_ok,
                                                                                          rigs, monkeypatch):
    from migrt.pods import hold

    assert hold.FILL_ENV == held.HOLD_ENV
    pod = hold.Hold(str(tmp_path), "sb1", resume=lambda root, cid: None)
    pod.join(["app", "side"], 60)
    monkeypatch.setenv(held.HOLD_ENV, pod.path)
    rigs.append(rig := Rig(tmp_path, 16 * MiB))
    rig.guard.send(b"F")  # the restore finished: background copies would start now
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", rig.read_faulting(3 * MiB, 100)), daemon=True)
    t.start()
    t.join(10)
    assert got.get("v") == rig.data[3 * MiB:3 * MiB + 100]  # a fault is served while held
    time.sleep(0.5)
    assert 0 < rig.filler.copied <= engine.FAULT_WINDOW  # the fault's window, nothing else
    assert "held_s" not in rig.filler.counts
    pod.arrived("app", "c1")
    pod.arrived("side", "c2")
    pod.release()
    rig.thread.join(30)
    assert not rig.thread.is_alive() and rig.rc == 0
    assert rig.read(0, rig.size) == rig.data and rig.filler.copied == rig.size
    assert rig.filler.counts["held_s"] >= 0.5


def test_wait_does_not_count_a_held_pod_parts_wait_for_its_release_as_a_stall(tmp_path):
    """The held part's filler copies nothing until its pod is released: no stall meanwhile; the stall
    time counts from the release."""
    import json
    import subprocess

    from migrt.errors import RuntimeFailed
    from migrt.pagefill.session import PageFill

    status = tmp_path / "status.json"
    status.write_text(json.dumps({"state": "filling", "copied_bytes": 0, "lazy_bytes": 8 * MiB, "pids": {},
                                  "held": True}))

    def released_later() -> None:
        time.sleep(0.8)
        status.write_text(json.dumps({"state": "filling", "copied_bytes": 0, "lazy_bytes": 8 * MiB, "pids": {},
                                      "held": False}))

    proc = subprocess.Popen(["sleep", "30"])
    try:
        fill = PageFill(str(tmp_path), proc, -1, 2)
        fill.control_w = None
        threading.Thread(target=released_later, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeFailed, match=r"no memory page arrived for 0 s \(0 of 8 MiB in\)"):
            fill.wait(stall=0.3, interval=0.02)
        assert 1.0 <= time.monotonic() - t0 < 5  # 0.8 s held, then 0.3 s without a byte
    finally:
        proc.kill()
        proc.wait()
