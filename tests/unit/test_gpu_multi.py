"""Multi-GPU jobs (docs/gpu.md, "Multi-GPU jobs"), wired into every path: the peer-state refusal
before the GPU lock, the application hook, processes each on its own GPU moved onto swapped GPUs,
and what a GPU resume that fails after a complete dump leaves to retry.

Two rigs: the GPU steps with the fake backend and a stand-in lower runtime (tests/unit/test_gpu_ops.py's
Node, with a proc tree laid out by hand for what the rule reads), and the simulated GPU node
(MIGRT_FAKE_GPU) with real processes and the real CLI (tests/unit/test_gpu_preempt.py's rig)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from migrt.errors import PreconditionFailed, RuntimeFailed
from migrt.gpu import apphooks, fakenode, peers, procview, records
from migrt.gpu.backend import CHECKPOINTED, LOCKED, RUNNING, GpuCannotRestore, uuid_bytes
from migrt.gpu.fake import FileFakeGpuBackend
from migrt.gpu.session import suspend_all
from migrt.ops import checkpoint as ops_checkpoint
from migrt.ops import gpu_preempt
from migrt.store import Store
from tests.unit.support import REPO
from migrt.oci.bundle import Bundle
from migrt.ops import restore as ops_restore
from tests.unit.support import write_bundle
from tests.unit.test_gpu_ops import (CHILD, INIT, NEW_CHILD, NEW_INIT, U0, U1, FakeLower, cfg, node,  # noqa: F401
                                     take_checkpoint)
from tests.unit.test_gpu_peers import ProcTree, nccl_rank
from tests.unit.test_gpu_preempt import CLI, gpu_node  # noqa: F401 - the simulated node's fixture


# -- the GPU steps (fake backend, stand-in runc) ------------------------------------------------------------
def restore_into(cfg, tmp_path, env: list[str], *, annotations: dict | None = None, cid: str = "c2"):
    bundle = write_bundle(tmp_path / f"bundle-{cid}", env=env, annotations=annotations)
    target = ops_restore.RestoreTarget(container_id=cid, bundle=Bundle.load(str(bundle)), root=str(tmp_path / "rr"))
    return ops_restore.restore_checkpoint(cfg, "ck1", target)


@pytest.fixture
def two_ranks(node, tmp_path, monkeypatch):
    """INIT and CHILD are a torch.distributed job's ranks, each on its own GPU, NCCL initialised."""
    tree = ProcTree(tmp_path / "proc")
    monkeypatch.setattr(procview, "PROC", str(tree.root))
    node.inv.processes = {INIT: [(U0, 6 << 30)], CHILD: [(U1, 6 << 30)]}
    return tree


def test_checkpoint_of_nccl_peers_is_refused_before_anything_is_touched(cfg, node, two_ranks):
    nccl_rank(two_ranks, INIT, 0)
    nccl_rank(two_ranks, CHILD, 1)
    with pytest.raises(peers.PeerStateRefused) as info:
        take_checkpoint(cfg)
    assert info.value.exit_code == 8
    assert str(info.value).startswith(f"container c1: CUDA process(es) {INIT}, {CHILD} hold peer-to-peer")
    assert FakeLower.calls == [] and node.backend.calls_of("lock") == []  # not frozen, not locked
    assert node.states(INIT, CHILD) == [RUNNING, RUNNING]
    assert not Store(cfg.store).exists("ck1")


