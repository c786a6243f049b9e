"""A restore's GPU steps off the path to CRIU and per process: the GPU preflight (NVML) and the
driver's load run while CRIU restores, and after a lazy restore each CUDA process's GPU restore
starts as soon as ITS memory is in (the page filler still filling the others), several at once, all
unlocked together at the end. On the fake GPU backend with a scripted fill in place of the page
filler; no container, no GPU."""

from __future__ import annotations

import json
import threading
import time

import pytest

from migrt.errors import PreconditionFailed, RuntimeFailed
from migrt.gpu import session
from migrt.gpu.backend import CHECKPOINTED, LOCKED, RUNNING, GpuError
from migrt.gpu.fake import FakeGpuBackend
from migrt.ops import gpu_steps, pages
from migrt.pagefill import session as fill_session
from migrt.store import Store
from tests.unit.test_gpu_ops import (  # noqa: F401 - fixtures
    NEW_CHILD, NEW_INIT, U1, FakeLower, cfg, node, restore_into, take_checkpoint,
)

VPID = {NEW_INIT: 1, NEW_CHILD: 7}  # the restored processes' pids inside the container (the filler's keys)


# -- gpu.session.resume_as_ready ------------------------------------------------------------------------
def test_each_process_is_restored_once_ready_and_all_are_unlocked_at_the_end():
    b = FakeGpuBackend({1: CHECKPOINTED, 2: CHECKPOINTED})
    # process 1's memory comes in only after process 2's GPU restore has begun
    spans = session.resume_as_ready([1, 2], b, None,
                                    lambda waiting: {2} | ({1} if 2 in b.calls_of("restore") else set()),
                                    poll_s=0.001)
    assert b.states == {1: RUNNING, 2: RUNNING}
    order = [(c, p) for c, p, _ in b.calls if c in ("restore", "unlock")]
    assert order[0] == ("restore", 2) and order[1] == ("restore", 1)
    assert {c for c, _ in order[2:]} == {"unlock"}  # nobody unlocked before every restore ended
    assert spans[2][0] <= spans[1][0] and all(s >= 0 for _, s in spans.values())


def test_processes_whose_memory_is_in_are_restored_in_parallel():
    """Each restore waits until both are inside restore(): passes only if they run at once."""
    barrier = threading.Barrier(2, timeout=5)

    class Slow(FakeGpuBackend):
        def restore(self, pid, remap=None):
            barrier.wait()
            super().restore(pid, remap)

    b = Slow({1: CHECKPOINTED, 2: CHECKPOINTED})
    session.resume_as_ready([1, 2], b, None, lambda waiting: set(waiting), poll_s=0.001)
    assert b.states == {1: RUNNING, 2: RUNNING}


