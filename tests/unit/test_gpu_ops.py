"""The GPU steps wired into checkpoint and restore (migrt's ops and migrt-runc's own checkpoint and
restore), on the fake GPU backend, with a stand-in lower runtime. No container, no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from migrt import config as config_mod
from migrt.config import Config
from migrt.errors import ConfigError, MigrtError, PreconditionFailed, RuntimeFailed
from migrt.gpu import devnodes, procs, records, select, visible
from migrt.gpu.backend import CHECKPOINTED, RUNNING, GpuError
from migrt.gpu.fake import FakeGpuBackend
from migrt.gpu.inventory import Gpu, Inventory
from migrt.gpu.nogpu import NoGpuBackend
from migrt.oci.bundle import Bundle
from migrt.ops import checkpoint as ops_checkpoint
from migrt.ops import gpu_runc, gpu_steps
from migrt.ops import restore as ops_restore
from migrt.runtime.argv import Call, RuncArgv
from migrt.runtime.messages import ContainerState
from migrt.shim import __main__ as shim
from migrt.store import Store
from tests.unit.support import PY_SHIM, write_bundle

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
GIB = 1 << 30
INIT, CHILD = 1000, 1001          # the checkpointed container's CUDA processes
NEW_INIT, NEW_CHILD = 2000, 2001  # the same processes after the restore (new host pids)


def h100(index: int, uuid: str) -> Gpu:
    return Gpu(index=index, uuid=uuid, name="NVIDIA H100 80GB HBM3", pci_bus_id=f"00000000:{index + 0x10:02X}:00.0",
               minor=index, memory_total=80 * GIB, memory_used=GIB, memory_free=79 * GIB)


class Node:
    """A GPU node as the GPU steps see it: the fake backend, an inventory, container process trees."""

    def __init__(self, monkeypatch):
        self.backend = FakeGpuBackend({INIT: RUNNING, CHILD: RUNNING})
        self.inv = Inventory(source="nvml", driver_version="580.159", gpus=[h100(0, U0), h100(1, U1)],
                             processes={INIT: [(U0, 6 * GIB)], CHILD: [(U0, 2 * GIB)]})
        self.trees = {INIT: [INIT, CHILD, 1002], NEW_INIT: [NEW_INIT, NEW_CHILD, 2002]}
        self.synced: list[tuple[int, list[int]]] = []
        monkeypatch.setattr(select, "override", self.backend)
        monkeypatch.setattr(gpu_steps.inventory, "take", lambda *a, **k: self.inv)
        monkeypatch.setattr(procs, "container_pids", lambda pid, cgroup=None: list(self.trees.get(pid, [pid])))
        monkeypatch.setattr(procs, "cuda_pids", lambda pids, live=True: [p for p in pids if p in self.backend.states])
        monkeypatch.setattr(visible, "from_devnodes", lambda pid, inv: None)
        monkeypatch.setattr(devnodes, "sync", lambda pid, minors, **k: self.synced.append((pid, minors)) or [])

    def states(self, *pids: int) -> list[str]:
        return [self.backend.states.get(p) for p in pids]


class FakeLower:
    """Stands in for LowerRuntime: records calls, sees the GPU states at dump time, may fail."""

    calls: list[tuple] = []
    fail: set[str] = set()
    node: Node | None = None

    def __init__(self, path, global_args=None):
        self.path = path

    status = "running"

    def state(self, root, cid):
        return ContainerState(id=cid, status=FakeLower.status, pid=INIT, bundle="")

    def pause(self, root, cid):
        FakeLower.calls.append(("pause", cid, self.node.states(INIT, CHILD)))
        FakeLower.status = "paused"

    def resume(self, root, cid):
        FakeLower.calls.append(("resume", cid, self.node.states(INIT, CHILD)))
        FakeLower.status = "running"

    def checkpoint(self, root, cid, *, image_path, work_path, options, leave_running, extra=None, env=None):
        assert leave_running and FakeLower.status == "paused"  # frozen, never stopped, by the dump
        FakeLower.calls.append(("checkpoint", (env or {}).get("MIGRT_GPU_HANDLED"), self.node.states(INIT, CHILD)))
        Path(image_path, "pages-1.img").write_bytes(b"x" * 100)
        if "checkpoint" in FakeLower.fail:
            raise RuntimeFailed("checkpoint of container c1 failed: criu said no")

    def restore(self, spec, *, global_tokens, stdio=None, log_path=None, env=None):
        FakeLower.calls.append(("restore", (env or {}).get("MIGRT_GPU_HANDLED"),
                                sorted(os.listdir(spec.image_path))))
        os.makedirs(os.path.join(global_tokens[1], spec.container_id), exist_ok=True)  # runc's state dir
        self.node.backend.add(NEW_INIT, CHECKPOINTED)
        self.node.backend.add(NEW_CHILD, CHECKPOINTED)
        return NEW_INIT

    def delete_force(self, root, cid):
        FakeLower.calls.append(("delete", cid))
        return 0

    def stop(self, root, cid):
        FakeLower.calls.append(("stop", cid))


def dumps() -> list[tuple]:
    return [c for c in FakeLower.calls if c[0] == "checkpoint"]


@pytest.fixture
def node(monkeypatch) -> Node:
    return Node(monkeypatch)


@pytest.fixture
def cfg(tmp_path, monkeypatch, node, fake_runtime) -> Config:
    FakeLower.calls, FakeLower.fail, FakeLower.node, FakeLower.status = [], set(), node, "running"
    monkeypatch.setattr(ops_checkpoint, "LowerRuntime", FakeLower)
    monkeypatch.setattr(ops_restore, "LowerRuntime", FakeLower)
    return Config(path=str(tmp_path / "none.yaml"), runtime=str(fake_runtime.path), store=str(tmp_path / "store"),
                  log_file=str(tmp_path / "migrt.log"))


def take_checkpoint(cfg, name="ck1", leave_running=False) -> dict:
    return ops_checkpoint.checkpoint(cfg, ops_checkpoint.CheckpointRequest(
        container_id="c1", root="/run/x", name=name, leave_running=leave_running))


def restore_into(cfg, tmp_path, env: list[str], name="ck1"):
    bundle = write_bundle(tmp_path / "newbundle", env=env)
    target = ops_restore.RestoreTarget(container_id="c2", bundle=Bundle.load(str(bundle)), root=str(tmp_path / "rr"))
    return ops_restore.restore_checkpoint(cfg, name, target)


# -- migrt checkpoint -------------------------------------------------------------------------------------
def test_checkpoint_suspends_all_cuda_processes_before_the_dump(cfg, node):
    data = take_checkpoint(cfg)
    # GPU suspended while the processes run, then frozen, dumped (hook told to stand aside), and
    # stopped only after the commit
    assert FakeLower.calls == [("pause", "c1", [CHECKPOINTED, CHECKPOINTED]),
                               ("checkpoint", "1", [CHECKPOINTED, CHECKPOINTED]), ("stop", "c1")]
    assert node.states(INIT, CHILD) == [CHECKPOINTED, CHECKPOINTED]  # the dump ends them
    gpu = data["gpu"]
    assert gpu["driver_version"] == "580.159" and [g["uuid"] for g in gpu["gpus"]] == [U0]
    assert [(p["pid"], p["gpus"], p["memory_bytes"]) for p in gpu["processes"]] == [
        (INIT, [U0], 6 * GIB), (CHILD, [U0], 2 * GIB)]
    assert gpu["timings"]["gpu_checkpoint_s"] >= 0 and "gpu_checkpoint_s" in data["timings"]
    assert "images/migrt-gpu.json" in data["files"]
    ckpt = Store(cfg.store).get("ck1")
    assert records.read_image_file(ckpt.images)["processes"][1]["pid"] == CHILD


def test_checkpoint_leave_running_resumes_the_gpu(cfg, node):
    data = take_checkpoint(cfg, leave_running=True)
    assert node.states(INIT, CHILD) == [RUNNING, RUNNING]
    assert "gpu_resume_s" in data["timings"]


def test_failed_dump_resumes_the_gpu_and_keeps_no_checkpoint(cfg, node):
    FakeLower.fail = {"checkpoint"}
    with pytest.raises(RuntimeFailed, match="criu said no"):
        take_checkpoint(cfg)
    assert node.states(INIT, CHILD) == [RUNNING, RUNNING]
    assert not Store(cfg.store).exists("ck1")
    # thawed first (the driver restores through a thread of the process), never stopped
    assert [c[0] for c in FakeLower.calls] == ["pause", "checkpoint", "resume"]
    assert FakeLower.calls[-1][2] == [CHECKPOINTED, CHECKPOINTED] and FakeLower.status == "running"


def test_failed_gpu_suspend_never_dumps(cfg, node):
    node.backend.fail("checkpoint", CHILD)
    with pytest.raises(GpuError, match="every process was resumed"):
        take_checkpoint(cfg)
    assert FakeLower.calls == []
    assert node.states(INIT, CHILD) == [RUNNING, RUNNING]


def test_container_without_cuda_processes_needs_no_gpu_at_all(cfg, node, monkeypatch):
    node.backend.states.clear()  # no CUDA process anywhere
    monkeypatch.setattr(select, "override", NoGpuBackend("must not be asked"))
    monkeypatch.setattr(gpu_steps.inventory, "take", lambda *a, **k: pytest.fail("NVML must not be asked"))
    data = take_checkpoint(cfg)
    assert "gpu" not in data and "images/migrt-gpu.json" not in data["files"]
    assert dumps() == [("checkpoint", None, [None, None])]  # no MIGRT_GPU_HANDLED: nothing handled


def test_cuda_processes_without_the_checkpoint_api_fail_clearly(cfg, node, monkeypatch):
    monkeypatch.setattr(select, "override", NoGpuBackend("cannot load libcuda.so.1"))
    with pytest.raises(PreconditionFailed, match="2 CUDA process.*not usable here: cannot load libcuda"):
        take_checkpoint(cfg)
    assert FakeLower.calls == []


# -- migrt restore / the create->restore swap ----------------------------------------------------------------
def test_restore_onto_another_gpu_remaps_and_unlocks(cfg, node, tmp_path):
    take_checkpoint(cfg)
    result = restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert FakeLower.calls[-1][:2] == ("restore", "1") and "migrt-gpu.json" in FakeLower.calls[-1][2]
    assert node.states(NEW_INIT, NEW_CHILD) == [RUNNING, RUNNING]
    from migrt.gpu.backend import uuid_bytes

    assert node.backend.remaps == {p: [(uuid_bytes(U0), uuid_bytes(U1))] for p in (NEW_INIT, NEW_CHILD)}
    assert node.synced == [(NEW_INIT, [1])]
    assert result["timings"]["gpu_restore_s"] >= 0 and result["pid"] == NEW_INIT


def test_restore_onto_the_same_gpu_needs_no_remap(cfg, node, tmp_path):
    take_checkpoint(cfg)
    restore_into(cfg, tmp_path, [])  # config silent: the checkpoint's GPU, present here
    assert node.backend.remaps == {NEW_INIT: None, NEW_CHILD: None}
    assert node.synced == [(NEW_INIT, [0])]


def test_preflight_mismatch_stops_the_restore_before_the_gpu_and_keeps_the_checkpoint(cfg, node, tmp_path):
    """The preflight runs while CRIU restores (the restore gate holds the tree at post-restore until
    it passed; the fake runc has no gate, so migrt's own second check stops it here): the restored
    container is removed before any GPU call on it, the checkpoint stays whole."""
    take_checkpoint(cfg)
    with pytest.raises(PreconditionFailed, match="ran on 1 GPU.*gets 2"):
        restore_into(cfg, tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])
    assert [c[0] for c in FakeLower.calls] == ["pause", "checkpoint", "stop", "restore", "delete"]
    assert node.backend.calls_of("restore") == [] and node.backend.calls_of("state") == []
    assert node.states(NEW_INIT, NEW_CHILD) == [CHECKPOINTED, CHECKPOINTED]
    (tmp_path / "rr" / "c2").rmdir()  # what runc's delete does (the fake's does not)
    Store(cfg.store).get("ck1").verify()  # still whole, and usable:
    restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert node.states(NEW_INIT, NEW_CHILD) == [RUNNING, RUNNING]


def test_failed_gpu_restore_removes_the_container_and_keeps_the_checkpoint(cfg, node, tmp_path):
    take_checkpoint(cfg)
    node.backend.fail("restore", NEW_CHILD, message="CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(GpuError, match="GPU restore of 1 of 2 process.*INVALID_VALUE"):
        restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert FakeLower.calls[-1] == ("delete", "c2")
    Store(cfg.store).get("ck1").verify()


def test_restore_finds_fewer_processes_than_checkpointed(cfg, node, tmp_path):
    take_checkpoint(cfg)
    node.trees[NEW_INIT] = [NEW_INIT]  # the child did not come back
    with pytest.raises(GpuError, match="found 1 checkpointed CUDA process.*the checkpoint has 2"):
        restore_into(cfg, tmp_path, [])
    assert FakeLower.calls[-1] == ("delete", "c2")


# -- a migrt killed mid-checkpoint: the next command recovers (journal) -------------------------------------
class Killed(BaseException):
    """SIGKILL in-process: no undo, no finally of ours runs (patched out below), the lock goes."""


PHASES = ["gpu-locking", "freezing", "dumping", "dumped", "committing", "committed", "stopping"]


@pytest.mark.parametrize("phase", PHASES)
def test_killed_checkpoint_is_recovered_by_the_next_command(cfg, node, tmp_path, monkeypatch, phase):
    from migrt import faults
    from migrt.ops import recover
    from migrt.store import Staging, journal

    root = tmp_path / "runc-root"
    (root / "c1").mkdir(parents=True)
    (root / "c1" / "state.json").write_text("{}")  # runc's: the container exists
    seen = {}

    def point(name):
        if name == f"checkpoint:{phase}":
            seen["entry"] = [e for e in journal.entries(cfg.store)]
            raise Killed(name)

    with monkeypatch.context() as m:  # what SIGKILL skips: every undo and clean-up of the dying process
        m.setattr(faults, "point", point)
        m.setattr(ops_checkpoint._Undo, "__exit__", lambda self, *a: False)
        m.setattr(Staging, "discard", lambda self: None)
        m.setattr(journal.Entry, "end", journal.Entry.release)
        with pytest.raises(Killed):
            ops_checkpoint.checkpoint(cfg, ops_checkpoint.CheckpointRequest(container_id="c1", root=str(root),
                                                                            name="ck1"))
    rec = seen["entry"][0]
    assert rec["phase"] == phase and rec["container"] == "c1" and rec["pid"] == os.getpid()
    if phase != "gpu-locking":
        assert rec["gpu_pids"] == [INIT, CHILD]  # recorded before the driver was asked to lock
    assert [e["stale"] for e in journal.entries(cfg.store)] == [True]
    committed = PHASES.index(phase) >= PHASES.index("committed")
    FakeLower.calls.clear()
    monkeypatch.setattr(recover, "LowerRuntime", FakeLower)

    outcomes = recover.recover(cfg)

    assert [o.status for o in outcomes] == ["recovered"], outcomes
    assert journal.entries(cfg.store) == []
    assert os.listdir(os.path.join(cfg.store, ".staging")) == []
    store = Store(cfg.store)
    if committed:  # the checkpoint is whole: finish the job, stop the container
        assert FakeLower.calls == [("stop", "c1")]
        store.get("ck1").verify()
    else:  # not committed: the workload is the truth: thawed first, GPU restored + unlocked, no checkpoint
        assert node.states(INIT, CHILD) == [RUNNING, RUNNING] and FakeLower.status == "running"
        frozen = PHASES.index(phase) > PHASES.index("freezing")
        assert [c[0] for c in FakeLower.calls] == (["resume"] if frozen else [])
        assert store.list() == [] and store.incomplete() == []
        if phase != "gpu-locking":
            assert ("restore", INIT, None) in node.backend.calls and ("unlock", CHILD, None) in node.backend.calls
    assert recover.recover(cfg) == []  # done once
    FakeLower.status = "running"
    if committed:  # the stopped container's processes are gone; a new one runs
        node.backend.states.update({INIT: RUNNING, CHILD: RUNNING})
    ops_checkpoint.checkpoint(cfg, ops_checkpoint.CheckpointRequest(container_id="c1", root=str(root), name="ck2"))
    store.get("ck2").verify()  # the next operation succeeds


def test_container_gone_before_commit_keeps_the_images(cfg, node, tmp_path, monkeypatch):
    """A node reboot mid-commit: the only copy of the workload may be the staging: never deleted."""
    from migrt import faults
    from migrt.ops import recover
    from migrt.store import Staging, journal

    root = tmp_path / "runc-root"
    (root / "c1").mkdir(parents=True)
    (root / "c1" / "state.json").write_text("{}")

    def point(name):
        if name == "checkpoint:committing":
            raise Killed(name)

    with monkeypatch.context() as m:
        m.setattr(faults, "point", point)
        m.setattr(ops_checkpoint._Undo, "__exit__", lambda self, *a: False)
        m.setattr(Staging, "discard", lambda self: None)
        m.setattr(journal.Entry, "end", journal.Entry.release)
        with pytest.raises(Killed):
            ops_checkpoint.checkpoint(cfg, ops_checkpoint.CheckpointRequest(container_id="c1", root=str(root),
                                                                            name="ck1"))
    (root / "c1" / "state.json").unlink()  # the container is gone
    Store(cfg.store).gc()  # gc alone never touches a journaled staging directory
    assert len(os.listdir(os.path.join(cfg.store, ".staging"))) == 1
    monkeypatch.setattr(recover, "LowerRuntime", FakeLower)
    [o] = recover.recover(cfg)
    assert o.status == "recovered" and "kept its uncommitted images" in o.actions[0]
    [kept] = Store(cfg.store).incomplete()
    assert kept["container"] == "c1" and kept["phase"] == "committing"
    assert os.path.getsize(os.path.join(kept["path"], "images", "pages-1.img")) == 100
    assert Store(cfg.store).list() == []  # not listed as a checkpoint


# -- migrt-runc checkpoint / restore (containerd's own paths) ------------------------------------------------
def runc_args(tmp_path: Path, *rest: str) -> RuncArgv:
    return RuncArgv.parse(["--root", str(tmp_path / "root"), "--log", str(tmp_path / "log.json"),
                           "--log-format", "json", *rest])


def as_shim(handler, parsed: RuncArgv, lower: str, *args) -> int:
    """A handler's outcome as migrt-runc ends it: the exit status it returns, or its MigrtError as the
    shim reports it (the error's line in runc's log, the error's exit code)."""
    try:
        return handler(Call(parsed, lower), *args)
    except MigrtError as exc:
        return shim.report(parsed, exc)


@pytest.fixture
def shim_env(migrt_env, node, monkeypatch, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", env=[f"NVIDIA_VISIBLE_DEVICES={U0}"])
    state = {"init_process_pid": INIT, "config": {"labels": [f"bundle={bundle}"]}}
    monkeypatch.setattr(procs, "runc_state", lambda root, cid: state)
    return migrt_env


def test_runc_checkpoint_with_gpu(shim_env, node, tmp_path):
    img = tmp_path / "img"
    parsed = runc_args(tmp_path, "checkpoint", "--image-path", str(img), "--work-path", str(tmp_path / "w"), "c1")
    assert as_shim(gpu_runc.checkpoint, parsed, str(shim_env.fake.path), [INIT, CHILD]) == 0
    call, = shim_env.fake.calls()
    assert call["env"]["MIGRT_GPU_HANDLED"] == "1"
    assert [bytes.fromhex(a).decode() for a in call["argv_hex"]] == parsed.render()
    assert node.states(INIT, CHILD) == [CHECKPOINTED, CHECKPOINTED]
    assert [p["pid"] for p in records.read_image_file(str(img))["processes"]] == [INIT, CHILD]


@pytest.mark.parametrize("leave_running, rc", [(True, "0"), (False, "1")])
def test_runc_checkpoint_resumes_when_the_container_stays(shim_env, node, tmp_path, monkeypatch, leave_running, rc):
    monkeypatch.setenv("FAKE_RC", rc)
    flags = ["--leave-running"] if leave_running else []
    parsed = runc_args(tmp_path, "checkpoint", "--image-path", str(tmp_path / "img"), *flags, "c1")
    assert as_shim(gpu_runc.checkpoint, parsed, str(shim_env.fake.path), [INIT, CHILD]) == int(rc)
    assert node.states(INIT, CHILD) == [RUNNING, RUNNING]


def test_runc_checkpoint_gpu_failure_is_reported_in_runc_log(shim_env, node, tmp_path):
    node.backend.fail("lock", INIT, message="CUDA_ERROR_TIMEOUT")
    parsed = runc_args(tmp_path, "checkpoint", "--image-path", str(tmp_path / "img"), "c1")
    assert as_shim(gpu_runc.checkpoint, parsed, str(shim_env.fake.path), [INIT, CHILD]) == 5
    assert shim_env.fake.calls() == []
    last = json.loads((tmp_path / "log.json").read_text().splitlines()[-1])
    assert last["level"] == "error" and "GPU lock of 2 process(es) failed" in last["msg"]
    assert node.states(INIT, CHILD) == [RUNNING, RUNNING]


def _gpu_image(tmp_path: Path) -> Path:
    img = tmp_path / "img"
    img.mkdir()
    sec = records.describe([INIT], Inventory(source="nvml", driver_version="580.159", gpus=[h100(0, U0)]), [U0])
    records.write_image_file(str(img), sec)
    return img


@pytest.fixture
def restored_node(shim_env, node, tmp_path, monkeypatch):
    """After runc restore: the container's init NEW_INIT is a checkpointed CUDA process; the new
    bundle gives GPU U1."""
    monkeypatch.setattr(procs, "runc_state", lambda root, cid: {"init_process_pid": NEW_INIT})
    node.trees[NEW_INIT] = [NEW_INIT]
    node.backend.add(NEW_INIT, CHECKPOINTED)
    node.img = _gpu_image(tmp_path)
    node.new_bundle = write_bundle(tmp_path / "nb", env=[f"NVIDIA_VISIBLE_DEVICES={U1}"])
    return node


def test_runc_restore_with_gpu_remaps_after_runc(shim_env, restored_node, tmp_path):
    node, img, bundle = restored_node, restored_node.img, restored_node.new_bundle
    parsed = runc_args(tmp_path, "restore", "--image-path", str(img), "--detach", "--pid-file", str(bundle / "init.pid"),
                       "-no-subreaper", "--bundle", str(bundle), "c2")
    assert as_shim(gpu_runc.restore, parsed, str(shim_env.fake.path), str(img)) == 0
    call, = shim_env.fake.calls()
    assert call["env"]["MIGRT_GPU_HANDLED"] == "1" and "-no-subreaper" in [bytes.fromhex(a).decode() for a in call["argv_hex"]]
    assert node.states(NEW_INIT) == [RUNNING] and node.synced == [(NEW_INIT, [1])]


def test_runc_restore_gpu_failure_deletes_the_container(shim_env, restored_node, tmp_path):
    node, img, bundle = restored_node, restored_node.img, restored_node.new_bundle
    node.backend.fail("restore", NEW_INIT)
    parsed = runc_args(tmp_path, "restore", "--image-path", str(img), "--detach", "--bundle", str(bundle), "c2")
    assert as_shim(gpu_runc.restore, parsed, str(shim_env.fake.path), str(img)) == 5
    argvs = [[bytes.fromhex(a).decode() for a in c["argv_hex"]] for c in shim_env.fake.calls()]
    assert argvs[1][-3:] == ["delete", "--force", "c2"]
    last = json.loads((tmp_path / "log.json").read_text().splitlines()[-1])
    assert "the container was removed" in last["msg"] and str(img) in last["msg"]
    assert (img / records.IMAGE_FILE).exists()


def test_runc_restore_without_detach_is_refused_before_runc(shim_env, restored_node, tmp_path):
    img, bundle = restored_node.img, restored_node.new_bundle
    parsed = runc_args(tmp_path, "restore", "--image-path", str(img), "--bundle", str(bundle), "c2")
    assert as_shim(gpu_runc.restore, parsed, str(shim_env.fake.path), str(img)) == 2
    assert shim_env.fake.calls() == []
    assert "needs --detach" in json.loads((tmp_path / "log.json").read_text().splitlines()[-1])["msg"]


def test_shim_restore_of_a_gpu_image_on_a_node_without_gpu_fails_before_runc(migrt_env, tmp_path):
    """The real shim in a subprocess: no fake backend, no NVIDIA driver on this machine."""
    img = _gpu_image(tmp_path)
    bundle = write_bundle(tmp_path / "nb")
    argv = ["--root", str(tmp_path / "root"), "--log", str(bundle / "log.json"), "--log-format", "json", "restore",
            "--image-path", str(img), "--detach", "--bundle", str(bundle), "c3"]
    env = {**migrt_env.env, "PROC_NVIDIA_TEST": "1"}
    r = subprocess.run([str(PY_SHIM), *argv], env=env, capture_output=True, timeout=60)
    if os.path.exists("/proc/driver/nvidia"):
        pytest.fail("this test expects a machine without an NVIDIA driver (the CI machine)")
    assert r.returncode == 8 and r.stdout == b"" and r.stderr == b""
    assert migrt_env.fake.calls() == []
    last = json.loads((bundle / "log.json").read_text().splitlines()[-1])
    assert last["level"] == "error" and "no usable NVIDIA driver" in last["msg"]


def test_shim_checkpoint_without_cuda_processes_passes_through(migrt_env, tmp_path):
    argv = ["--root", str(tmp_path / "root"), "checkpoint", "--image-path", str(tmp_path / "i"), "nosuch"]
    r = subprocess.run([str(PY_SHIM), *argv], env=migrt_env.env, capture_output=True, timeout=60)
    assert r.returncode == 0
    assert [[bytes.fromhex(a).decode() for a in c["argv_hex"]] for c in migrt_env.fake.calls()] == [argv]


def test_shim_stands_aside_when_the_gpu_is_handled_above(migrt_env, tmp_path):
    img = _gpu_image(tmp_path)
    argv = ["restore", "--image-path", str(img), "--detach", "c4"]
    r = subprocess.run([str(PY_SHIM), *argv], env={**migrt_env.env, "MIGRT_GPU_HANDLED": "1"}, capture_output=True,
                       timeout=60)
    assert r.returncode == 0 and len(migrt_env.fake.calls()) == 1


# -- config ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, match", [
    ("gpu_backend: nvidia\n", "'gpu_backend' must be one of"),
    ("gpu_lock_timeout_ms: -1\n", "'gpu_lock_timeout_ms' must be an integer"),
    ("gpu_lock_timeout_ms: true\n", "'gpu_lock_timeout_ms' must be an integer"),
])
def test_gpu_config_keys_are_checked(tmp_path, text, match):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        config_mod.load(str(p))


def test_gpu_config_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("gpu_backend: none\ngpu_lock_timeout_ms: 5000\n")
    cfg = config_mod.load(str(p))
    assert (cfg.gpu_backend, cfg.gpu_lock_timeout_ms) == ("none", 5000)
    assert gpu_steps.lock_timeout_ms(cfg) == 5000
    select.override = None
    assert isinstance(select.get_backend(cfg.gpu_backend), NoGpuBackend)


def test_inspect_shows_the_gpu_part(cfg, node, migrt_env):
    from click.testing import CliRunner

    from migrt.cli import commands  # noqa: F401 - registers the commands
    from migrt.cli.main import cli

    assert str(migrt_env.store) == cfg.store
    take_checkpoint(cfg)
    r = CliRunner().invoke(cli, ["inspect", "ck1"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    gpu = next(i for i, line in enumerate(lines) if line.startswith("gpu:"))
    assert "NVIDIA driver 580.159, 1 GPU(s), 2 CUDA process(es)" in lines[gpu]
    assert U0 in lines[gpu + 1] and f"pid {INIT:>7}" in lines[gpu + 2]


def test_shim_checkpoint_decision_imports_only_the_standard_library(migrt_env, tmp_path):
    """migrt-runc checkpoint of a container without CUDA processes decides with migrt.gpu.procs
    (stdlib), records it in the journal and runs the lower runtime as a child (ops/runc_checkpoint.py):
    no third-party module is imported on the way."""
    root = tmp_path / "root"
    (root / "c9").mkdir(parents=True)
    (root / "c9" / "state.json").write_text(json.dumps({"init_process_pid": os.getpid()}))  # no libcuda here
    probe = (
        "import json, os, sys\n"
        "import migrt.shim.__main__ as shim\n"
        "class Exec(Exception): pass\n"
        "def fake_execv(path, args): raise Exec(args)\n"
        "os.execv = fake_execv\n"
        "try:\n"
        f"    shim.main(['--root', {str(root)!r}, 'checkpoint', '--image-path', '/x', 'c9'])\n"
        "except Exec:\n"
        "    pass\n"
        "print(json.dumps(sorted(m for m in ('click', 'structlog', 'yaml', 'pynvml', 'pycriu') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=migrt_env.env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert json.loads(out.stdout) == []
