"""The GPU restore order of a lazy restore (issue 18): the driver's host copy of each process's GPU
memory is found on the source (the writable private anonymous ranges that appeared during the
driver's checkpoint: gpu/backing.py), recorded per process in the GPU record (`gpu_backing`), read
by the filler's plan (`first` ranges, segments cut at their edges), copied before any other range
over every copy thread, and the process's GPU restore starts once they are in (`first_done` in the
filler's status, PageFill.gpu_ready, MemoryReady). No container, no GPU: the test process's own
memory stands in for a CUDA process."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket

import pytest

from migrt.config import Config
from migrt.gpu import backing, inventory, select
from migrt.gpu.backend import RUNNING
from migrt.gpu.fake import FakeGpuBackend
from migrt.ops import gpu_steps, pages
from migrt.pagefill import engine, images
from migrt.pagefill import session as fill_session
from tests.unit.test_gpu_restore_per_process import _fill
from tests.unit.test_pagefill import Rig, _pm, _vma, make_images, rigs, uffd_ok  # noqa: F401

MiB = 1 << 20
PAGE = 4096


def _private(size: int) -> mmap.mmap:
    """Private anonymous memory, as the driver's host copy is (Python's default mmap is shared)."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"g" * size)
    return m


def _addr(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


# -- the source: what appeared during the driver's checkpoint -----------------------------------------------
def test_appeared_is_what_no_earlier_range_covered():
    before = [(0x1000_0000, 0x1010_0000), (0x2000_0000, 0x2020_0000)]
    after = [(0x1000_0000, 0x1050_0000),   # grown by 4 MiB (merged with its new neighbour)
             (0x1800_0000, 0x1880_0000),   # new, 8 MiB
             (0x2000_0000, 0x2020_0000),   # unchanged
             (0x3000_0000, 0x3000_8000)]   # new but small (a thread's bits): left out
    assert backing.appeared(before, after) == [[0x1010_0000, 0x1050_0000], [0x1800_0000, 0x1880_0000]]
    # memory committed inside an earlier range's hole, and around one that stayed
    assert backing.appeared([(0x5040_0000, 0x5060_0000)], [(0x5000_0000, 0x5100_0000)]) == \
        [[0x5000_0000, 0x5040_0000], [0x5060_0000, 0x5100_0000]]
    assert backing.appeared(after, after) == []


def test_appeared_keeps_the_biggest_ranges_only():
    after = [(i << 32, (i << 32) + (1 + i % 3) * MiB) for i in range(1, 200)]
    got = backing.appeared([], after)
    assert len(got) == backing.MAX_RANGES and got == sorted(got)
    assert {r[1] - r[0] for r in got} == {3 * MiB}


def test_a_private_mapping_made_between_the_snapshots_is_found_shared_and_small_ones_are_not():
    me = os.getpid()
    before = backing.snapshot([me])
    keep = [_private(8 * MiB), mmap.mmap(-1, 8 * MiB), _private(64 << 10)]  # private, shared, small
    got = backing.found(before)[me]
    a = _addr(keep[0])
    assert [r for r in got if r[0] <= a < r[1]] and all(r[1] - r[0] >= backing.MIN_BYTES for r in got)
    shared = _addr(keep[1])
    assert not [r for r in got if r[0] <= shared < r[1]]
    assert backing.found({999_999_999: None}) == {}


def test_the_gpu_checkpoint_records_where_the_driver_put_each_process_s_gpu_memory(monkeypatch):
    """gpu_steps.suspend around the driver's checkpoint: the fake driver maps and fills 8 MiB of host
    memory in the checkpointed process (this one), as the real one does; the GPU record says where."""
    me = os.getpid()
    copies = []

    class Driver(FakeGpuBackend):
        def checkpoint(self, pid):
            copies.append(_private(8 * MiB))
            super().checkpoint(pid)

    monkeypatch.setattr(select, "override", Driver({me: RUNNING}))
    monkeypatch.setattr(gpu_steps.inventory, "take",
                        lambda *a, **k: inventory.Inventory(source="nvml", driver_version="580.159", gpus=[],
                                                            processes={}))
    sus = gpu_steps.suspend(Config(path="/none"), "c1", None, None, pids=[me])
    proc = sus.section["processes"][0]
    a = _addr(copies[0])
    assert proc["pid"] == me and [r for r in proc["gpu_backing"] if r[0] <= a and a + 8 * MiB <= r[1]]


# -- the target: the plan's first ranges ----------------------------------------------------------------------
def _gpu_record(d, processes):
    (d / images.GPU_RECORD).write_text(json.dumps({"schema": 1, "processes": processes}))


def test_the_plan_cuts_each_process_s_segments_at_its_gpu_backing(tmp_path):
    base = 0x7f00_0000_0000
    make_images(tmp_path, [_vma(base, base + 16 * MiB)], [_pm(base, 4096, "PE_PRESENT | PE_LAZY")])
    _gpu_record(tmp_path, [{"pid": 4242, "ns_pid": 1, "gpu_backing": [[base + 4 * MiB, base + 10 * MiB + 1]]}])
    p = images.plan(str(tmp_path)).processes[1]
    assert p.first == [(base + 4 * MiB, base + 10 * MiB + PAGE)]  # page-rounded
    assert [(s.start - base, s.end - base, s.offset) for s in p.segments] == [
        (0, 4 * MiB, 0), (4 * MiB, 10 * MiB + PAGE, 4 * MiB), (10 * MiB + PAGE, 16 * MiB, 10 * MiB + PAGE)]
    assert p.first_bytes == 6 * MiB + PAGE and p.lazy_bytes == 16 * MiB


@pytest.mark.parametrize("record", [
    "not json", '{"processes": 3}', '{"processes": [{"ns_pid": true, "gpu_backing": [[0, 4096]]}]}',
    '{"processes": [{"ns_pid": 1, "gpu_backing": [[8192, 4096]]}]}',
    '{"processes": [{"ns_pid": 1, "gpu_backing": [["0x0", 4096]]}]}',
    '{"processes": [{"ns_pid": 1, "gpu_backing": "all"}]}',
])
def test_a_malformed_gpu_record_changes_nothing(tmp_path, record):
    base = 0x7f00_0000_0000
    make_images(tmp_path, [_vma(base, base + 4 * MiB)], [_pm(base, 1024, "PE_PRESENT | PE_LAZY")])
    (tmp_path / images.GPU_RECORD).write_text(record)
    p = images.plan(str(tmp_path)).processes[1]
    assert p.first == [] and len(p.segments) == 1


# -- the filler: first ranges before any other ----------------------------------------------------------------
class FirstRig(Rig):
    """32 MiB of our memory as two lazy ranges, 24 and 8 MiB (biggest first would take the 24 MiB one
    first), with the GPU backing [26, 30) MiB inside the small one."""

    def __init__(self, tmp_path, threads=2) -> None:  # noqa: D107 - Rig's methods, another plan
        self._memory(tmp_path, 32 * MiB)
        a = self.addr
        self.first = [(a + 26 * MiB, a + 30 * MiB)]
        segs = images.cut([images.Segment(a, a + 24 * MiB, 0), images.Segment(a + 24 * MiB, a + 32 * MiB, 24 * MiB)],
                          self.first)
        self._start(tmp_path, segs, threads, first=self.first)


def test_the_copy_threads_fill_the_gpu_backing_before_the_bigger_ranges(tmp_path, uffd_ok, rigs):
    rigs.append(rig := FirstRig(tmp_path))
    assert rig.finish() == 0
    assert rig.read(0, rig.size) == rig.data
    st = json.loads((tmp_path / "status.json").read_text())["pids"]["1"]
    assert st["first_bytes"] == 4 * MiB and st["first_done"] is True
    # while the backing came in, the threads copied nothing else but their one chunk each
    assert 4 * MiB <= st["copied_at_first"] <= 4 * MiB + rig.filler.nthreads * engine.CHUNK < 24 * MiB
    assert st["first_s"] <= st["seconds"]


def test_a_first_range_goes_before_the_range_being_cut(tmp_path):
    """_take() alone: a task with first ranges that arrives while the threads cut another task's big
    range gets the next chunk."""
    size = 16 * MiB
    for name in ("a", "b"):
        (tmp_path / f"pages-{name}.img").write_bytes(b"\0" * size)
    big = images.ProcessPlan(pid=1, pages_file=str(tmp_path / "pages-a.img"),
                             segments=[images.Segment(0x10_0000_0000, 0x10_0000_0000 + size, 0)])
    gpu = images.ProcessPlan(pid=2, pages_file=str(tmp_path / "pages-b.img"),
                             segments=[images.Segment(0x20_0000_0000, 0x20_0000_0000 + 2 * MiB, 0)],
                             first=[(0x20_0000_0000, 0x20_0000_0000 + 2 * MiB)])
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    f = engine.Filler(images.Plan(images=str(tmp_path), processes={1: big, 2: gpu}), threads=1, guard=theirs,
                      status_path=None)
    f.add_task(1, 1, -1)
    f.copying = True
    with f.state:
        assert f._take().t.vpid == 1
    f.add_task(2, 2, -1)
    with f.state:
        job = f._take()
        assert job.t.vpid == 2 and job.end - job.start == 2 * MiB
        assert f._take().t.vpid == 1  # then back to the big one
    ours.close()
    theirs.close()


# -- the restore: whose GPU restore may start -------------------------------------------------------------------
def test_gpu_ready_names_processes_whose_backing_or_whole_memory_is_in(tmp_path):
    pids = {"1": {"done": False, "first_done": True}, "7": {"done": True}, "9": {"done": False, "first_done": False}}
    assert _fill(tmp_path, {"state": "filling", "restore_finished": True, "pids": pids}).gpu_ready() == \
        {1: "gpu_backing", 7: "memory"}
    assert _fill(tmp_path, {"state": "filling", "restore_finished": False, "pids": pids}).gpu_ready() == \
        {1: "gpu_backing"}
    (gone := tmp_path / "gone").mkdir()
    assert _fill(gone, None, code=0).gpu_ready() is None  # the guard exited cleanly: every page is in


def test_memory_ready_says_what_each_gpu_restore_waited_for(monkeypatch):
    class Fill:
        started = 0.0

        def __init__(self):
            self.answers = iter([{1: "gpu_backing"}, {1: "gpu_backing", 7: "memory"}])

        def gpu_ready(self):
            return next(self.answers)

    monkeypatch.setattr(fill_session, "container_vpid", lambda pid: {100: 1, 107: 7}[pid])
    ready = pages.MemoryReady(Fill())
    assert ready.ready([100, 107]) == {100}
    assert ready.ready([107]) == {107}
    assert ready.about(100)["waited_for"] == "gpu_backing" and ready.about(107)["waited_for"] == "memory"


def test_a_task_added_while_a_range_is_cut_loses_nothing_of_that_range(tmp_path):
    """A fork child (or any task) added while the copy threads cut a range of another task: the rest of
    that range is still copied (it was out of the heap, and adding a task used to drop it)."""
    size = 16 * MiB
    (tmp_path / "pages-a.img").write_bytes(b"\0" * size)
    plan = images.Plan(images=str(tmp_path), processes={
        1: images.ProcessPlan(pid=1, pages_file=str(tmp_path / "pages-a.img"),
                              segments=[images.Segment(0x10_0000_0000, 0x10_0000_0000 + size, 0)]),
        2: images.ProcessPlan(pid=2, pages_file=str(tmp_path / "pages-a.img"),
                              segments=[images.Segment(0x20_0000_0000, 0x20_0000_0000 + MiB, 0)])})
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    f = engine.Filler(plan, threads=1, guard=theirs, status_path=None)
    f.add_task(1, 1, -1)
    f.copying = True
    taken = {1: 0, 2: 0}
    with f.state:
        job = f._take()
    taken[job.t.vpid] += job.end - job.start
    f.add_task(2, 2, -1)
    with f.state:
        while (job := f._take()) is not None:
            taken[job.t.vpid] += job.end - job.start
    assert taken == {1: size, 2: MiB}
    ours.close()
    theirs.close()


# -- the simulated GPU node (CI's stand-in for the driver) -------------------------------------------------------
def _child(code: str):
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_the_simulated_checkpoint_has_the_workload_make_its_host_copy(tmp_path, monkeypatch):
    from migrt.gpu import fakenode
    from migrt.gpu.backend import GpuError

    ack = tmp_path / "gpu-copy"
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"checkpoint_signal": 10, "checkpoint_ack": str(ack)}))
    p = _child(f"import signal, time\nsignal.signal(10, lambda *a: open({str(ack)!r}, 'w').close())\n"
               "print('ready', flush=True)\ntime.sleep(30)")
    try:
        fakenode.host_copy(str(state), p.pid)  # returns once the workload said it is done
        assert ack.exists()
    finally:
        p.kill()
        p.wait()
    monkeypatch.setattr(fakenode, "HOST_COPY_WAIT_S", 0.3)
    p = _child("import signal, time\nsignal.signal(10, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(30)")
    try:
        with pytest.raises(GpuError, match="did not map its host copy"):
            fakenode.host_copy(str(state), p.pid)
    finally:
        p.kill()
        p.wait()


def test_the_simulated_node_reads_an_environment_through_process_vm_readv():
    """A lazily restored process's environment page may not be in yet: /proc/PID/environ then reads
    nothing (seen in bench/gpu_migration.py --simulate: 'found 0 checkpointed CUDA process(es)' in 2
    lazy runs of 3), process_vm_readv faults it in through the filler. Same bytes."""
    from migrt.gpu import fakenode

    with open("/proc/self/environ", "rb") as fh:
        assert fakenode._environ_by_vm(os.getpid()) == fh.read()
