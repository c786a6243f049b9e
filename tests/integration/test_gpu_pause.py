"""GPU release on pause through migrt-runc with the real runc: a busybox container whose processes
carry the simulated GPU node's CUDA marker (MIGRT_FAKE_GPU, migrt/gpu/fakenode.py), created with the
annotation migrt.io/gpu-release-on-pause=true. `pause` suspends its GPU state before the cgroup
freeze, `resume` restores it after the thaw; a container without the annotation passes straight
through. (The real driver's side runs on the GPU machine: tests/gpu/test_gpu_preempt.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from migrt.gpu import fakenode
from migrt.runtime.markers import GPU_RELEASE_MARKER
from tests.helpers.bundles import make_bundle
from tests.integration.conftest import SHIM, run_cli
from tests.integration.test_runc import Piped, _state
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration
GIB = 1 << 30
U0 = "GPU-00000000-0000-0000-0000-0000000000aa"


@pytest.fixture
def fake_gpu(stack, migrt_config, tmp_path, monkeypatch):
    path = tmp_path / "fake-gpu.json"
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"  # this test's containers only
    path.write_text(json.dumps({"driver_version": "580.159", "process_bytes": 4 * GIB, "marker": marker, "ns_init_only": True,
                                "gpus": [{"uuid": U0, "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GIB}]}))
    monkeypatch.setenv(fakenode.ENV, str(path))
    return path


@pytest.fixture
def runc_root(stack, migrt_config, tmp_path):
    root = tmp_path / "runc-root"
    root.mkdir()
    yield str(root)
    for cid in os.listdir(root):
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid], capture_output=True)


def shim(root: str, bundle: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SHIM, "--root", root, "--log", os.path.join(bundle, "log.json"), "--log-format", "json",
                           *args], capture_output=True, timeout=120)


def start(root: str, tmp_path, name: str, fake_gpu, *, annotated: bool) -> tuple[str, str, Piped]:
    marker = json.loads(fake_gpu.read_text())["marker"]
    cid = f"{name}-{uuid.uuid4().hex[:6]}"
    ann = {"migrt.io/gpu-release-on-pause": "true"} if annotated else None
    bundle = make_bundle(str(tmp_path / cid), ["sh", "-c", COUNTER], env=[marker], annotations=ann)
    p = Piped([SHIM, "--root", root, "--log", os.path.join(bundle, "log.json"), "--log-format", "json", "create",
               "--bundle", bundle, "--pid-file", os.path.join(bundle, "init.pid"), cid], bundle)
    assert p.rc == 0, open(os.path.join(bundle, "log.json")).read() if os.path.exists(os.path.join(bundle, "log.json")) else ""
    assert shim(root, bundle, "start", cid).returncode == 0
    assert len(parse_ticks(p.read_for(1.0))) >= 2
    return cid, bundle, p


def driver(path) -> dict:
    with fakenode.locked(str(path)) as d:
        fakenode.discover(d)
        return json.loads(json.dumps(d))


def states(path, root_or_pid, cid: str | None = None):
    """The driver state of a container's init ({state}, by runc root and id), or of a pid (state)."""
    pid = _state(root_or_pid, cid)["pid"] if cid else root_or_pid
    procs = driver(path)["processes"]
    found = {p["state"] for k, p in procs.items() if k == str(pid)}
    return found if cid else next(iter(found), None)


def test_pause_releases_the_gpu_and_resume_brings_it_back(runc_root, fake_gpu, tmp_path):
    cid, bundle, p = start(runc_root, tmp_path, "gpu-pause", fake_gpu, annotated=True)
    try:
        assert os.path.isfile(os.path.join(runc_root, cid, GPU_RELEASE_MARKER))
        assert states(fake_gpu, runc_root, cid) == {"running"}
        r = shim(runc_root, bundle, "pause", cid)
        assert r.returncode == 0, open(os.path.join(bundle, "log.json")).read()
        assert _state(runc_root, cid)["status"] == "paused"
        assert states(fake_gpu, runc_root, cid) == {"checkpointed"}
        calls = [c[0] for c in driver(fake_gpu)["calls"] if c[0] != "state"]
        n = len(calls) // 2  # the shell: the container's init is its one CUDA process
        assert n >= 1 and calls == ["lock"] * n + ["checkpoint"] * n  # then the freeze
        st = json.loads(run_cli("gpu", "status", cid, "--root", runc_root, "--json").stdout)
        assert st[0]["by"] == "pause" and st[0]["gpus"] == [U0]
        frozen_at = len(parse_ticks(p.read_for(0.3)))
        assert len(parse_ticks(p.read_for(0.8))) == frozen_at  # frozen: no tick
        r = shim(runc_root, bundle, "resume", cid)
        assert r.returncode == 0, open(os.path.join(bundle, "log.json")).read()
        assert _state(runc_root, cid)["status"] == "running"
        assert states(fake_gpu, runc_root, cid) == {"running"}
        after = [c[0] for c in driver(fake_gpu)["calls"] if c[0] != "state"][2 * n:]
        m = after.count("restore")  # a `sleep` that ended right after the thaw took its GPU state along
        assert m >= 1 and after == ["restore"] * m + ["unlock"] * m
        ticks = parse_ticks(p.read_for(1.0))
        assert len(ticks) > frozen_at and all(t[1] == t[2] for t in ticks)  # goes on, its memory intact
        assert json.loads(run_cli("gpu", "status", "--root", runc_root, "--json").stdout) == []
    finally:
        p.close()


