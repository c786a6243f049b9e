"""Containers running PyTorch on the GPU, checkpointed and restored by migrt on every path; the data
on the GPU must come back bit for bit and the program must go on counting. GPU machine only
(pytest -m gpu; tests/gpu/run_on_device.sh). Sizes: MIGRT_GPU_TEST_GBS (default "2")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from tests.gpu import harness
from tests.gpu.harness import Container, Workload

pytestmark = pytest.mark.gpu
SMALL = min(harness.gbs())


def tag_of(prefix: str, gb: float) -> str:
    return f"{prefix}-{gb:g}".replace(".", "p")


def start(node, tag: str, gb: float, gpu: int = 0, *, pair: bool = False, annotations=None):
    data = node.data_dir(tag)
    args = node.workload_args("--pair", str(gb / 2)) if pair else node.workload_args("w", str(gb))
    bundle = node.bundle(f"{tag}-src", args, data, [gpu], annotations=annotations)
    return Container.run(node, f"{tag}-src", bundle), data


def checkpoint(node, cid: str, name: str, *flags: str) -> tuple[dict, float]:
    t0 = time.monotonic()
    r = node.cli("checkpoint", cid, "--root", str(node.runc_root), "--name", name, "--json", *flags)
    wall = time.monotonic() - t0
    assert json.loads(r.stdout)["name"] == name
    manifest = json.loads(node.cli("inspect", name, "--json").stdout)["manifest"]
    return manifest, wall


def restore_by_create(node, name: str, cid: str, data, gpus: list[int]) -> Container:
    """What containerd does for a pod whose container asks for MIGRT_RESTORE: migrt-runc create, start."""
    bundle = node.bundle(cid, node.workload_args("fresh", "0"), data, gpus, env=[f"MIGRT_RESTORE={name}"])
    log = os.path.join(bundle, "log.json")
    c = Container(node, cid, [node.shim, "--root", str(node.runc_root), "--log", log, "--log-format", "json",
                              "create", "--bundle", bundle, "--pid-file", os.path.join(bundle, "init.pid"), cid],
                  bundle)
    c.log = log
    c.pid_file = os.path.join(bundle, "init.pid")
    if c.rc == 0:
        subprocess.run([node.shim, "--root", str(node.runc_root), "start", cid], check=True, env=node.env)
    return c


def last_error(path: str) -> str:
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    errors = [json.loads(line)["msg"] for line in lines if '"error"' in line]
    return errors[-1] if errors else ""


def cleanup(node, *containers, checkpoint: str | None = None, dirs=()) -> None:
    """Containers, the checkpoint and image directories go: they hold GBs of RAM on /dev/shm."""
    for c in containers:
        if c:
            c.remove()
    if checkpoint and os.environ.get("MIGRT_GPU_KEEP") != "1":
        node.cli("rm", checkpoint, check=False)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def stopped(c: Container) -> bool:
    return c.state().get("status") in (None, "stopped")


def figures(manifest: dict, restored: dict, ck_wall: float, rs_wall: float, resumed_after: float) -> dict:
    t, r = manifest.get("timings", {}), restored.get("timings", {})
    return {
        "gpu_checkpoint_s": t.get("gpu_checkpoint_s"), "dump_s": t.get("dump_s"), "commit_s": t.get("commit_s"),
        "checkpoint_total_s": t.get("total_s"), "checkpoint_wall_s": round(ck_wall, 3),
        "verify_s": r.get("verify_s"), "restore_s": r.get("restore_s"), "gpu_restore_s": r.get("gpu_restore_s"),
        "restore_total_s": r.get("total_s"), "restore_wall_s": round(rs_wall, 3),
        "counting_again_after_s": round(resumed_after, 3), "image_bytes": manifest.get("size_bytes"),
    }


# -- migrt checkpoint, then a new container with MIGRT_RESTORE -------------------------------------------
@pytest.mark.parametrize("gb", harness.gbs())
def test_checkpoint_then_restore_by_create(node, gb):
    tag = tag_of("rt", gb)
    src, data = start(node, tag, gb)
    w = Workload(data, "w")
    dst = None
    try:
        ready = w.ready()
        w.counting_past(5)
        assert w.verify()["checksum"] == ready["checksum"]
        manifest, ck_wall = checkpoint(node, src.cid, tag)
        assert stopped(src)
        gpu = manifest["gpu"]
        assert [g["uuid"] for g in gpu["gpus"]] == [node.gpus[0].uuid]
        assert len(gpu["processes"]) == 1 and gpu["processes"][0]["ns_pid"] == 1
        assert gpu["processes"][0]["memory_bytes"] >= gb * (1 << 30)
        last = w.status()["count"]
        time.sleep(0.5)
        assert w.status()["count"] == last  # nothing runs any more
        dst = restore_by_create(node, tag, f"{tag}-dst", data, [0])
        assert dst.rc == 0, f"{last_error(dst.log)}\n{node.tail_logs()}"
        t0 = time.monotonic()
        after = w.counting_past(last)
        resumed_after = time.monotonic() - t0
        assert after["count"] > last and after["gpu_count"] == after["count"]
        check = w.verify()
        assert check["checksum"] == ready["checksum"]
        assert check["gpu_count"] == check["count"] > last
        assert harness.gpu_of_pid(int(open(dst.pid_file).read())) == [node.gpus[0].uuid]
        restored = node.migrt_events("restored")[-1]
        node.record("migrt checkpoint + restore by create", gb=gb, processes=1,
                    **figures(manifest, restored, ck_wall, dst.seconds, resumed_after))
    finally:
        cleanup(node, src, dst, checkpoint=tag)


def test_two_cuda_processes(node):
    gb = SMALL
    tag = tag_of("pair", gb)
    src, data = start(node, tag, gb, pair=True)
    ws = [Workload(data, n) for n in ("a", "b")]
    dst = None
    try:
        ready = [w.ready() for w in ws]
        for w in ws:
            w.counting_past(3)
        manifest, ck_wall = checkpoint(node, src.cid, tag)
        assert stopped(src)
        procs = manifest["gpu"]["processes"]
        assert len(procs) == 2 and all(p["ns_pid"] != 1 for p in procs)  # the workers, not the supervisor
        last = [w.status()["count"] for w in ws]
        dst = restore_by_create(node, tag, f"{tag}-dst", data, [0])
        assert dst.rc == 0, f"{last_error(dst.log)}\n{node.tail_logs()}"
        t0 = time.monotonic()
        for w, n in zip(ws, last):
            w.counting_past(n)
        resumed_after = time.monotonic() - t0
        for w, r in zip(ws, ready):
            check = w.verify()
            assert check["checksum"] == r["checksum"] and check["gpu_count"] == check["count"]
        node.record("two CUDA processes", gb=gb, processes=2,
                    **figures(manifest, node.migrt_events("restored")[-1], ck_wall, dst.seconds, resumed_after))
    finally:
        cleanup(node, src, dst, checkpoint=tag)


def test_restore_onto_the_other_gpu(node):
    if len(node.gpus) < 2 or node.gpus[0].name != node.gpus[1].name:
        pytest.skip(f"needs two GPUs of one model (this node: {[g.name for g in node.gpus]}); "
                    "run on nvidia-h200-x2")
    gb = SMALL
    tag = tag_of("move", gb)
    src, data = start(node, tag, gb, gpu=0)
    w = Workload(data, "w")
    dst = None
    try:
        ready = w.ready()
        w.counting_past(3)
        manifest, ck_wall = checkpoint(node, src.cid, tag)
        last = w.status()["count"]
        dst = restore_by_create(node, tag, f"{tag}-dst", data, [1])
        assert dst.rc == 0, f"{last_error(dst.log)}\n{node.tail_logs()}"
        t0 = time.monotonic()
        w.counting_past(last)
        resumed_after = time.monotonic() - t0
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
        pid = int(open(dst.pid_file).read())
        assert harness.gpu_of_pid(pid) == [node.gpus[1].uuid]  # its memory now lives on GPU 1
        node.record("restore onto the other GPU", gb=gb, processes=1,
                    **figures(manifest, node.migrt_events("restored")[-1], ck_wall, dst.seconds, resumed_after))
    finally:
        cleanup(node, src, dst, checkpoint=tag)


def test_failed_preflight_leaves_the_checkpoint_usable(node):
    """No room on the GPU (a hog holds its memory): refused before anything is touched; once the
    memory is free again the same checkpoint restores."""
    gb = SMALL
    tag = tag_of("pf", gb)
    src, data = start(node, tag, gb)
    w = Workload(data, "w")
    hog = dst = None
    try:
        ready = w.ready()
        w.counting_past(3)
        manifest, _ = checkpoint(node, src.cid, tag)
        need = manifest["gpu"]["processes"][0]["memory_bytes"]
        assert need, "NVML did not report the process's GPU memory: the preflight cannot check free memory"
        from migrt.gpu import inventory

        free = inventory.take().by_uuid(node.gpus[0].uuid).memory_free
        hog = subprocess.Popen([node.python, "-c", (
            "import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda:0'); "
            "print('held', flush=True); time.sleep(600)"), str(free - need // 2)],
            stdout=subprocess.PIPE, text=True, env=node.env)
        assert hog.stdout.readline().strip() == "held"
        refused = restore_by_create(node, tag, f"{tag}-no", data, [0])
        assert refused.rc == 8, last_error(refused.log)
        msg = last_error(refused.log)
        assert f"checkpoint {tag}: GPU {node.gpus[0].uuid} has" in msg and "free" in msg, msg
        assert refused.state() == {}  # no container was made
        refused.remove()
        if len(node.gpus) >= 2:  # and a count mismatch, where there are two GPUs
            two = restore_by_create(node, tag, f"{tag}-two", data, [0, 1])
            assert two.rc == 8 and "ran on 1 GPU(s)" in last_error(two.log)
            two.remove()
        node.cli("inspect", tag, "--verify")  # the checkpoint is whole
        hog.kill()
        hog.wait()
        hog = None
        dst = restore_by_create(node, tag, f"{tag}-dst", data, [0])
        assert dst.rc == 0, f"{last_error(dst.log)}\n{node.tail_logs()}"
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
    finally:
        if hog:
            hog.kill()
        cleanup(node, src, dst, checkpoint=tag)


def test_leave_running_and_a_copy_elsewhere(node):
    """--leave-running: the workload goes on (GPU resumed); the checkpoint restores as a copy whose
    /data is another directory (bind mounts follow the new config)."""
    gb = SMALL
    tag = tag_of("lr", gb)
    src, data = start(node, tag, gb)
    w = Workload(data, "w")
    copy = None
    try:
        ready = w.ready()
        w.counting_past(3)
        manifest, ck_wall = checkpoint(node, src.cid, tag, "--leave-running")
        assert src.state().get("status") == "running"
        n = w.status()["count"]
        t0 = time.monotonic()
        w.counting_past(n + 5)
        going_again = time.monotonic() - t0
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
        # The rig's containers share the host's network namespace (see rig.py), so the copy's abstract
        # unix sockets would clash with the still-running original ("Can't bind ... Address already
        # in use", seen on the H100): stop the original before the copy comes up.
        src.remove()
        data2 = node.data_dir(f"{tag}-copy")
        copy = restore_by_create(node, tag, f"{tag}-copy", data2, [0])
        assert copy.rc == 0, f"{last_error(copy.log)}\n{node.tail_logs()}"
        w2 = Workload(data2, "w")
        w2.counting_past(0)
        assert w2.verify()["checksum"] == ready["checksum"]
        node.record("leave-running (workload resumed) + copy", gb=gb, processes=1,
                    gpu_checkpoint_s=manifest["timings"].get("gpu_checkpoint_s"),
                    gpu_resume_s=manifest["timings"].get("gpu_resume_s"), dump_s=manifest["timings"].get("dump_s"),
                    checkpoint_wall_s=round(ck_wall, 3), counting_again_after_s=round(going_again, 3))
    finally:
        cleanup(node, src, copy, checkpoint=tag)


# -- containerd's own paths: migrt-runc checkpoint / restore -------------------------------------------------
def test_migrt_runc_checkpoint_and_restore(node):
    gb = SMALL
    tag = tag_of("crd", gb)
    src, data = start(node, tag, gb)
    w = Workload(data, "w")
    dst = None
    img, work = node.base / f"{tag}-img", node.base / f"{tag}-work"
    g = ["--root", str(node.runc_root), "--log", str(node.base / f"{tag}.log.json"), "--log-format", "json"]
    try:
        ready = w.ready()
        w.counting_past(3)
        t0 = time.monotonic()
        r = subprocess.run([node.shim, *g, "checkpoint", "--image-path", str(img), "--work-path", str(work), src.cid],
                           env=node.env, capture_output=True, text=True, timeout=600)
        ck_wall = time.monotonic() - t0
        assert r.returncode == 0, f"{last_error(str(node.base / f'{tag}.log.json'))}\n{r.stderr}\n{node.tail_logs()}"
        assert stopped(src)
        record = json.loads((img / "migrt-gpu.json").read_text())
        assert len(record["processes"]) == 1
        last = w.status()["count"]
        bundle = node.bundle(f"{tag}-dst", node.workload_args("fresh", "0"), data, [0])
        dst = Container(node, f"{tag}-dst", [node.shim, *g, "restore", "--image-path", str(img), "--work-path",
                                             str(node.base / f"{tag}-work2"), "--detach", "--pid-file",
                                             os.path.join(bundle, "init.pid"), "-no-subreaper", "--bundle", bundle,
                                             f"{tag}-dst"], bundle)
        assert dst.rc == 0, f"{last_error(str(node.base / f'{tag}.log.json'))}\n{node.tail_logs()}"
        w.counting_past(last)
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
        ev = node.migrt_events("gpu_restore")[-1]
        node.record("migrt-runc checkpoint + restore (containerd's path)", gb=gb, processes=1,
                    gpu_checkpoint_s=record["timings"].get("gpu_checkpoint_s"), checkpoint_wall_s=round(ck_wall, 3),
                    gpu_restore_s=ev.get("timings", {}).get("gpu_restore_s"), restore_wall_s=round(dst.seconds, 3))
    finally:
        cleanup(node, src, dst, dirs=(img, work, node.base / f"{tag}-work2"))


# -- plain runc, GPU handled by the CRIU action script ---------------------------------------------------------
def hook_events(node, event: str) -> list[dict]:
    path = node.base / "hook.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if f'"event": "{event}"' in line]


def test_plain_runc_with_the_criu_action_script(node):
    """runc alone, the hook named in a CRIU config file (org.criu.config: runc's per-container
    /etc/criu/runc.conf): --leave-running (the watchdog resumes the GPU once CRIU has exited), then
    a real checkpoint and `runc restore` (post-resume restores the GPU)."""
    gb = SMALL
    tag = tag_of("hook", gb)
    conf = node.base / "criu-hook.conf"
    conf.write_text(f"action-script {harness.REPO / 'hooks' / 'cuda-criu-action'}\n")
    ann = {"org.criu.config": str(conf)}
    src, data = start(node, tag, gb, annotations=ann)
    w = Workload(data, "w")
    dst = None
    R = ["runc", "--root", str(node.runc_root)]
    try:
        ready = w.ready()
        w.counting_past(3)
        r = subprocess.run([*R, "checkpoint", "--leave-running", "--image-path", str(node.base / f"{tag}-img0"),
                            "--work-path", str(node.base / f"{tag}-w0"), src.cid], env=node.env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{r.stderr}\n{node.tail_logs()}"
        t0 = time.monotonic()
        w.counting_past(w.status()["count"] + 3, timeout=120)  # resumed by the watchdog
        resumed_after = time.monotonic() - t0
        assert w.verify()["checksum"] == ready["checksum"]
        assert hook_events(node, "suspended") and hook_events(node, "watchdog_done")[-1]["resumed"]
        img = node.base / f"{tag}-img"
        t0 = time.monotonic()
        r = subprocess.run([*R, "checkpoint", "--image-path", str(img), "--work-path", str(node.base / f"{tag}-w"),
                            src.cid], env=node.env, capture_output=True, text=True, timeout=600)
        ck_wall = time.monotonic() - t0
        assert r.returncode == 0, f"{r.stderr}\n{node.tail_logs()}"
        assert (img / "migrt-gpu.json").exists() and stopped(src)
        last = w.status()["count"]
        bundle = node.bundle(f"{tag}-dst", node.workload_args("fresh", "0"), data, [0], annotations=ann)
        dst = Container(node, f"{tag}-dst", [*R, "restore", "--detach", "--image-path", str(img), "--work-path",
                                             str(node.base / f"{tag}-w2"), "--bundle", bundle, "--pid-file",
                                             os.path.join(bundle, "init.pid"), f"{tag}-dst"], bundle)
        assert dst.rc == 0, f"{dst.output()}\n{node.tail_logs()}"
        w.counting_past(last)
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
        restored = hook_events(node, "restored")[-1]
        node.record("plain runc + CRIU action script", gb=gb, processes=1,
                    leave_running_resumed_after_s=round(resumed_after, 3), checkpoint_wall_s=round(ck_wall, 3),
                    gpu_checkpoint_s=hook_events(node, "suspended")[-1].get("seconds"),
                    gpu_restore_s=restored.get("seconds"), restore_wall_s=round(dst.seconds, 3))
    finally:
        cleanup(node, src, dst, dirs=[node.base / f"{tag}-{d}" for d in ("img0", "w0", "img", "w", "w2")])