def test_a_failed_restore_stops_the_rest_and_unlocks_those_restored():
    b = FakeGpuBackend({1: CHECKPOINTED, 2: CHECKPOINTED, 3: CHECKPOINTED})
    b.fail("restore", 2, message="CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(GpuError, match="GPU restore of 1 of 3 process\\(es\\) failed \\(pids 2\\)") as info:
        session.resume_as_ready([1, 2, 3], b, None, lambda waiting: {1, 2}, poll_s=0.001)
    assert b.states == {1: RUNNING, 2: CHECKPOINTED, 3: CHECKPOINTED}  # 3 never started: its memory never came
    assert "pid 1: restored, then unlocked" in info.value.details
    assert "pid 3: not restored (still checkpointed)" in info.value.details


def test_memory_that_can_never_come_stops_it_with_that_error():
    b = FakeGpuBackend({1: CHECKPOINTED, 2: CHECKPOINTED})
    answers = iter([{1}])

    def ready(waiting):
        try:
            return next(answers)
        except StopIteration:
            time.sleep(0.01)  # process 1's restore has surely ended by now (it is instant)
            raise RuntimeFailed("restore failed: the page filler failed: killed by SIGKILL") from None

    with pytest.raises(RuntimeFailed, match="page filler failed: killed by SIGKILL") as info:
        session.resume_as_ready([1, 2], b, None, ready, poll_s=0.001)
    assert not isinstance(info.value, GpuError)
    assert b.states == {1: RUNNING, 2: CHECKPOINTED}
    assert info.value.details == ["GPU restore: pid 1: restored, then unlocked",
                                  "GPU restore: pid 2: not restored (still checkpointed)"]


def test_a_failed_unlock_is_reported_like_resume_all():
    b = FakeGpuBackend({1: CHECKPOINTED, 2: CHECKPOINTED})
    b.fail("unlock", 1, message="CUDA_ERROR_ILLEGAL_STATE")
    with pytest.raises(GpuError, match="GPU restore of 1 of 2 process\\(es\\) failed \\(pids 1\\)"):
        session.resume_as_ready([1, 2], b, None, lambda waiting: set(waiting), poll_s=0.001)
    assert b.states[2] == RUNNING


# -- PageFill.completed: the filler's status file, read without waiting ---------------------------------
class _Proc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


def _fill(tmp_path, status: dict | None, code=None) -> fill_session.PageFill:
    if status is not None:
        (tmp_path / "status.json").write_text(json.dumps(status))
    return fill_session.PageFill(str(tmp_path), _Proc(code), -1, 2)


def test_completed_lists_the_processes_whose_memory_is_in(tmp_path):
    pids = {"1": {"done": False}, "7": {"done": True}}
    assert _fill(tmp_path, {"state": "filling", "restore_finished": True, "pids": pids}).completed() == {7}
    assert _fill(tmp_path, {"state": "filling", "restore_finished": False, "pids": pids}).completed() == set()


def test_completed_is_none_once_the_fill_is_over_and_raises_when_it_failed(tmp_path):
    assert _fill(tmp_path, None, code=0).completed() is None  # the guard exited cleanly: every page is in
    with pytest.raises(RuntimeFailed, match="page filler failed: boom"):
        _fill(tmp_path, {"state": "failed", "error": "boom"}).completed()
    with pytest.raises(RuntimeFailed, match="aborted"):
        _fill(tmp_path, {"state": "aborted"}).completed()


# -- the restore path, with a scripted fill in place of the page filler ---------------------------------
class ScriptedFill:
    """Stands in for PageFill: `script(calls)` says which vpids are complete on the n-th look (None: the
    whole fill is over) or raises as a failed filler does."""

    def __init__(self, script):
        self.script = script
        self.started = time.monotonic()
        self.looks = 0
        self.events: list[str] = []

    def link(self, work):
        self.events.append("link")

    def check(self):
        return {"state": "filling"}

    def planned(self):
        return {"state": "filling"}

    def restored(self, pid):
        self.events.append(f"restored {pid}")

    def completed(self):
        self.looks += 1
        return self.script(self.looks)

    def gpu_ready(self):
        done = self.completed()
        return None if done is None else {v: "memory" for v in done}

    def wait(self, vpids=None, timeout=None):
        self.events.append("wait")
        return {"state": "done", "copied_bytes": 1}

    def status(self):
        return {"state": "filling"}

    def abort(self):
        self.events.append("abort")

    def detach(self):
        self.events.append("detach")


@pytest.fixture
def lazy(monkeypatch):
    """Every restore decided lazy, through the fill that `use()` sets."""
    holder = {}
    monkeypatch.setattr(pages, "decide", lambda cfg, images, **kw: {"mode": "lazy", "requested": "lazy",
                                                                     "threads": 2, "reason": "test"})
    monkeypatch.setattr(pages, "start", lambda decision, images, **kw: holder["fill"])
    monkeypatch.setattr(fill_session, "container_vpid", lambda pid: VPID.get(pid))

    def use(script) -> ScriptedFill:
        holder["fill"] = ScriptedFill(script)
        return holder["fill"]

    return use


def test_the_gpu_restore_of_a_process_starts_when_its_own_memory_is_in(cfg, node, tmp_path, lazy):
    take_checkpoint(cfg)
    # the child's memory is in from the start; the init's only once the child's GPU restore has begun
    fill = lazy(lambda n: {7} | ({1} if NEW_CHILD in node.backend.calls_of("restore") else set()))
    result = restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert node.states(NEW_INIT, NEW_CHILD) == [RUNNING, RUNNING]
    order = [(c, p) for c, p, _ in node.backend.calls if c in ("restore", "unlock")]
    assert order[:2] == [("restore", NEW_CHILD), ("restore", NEW_INIT)]
    assert {c for c, _ in order[2:]} == {"unlock"}
    assert "wait" not in fill.events and fill.events[-1] == "detach"  # never waited for the whole memory
    t = result["timings"]
    by_pid = {r["pid"]: r for r in t["gpu_restores"]}
    assert by_pid[NEW_CHILD]["vpid"] == 7 and by_pid[NEW_INIT]["vpid"] == 1
    for r in by_pid.values():
        assert 0 <= r["memory_in_s"] <= r["gpu_restore_start_s"] and r["gpu_restore_s"] >= 0
    assert by_pid[NEW_CHILD]["gpu_restore_start_s"] <= by_pid[NEW_INIT]["gpu_restore_start_s"]
    assert t["gpu_memory_wait_s"] >= 0 and t["gpu_restore_s"] >= 0


def test_a_process_the_filler_does_not_list_goes_when_the_fill_is_over(cfg, node, tmp_path, lazy):
    take_checkpoint(cfg)
    lazy(lambda n: {7} if n < 5 else None)  # vpid 1 never listed (no lazy memory): ready at the end
    result = restore_into(cfg, tmp_path, [])
    assert node.states(NEW_INIT, NEW_CHILD) == [RUNNING, RUNNING]
    by_pid = {r["pid"]: r for r in result["timings"]["gpu_restores"]}
    assert by_pid[NEW_INIT]["gpu_restore_start_s"] >= by_pid[NEW_CHILD]["gpu_restore_start_s"]


def test_a_filler_failing_mid_way_removes_the_container_and_keeps_the_checkpoint(cfg, node, tmp_path, lazy):
    take_checkpoint(cfg)

    def script(n):  # the child's memory is in; the filler dies once the child's GPU restore is done
        if node.backend.states.get(NEW_CHILD) == LOCKED or n > 500:
            raise RuntimeFailed("the page filler failed: killed by SIGKILL")
        return {7}

    fill = lazy(script)
    with pytest.raises(RuntimeFailed, match="restore failed: the page filler failed: killed by SIGKILL") as info:
        restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert f"GPU restore: pid {NEW_CHILD}: restored, then unlocked" in info.value.details
    assert f"GPU restore: pid {NEW_INIT}: not restored (still checkpointed)" in info.value.details
    assert node.states(NEW_INIT, NEW_CHILD) == [CHECKPOINTED, RUNNING]
    assert FakeLower.calls[-1] == ("delete", "c2") and "abort" in fill.events
    Store(cfg.store).get("ck1").verify()


def test_a_failed_gpu_restore_stops_before_the_others_memory_and_keeps_the_checkpoint(cfg, node, tmp_path, lazy):
    take_checkpoint(cfg)
    node.backend.fail("restore", NEW_CHILD, message="CUDA_ERROR_INVALID_VALUE")
    lazy(lambda n: {7} | ({1} if n > 1000 else set()))  # the init's memory would come much later
    with pytest.raises(GpuError, match="GPU restore of 1 of 2 process.*INVALID_VALUE"):
        restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert node.backend.calls_of("restore") == [NEW_CHILD]
    assert FakeLower.calls[-1] == ("delete", "c2")
    Store(cfg.store).get("ck1").verify()


def test_an_eager_restore_restores_every_gpu_process_at_once(cfg, node, tmp_path):
    take_checkpoint(cfg)
    result = restore_into(cfg, tmp_path, [])
    assert node.states(NEW_INIT, NEW_CHILD) == [RUNNING, RUNNING]
    assert "gpu_restores" not in result["timings"] and result["pages"]["mode"] == "eager"



# -- the GPU preflight while CRIU restores ----------------------------------------------------------------
def test_the_gpu_preflight_runs_while_criu_restores(cfg, node, tmp_path, monkeypatch):
    take_checkpoint(cfg)
    criu_called = threading.Event()

    def take(*a, **kw):  # NVML answers only once runc restore has been called: a preflight in front hangs
        assert criu_called.wait(10), "the GPU preflight ran before runc restore"
        return node.inv

    monkeypatch.setattr(gpu_steps.inventory, "take", take)
    restore = FakeLower.restore
    monkeypatch.setattr(FakeLower, "restore", lambda self, spec, **kw: criu_called.set() or restore(self, spec, **kw))
    result = restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert node.states(NEW_INIT, NEW_CHILD) == [RUNNING, RUNNING]
    assert result["timings"]["gpu_preflight_s"] >= 0 and result["timings"]["gpu_driver_s"] >= 0


def test_a_driver_that_does_not_load_stops_the_restore_before_the_gpu(cfg, node, tmp_path, monkeypatch):
    take_checkpoint(cfg)
    monkeypatch.setattr(node.backend, "available", lambda: False)
    with pytest.raises(PreconditionFailed, match="holds GPU state, but the CUDA checkpoint API is not usable"):
        restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert [c[0] for c in FakeLower.calls][-2:] == ["restore", "delete"]
    assert node.backend.calls_of("restore") == [] and node.states(NEW_INIT, NEW_CHILD) == [CHECKPOINTED] * 2
    Store(cfg.store).get("ck1").verify()


# -- deferred checks: the GPU ones start as runc is called ----------------------------------------------
def test_a_deferred_check_runs_only_once_released(tmp_path):
    from migrt.ops.restore_checks import RestoreChecks

    ran = threading.Event()
    checks = RestoreChecks(str(tmp_path))
    checks.add("later", lambda: ran.set() or "value", deferred=True)
    checks.start()
    assert not ran.wait(0.2)  # held until the caller's last step before runc
    checks.release()
    assert checks.failure() is None and ran.is_set() and checks.value("later") == "value"


def test_a_deferred_check_never_runs_when_the_restore_stops_before_runc(tmp_path):
    from migrt.ops.restore_checks import RestoreChecks

    ran = threading.Event()
    checks = RestoreChecks(str(tmp_path))
    checks.add("later", ran.set, deferred=True)
    assert checks.failure() is None and not ran.is_set() and checks.seconds() == {}