def test_checkpoint_with_p2p_and_shm_off_goes_ahead_on_both_gpus_and_restores_swapped(cfg, node, two_ranks,
                                                                                      tmp_path):
    off = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    nccl_rank(two_ranks, INIT, 0, env=off)
    nccl_rank(two_ranks, CHILD, 1, env=off)
    data = take_checkpoint(cfg)
    gpu = data["gpu"]
    assert [g["uuid"] for g in gpu["gpus"]] == [U0, U1]  # the container's GPUs, as its processes use them
    assert {p["pid"]: p["gpus"] for p in gpu["processes"]} == {INIT: [U0], CHILD: [U1]}
    assert "peer_findings" not in gpu
    # a new container given both GPUs, asking for them swapped: every process gets both pairs
    result = restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U0},{U1}"])
    assert result["pid"] == NEW_INIT
    swapped = [(uuid_bytes(U0), uuid_bytes(U1)), (uuid_bytes(U1), uuid_bytes(U0))]
    assert node.backend.remaps == {NEW_INIT: None, NEW_CHILD: None}  # PCI order pairs them unchanged
    node.backend.remaps.clear()
    result = restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U0},{U1}"], annotations={
        "migrt.io/restore-gpus": f"{U1},{U0}"}, cid="c3")
    assert node.backend.remaps == {NEW_INIT: swapped, NEW_CHILD: swapped}
    assert node.states(NEW_INIT, NEW_CHILD) == [RUNNING, RUNNING]


@pytest.mark.parametrize("apart", [True, False])
def test_the_checkpoint_tells_gpus_apart_by_the_drivers_list(cfg, node, two_ranks, apart):
    """Two PyTorch processes (libnccl mapped, no communicator seen) with NCCL's defaults: refused when
    the driver lists them on other GPUs, going ahead when on one GPU (the checkpoint passes the
    inventory's compute processes to the rule)."""
    nccl_rank(two_ranks, INIT, 0, via="lib")
    nccl_rank(two_ranks, CHILD, 1 if apart else 0, via="lib")
    node.inv.processes = {INIT: [(U0, 6 << 30)], CHILD: [(U1 if apart else U0, 6 << 30)]}
    node.inv.processes_seen = True
    if apart:
        with pytest.raises(peers.PeerStateRefused, match="NCCL loaded"):
            take_checkpoint(cfg)
        assert node.backend.calls_of("lock") == []
    else:
        assert take_checkpoint(cfg)["gpu"]["processes"]