def test_without_the_annotation_pause_and_resume_pass_through(runc_root, fake_gpu, tmp_path):
    cid, bundle, p = start(runc_root, tmp_path, "plain", fake_gpu, annotated=False)
    try:
        assert not os.path.exists(os.path.join(runc_root, cid, GPU_RELEASE_MARKER))
        assert shim(runc_root, bundle, "pause", cid).returncode == 0
        assert _state(runc_root, cid)["status"] == "paused"
        assert shim(runc_root, bundle, "resume", cid).returncode == 0
        assert _state(runc_root, cid)["status"] == "running"
        assert [c for c in driver(fake_gpu)["calls"]] == []  # the GPU was never touched
    finally:
        p.close()


def test_failed_gpu_resume_leaves_the_container_paused_and_suspended(runc_root, fake_gpu, tmp_path):
    cid, bundle, p = start(runc_root, tmp_path, "gpu-fail", fake_gpu, annotated=True)
    try:
        assert shim(runc_root, bundle, "pause", cid).returncode == 0
        with fakenode.locked(str(fake_gpu)) as d:
            d["fail"].append({"call": "restore", "message": "CUDA_ERROR_OUT_OF_MEMORY (injected)"})
        r = shim(runc_root, bundle, "resume", cid)
        assert r.returncode == 5
        msg = json.loads(open(os.path.join(bundle, "log.json")).read().splitlines()[-1])["msg"]
        assert "paused again with its GPU state in host memory" in msg and "OUT_OF_MEMORY" in msg
        assert _state(runc_root, cid)["status"] == "paused"
        assert states(fake_gpu, runc_root, cid) == {"checkpointed"}
        # the cause gone, containerd's next resume completes it
        assert shim(runc_root, bundle, "resume", cid).returncode == 0
        assert _state(runc_root, cid)["status"] == "running" and states(fake_gpu, runc_root, cid) == {"running"}
    finally:
        p.close()


def test_cli_suspend_resume_of_a_running_container(runc_root, fake_gpu, tmp_path):
    cid, bundle, p = start(runc_root, tmp_path, "gpu-cli", fake_gpu, annotated=False)
    try:
        out = json.loads(run_cli("gpu", "suspend", cid, "--root", runc_root, "--json").stdout)
        assert out["status"] == "suspended" and out["gpus"] == [U0] and out["gpu_memory_bytes"] == 4 * GIB * len(out["processes"])
        assert states(fake_gpu, runc_root, cid) == {"checkpointed"}
        assert _state(runc_root, cid)["status"] == "running"  # the processes stay alive (not frozen)
        # a checkpoint must wait: the GPU state sits in host memory, outside what a restore would resume
        r = run_cli("checkpoint", cid, "--root", runc_root, check=False)
        assert r.returncode == 6 and "is GPU-suspended" in r.stderr, r.stderr
        r = shim(runc_root, bundle, "checkpoint", "--image-path", os.path.join(bundle, "ck"), cid)
        assert r.returncode == 6 and "is GPU-suspended" in open(os.path.join(bundle, "log.json")).read()
        assert _state(runc_root, cid)["status"] == "running"
        # a pause now leaves the suspend alone (someone else made it), and so does the resume
        assert shim(runc_root, bundle, "pause", cid).returncode == 0
        assert shim(runc_root, bundle, "resume", cid).returncode == 0
        assert states(fake_gpu, runc_root, cid) == {"checkpointed"}
        done = json.loads(run_cli("gpu", "resume", cid, "--root", runc_root, "--json").stdout)
        assert done["gpus"] == [U0] and states(fake_gpu, runc_root, cid) == {"running"}
        # a frozen container cannot be locked: refused, nothing touched
        assert shim(runc_root, bundle, "pause", cid).returncode == 0
        r = run_cli("gpu", "suspend", cid, "--root", runc_root, check=False)
        assert r.returncode == 6 and "is paused" in r.stderr, r.stderr
        assert states(fake_gpu, runc_root, cid) == {"running"}
        assert shim(runc_root, bundle, "resume", cid).returncode == 0
        # delete removes migrt's record with runc's state directory
        run_cli("gpu", "suspend", cid, "--root", runc_root)
        subprocess.run(["runc", "--root", runc_root, "delete", "--force", cid], check=True)
        assert not os.path.exists(os.path.join(runc_root, cid))
        assert json.loads(run_cli("gpu", "status", "--root", runc_root, "--json").stdout) == []
    finally:
        p.close()


