"""Multi-GPU jobs on the 2-GPU machine (docs/gpu.md, "Multi-GPU jobs"): a torch.distributed job in a
container, one process per GPU, NCCL between them (tests/gpu/ddp_workload.py), GB GiB of tensors
per rank (MIGRT_GPU_MULTI_GB, default 8: the issue's 2 x 8 GiB).

  (a) NCCL defaults, no hook: `migrt gpu suspend` and `migrt checkpoint` are refused before the
      lock (exit 8), the job keeps running, nothing was taken from the GPUs;
  (b) NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: suspend + resume onto the swapped GPUs in place, then
      `migrt checkpoint --tcp-established` + restore into a new container onto the swapped GPUs
      (migrt.io/restore-gpus): identical tensors, all-reduce results right, training goes on;
  (c) NCCL defaults with the application hook: the same two round trips; the ranks destroy their
      process group at "pre-checkpoint" and build a new one at "post-restore".
Each case records what the peer rule saw of the ranks (`evidence`), so a run shows which signal
decided. Run: see docs/gpu.md ("Multi-GPU jobs", how it was measured)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.gpu import harness
from tests.gpu.harness import Container, wait_for

pytestmark = pytest.mark.gpu
WORKLOAD = Path(__file__).with_name("ddp_workload.py")
APPHOOK = harness.REPO / "migrt" / "apphook.py"
OFF = ["NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_IB_DISABLE=1", "NCCL_SOCKET_IFNAME=lo"]
COMMON = ["TORCH_NCCL_ENABLE_MONITORING=0", "NCCL_RAS_ENABLE=0", "NCCL_DEBUG=WARN"]
HOOK_TMPFS = {"destination": "/run/migrt", "type": "tmpfs", "source": "tmpfs",
              "options": ["nosuid", "nodev", "mode=755", "size=1m"]}


def multi_gbs() -> list[float]:
    return [float(x) for x in os.environ.get("MIGRT_GPU_MULTI_GB", "8").split()]


class Rank:
    def __init__(self, data: Path, rank: int) -> None:
        self.data, self.rank, self.k = data, rank, 0

    def _read(self, suffix: str) -> dict | None:
        try:
            return json.loads((self.data / f"r{self.rank}.{suffix}").read_text())
        except (OSError, ValueError):
            return None

    def ready(self, timeout: float = 600) -> dict:
        return wait_for(lambda: self._read("ready.json"), timeout, f"rank {self.rank} ready")

    def status(self) -> dict:
        return wait_for(lambda: self._read("status.json"), 60, f"rank {self.rank} status")

    def past(self, count: int, timeout: float = 180) -> dict:
        return wait_for(lambda: (s := self._read("status.json")) and s["count"] > count and s, timeout,
                        f"rank {self.rank} past step {count}")

    def verify(self, timeout: float = 300) -> dict:
        self.k += 1
        (self.data / f"r{self.rank}.verify-{self.k}").write_text("")
        return wait_for(lambda: self._read(f"result-{self.k}.json"), timeout, f"rank {self.rank} checksum #{self.k}")

    def hook_events(self) -> list[dict]:
        p = self.data / f"r{self.rank}.hook.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


class Job:
    """The container and its two ranks."""

    def __init__(self, node, tag: str, gb: float, env: list[str], hook: bool) -> None:
        self.node, self.tag, self.gb = node, tag, gb
        self.data = node.data_dir(tag)
        shutil.copy(WORKLOAD, self.data / "ddp_workload.py")
        shutil.copy(APPHOOK, self.data / "apphook.py")  # what an application does: carry the helper
        self.env = [*COMMON, *env, *(["WORKLOAD_HOOK=1"] if hook else [])]
        self.mounts = [HOOK_TMPFS] if hook else []
        bundle = node.bundle(f"{tag}-src", [node.python, "/data/ddp_workload.py", "--job", str(gb)], self.data,
                             [0, 1], env=self.env, mounts=self.mounts)
        self.container = Container.run(node, f"{tag}-src", bundle)
        self.ranks = [Rank(self.data, r) for r in (0, 1)]
        self.ready = [r.ready() for r in self.ranks]
        for r in self.ranks:
            r.past(3)

    def pids(self, container: Container | None = None) -> list[int]:
        """Host pids of ranks 0 and 1 (the init is the supervisor, without CUDA), by their pid in the
        container (what they wrote in ready.json; a restore keeps it)."""
        from migrt.gpu import procs

        init = (container or self.container).state()["pid"]
        by_ns = {procs.ns_pid(p): p for p in procs.process_tree(init) if p != init}
        return [by_ns[r["pid"]] for r in self.ready]

    def evidence(self, container: Container | None = None) -> dict:
        from migrt.gpu import inventory, peers

        v = peers.assess(self.pids(container), driver_version=inventory.take(with_processes=False).driver_version)
        return {"processes": [p.to_dict() for p in v.processes], "findings": [f.to_dict() for f in v.findings]}

    def counts(self) -> list[int]:
        return [r.status()["count"] for r in self.ranks]

    def going_on(self, after: list[int]) -> float:
        """Seconds until both ranks passed `after` with every all-reduce right."""
        t0 = time.monotonic()
        for r, n in zip(self.ranks, after):
            s = r.past(n + 3)
            assert s["allreduce_bad"] == 0, f"rank {r.rank}: {s['allreduce_bad']} wrong all-reduce results"
            assert s["gpu_count"] == s["count"]
        return round(time.monotonic() - t0, 3)

    def same_tensors(self) -> None:
        for r, ready in zip(self.ranks, self.ready):
            check = r.verify()
            assert check["checksum"] == ready["checksum"], f"rank {r.rank}: tensors differ after the round trip"

    def restore(self, name: str, *, swapped: bool) -> Container:
        """A new container (migrt-runc create with MIGRT_RESTORE), both GPUs, swapped if asked."""
        g = self.node.gpus
        ann = {"migrt.io/restore-gpus": f"{g[1].uuid},{g[0].uuid}"} if swapped else None
        cid = f"{self.tag}-dst"
        bundle = self.node.bundle(cid, [self.node.python, "/data/ddp_workload.py", "--job", "0"], self.data, [0, 1],
                                  env=[*self.env, f"MIGRT_RESTORE={name}"], annotations=ann, mounts=self.mounts)
        log = os.path.join(bundle, "log.json")
        c = Container(self.node, cid, [self.node.shim, "--root", str(self.node.runc_root), "--log", log,
                                       "--log-format", "json", "create", "--bundle", bundle, cid], bundle)
        err = ""
        if os.path.exists(log):
            err = "\n".join(json.loads(line).get("msg", "") for line in open(log) if '"error"' in line)
        assert c.rc == 0, f"restore {name}: {err}\n{self.node.tail_logs()}"
        subprocess.run([self.node.shim, "--root", str(self.node.runc_root), "start", cid], check=True,
                       env=self.node.env)
        return c


def gpus_of(pids: list[int]) -> list[list[str]]:
    return [harness.gpu_of_pid(p) for p in pids]


def suspend_resume_swapped(node, job: Job) -> dict:
    """In place: suspend both ranks, resume each onto the other GPU; returns the figures."""
    cid, root = job.container.cid, str(node.runc_root)
    g = node.gpus
    before = gpus_of(job.pids())
    rec = json.loads(node.cli("gpu", "suspend", cid, "--root", root, "--json").stdout)
    stalled = job.counts()
    time.sleep(1)
    assert job.counts() == stalled, "the ranks went on while their GPU state was away"
    done = json.loads(node.cli("gpu", "resume", cid, "--root", root, "--gpus", f"{g[1].uuid},{g[0].uuid}",
                               "--json").stdout)
    assert done["moved"] and [(p["old"], p["new"]) for p in done["pairs"]] == [(g[0].uuid, g[1].uuid),
                                                                             (g[1].uuid, g[0].uuid)]
    after = job.going_on(stalled)
    swap = {g[0].uuid: g[1].uuid, g[1].uuid: g[0].uuid}
    now = gpus_of(job.pids())
    assert [sorted(u) for u in now] == [sorted(swap[u] for u in b) for b in before], \
        f"each rank's memory should now be on the other GPU: before {before}, after {now}"
    job.same_tensors()
    return {"suspend_s": rec["timings"].get("suspend_s"), "resume_s": done["timings"].get("resume_s"),
            "going_on_after_s": after, "hook": done.get("app_hook")}


def checkpoint_restore_swapped(node, job: Job, name: str, *flags: str) -> dict:
    """migrt checkpoint (the source stops), restore into a new container onto the swapped GPUs."""
    g = node.gpus
    swap = {g[0].uuid: g[1].uuid, g[1].uuid: g[0].uuid}
    before = gpus_of(job.pids())
    t0 = time.monotonic()
    node.cli("checkpoint", job.container.cid, "--root", str(node.runc_root), "--name", name, "--json", *flags)
    ck_wall = time.monotonic() - t0
    manifest = json.loads(node.cli("inspect", name, "--json").stdout)["manifest"]
    stopped = job.counts()
    dst = job.restore(name, swapped=True)
    after = job.going_on(stopped)
    job.same_tensors()
    moved = gpus_of(job.pids(dst))
    restored = node.migrt_events("restored")[-1].get("timings", {})
    t = manifest.get("timings", {})
    return {"dst": dst, "gpu_checkpoint_s": t.get("gpu_checkpoint_s"), "dump_s": t.get("dump_s"),
            "checkpoint_total_s": t.get("total_s"), "checkpoint_wall_s": round(ck_wall, 3),
            "image_bytes": manifest.get("size_bytes"), "restore_s": restored.get("restore_s"),
            "gpu_restore_s": restored.get("gpu_restore_s"), "app_hook_s": restored.get("app_hook_s"),
            "restore_total_s": restored.get("total_s"), "restore_wall_s": round(dst.seconds, 3),
            "going_on_after_s": after, "gpus_before": before, "gpus_after": moved,
            "swapped": [sorted(u) for u in moved] == [sorted(swap[u] for u in b) for b in before]}


def two_gpus(node) -> None:
    if len(node.gpus) < 2 or node.gpus[0].name != node.gpus[1].name:
        pytest.fail(f"needs two GPUs of one model (this node: {[g.name for g in node.gpus]}): run on nvidia-h200-x2 "
                    "or nvidia-h100-x2")


@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_a_nccl_defaults_without_hook_are_refused_before_the_lock(node, gb):
    two_gpus(node)
    tag = f"ma-{gb:g}".replace(".", "p")
    job = Job(node, tag, gb, [], hook=False)
    try:
        ev = job.evidence()
        used = [harness.gpu_of_pid(p) for p in job.pids()]
        before = job.counts()
        r = node.cli("gpu", "suspend", job.container.cid, "--root", str(node.runc_root), check=False)
        refused = r.returncode == 8 and "hold peer-to-peer or IPC state" in r.stderr
        node.record("multi (a) NCCL defaults, no hook: gpu suspend refused", gb=gb, processes=2, refused=refused,
                    evidence=ev, stderr=r.stderr[-1500:])
        assert refused, f"not refused (exit {r.returncode}): {r.stderr}\nevidence: {json.dumps(ev)}"
        r = node.cli("checkpoint", job.container.cid, "--root", str(node.runc_root), "--name", tag, check=False)
        assert r.returncode == 8 and "hold peer-to-peer or IPC state" in r.stderr, r.stderr
        assert "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" in r.stderr and "application hook" in r.stderr
        assert job.container.state().get("status") == "running"
        job.going_on(before)  # never stopped, all-reduce right
        assert [harness.gpu_of_pid(p) for p in job.pids()] == used  # nothing taken from the GPUs
    finally:
        job.container.remove()


@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_b_p2p_and_shm_off_round_trips_onto_swapped_gpus(node, gb):
    two_gpus(node)
    tag = f"mb-{gb:g}".replace(".", "p")
    job = Job(node, tag, gb, OFF, hook=False)
    dst = None
    try:
        ev = job.evidence()
        inplace = suspend_resume_swapped(node, job)
        node.record("multi (b) P2P/SHM off: gpu suspend + resume onto swapped GPUs", gb=gb, processes=2,
                    gpu_checkpoint_s=inplace["suspend_s"], gpu_resume_s=inplace["resume_s"],
                    counting_again_after_s=inplace["going_on_after_s"], evidence=ev)
        out = checkpoint_restore_swapped(node, job, tag, "--tcp-established")  # NCCL's sockets between the ranks
        dst = out.pop("dst")
        assert out["swapped"], out["gpus_after"]
        node.record("multi (b) P2P/SHM off: checkpoint + restore onto swapped GPUs", gb=gb, processes=2,
                    counting_again_after_s=out.pop("going_on_after_s"), **out)
    finally:
        for c in (job.container, dst):
            if c:
                c.remove()
        node.cli("rm", tag, check=False)


@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_c_nccl_defaults_with_the_hook_round_trip_onto_swapped_gpus(node, gb):
    two_gpus(node)
    tag = f"mc-{gb:g}".replace(".", "p")
    job = Job(node, tag, gb, [], hook=True)
    dst = None
    try:
        ev = job.evidence()
        inplace = suspend_resume_swapped(node, job)
        downs = [r.hook_events() for r in job.ranks]
        assert all([e["event"] for e in d] == ["pre-checkpoint", "post-restore"] for d in downs), downs
        assert all(d[-1]["reason"] == "resumed" for d in downs)
        assert all(r.status()["gen"] == 1 for r in job.ranks)  # a new process group
        node.record("multi (c) NCCL defaults + hook: gpu suspend + resume onto swapped GPUs", gb=gb, processes=2,
                    gpu_checkpoint_s=inplace["suspend_s"], gpu_resume_s=inplace["resume_s"],
                    counting_again_after_s=inplace["going_on_after_s"], evidence=ev,
                    hook_down_s=max(d[0]["seconds"] for d in downs), hook_up_s=max(d[1]["seconds"] for d in downs))
        out = checkpoint_restore_swapped(node, job, tag)  # no TCP left: the group is gone at the dump
        dst = out.pop("dst")
        assert out["swapped"], out["gpus_after"]
        ups = [r.hook_events()[-1] for r in job.ranks]
        assert all(u["event"] == "post-restore" and u["reason"] == "restored" for u in ups), ups
        assert all(r.status()["gen"] == 2 for r in job.ranks)
        node.record("multi (c) NCCL defaults + hook: checkpoint + restore onto swapped GPUs", gb=gb, processes=2,
                    counting_again_after_s=out.pop("going_on_after_s"), hook_up_s=max(u["seconds"] for u in ups),
                    **out)
    finally:
        for c in (job.container, dst):
            if c:
                c.remove()
        node.cli("rm", tag, check=False)