def test_restore_gpus_must_be_the_containers_own(cfg, node, tmp_path, two_ranks):
    take_checkpoint(cfg)
    with pytest.raises(PreconditionFailed, match="restore-gpus names .* but the new container is given"):
        restore_into(cfg, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={U1}"], annotations={"migrt.io/restore-gpus": U0})


def test_a_declaration_lets_the_job_through_and_is_recorded(cfg, node, two_ranks):
    nccl_rank(two_ranks, INIT, 0, env={peers.OFF_ENV: "off"})
    nccl_rank(two_ranks, CHILD, 1, env={peers.OFF_ENV: "off"})
    data = take_checkpoint(cfg)
    assert {f["allowed_by"] for f in data["gpu"]["peer_findings"]} == {"declared"}


def test_leave_running_whose_gpu_resume_fails_keeps_the_dump_and_records_the_processes(cfg, node, tmp_path,
                                                                                     two_ranks):
    """The dump is complete; the driver will not restore the source (peer state it did not see).
    The checkpoint is committed, and the processes are recorded for 'migrt gpu resume'."""
    root = tmp_path / "runc"
    (root / "c1").mkdir(parents=True)
    node.backend.fail("restore", INIT, message="CUDA_ERROR_NOT_SUPPORTED", code=801, times=2)
    with pytest.raises(RuntimeFailed) as info:
        ops_checkpoint.checkpoint(cfg, ops_checkpoint.CheckpointRequest(
            container_id="c1", root=str(root), name="ck1", leave_running=True))
    msg = str(info.value)
    assert msg.startswith("checkpoint ck1 is committed, but the CUDA processes of container c1 could not be resumed")
    assert "'migrt gpu resume c1' retries" in msg and "or restore ck1 into a new container" in msg
    assert Store(cfg.store).exists("ck1")
    rec = gpu_preempt.read_record(str(root), "c1")
    assert rec["status"] == gpu_preempt.SUSPENDED and rec["by"] == "migrt checkpoint --leave-running"
    assert [p["pid"] for p in rec["processes"]] == [INIT, CHILD] and "NOT_SUPPORTED" in rec["error"]
    assert node.states(INIT, CHILD) == [CHECKPOINTED, RUNNING]  # as the driver left them
    assert ("resume", "c1", [CHECKPOINTED, CHECKPOINTED]) in FakeLower.calls  # thawed first


def test_the_restored_processes_hear_post_restore(cfg, node, tmp_path, monkeypatch):
    told = []
    monkeypatch.setattr(apphooks, "after_restore",
                        lambda pids, **kw: told.append((sorted(pids), kw["reason"])) or ([], []))
    take_checkpoint(cfg)
    restore_into(cfg, tmp_path, [])
    assert told == [([NEW_INIT, NEW_CHILD, 2002], apphooks.RESTORED)]


def test_a_failed_lock_tells_the_hooks_processes_aborted(cfg, node, two_ranks, monkeypatch):
    sent = []
    monkeypatch.setattr(apphooks, "find", lambda pids, proc=None: [apphooks.Endpoint(INIT, "/run/migrt/hooks/r.sock",
                                                                                      7, (INIT,))])
    monkeypatch.setattr(apphooks, "call", lambda eps, event, timeout, **kw: sent.append((event, kw.get("reason"))) or
                        {e: apphooks.Reply(True) for e in eps})
    node.backend.fail("lock", CHILD)
    with pytest.raises(Exception, match="GPU lock of 2 process"):
        take_checkpoint(cfg)
    assert sent == [(apphooks.PRE, None), (apphooks.POST, apphooks.ABORTED)]


# -- the simulated GPU node: real processes, the CLI --------------------------------------------------------
WORKER = r"""
import json, mmap, os, sys, time
rank, mode, log = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
if mode.get("nccl"):  # what a live NCCL communicator maps (legacy SHM/proxy pool), unlinked as NCCL does
    path = f"/dev/shm/nccl-{mode['tag']}{rank}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    shm = mmap.mmap(fd, 4096)
    os.unlink(path)
if mode.get("hook"):
    from migrt.apphook import AppHook
    def note(what):
        def fn(request):
            time.sleep(mode.get("slow", 0))
            with open(log, "a") as fh:
                fh.write(json.dumps([rank, what, request.get("reason")]) + "\n")
        return fn
    AppHook(f"rank{rank}", on_checkpoint=note("down"), on_restore=note("up")).start()
print("ready", flush=True)
time.sleep(1000)
"""


class Job:
    """A container running a 2-rank job: a supervisor without CUDA and one CUDA process per GPU."""

    def __init__(self, node, tmp_path: Path, cid: str = "job-7", **mode) -> None:
        marker = json.loads(node.file.read_text())["marker"]
        self.tag, self.log, self.node = uuid.uuid4().hex[:8], tmp_path / f"{cid}-hook.log", node
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "MIGRT_HOOK_DIR": str(tmp_path / "hooks"),
               **mode.pop("env", {})}
        mode["tag"] = self.tag
        gpu = (lambda r: 0) if mode.get("one_gpu") else (lambda r: r)
        ranks = " ".join(f"{marker} FAKE_CUDA_GPU={gpu(r)} {sys.executable} -c \"$W\" {r} '{json.dumps(mode)}' "
                         f"{self.log} &" for r in (0, 1))
        self.proc = subprocess.Popen(["sh", "-c", f"{ranks} wait"], env={**env, "W": WORKER},
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert [self.proc.stdout.readline().strip() for _ in (0, 1)] == ["ready", "ready"]
        self.cid = cid
        root = node.runc_root
        (root / cid).mkdir(parents=True, exist_ok=True)
        (root / cid / "state.json").write_text(json.dumps({"id": cid, "init_process_pid": self.proc.pid,
                                                           "cgroup_paths": {}, "config": {"labels": []}}))
        from migrt.gpu import procs

        self.ranks = [p for p in procs.process_tree(self.proc.pid) if p != self.proc.pid]
        assert len(self.ranks) == 2

    def events(self) -> list[list]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def gpus(self) -> dict[int, str | None]:
        with fakenode.locked(str(self.node.file)) as data:
            fakenode.discover(data)  # the driver knows every CUDA process
            return {p: data["processes"][str(p)]["gpu"] for p in self.ranks}

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def job(gpu_node, tmp_path):
    jobs: list[Job] = []

    def start(**mode) -> Job:
        j = Job(gpu_node, tmp_path, cid=f"job-{len(jobs)}", **mode)
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.stop()


def calls(node, name: str) -> list[int]:
    return [pid for call, pid in node.data()["calls"] if call == name]


def test_gpu_suspend_of_nccl_peers_is_refused_and_the_job_runs_on(gpu_node, job):
    j = job(nccl=True)
    r = gpu_node.cli("gpu", "suspend", j.cid, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == 8, r.stderr
    assert "hold peer-to-peer or IPC state" in r.stderr and "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" in r.stderr
    assert calls(gpu_node, "lock") == []
    assert gpu_preempt.read_record(str(gpu_node.runc_root), j.cid) is None
    assert gpu_node.states(j.ranks) == [RUNNING, RUNNING]


def test_gpu_suspend_of_nccl_processes_on_one_gpu_goes_ahead(gpu_node, job):
    """The driver lists both on GPU 0: no intra-node NCCL peers (gpu suspend passes its inventory's
    compute processes to the rule; without them both would count as apart and be refused)."""
    j = job(nccl=True, one_gpu=True)
    assert set(j.gpus().values()) == {U0}
    gpu_node.cli("gpu", "suspend", j.cid, "--root", str(gpu_node.runc_root))
    assert gpu_node.states(j.ranks) == [CHECKPOINTED, CHECKPOINTED]
    gpu_node.cli("gpu", "resume", j.cid, "--root", str(gpu_node.runc_root))
    assert gpu_node.states(j.ranks) == [RUNNING, RUNNING]


def test_p2p_and_shm_off_suspend_and_resume_onto_the_swapped_gpus(gpu_node, job):
    j = job(nccl=True, env={"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
    assert j.gpus() == dict(zip(j.ranks, (U0, U1)))  # one process per GPU
    gpu_node.cli("gpu", "suspend", j.cid, "--root", str(gpu_node.runc_root))
    assert gpu_node.states(j.ranks) == [CHECKPOINTED, CHECKPOINTED]
    out = json.loads(gpu_node.cli("gpu", "resume", j.cid, "--root", str(gpu_node.runc_root), "--gpus", f"{U1},{U0}",
                                  "--json").stdout)
    assert out["pairs"] == [{"old": U0, "new": U1}, {"old": U1, "new": U0}] and out["moved"]
    assert gpu_node.states(j.ranks) == [RUNNING, RUNNING]
    assert j.gpus() == dict(zip(j.ranks, (U1, U0)))


def test_the_hook_lets_nccl_defaults_through_and_hears_both_ends(gpu_node, job):
    j = job(nccl=True, hook=True)
    gpu_node.cli("gpu", "suspend", j.cid, "--root", str(gpu_node.runc_root))
    assert sorted(j.events()) == [[0, "down", None], [1, "down", None]]
    gpu_node.cli("gpu", "resume", j.cid, "--root", str(gpu_node.runc_root))
    assert sorted(e for e in j.events() if e[1] == "up") == [[0, "up", "resumed"], [1, "up", "resumed"]]
    assert gpu_node.states(j.ranks) == [RUNNING, RUNNING]


def test_a_hook_that_does_not_answer_refuses_and_nothing_is_locked(gpu_node, job):
    gpu_node.env.config.write_text(gpu_node.env.config.read_text() + "gpu_hook_timeout_s: 1\n")
    j = job(nccl=True, hook=True, slow=3)
    t0 = time.monotonic()
    r = gpu_node.cli("gpu", "suspend", j.cid, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == 8 and "did not answer 'pre-checkpoint' in time" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 10
    assert calls(gpu_node, "lock") == [] and gpu_node.states(j.ranks) == [RUNNING, RUNNING]


def test_a_resume_the_driver_refuses_stays_suspended_and_says_retrying_will_not_help(gpu_node, job):
    j = job(nccl=True, env={"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
    gpu_node.cli("gpu", "suspend", j.cid, "--root", str(gpu_node.runc_root))
    gpu_node.fail("restore", j.ranks[0], message="CUDA_ERROR_NOT_SUPPORTED: operation not supported", code=801)
    r = gpu_node.cli("gpu", "resume", j.cid, "--root", str(gpu_node.runc_root), check=False)
    assert r.returncode == 5, r.stderr
    assert "this driver will not restore it" in r.stderr and "cannot succeed here" in r.stderr
    assert gpu_preempt.read_record(str(gpu_node.runc_root), j.cid)["status"] == gpu_preempt.SUSPENDED
    assert gpu_node.states(j.ranks) == [CHECKPOINTED, CHECKPOINTED]  # put back: nothing half-resumed


def test_processes_kept_suspended_after_a_dump_are_resumed_by_gpu_resume(gpu_node, job):
    """What checkpoint --leave-running, migrt-runc's checkpoint and migrate leave when the GPU resume
    after a complete dump fails: a record `migrt gpu resume` finishes from."""
    j = job()
    backend = FileFakeGpuBackend(str(gpu_node.file))
    from migrt.gpu import inventory

    inv = inventory.take()
    section = records.describe(j.ranks, inv, [U0, U1])
    suspend_all(j.ranks, backend)
    backend.restore(j.ranks[1])  # one came back half-way (locked), the other is still checkpointed
    said = gpu_preempt.keep_suspended(j.cid, str(gpu_node.runc_root), j.ranks, section, by="migrt checkpoint "
                                      "--leave-running", error="restore failed")
    assert f"'migrt gpu resume {j.cid}' retries" in said
    assert gpu_node.states(j.ranks) == [CHECKPOINTED, LOCKED]
    status = json.loads(gpu_node.cli("gpu", "status", j.cid, "--root", str(gpu_node.runc_root), "--json").stdout)
    assert status[0]["by"] == "migrt checkpoint --leave-running"
    gpu_node.cli("gpu", "resume", j.cid, "--root", str(gpu_node.runc_root))
    assert gpu_node.states(j.ranks) == [RUNNING, RUNNING]
    assert j.gpus() == dict(zip(j.ranks, (U0, U1)))


def test_fake_restore_not_supported_is_the_backends_cannot_restore(gpu_node, job):
    j = job()
    backend = FileFakeGpuBackend(str(gpu_node.file))
    suspend_all(j.ranks, backend)
    gpu_node.fail("restore", j.ranks[0], code=801)
    with pytest.raises(GpuCannotRestore):
        backend.restore(j.ranks[0])
    assert fakenode.read(str(gpu_node.file))["processes"][str(j.ranks[0])]["state"] == CHECKPOINTED


@pytest.mark.parametrize("text, match", [
    ("gpu_hook_timeout_s: 0\n", "'gpu_hook_timeout_s' must be a number of seconds from 1 to 3600"),
    ("gpu_peer_check: off\n", "'gpu_peer_check' must be one of"),
])
def test_the_new_config_keys_are_checked(tmp_path, text, match):
    from migrt import config as config_mod
    from migrt.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        config_mod.load(str(path))
    path.write_text("gpu_hook_timeout_s: 5\ngpu_peer_check: warn\n")
    cfg = config_mod.load(str(path))
    assert (cfg.gpu_hook_timeout_s, cfg.gpu_peer_check) == (5.0, "warn")


# -- the CRIU action script and migrt-runc's checkpoint ------------------------------------------------------
def test_criu_hook_pre_dump_refuses_nccl_peers_before_any_lock_or_watchdog(tmp_path, monkeypatch):
    from tests.unit.test_gpu_hook import CHILD as HCHILD
    from tests.unit.test_gpu_hook import ROOT as HROOT
    from tests.unit.test_gpu_hook import crtools, hook, run

    from migrt.gpu import procs
    from migrt.gpu.fake import FakeGpuBackend

    tree = ProcTree(tmp_path / "proc")
    monkeypatch.setattr(procview, "PROC", str(tree.root))
    nccl_rank(tree, HROOT, 0)
    nccl_rank(tree, HCHILD, 1)
    backend = FakeGpuBackend({HROOT: RUNNING, HCHILD: RUNNING})
    monkeypatch.setattr(procs, "process_tree", lambda root: [root, root + 1])
    monkeypatch.setattr(procs, "cuda_pids", lambda pids, live=True: [p for p in pids if p in backend.states])
    monkeypatch.setattr(hook, "LOG", str(tmp_path / "hook.log"))
    rc, h = run(crtools("pre-dump", tmp_path), backend)
    assert rc == 1 and h.watchdog_args is None and backend.calls_of("lock") == []
    assert "hold peer-to-peer or IPC state" in (tmp_path / "hook.log").read_text()
    rc, h = run(crtools("pre-dump", tmp_path, MIGRT_GPU_PEER_CHECK="warn"), backend)  # the node's say-so
    assert rc == 0 and sorted(backend.calls_of("lock")) == [HROOT, HCHILD]


def test_criu_hook_tells_the_restored_and_the_resumed(tmp_path, monkeypatch):
    from tests.unit.test_gpu_hook import crtools, hook, run, sleeper

    from migrt.gpu import procs, session
    from migrt.gpu.fake import FakeGpuBackend

    told = []
    monkeypatch.setattr(apphooks, "after_restore",
                        lambda pids, **kw: told.append((list(pids), kw["reason"])) or ([], []))
    monkeypatch.setattr(hook, "LOG", str(tmp_path / "hook.log"))
    criu, task = sleeper(0.05), sleeper()
    try:
        backend = FakeGpuBackend({task.pid: CHECKPOINTED})
        hook.watch((criu.pid, procs.start_time(criu.pid)), [(task.pid, procs.start_time(task.pid))],
                   lambda: backend, procs, session)
    finally:
        task.kill()
        criu.wait()
        task.wait()
    assert told == [([task.pid], "resumed")]
    told.clear()
    backend = FakeGpuBackend({4000: CHECKPOINTED})
    monkeypatch.setattr(procs, "process_tree", lambda root: [root, root + 1])
    monkeypatch.setattr(procs, "cuda_pids", lambda pids, live=True: [p for p in pids if p in backend.states])
    rc, _ = run(crtools("post-resume", tmp_path), backend)
    assert rc == 0 and told == [([4000, 4001], "restored")]


def test_migrt_runc_checkpoint_that_cannot_resume_leaves_a_record_for_gpu_resume(migrt_env, node, tmp_path,
                                                                                monkeypatch):
    from migrt.gpu import procs
    from migrt.ops import gpu_runc
    from tests.unit.test_gpu_ops import as_shim, runc_args

    bundle = write_bundle(tmp_path / "bundle", env=[f"NVIDIA_VISIBLE_DEVICES={U0}"])
    monkeypatch.setattr(procs, "runc_state", lambda root, cid: {"init_process_pid": INIT,
                                                                "config": {"labels": [f"bundle={bundle}"]}})
    (tmp_path / "root" / "c1").mkdir(parents=True)
    node.backend.fail("restore", CHILD, message="CUDA_ERROR_NOT_SUPPORTED", code=801, times=2)
    parsed = runc_args(tmp_path, "checkpoint", "--image-path", str(tmp_path / "img"), "--leave-running", "c1")
    assert as_shim(gpu_runc.checkpoint, parsed, str(migrt_env.fake.path), [INIT, CHILD]) == 5
    last = json.loads((tmp_path / "log.json").read_text().splitlines()[-1])
    assert "could not be resumed" in last["msg"] and "'migrt gpu resume c1' retries" in last["msg"]
    rec = gpu_preempt.read_record(str(tmp_path / "root"), "c1")
    assert rec["by"] == "migrt-runc checkpoint" and rec["status"] == gpu_preempt.SUSPENDED


def test_a_migration_offer_is_refused_for_nccl_peers_and_a_failed_source_resume_is_recorded(cfg, node, two_ranks,
                                                                                         tmp_path, monkeypatch):
    from migrt.migration.gpu import GpuSource

    nccl_rank(two_ranks, INIT, 0)
    nccl_rank(two_ranks, CHILD, 1)
    with pytest.raises(peers.PeerStateRefused):
        GpuSource(cfg, "c1", INIT, None).probe(paused=False)  # before any offer goes out
    assert node.backend.calls_of("lock") == []
    off = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    two_ranks.root.joinpath(str(INIT), "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in off.items()))
    two_ranks.root.joinpath(str(CHILD), "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in off.items()))
    src = GpuSource(cfg, "c1", INIT, None)
    assert src.probe(paused=False)["processes"]
    src.suspend()
    root = tmp_path / "runc"
    (root / "c1").mkdir(parents=True)
    monkeypatch.setattr(gpu_preempt, "find_root", lambda cid, extra=None: str(root))
    node.backend.fail("restore", INIT, code=801, times=2)
    said = src.resume()  # the migration failed before the target ran: back onto its own GPU, which fails
    assert "could NOT be resumed" in said and "'migrt gpu resume c1' retries" in said
    assert gpu_preempt.read_record(str(root), "c1")["by"] == "migrt migrate"


def test_a_migrt_killed_after_asking_the_hook_is_recovered_and_the_processes_told(cfg, node, tmp_path, monkeypatch):
    """Killed between "pre-checkpoint" and the lock: the journal already names the processes, so the
    next command's recovery resumes them (nothing to do on the GPU) and tells them "post-restore"."""
    from migrt.ops import recover
    from migrt.store import Staging, journal
    from tests.unit.test_gpu_ops import Killed

    root = tmp_path / "runc-root"
    (root / "c1").mkdir(parents=True)
    (root / "c1" / "state.json").write_text("{}")
    sent = []
    ep = apphooks.Endpoint(INIT, "/run/migrt/hooks/rank0.sock", 7, (INIT,))

    def call(eps, event, timeout, **kw):
        sent.append((event, kw.get("reason")))
        if event == apphooks.PRE:
            raise Killed("SIGKILL while the ranks tear down")
        return {e: apphooks.Reply(True) for e in eps}

    monkeypatch.setattr(apphooks, "find", lambda pids, proc=None: [ep] if INIT in pids else [])
    monkeypatch.setattr(apphooks, "call", call)
    with monkeypatch.context() as m:  # what SIGKILL skips
        m.setattr(ops_checkpoint._Undo, "__exit__", lambda self, *a: False)
        m.setattr(Staging, "discard", lambda self: None)
        m.setattr(journal.Entry, "end", journal.Entry.release)
        with pytest.raises(Killed):
            ops_checkpoint.checkpoint(cfg, ops_checkpoint.CheckpointRequest(container_id="c1", root=str(root),
                                                                            name="ck1"))
    assert node.backend.calls_of("lock") == []
    monkeypatch.setattr(recover, "LowerRuntime", FakeLower)
    [outcome] = recover.recover(cfg)
    assert outcome.status == "recovered" and "told 1 application hook(s) 'post-restore'" in outcome.actions
    assert sent == [(apphooks.PRE, None), (apphooks.POST, apphooks.RESUMED)]


# -- locks that time out while a peer is already locked -----------------------------------------------------
def test_a_lock_that_times_out_is_undone_and_tried_once_more():
    """Rank B's all-reduce waits for rank A, locked a moment earlier: B's lock times out
    (CUDA_ERROR_NOT_READY). Everything is unlocked (A runs, B's collective completes) and the locks
    are tried again; the second try succeeds."""
    from migrt.gpu.fake import FakeGpuBackend

    b = FakeGpuBackend([1, 2])
    b.fail("lock", 2, code=600, message="CUDA_ERROR_NOT_READY")
    suspend_all([1, 2], b, 5000, parallel=False)
    assert b.states == {1: CHECKPOINTED, 2: CHECKPOINTED}
    assert [(c, p) for c, p, _ in b.calls if c != "state"] == [
        ("lock", 1), ("lock", 2), ("unlock", 1), ("lock", 1), ("lock", 2), ("checkpoint", 1), ("checkpoint", 2)]


def test_locks_that_keep_timing_out_or_fail_otherwise_are_not_retried_forever():
    from migrt.gpu.fake import FakeGpuBackend

    b = FakeGpuBackend([1, 2])
    b.fail("lock", 2, code=909, times=2, message="CUDA_ERROR_TIMEOUT")
    with pytest.raises(Exception, match="GPU lock of 2 process.*CUDA_ERROR_TIMEOUT.*every process was resumed"):
        suspend_all([1, 2], b, 5000, parallel=False)
    assert b.calls_of("lock") == [1, 2, 1, 2] and b.states == {1: RUNNING, 2: RUNNING}
    other = FakeGpuBackend([1, 2])
    other.fail("lock", 2, code=999)  # not a timeout: no second try
    with pytest.raises(Exception, match="injected failure"):
        suspend_all([1, 2], other, 5000, parallel=False)
    assert other.calls_of("lock") == [1, 2] and other.states == {1: RUNNING, 2: RUNNING}


def test_a_lock_timeout_says_what_holds_the_process():
    from migrt.gpu import cuda

    assert "collective waiting for a peer process that was locked first" in cuda.hint(cuda.CUDA_ERROR_NOT_READY,
                                                                                       cuda.LOCK)
    assert cuda.hint(cuda.CUDA_ERROR_NOT_READY, cuda.RESTORE) is None  # said only where it is true


class _PeerLockedFirst:
    """A FakeGpuBackend whose lock of pid 2 does not return while pid 1 is locked, whatever its
    timeout (what NVIDIA/cuda-checkpoint#30 reports for NCCL ranks): released when 1 is unlocked
    (`released_by_unlock`) or only by the test."""

    def __new__(cls, released_by_unlock: bool, times: int = 1):
        from migrt.gpu.fake import FakeGpuBackend

        class Backend(FakeGpuBackend):
            def __init__(self) -> None:
                super().__init__([1, 2])
                self.gate = __import__("threading").Event()
                self.left = times

            def lock(self, pid: int, timeout_ms: int = 0) -> None:
                if pid == 2 and self.left:
                    self.left -= 1
                    time.sleep(0.05)  # 1 is locked first
                    self.gate.wait(30)
                    self.gate.clear()
                super().lock(pid, timeout_ms)

            def unlock(self, pid: int) -> None:
                super().unlock(pid)
                if pid == 1 and released_by_unlock:
                    self.gate.set()

        return Backend()


def test_a_lock_stuck_in_the_driver_is_released_by_unlocking_its_peer_and_tried_again(monkeypatch):
    from migrt.gpu import session

    monkeypatch.setattr(session, "LOCK_GRACE_S", 0.5)
    b = _PeerLockedFirst(released_by_unlock=True)
    t0 = time.monotonic()
    suspend_all([1, 2], b, 200)
    assert time.monotonic() - t0 < 5
    assert b.states == {1: CHECKPOINTED, 2: CHECKPOINTED}
    # the stuck lock went through once 1 was unlocked, was undone, and both were locked again
    assert [(c, p) for c, p, _ in b.calls if c in ("lock", "unlock")] == [
        ("lock", 1), ("unlock", 1), ("lock", 2), ("unlock", 2), ("lock", 1), ("lock", 2)]


def test_a_lock_that_never_returns_ends_the_suspend_in_bounded_time_and_is_named(monkeypatch):
    """The call cannot be interrupted: migrt stops waiting, unlocks what it locked, names the pid that
    may still end up locked (nobody queries it again) and exits; the old code waited forever."""
    from migrt.gpu import session

    monkeypatch.setattr(session, "LOCK_GRACE_S", 0.3)
    b = _PeerLockedFirst(released_by_unlock=False)
    t0 = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            suspend_all([1, 2], b, 200)
        assert time.monotonic() - t0 < 3
        msg = str(info.value)
        assert "cuCheckpointProcessLock of pid(s) 2 did not return within 0.5 s" in msg
        assert "NVIDIA/cuda-checkpoint#30" in msg and "pid(s) 2 still had not returned" in msg
        assert info.value.pending == [2] and b.states[1] == RUNNING
        assert ("state", 2, None) not in b.calls
    finally:
        b.gate.set()
