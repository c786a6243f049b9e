"""GPU preemption in place on the GPU machine: `migrt gpu suspend` frees the GPU while the PyTorch
workload stays alive, another process can allocate that memory, `migrt gpu resume` brings the data
back bit for bit and the workload goes on; the same through migrt-runc `pause`/`resume` (containerd's
argv) for a container created with migrt.io/gpu-release-on-pause=true; resume onto the other GPU
where there are two. Sizes: MIGRT_GPU_PREEMPT_GBS (default: the smallest of MIGRT_GPU_TEST_GBS)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.gpu import harness
from tests.gpu.harness import Container, Workload

pytestmark = pytest.mark.gpu
GIB = 1 << 30


def preempt_gbs() -> list[float]:
    raw = os.environ.get("MIGRT_GPU_PREEMPT_GBS")
    return [float(x) for x in raw.split()] if raw else [min(harness.gbs())]


def used(uuid: str) -> int:
    from migrt.gpu import inventory

    return inventory.take().by_uuid(uuid).memory_used


def allocate(node, gb: float, index: int = 0) -> None:
    """Another process takes gb GiB on the GPU, touches it, and lets go."""
    code = ("import sys, torch; x = torch.ones(int(float(sys.argv[1]) * (1 << 30)), dtype=torch.uint8, "
            "device=f'cuda:{sys.argv[2]}'); torch.cuda.synchronize(); print(int(x.sum().item()))")
    out = subprocess.run([node.python, "-c", code, str(gb), str(index)], capture_output=True, text=True,
                         env=node.env, timeout=300)
    assert out.returncode == 0 and int(out.stdout.strip()) == int(gb * GIB), out.stderr[-2000:]


def stalled(w: Workload, seconds: float = 1.5) -> int:
    a = w.status()["count"]
    time.sleep(seconds)
    b = w.status()["count"]
    assert a == b, f"the workload went on counting ({a} -> {b}) while its GPU was taken away"
    return b


def start_via_shim(node, cid: str, bundle: str) -> Container:
    log = os.path.join(bundle, "log.json")
    c = Container(node, cid, [node.shim, "--root", str(node.runc_root), "--log", log, "--log-format", "json",
                              "create", "--bundle", bundle, "--pid-file", os.path.join(bundle, "init.pid"), cid],
                  bundle)
    assert c.rc == 0, open(log).read() if os.path.exists(log) else c.output()
    subprocess.run([node.shim, "--root", str(node.runc_root), "start", cid], check=True, env=node.env)
    c.log = log
    return c


def shim_call(node, c: Container, sub: str) -> tuple[int, float]:
    t0 = time.monotonic()
    r = subprocess.run([node.shim, "--root", str(node.runc_root), "--log", c.log, "--log-format", "json", sub, c.cid],
                       env=node.env, capture_output=True, timeout=600)
    return r.returncode, time.monotonic() - t0


@pytest.mark.parametrize("gb", preempt_gbs())
def test_suspend_frees_the_gpu_and_resume_brings_the_data_back(node, gb):
    g0 = node.gpus[0].uuid
    baseline = used(g0)
    tag = f"pre-{gb:g}".replace(".", "p")
    data = node.data_dir(tag)
    src = Container.run(node, f"{tag}-c", node.bundle(f"{tag}-c", node.workload_args("w", str(gb)), data, [0]))
    w = Workload(data, "w")
    try:
        ready = w.ready()
        w.counting_past(3)
        before = used(g0)
        assert before - baseline >= gb * GIB * 0.95
        t0 = time.monotonic()
        rec = json.loads(node.cli("gpu", "suspend", src.cid, "--root", str(node.runc_root), "--json").stdout)
        suspend_wall = time.monotonic() - t0
        after = used(g0)
        assert after - baseline < 256 << 20, f"GPU still holds {(after - baseline) / GIB:.2f} GiB above baseline"
        assert src.state()["status"] == "running"  # alive, not frozen
        last = stalled(w)
        st = json.loads(node.cli("gpu", "status", src.cid, "--root", str(node.runc_root), "--json").stdout)[0]
        assert st["status"] == "suspended" and {p["driver_state"] for p in st["processes"]} == {"checkpointed"}
        host = st["host_memory_bytes"]
        assert host >= gb * GIB * 0.95  # the GPU memory now lives in the process's host memory
        t0 = time.monotonic()
        allocate(node, gb)  # the freed memory is usable by someone else
        other_s = time.monotonic() - t0
        t0 = time.monotonic()
        done = json.loads(node.cli("gpu", "resume", src.cid, "--root", str(node.runc_root), "--json").stdout)
        resume_wall = time.monotonic() - t0
        t1 = time.monotonic()
        w.counting_past(last)
        going_after = time.monotonic() - t1
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"] > last
        assert used(g0) - baseline >= gb * GIB * 0.95
        node.record("gpu suspend/resume in place", gb=gb, processes=len(rec["processes"]),
                    suspend_s=rec["timings"]["suspend_s"], suspend_wall_s=round(suspend_wall, 3),
                    resume_s=done["timings"]["resume_s"], resume_wall_s=round(resume_wall, 3),
                    counting_again_after_s=round(going_after, 3), gpu_used_before_gib=round(before / GIB, 2),
                    gpu_used_suspended_gib=round(after / GIB, 2), gpu_baseline_gib=round(baseline / GIB, 2),
                    gpu_freed_gib=round((before - after) / GIB, 2), host_memory_gib=round(host / GIB, 2),
                    other_process_alloc_s=round(other_s, 3))
    finally:
        src.remove()


def test_pause_and_resume_through_migrt_runc_release_the_gpu(node):
    gb = min(preempt_gbs())
    g0 = node.gpus[0].uuid
    baseline = used(g0)
    tag = f"pause-{gb:g}".replace(".", "p")
    data = node.data_dir(tag)
    bundle = node.bundle(f"{tag}-c", node.workload_args("w", str(gb)), data, [0],
                         annotations={"migrt.io/gpu-release-on-pause": "true"})
    c = start_via_shim(node, f"{tag}-c", bundle)
    w = Workload(data, "w")
    try:
        ready = w.ready()
        w.counting_past(3)
        rc, pause_s = shim_call(node, c, "pause")
        assert rc == 0, open(c.log).read()
        assert c.state()["status"] == "paused"
        assert used(g0) - baseline < 256 << 20
        last = stalled(w)
        allocate(node, gb)
        rc, resume_s = shim_call(node, c, "resume")
        assert rc == 0, open(c.log).read()
        assert c.state()["status"] == "running"
        w.counting_past(last)
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
        node.record("migrt-runc pause/resume with GPU release", gb=gb, processes=1, pause_wall_s=round(pause_s, 3),
                    resume_wall_s=round(resume_s, 3))
    finally:
        c.remove()


def test_resume_onto_the_other_gpu(node):
    if len(node.gpus) < 2 or node.gpus[0].name != node.gpus[1].name:
        pytest.skip(f"needs two GPUs of one model (this node: {[g.name for g in node.gpus]})")
    gb = min(preempt_gbs())
    tag = f"premove-{gb:g}".replace(".", "p")
    data = node.data_dir(tag)
    src = Container.run(node, f"{tag}-c", node.bundle(f"{tag}-c", node.workload_args("w", str(gb)), data, [0, 1]))
    w = Workload(data, "w")
    try:
        ready = w.ready()
        w.counting_past(3)
        node.cli("gpu", "suspend", src.cid, "--root", str(node.runc_root))
        last = stalled(w)
        pid = int(json.loads(node.cli("gpu", "status", src.cid, "--root", str(node.runc_root), "--json").stdout)[0]
                  ["processes"][0]["pid"])
        swapped = f"{node.gpus[1].uuid},{node.gpus[0].uuid}"
        done = json.loads(node.cli("gpu", "resume", src.cid, "--root", str(node.runc_root), "--gpus", swapped,
                                   "--json").stdout)
        assert done["moved"]
        w.counting_past(last)
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
        assert harness.gpu_of_pid(pid) == [node.gpus[1].uuid]  # cuda:0 now lives on GPU 1
        node.record("gpu resume onto the other GPU", gb=gb, processes=1, resume_s=done["timings"]["resume_s"])
    finally:
        src.remove()