# -- through containerd, unmodified: `ctr task pause` / `ctr task resume` ----------------------------
@pytest.fixture(scope="module")
def gpu_containerd(stack, migrt_config, tmp_path_factory):
    """A private containerd whose shims (and so migrt-runc) see a simulated GPU node."""
    from tests.helpers.containerd import Containerd

    base = tmp_path_factory.mktemp("ctd-gpu")
    fake = base / "fake-gpu.json"
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"
    fake.write_text(json.dumps({"driver_version": "580.159", "process_bytes": 4 * GIB, "marker": marker, "ns_init_only": True,
                                "gpus": [{"uuid": U0, "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GIB}]}))
    old = os.environ.get(fakenode.ENV)
    os.environ[fakenode.ENV] = str(fake)  # containerd's environment, passed on to its shims and runtimes
    ctd = None
    try:
        ctd = Containerd(str(base / "ctd"), namespace=f"migrt-gpu-{uuid.uuid4().hex[:6]}").start()
        ctd.image = ctd.import_busybox()
        ctd.fake, ctd.marker = fake, marker
        yield ctd
    finally:
        if old is None:
            os.environ.pop(fakenode.ENV, None)
        else:
            os.environ[fakenode.ENV] = old
        if ctd:
            ctd.cleanup_containers()
            ctd.stop()


def _task(ctd, cid: str) -> tuple[int, str]:
    for line in ctd.ctr("task", "ls").stdout.splitlines()[1:]:
        parts = line.split()
        if parts and parts[0] == cid:
            return int(parts[1]), parts[2]
    raise AssertionError(f"task {cid} not listed")


@pytest.mark.parametrize("how", [("--annotation", "migrt.io/gpu-release-on-pause=true"),
                                 ("--env", "MIGRT_GPU_RELEASE_ON_PAUSE=1"), None])
def test_ctr_task_pause_resume(gpu_containerd, how):
    ctd = gpu_containerd
    cid = f"ctr-gpu-{uuid.uuid4().hex[:6]}"
    counter = COUNTER  # its init, the shell, is the one CUDA process (ns_init_only)
    ctd.ctr("run", "-d", "--runc-binary", SHIM, "--env", ctd.marker, *(how or ()), ctd.image, cid, "sh", "-c", counter)
    try:
        pid, status = _task(ctd, cid)
        assert status == "RUNNING" and states(ctd.fake, pid) == "running"
        n = len([c for c in driver(ctd.fake)["calls"] if c[1] == pid and c[0] != "state"])
        ctd.ctr("task", "pause", cid)
        assert _task(ctd, cid)[1] == "PAUSED"
        assert states(ctd.fake, pid) == ("checkpointed" if how else "running")
        ctd.ctr("task", "resume", cid)
        assert _task(ctd, cid)[1] == "RUNNING" and states(ctd.fake, pid) == "running"
        calls = [c[0] for c in driver(ctd.fake)["calls"] if c[1] == pid and c[0] != "state"][n:]
        assert calls == (["lock", "checkpoint", "restore", "unlock"] if how else [])
    finally:
        ctd.ctr("task", "kill", "-s", "KILL", cid, check=False)
        for _ in range(50):
            if ctd.ctr("task", "delete", cid, check=False).returncode == 0:
                break
            time.sleep(0.1)
        ctd.ctr("containers", "delete", cid, check=False)


def test_ctr_task_pause_refused_by_the_driver_keeps_the_task_running(gpu_containerd):
    ctd = gpu_containerd
    cid = f"ctr-gpu-{uuid.uuid4().hex[:6]}"
    counter = COUNTER
    ctd.ctr("run", "-d", "--runc-binary", SHIM, "--env", ctd.marker, "--annotation",
            "migrt.io/gpu-release-on-pause=true", ctd.image, cid, "sh", "-c", counter)
    try:
        pid, _ = _task(ctd, cid)
        with fakenode.locked(str(ctd.fake)) as d:
            d["fail"].append({"call": "lock", "pid": pid, "message": "CUDA_ERROR_TIMEOUT (injected)"})
        res = ctd.ctr("task", "pause", cid, check=False)
        assert res.returncode != 0 and "was not paused (it keeps running)" in res.stderr, res.stderr
        assert _task(ctd, cid)[1] == "RUNNING" and states(ctd.fake, pid) == "running"
    finally:
        ctd.ctr("task", "kill", "-s", "KILL", cid, check=False)
        for _ in range(50):
            if ctd.ctr("task", "delete", cid, check=False).returncode == 0:
                break
            time.sleep(0.1)
        ctd.ctr("containers", "delete", cid, check=False)
