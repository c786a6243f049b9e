"""GPU preemption in place (`migrt gpu suspend|resume|status`, migrt-runc pause/resume with GPU
release) on the simulated GPU node (MIGRT_FAKE_GPU, migrt/gpu/fakenode.py): real processes carrying
the fake's CUDA marker, a runc state directory written by hand, the fake lower runtime. No GPU, no
container, no root."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from migrt import config as config_mod
from migrt.errors import Conflict, NotFound, PreconditionFailed
from migrt.gpu import fakenode, inventory
from migrt.gpu.backend import GpuError
from migrt.ops import gpu_preempt
from migrt.runtime.markers import GPU_RELEASE_MARKER
from tests.unit.support import PY_SHIM, VENV_BIN, write_bundle
from tests.unit.test_shim import ShShim, render_sh, sh_shim  # noqa: F401 - the fixture

GIB = 1 << 30
U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
CID = "job-7"
CLI = str(VENV_BIN / "migrt")


def node_file(path: Path, **over) -> Path:
    data = {"driver_version": "580.159", "process_bytes": 8 * GIB,
            "gpus": [{"uuid": U0, "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GIB, "minor": 0},
                     {"uuid": U1, "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GIB, "minor": 1}]}
    data.update(over)
    path.write_text(json.dumps(data))
    return path


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Box:
    """A 'container': a process tree whose processes carry the fake CUDA marker (or not), and the
    runc state file that names its init."""

    def __init__(self, root: Path, bundle: Path, cid: str = CID, *, cuda: bool = True, workers: int = 2,
                 marker: str = "FAKE_CUDA=1") -> None:
        self.bundle = bundle
        key, _, value = marker.partition("=")
        env = {"PATH": os.environ["PATH"], **({key: value} if cuda else {})}
        script = " ".join(["sleep 1000 &"] * workers) + " wait" if workers else "exec sleep 1000"
        self.proc = subprocess.Popen(["sh", "-c", script], env=env, start_new_session=True)
        self.cid, self.root = cid, root
        deadline = time.monotonic() + 10
        while not self._settled(workers + 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        (root / cid).mkdir(parents=True, exist_ok=True)
        (root / cid / "state.json").write_text(json.dumps({
            "id": cid, "init_process_pid": self.proc.pid, "cgroup_paths": {},
            "config": {"labels": [f"bundle={bundle}"]}}))

    def _settled(self, n: int) -> bool:
        """n processes, each past its exec (no longer with pytest's command line, a fork's before exec)."""
        pids = self.pids()
        ours = _cmdline(os.getpid())
        return len(pids) >= n and all(_cmdline(p) not in (ours, b"") for p in pids)

    def pids(self) -> list[int]:
        from migrt.gpu import procs

        return procs.process_tree(self.proc.pid)

    def stop(self) -> None:
        from migrt.gpu import procs

        pids = self.pids()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        deadline = time.monotonic() + 20
        while any(procs.alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)


@pytest.fixture
def gpu_node(tmp_path, migrt_env, monkeypatch):
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"  # this test's processes only (others may run beside it)
    path = node_file(tmp_path / "fake-gpu.json", marker=marker)
    monkeypatch.setenv(fakenode.ENV, str(path))
    migrt_env.env[fakenode.ENV] = str(path)
    root = tmp_path / "runc-root"
    root.mkdir()
    boxes: list[Box] = []

    class Node:
        file = path
        env = migrt_env
        runc_root = root

        @staticmethod
        def box(*a, bundle_env=None, **k) -> Box:
            b = Box(root, write_bundle(tmp_path / f"bundle-{len(boxes)}", env=bundle_env), *a, marker=marker, **k)
            boxes.append(b)
            return b

        @staticmethod
        def data() -> dict:
            return fakenode.read(str(path))

        @staticmethod
        def states(pids) -> list[str]:
            with fakenode.locked(str(path)) as d:
                fakenode.discover(d)  # the driver knows every CUDA process
                return [d["processes"][str(p)]["state"] for p in pids]

        @staticmethod
        def fail(call: str, pid=None, **k) -> None:
            with fakenode.locked(str(path)) as d:
                d["fail"].append({"call": call, "pid": pid, **k})

        @staticmethod
        def cli(*args, check=True) -> subprocess.CompletedProcess:
            r = subprocess.run([CLI, *args], env=migrt_env.env, capture_output=True, text=True, timeout=60)
            if check:
                assert r.returncode == 0, r.stderr
            return r

    yield Node
    for b in boxes:
        b.stop()


def cfg():
    return config_mod.load()


def free(uuid: str) -> int:
    return inventory.take().by_uuid(uuid).memory_free


def test_suspend_frees_the_gpu_and_resume_from_a_new_process_brings_it_back(gpu_node):
    box = gpu_node.box()
    pids = box.pids()
    assert free(U0) == 80 * GIB - 3 * 8 * GIB  # sh + two workers, 8 GiB each on GPU 0
    rec = gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    assert rec["status"] == "suspended" and sorted(p["pid"] for p in rec["processes"]) == sorted(pids)
    assert rec["gpus"] == [U0] and rec["gpu_memory_bytes"] == 24 * GIB
    assert gpu_node.states(pids) == ["checkpointed"] * 3
    assert free(U0) == 80 * GIB  # the GPU is free
    assert all(p.poll() is None for p in [box.proc])  # the processes live on
    calls = gpu_node.data()["calls"]
    locks = [i for i, c in enumerate(calls) if c[0] == "lock"]
    ckpts = [i for i, c in enumerate(calls) if c[0] == "checkpoint"]
    assert max(locks) < min(ckpts)  # every process locked before any checkpoint

    st = json.loads(gpu_node.cli("gpu", "status", "--root", str(gpu_node.runc_root), "--json").stdout)
    assert [s["container_id"] for s in st] == [CID] and st[0]["status"] == "suspended"
    assert {p["driver_state"] for p in st[0]["processes"]} == {"checkpointed"}
    assert st[0]["host_memory_bytes"] > 0 and st[0]["gpus"] == [U0]

    r = gpu_node.cli("gpu", "resume", CID, "--root", str(gpu_node.runc_root), "--json")
    done = json.loads(r.stdout)
    assert done["moved"] is False and done["gpus"] == [U0] and done["timings"]["resume_s"] >= 0
    assert gpu_node.states(pids) == ["running"] * 3
    assert free(U0) == 80 * GIB - 24 * GIB
    assert not os.path.exists(gpu_preempt.record_path(str(gpu_node.runc_root), CID))
    assert json.loads(gpu_node.cli("gpu", "status", "--root", str(gpu_node.runc_root), "--json").stdout) == []


def test_resume_onto_another_gpu_remaps(gpu_node):
    box = gpu_node.box(workers=1)
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    done = gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root), gpus=[U1])
    assert done["moved"] and done["pairs"] == [{"old": U0, "new": U1}]
    procs = gpu_node.data()["processes"]
    assert {procs[str(p)]["gpu"] for p in box.pids()} == {U1}
    assert {tuple(procs[str(p)]["remap"][0]) for p in box.pids()} == {(U0, U1)}
    assert free(U1) == 80 * GIB - 16 * GIB and free(U0) == 80 * GIB


def test_resume_with_named_gpus_pairs_them_in_the_order_given(gpu_node):
    box = gpu_node.box(workers=0, bundle_env=[f"NVIDIA_VISIBLE_DEVICES={U0},{U1}"])  # sees both, uses GPU 0
    rec = gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    assert rec["gpus"] == [U0, U1]
    done = gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root), gpus=[U1, U0])
    assert done["pairs"] == [{"old": U0, "new": U1}, {"old": U1, "new": U0}]
    assert gpu_node.data()["processes"][str(box.proc.pid)]["gpu"] == U1


def test_suspend_without_cuda_process_is_refused_and_touches_nothing(gpu_node):
    gpu_node.box(cuda=False)
    with pytest.raises(PreconditionFailed, match="has no CUDA process"):
        gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    assert gpu_node.data()["calls"] == []
    r = gpu_node.cli("gpu", "suspend", CID, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == 8 and "no CUDA process" in r.stderr


def test_suspend_of_a_missing_container(gpu_node):
    r = gpu_node.cli("gpu", "suspend", "nope", "--root", str(gpu_node.runc_root), "--json", check=False)
    assert r.returncode == 3 and json.loads(r.stdout)["type"] == "NotFound"


def test_driver_refusing_checkpoint_leaves_everything_running(gpu_node):
    box = gpu_node.box()
    pids = box.pids()
    gpu_node.fail("checkpoint", pids[1], message="CUDA_ERROR_NOT_SUPPORTED")
    with pytest.raises(GpuError, match="CUDA_ERROR_NOT_SUPPORTED.*every process was resumed"):
        gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    assert gpu_node.states(pids) == ["running"] * 3
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID) is None
    with pytest.raises(NotFound):
        gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root))


def test_resume_without_free_memory_is_refused_before_any_driver_call(gpu_node):
    box = gpu_node.box(workers=1)
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    hog = gpu_node.box("hog", workers=0)  # another job took the GPU meanwhile: 8 GiB ...
    with fakenode.locked(str(gpu_node.file)) as d:
        fakenode.discover(d)
        d["processes"][str(hog.proc.pid)]["bytes"] = 70 * GIB  # ... make it 70 GiB
    n = len(gpu_node.data()["calls"])
    r = gpu_node.cli("gpu", "resume", CID, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == 8 and "has 10.0 GiB free" in r.stderr and "16.0 GiB" in r.stderr, r.stderr
    assert [c[0] for c in gpu_node.data()["calls"][n:] if c[0] != "state"] == []  # no transition
    assert gpu_node.states(box.pids()) == ["checkpointed"] * 2
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID)["status"] == "suspended"
    # onto the free GPU it goes
    gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root), gpus=[U1])
    assert gpu_node.states(box.pids()) == ["running"] * 2


def test_resume_gpu_count_and_unknown_gpu_are_refused(gpu_node):
    gpu_node.box(workers=1)
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    with pytest.raises(PreconditionFailed, match="ran on 1 GPU"):
        gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root), gpus=[U0, U1])
    with pytest.raises(PreconditionFailed, match="not on this node"):
        gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root), gpus=["GPU-22222222-2222-2222-2222-222222222222"])


def test_driver_refusing_restore_keeps_the_container_suspended_never_half_resumed(gpu_node):
    box = gpu_node.box()
    pids = box.pids()
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    gpu_node.fail("unlock", pids[2], message="CUDA_ERROR_UNKNOWN")  # after all were restored
    with pytest.raises(GpuError, match="CUDA_ERROR_UNKNOWN.*every process stays suspended"):
        gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root))
    assert gpu_node.states(pids) == ["checkpointed"] * 3
    assert free(U0) == 80 * GIB
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID)["status"] == "suspended"
    gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root))  # once the cause is gone
    assert gpu_node.states(pids) == ["running"] * 3


def test_twice_suspended_is_a_conflict(gpu_node):
    gpu_node.box(workers=1)
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    with pytest.raises(Conflict, match="already GPU-suspended"):
        gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))


@pytest.mark.parametrize("where", ["lock", "checkpoint"])
def test_migrt_killed_during_suspend_is_finished_by_resume_in_a_new_process(gpu_node, where):
    box = gpu_node.box()
    pids = box.pids()
    gpu_node.fail(where, pids[1], crash=True)  # SIGKILL of `migrt gpu suspend` in that driver call
    r = gpu_node.cli("gpu", "suspend", CID, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == -signal.SIGKILL
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID)["status"] == "suspending"
    states = gpu_node.states(pids)
    if where == "checkpoint":  # every lock came first
        assert "running" not in states and "checkpointed" not in states[1:2], states
    else:
        assert set(states) <= {"running", "locked"}, states
    st = json.loads(gpu_node.cli("gpu", "status", CID, "--root", str(gpu_node.runc_root), "--json").stdout)
    assert st[0]["status"] == "suspending"
    r = gpu_node.cli("gpu", "suspend", CID, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == 6 and "interrupted" in r.stderr
    gpu_node.cli("gpu", "resume", CID, "--root", str(gpu_node.runc_root))
    assert gpu_node.states(pids) == ["running"] * 3
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID) is None


def test_migrt_killed_during_resume_is_finished_by_resume(gpu_node):
    box = gpu_node.box()
    pids = box.pids()
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    gpu_node.fail("unlock", pids[1], crash=True)
    r = gpu_node.cli("gpu", "resume", CID, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == -signal.SIGKILL
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID)["status"] == "resuming"
    assert sorted(gpu_node.states(pids)) == ["locked", "locked", "running"]
    gpu_node.cli("gpu", "resume", CID, "--root", str(gpu_node.runc_root))
    assert gpu_node.states(pids) == ["running"] * 3
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID) is None


def test_processes_that_exited_while_suspended_are_skipped_and_all_gone_is_an_error(gpu_node):
    box = gpu_node.box(workers=2)
    pids = box.pids()
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    os.kill(pids[1], signal.SIGKILL)
    from migrt.gpu import procs

    deadline = time.monotonic() + 20  # a loaded machine may take a while to schedule the dying process
    while procs.alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.02)
    done = gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root))
    assert done["exited"] == [pids[1]] and sorted(done["processes"]) == sorted([pids[0], pids[2]])
    assert gpu_node.states([pids[0], pids[2]]) == ["running"] * 2
    gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    box.stop()
    with pytest.raises(NotFound, match="every suspended process .* is gone"):
        gpu_preempt.resume(cfg(), CID, str(gpu_node.runc_root))


# -- migrt-runc pause/resume ------------------------------------------------------------------------
def shim_argv(root: Path, bundle: Path, *rest: str) -> list[str]:
    return ["--root", str(root), "--log", str(bundle / "log.json"), "--log-format", "json", *rest]


@pytest.mark.parametrize("how", ["annotation", "env"])
def test_sh_create_with_release_on_pause_marks_the_container(sh_shim, gpu_node, tmp_path, how):
    ann = {"migrt.io/gpu-release-on-pause": "true"} if how == "annotation" else None
    env = ["MIGRT_GPU_RELEASE_ON_PAUSE=1"] if how == "env" else None
    bundle = write_bundle(tmp_path / "b", env=env, annotations=ann)
    root = gpu_node.runc_root
    (root / "c1").mkdir()  # what runc create leaves (the fake runtime creates nothing)
    argv = shim_argv(root, bundle, "create", "--bundle", str(bundle), "--pid-file", f"{bundle}/init.pid", "c1")
    r = sh_shim.run(argv)
    assert r.returncode == 0, r.stderr
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]
    assert (root / "c1" / GPU_RELEASE_MARKER).is_file()
    assert len(sh_shim.py_calls()) == 1


def test_sh_create_failing_leaves_no_marker(sh_shim, gpu_node, tmp_path):
    bundle = write_bundle(tmp_path / "b", annotations={"migrt.io/gpu-release-on-pause": "true"})
    root = gpu_node.runc_root
    (root / "c1").mkdir()
    r = sh_shim.run(shim_argv(root, bundle, "create", "--bundle", str(bundle), "c1"),
                    {**sh_shim.env.env, "FAKE_RC": "3"})
    assert r.returncode == 3 and not (root / "c1" / GPU_RELEASE_MARKER).exists()


def test_sh_pause_resume_without_marker_never_start_python(sh_shim, gpu_node, tmp_path):
    box = gpu_node.box()  # a CUDA container, but not created with release on pause
    bundle = write_bundle(tmp_path / "b")
    for sub in ("pause", "resume"):
        assert sh_shim.run(shim_argv(gpu_node.runc_root, bundle, sub, CID)).returncode == 0
    assert sh_shim.py_calls() == []
    assert gpu_node.data()["calls"] == [] and gpu_node.states(box.pids()) == ["running"] * 3


def test_sh_pause_suspends_the_gpu_first_and_resume_restores_it_after(sh_shim, gpu_node, tmp_path):
    box = gpu_node.box()
    pids = box.pids()
    (gpu_node.runc_root / CID / GPU_RELEASE_MARKER).write_text("")
    bundle = write_bundle(tmp_path / "b")
    spy = tmp_path / "order.log"
    env = {**sh_shim.env.env}
    pause = shim_argv(gpu_node.runc_root, bundle, "pause", CID)
    r = sh_shim.run(pause, env)
    assert r.returncode == 0, (r.stderr, (bundle / "log.json").read_text() if (bundle / "log.json").exists() else "")
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in pause]]  # runc pause, argv untouched
    assert gpu_node.states(pids) == ["checkpointed"] * 3 and free(U0) == 80 * GIB
    rec = gpu_preempt.read_record(str(gpu_node.runc_root), CID)
    assert rec["by"] == "pause" and rec["status"] == "suspended"
    st = json.loads(gpu_node.cli("gpu", "status", "--root", str(gpu_node.runc_root), "--json").stdout)
    assert st[0]["by"] == "pause"

    resume = shim_argv(gpu_node.runc_root, bundle, "resume", CID)
    r = sh_shim.run(resume, env)
    assert r.returncode == 0, r.stderr
    assert sh_shim.env.fake.argvs()[-1] == [os.fsencode(a) for a in resume]
    assert gpu_node.states(pids) == ["running"] * 3
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID) is None
    assert len(sh_shim.py_calls()) == 2
    del spy


def test_pause_failing_in_the_lower_runtime_gives_the_gpu_back(sh_shim, gpu_node, tmp_path):
    box = gpu_node.box(workers=1)
    (gpu_node.runc_root / CID / GPU_RELEASE_MARKER).write_text("")
    bundle = write_bundle(tmp_path / "b")
    r = sh_shim.run(shim_argv(gpu_node.runc_root, bundle, "pause", CID), {**sh_shim.env.env, "FAKE_RC": "1"})
    assert r.returncode == 1
    assert gpu_node.states(box.pids()) == ["running"] * 2
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID) is None


def test_pause_refused_by_the_driver_keeps_the_container_running(sh_shim, gpu_node, tmp_path):
    box = gpu_node.box(workers=1)
    (gpu_node.runc_root / CID / GPU_RELEASE_MARKER).write_text("")
    bundle = write_bundle(tmp_path / "b")
    gpu_node.fail("lock", None, message="CUDA_ERROR_TIMEOUT")
    r = sh_shim.run(shim_argv(gpu_node.runc_root, bundle, "pause", CID))
    assert r.returncode == 5
    assert sh_shim.env.fake.calls() == []  # never frozen
    msg = json.loads((bundle / "log.json").read_text().splitlines()[-1])["msg"]
    assert "was not paused (it keeps running)" in msg and "CUDA_ERROR_TIMEOUT" in msg
    assert gpu_node.states(box.pids()) == ["running"] * 2


def test_gpu_resume_failing_after_thaw_pauses_the_container_again(sh_shim, gpu_node, tmp_path):
    box = gpu_node.box(workers=1)
    (gpu_node.runc_root / CID / GPU_RELEASE_MARKER).write_text("")
    bundle = write_bundle(tmp_path / "b")
    assert sh_shim.run(shim_argv(gpu_node.runc_root, bundle, "pause", CID)).returncode == 0
    gpu_node.fail("restore", None, message="CUDA_ERROR_OUT_OF_MEMORY")
    r = sh_shim.run(shim_argv(gpu_node.runc_root, bundle, "resume", CID))
    assert r.returncode == 5
    subs = [a[a.index(b"--log-format") + 2] for a in sh_shim.env.fake.argvs() if b"--log-format" in a]
    subs += [a[2] for a in sh_shim.env.fake.argvs() if b"--log-format" not in a]
    assert [a for a in sh_shim.env.fake.argvs()][-1][-2:] == [b"pause", CID.encode()]
    msg = json.loads((bundle / "log.json").read_text().splitlines()[-1])["msg"]
    assert "paused again with its GPU state in host memory" in msg
    assert gpu_node.states(box.pids()) == ["checkpointed"] * 2
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID)["status"] == "suspended"


def test_pause_of_a_container_without_cuda_process_just_pauses(sh_shim, gpu_node, tmp_path):
    gpu_node.box(cuda=False)
    (gpu_node.runc_root / CID / GPU_RELEASE_MARKER).write_text("")
    bundle = write_bundle(tmp_path / "b")
    pause = shim_argv(gpu_node.runc_root, bundle, "pause", CID)
    assert sh_shim.run(pause).returncode == 0
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in pause]]
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID) is None


def test_py_shim_pause_marker_lookup_refuses_paths(gpu_node, tmp_path):
    (gpu_node.runc_root / GPU_RELEASE_MARKER).write_text("")
    r = subprocess.run([str(PY_SHIM), "--root", str(gpu_node.runc_root / "x"), "pause", ".."],
                       env=gpu_node.env.env, capture_output=True)
    assert r.returncode == 0 and gpu_node.env.fake.argvs()[-1][-2:] == [b"pause", b".."]


def test_a_lock_still_stuck_in_the_driver_keeps_the_record_and_is_not_queried(gpu_node, monkeypatch):
    """gpu.session names a lock call that never returned (`pending`): the suspend fails at once,
    keeps its record for 'migrt gpu resume' and asks the driver nothing more (a state query on such a
    process can block as its lock does)."""
    from migrt.gpu.backend import GpuError as Err

    box = gpu_node.box()
    pids = box.pids()

    def stuck(pids, backend, timeout_ms, checkpoint_window=None):
        err = Err(f"GPU lock of {len(pids)} process(es) failed: cuCheckpointProcessLock of pid(s) {pids[1]} did "
                  "not return within 40 s", call="cuCheckpointProcessLock", pid=pids[1])
        err.pending = [pids[1]]
        raise err

    monkeypatch.setattr(gpu_preempt, "suspend_all", stuck)
    monkeypatch.setattr(gpu_preempt, "_state_or_none", lambda b, p: pytest.fail(f"state of {p} asked"))
    with pytest.raises(GpuError, match=f"did not return within 40 s; 'migrt gpu resume {CID}' retries bringing "
                                       f"pids {pids[1]} back"):
        gpu_preempt.suspend(cfg(), CID, str(gpu_node.runc_root))
    assert gpu_preempt.read_record(str(gpu_node.runc_root), CID)["status"] == gpu_preempt.SUSPENDING
