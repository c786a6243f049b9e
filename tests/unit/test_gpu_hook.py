"""hooks/cuda-criu-action, driven as CRIU drives it (CRTOOLS_* environment), on the fake GPU backend;
its watchdog against real short-lived processes; and the script itself run as CRIU would."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from migrt.gpu import devnodes, procs, records, session
from migrt.gpu.backend import CHECKPOINTED, LOCKED, RUNNING, uuid_bytes
from migrt.gpu.fake import FakeGpuBackend
from migrt.gpu.inventory import Gpu, Inventory
from migrt.gpu.nogpu import NoGpuBackend

HOOK = Path(__file__).resolve().parents[2] / "hooks" / "cuda-criu-action"
U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
GIB = 1 << 30
ROOT, CHILD = 4000, 4001


def load_hook():
    loader = importlib.machinery.SourceFileLoader("cuda_criu_action", str(HOOK))
    spec = importlib.util.spec_from_loader("cuda_criu_action", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


hook = load_hook()


def h100(index: int, uuid: str) -> Gpu:
    return Gpu(index=index, uuid=uuid, name="NVIDIA H100 80GB HBM3", pci_bus_id=f"0000:{index + 0x10:02X}:00.0",
               minor=index, memory_total=80 * GIB, memory_free=70 * GIB)


INV = Inventory(source="nvml", driver_version="580.159", gpus=[h100(0, U0), h100(1, U1)])


@pytest.fixture
def tree(monkeypatch, tmp_path):
    """The process tree CRIU works on: ROOT and CHILD use CUDA, 4002 does not."""
    monkeypatch.setattr(procs, "process_tree", lambda root: [root, root + 1, root + 2])
    monkeypatch.setattr(procs, "start_time", lambda pid: 1000 + pid)
    backend = FakeGpuBackend({ROOT: RUNNING, CHILD: RUNNING})
    monkeypatch.setattr(procs, "cuda_pids", lambda pids, live=True: [p for p in pids if p in backend.states])
    monkeypatch.setattr(hook, "LOG", str(tmp_path / "hook.log"))
    return backend


def crtools(action: str, tmp_path: Path, **extra) -> dict:
    env = {"CRTOOLS_SCRIPT_ACTION": action, "CRTOOLS_IMAGE_DIR": str(tmp_path / "img"), **extra}
    (tmp_path / "img").mkdir(exist_ok=True)
    if action != "pre-restore":
        env["CRTOOLS_INIT_PID"] = str(ROOT)
    return env


def run(env: dict, backend, inv=INV) -> tuple[int, object]:
    h = hook.Hook(env, backend=backend, inventory=lambda: inv, spawn_watchdog=False)
    return h.run(), h


# -- pre-dump ---------------------------------------------------------------------------------------------
def test_pre_dump_suspends_the_tree_and_records_it(tree, tmp_path):
    rc, h = run(crtools("pre-dump", tmp_path), tree)
    assert rc == 0
    assert tree.states == {ROOT: CHECKPOINTED, CHILD: CHECKPOINTED}
    sec = records.read_image_file(str(tmp_path / "img"))
    assert [p["pid"] for p in sec["processes"]] == [ROOT, CHILD] and sec["driven_by"] == "cuda-criu-action"
    assert h.watchdog_args == (os.getppid(), [(ROOT, 1000 + ROOT), (CHILD, 1000 + CHILD)])
    h = hook.Hook({**crtools("pre-dump", tmp_path), "CRTOOLS_IMAGE_DIR": "/proc/4242/fd/5"}, backend=tree)
    assert h.criu_pid() == 4242  # CRIU names its image directory through its own /proc entry


def test_everything_is_left_alone_when_migrt_drives_the_gpu(tree, tmp_path):
    for action in ("pre-dump", "pre-restore", "post-resume"):
        rc, _ = run(crtools(action, tmp_path, MIGRT_GPU_HANDLED="1"), tree)
        assert rc == 0
    assert tree.calls == [] and not (tmp_path / "img" / records.IMAGE_FILE).exists()


def test_pre_dump_failure_is_undone_and_aborts_the_dump(tree, tmp_path):
    tree.fail("lock", CHILD, message="CUDA_ERROR_TIMEOUT")
    rc, _ = run(crtools("pre-dump", tmp_path), tree)
    assert rc == 1
    assert tree.states == {ROOT: RUNNING, CHILD: RUNNING}
    assert "CUDA_ERROR_TIMEOUT" in (tmp_path / "hook.log").read_text()


def test_pre_dump_without_the_driver_api_refuses(tree, tmp_path):
    rc, h = run(crtools("pre-dump", tmp_path), NoGpuBackend("no libcuda"))
    assert rc == 1 and h.watchdog_args is None
    assert "not usable: no libcuda" in (tmp_path / "hook.log").read_text()


def test_pre_dump_of_a_tree_without_cuda_does_nothing(tree, tmp_path, monkeypatch):
    monkeypatch.setattr(procs, "cuda_pids", lambda pids, live=True: [])
    rc, h = run(crtools("pre-dump", tmp_path), NoGpuBackend("must not matter"))
    assert rc == 0 and h.watchdog_args is None


@pytest.mark.parametrize("action", ["post-dump", "network-lock", "setup-namespaces", "post-restore", ""])
def test_other_actions_do_nothing(tree, tmp_path, action):
    rc, _ = run(crtools(action, tmp_path), tree)
    assert rc == 0 and tree.calls == []


# -- the watchdog -----------------------------------------------------------------------------------------
def sleeper(seconds: float = 30) -> subprocess.Popen:
    return subprocess.Popen(["sleep", str(seconds)])


def test_watchdog_resumes_the_tasks_that_live_on_once_criu_exits():
    criu, task, gone = sleeper(0.3), sleeper(), sleeper()
    try:
        gone.kill()
        gone.wait()
        backend = FakeGpuBackend({task.pid: CHECKPOINTED, gone.pid: CHECKPOINTED})
        t0 = time.monotonic()
        resumed = hook.watch((criu.pid, procs.start_time(criu.pid)),
                             [(task.pid, procs.start_time(task.pid)), (gone.pid, 12345)],
                             lambda: backend, procs, session)
        assert time.monotonic() - t0 >= 0.2  # waited for "CRIU"
        assert resumed == [task.pid]
        assert backend.states[task.pid] == RUNNING and backend.states[gone.pid] == CHECKPOINTED
    finally:
        task.kill()
        criu.wait()
        task.wait()


def test_watchdog_from_locked_and_leaves_a_reused_pid_alone():
    criu, task = sleeper(0.05), sleeper()
    try:
        backend = FakeGpuBackend({task.pid: LOCKED})
        assert hook.watch((criu.pid, procs.start_time(criu.pid)), [(task.pid, procs.start_time(task.pid))],
                          lambda: backend, procs, session) == [task.pid]
        assert backend.states[task.pid] == RUNNING
        backend.states[task.pid] = CHECKPOINTED  # same pid, another process (start time differs)
        assert hook.watch((criu.pid, None), [(task.pid, 1)], lambda: backend, procs, session) == []
        assert backend.states[task.pid] == CHECKPOINTED
    finally:
        task.kill()
        criu.wait()
        task.wait()


def test_a_killed_task_is_dying():
    task = sleeper()
    assert not hook.dying(task.pid)
    task.kill()
    task.wait()
    assert hook.dying(task.pid)


# -- pre-restore / post-resume ------------------------------------------------------------------------------
def write_record(tmp_path: Path, gpus=(U0,)) -> None:
    inv = Inventory(source="nvml", driver_version="580.159", gpus=[g for g in INV.gpus if g.uuid in gpus])
    sec = records.describe([os.getpid()], inv, list(gpus))
    (tmp_path / "img").mkdir(exist_ok=True)
    records.write_image_file(str(tmp_path / "img"), sec)


def test_pre_restore_preflight(tree, tmp_path, monkeypatch):
    write_record(tmp_path)
    monkeypatch.setattr(hook.Hook, "bundle_config", lambda self, start=None: None)
    assert run(crtools("pre-restore", tmp_path), tree)[0] == 0
    other = Inventory(source="nvml", driver_version="580.159", gpus=[h100(0, U1)])
    assert run(crtools("pre-restore", tmp_path), tree, inv=other)[0] == 1
    assert "does not say which GPUs" in (tmp_path / "hook.log").read_text()
    old = Inventory(source="nvml", driver_version="570.86", gpus=[h100(0, U0)])
    assert run(crtools("pre-restore", tmp_path), tree, inv=old)[0] == 1
    assert "which is older" in (tmp_path / "hook.log").read_text()


def test_pre_restore_without_gpu_state_does_nothing(tree, tmp_path):
    assert run(crtools("pre-restore", tmp_path), NoGpuBackend("x"), inv=Inventory(source="none"))[0] == 0


def test_post_resume_restores_with_the_remap_from_the_environment(tree, tmp_path, monkeypatch):
    write_record(tmp_path)
    synced = []
    monkeypatch.setattr(devnodes, "sync", lambda pid, minors, **k: synced.append((pid, minors)) or [])
    tree.states.update({ROOT: CHECKPOINTED, CHILD: CHECKPOINTED})
    rc, _ = run(crtools("post-resume", tmp_path, MIGRT_GPU_REMAP=f"{U0}={U1}"), tree)
    assert rc == 0
    assert tree.states == {ROOT: RUNNING, CHILD: RUNNING}
    assert tree.remaps[ROOT] == [(uuid_bytes(U0), uuid_bytes(U1))]
    assert synced == [(ROOT, [1])]


def test_post_resume_onto_the_bundles_gpus(tree, tmp_path, monkeypatch):
    write_record(tmp_path)
    monkeypatch.setattr(devnodes, "sync", lambda pid, minors, **k: [])
    monkeypatch.setattr(hook.Hook, "bundle_config",
                        lambda self, start=None: {"process": {"env": [f"NVIDIA_VISIBLE_DEVICES={U1}"]}})
    tree.states.update({ROOT: CHECKPOINTED, CHILD: CHECKPOINTED})
    assert run(crtools("post-resume", tmp_path), tree)[0] == 0
    assert tree.remaps[CHILD] == [(uuid_bytes(U0), uuid_bytes(U1))]


def test_post_resume_failure_is_reported(tree, tmp_path, monkeypatch):
    write_record(tmp_path)
    monkeypatch.setattr(devnodes, "sync", lambda pid, minors, **k: [])
    monkeypatch.setattr(hook.Hook, "bundle_config", lambda self, start=None: None)
    tree.states.update({ROOT: CHECKPOINTED, CHILD: CHECKPOINTED})
    tree.fail("restore", CHILD)
    assert run(crtools("post-resume", tmp_path), tree)[0] == 1
    assert "GPU restore of" in (tmp_path / "hook.log").read_text()


def test_post_resume_skips_processes_that_never_used_cuda(tree, tmp_path):
    tree.states.clear()  # map libcuda (per the fixture: none here) / unknown to the driver
    assert run(crtools("post-resume", tmp_path), tree)[0] == 0


def test_bundle_of_the_runc_restore_that_started_criu(tmp_path):
    """A stand-in `runc restore --bundle B` process (argv[0] 'runc'): its config.json is found."""
    gcc = shutil.which("gcc") or pytest.fail("gcc is needed (installed on CI)")
    src = tmp_path / "runc.c"
    src.write_text("#include <unistd.h>\nint main(void) { sleep(30); return 0; }\n")
    subprocess.run([gcc, "-o", str(tmp_path / "runc"), str(src)], check=True)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=1"]}}))
    p = subprocess.Popen([str(tmp_path / "runc"), "--root", "/run/x", "--log", "/dev/null", "restore", "--detach",
                          "--bundle", "bundle", "c1"], cwd=str(tmp_path))
    try:
        time.sleep(0.1)
        h = hook.Hook({}, backend=FakeGpuBackend(), spawn_watchdog=False)
        assert h.bundle_config(start=p.pid) == {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=1"]}}
        assert h.bundle_config(start=os.getpid()) is None  # pytest is no runc restore
    finally:
        p.kill()
        p.wait()


# -- the script itself ------------------------------------------------------------------------------------
def test_script_on_a_tree_without_cuda_needs_no_driver(tmp_path):
    """As CRIU runs it, with a real process tree: nothing maps libcuda, so nothing is loaded."""
    task = sleeper()
    try:
        env = {"PATH": os.environ["PATH"], "CRTOOLS_SCRIPT_ACTION": "pre-dump", "CRTOOLS_INIT_PID": str(task.pid),
               "CRTOOLS_IMAGE_DIR": str(tmp_path), "MIGRT_HOOK_LOG": str(tmp_path / "log"), "PYTHONNOUSERSITE": "1"}
        r = subprocess.run([sys.executable, "-S", str(HOOK)], env=env, capture_output=True, text=True, timeout=30)
        assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
        assert not (tmp_path / records.IMAGE_FILE).exists()
    finally:
        task.kill()
        task.wait()


def test_script_finds_migrt_next_to_itself_without_site_packages(tmp_path):
    code = ("import runpy, sys; sys.argv = ['x']; m = runpy.run_path(%r); m['import_migrt'](); "
            "import migrt.gpu.session; print(migrt.gpu.session.__file__)") % str(HOOK)
    r = subprocess.run([sys.executable, "-S", "-c", code], env={"PATH": os.environ["PATH"]}, cwd="/",
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(HOOK.parents[1] / "migrt" / "gpu" / "session.py")


def test_script_watchdog_mode_returns_when_criu_is_gone(tmp_path):
    gone = sleeper(0)
    gone.wait()
    arg = json.dumps({"criu": [gone.pid, None], "tasks": []})
    r = subprocess.run([sys.executable, str(HOOK), "--watchdog", arg], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "MIGRT_HOOK_LOG": str(tmp_path / "log")})
    assert r.returncode == 0, r.stderr
    assert "watchdog_done" in (tmp_path / "log").read_text()
