"""`migrt migrate` of a container with CUDA processes, between two "hosts" in network namespaces, on
simulated GPU nodes (MIGRT_FAKE_GPU, migrt/gpu/fakenode.py): host A's GPU and host B's GPU have
different UUIDs, the busybox counter's processes carry the fake's CUDA marker, runc and CRIU are
real. Every failure point: the receiver's GPU preflight refuses (nothing frozen, GPU never locked),
the transfer is cut (the receiver is killed), the GPU restore on the target fails; each time the
source runs on with its GPU state restored and unlocked, and the target keeps nothing. And the
success, stop-and-copy and lazy: the counter continues on host B with its GPU state remapped onto B's
GPU; the source is gone.
(The real driver's side runs on the GPU machine: tests/gpu/test_gpu_migrate.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from migrt.gpu import fakenode
from tests.helpers import migration
from tests.helpers.bundles import make_bundle
from tests.helpers.twohosts import ADDR_B, in_ns, lazy_pipe_limit, two_hosts
from tests.integration.conftest import CLI
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration
GIB = 1 << 30
MODEL = "NVIDIA H200"
UA = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
UB = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


@pytest.fixture(scope="module")
def hosts(stack):
    with two_hosts() as h:
        yield h


@pytest.fixture
def nodes(stack, tmp_path):
    """Host A (source) and B (target): config, key, store, runc root and a simulated GPU node each."""
    yield from sim_nodes(tmp_path)


def sim_nodes(tmp_path, **gpu_extra):
    """The `nodes` fixture's body; gpu_extra: more fields of each node's simulated GPU (gpu.json).
    Removes what is left in both runc roots afterwards."""
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"
    secret = os.urandom(32).hex()
    out = {"base": tmp_path, "marker": marker}
    for node, gpu, state in (("a", UA, "running"), ("b", UB, "checkpointed")):
        d = tmp_path / node
        d.mkdir()
        (d / "key").write_text(secret + "\n")
        (d / "key").chmod(0o600)
        (d / "root").mkdir()
        (d / "config.yaml").write_text(
            f"runtime: runc\nstore: {d / 'store'}\nlog_file: {d / 'migrt.log'}\nlog_level: debug\n"
            f"migration_key_file: {d / 'key'}\n")
        (d / "gpu.json").write_text(json.dumps({
            "driver_version": "580.159", "marker": marker, "new_state": state, "process_bytes": 4 * GIB,
            "ns_init_only": True, **gpu_extra,
            "gpus": [{"uuid": gpu, "name": MODEL, "memory_total": 140 * GIB, "minor": 0}]}))
        out[node] = {"config": str(d / "config.yaml"), "store": str(d / "store"), "root": str(d / "root"),
                     "gpu": str(d / "gpu.json"), "dir": d}
    yield out
    for node in ("a", "b"):
        root = out[node]["root"]
        for cid in os.listdir(root):
            subprocess.run(["runc", "--root", root, "delete", "--force", cid], capture_output=True)


def _env(node: dict, **extra) -> dict:
    return {**os.environ, "MIGRT_CONFIG": node["config"], fakenode.ENV: node["gpu"], **extra}


def target_bundle(nodes, gpu: str = UB) -> str:
    """Host B's bundle gives the container B's GPU (as the NVIDIA toolkit's legacy mode says it)."""
    return make_bundle(str(nodes["base"] / "b" / f"bundle-{uuid.uuid4().hex[:6]}"), ["sh", "-c", "echo fresh; exit 3"],
                       env=[f"NVIDIA_VISIBLE_DEVICES={gpu}"])


class Counter(migration.Counter):
    def __init__(self, nodes) -> None:
        cid = f"gmig-{uuid.uuid4().hex[:6]}"
        # The shell, the container's init, is the one "CUDA process" (ns_init_only): what it forks holds no
        # GPU context, as a CUDA process's forks hold none.
        bundle = make_bundle(str(nodes["base"] / "a" / f"bundle-{cid}"), ["sh", "-c", COUNTER],
                             env=[nodes["marker"], f"NVIDIA_VISIBLE_DEVICES={UA}"])
        super().__init__(nodes["a"]["root"], bundle, cid)
        assert len(self.read_for(1.2)) >= 3


class Receiver(migration.Receiver):
    """`migrt receive --once` on host B, seeing host B's simulated GPU."""

    def __init__(self, nodes, hosts, port: int, *args: str, env: dict | None = None) -> None:
        super().__init__(nodes, hosts, port, *args, env=env or _env(nodes["b"]))


def migrate(nodes, hosts, port: int, cid: str) -> subprocess.CompletedProcess:
    argv = in_ns(hosts["a"], CLI, "migrate", cid, "--to", f"{ADDR_B}:{port}", "--root", nodes["a"]["root"], "--json")
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=_env(nodes["a"]))


def driver(path: str) -> dict:
    return fakenode.read(path)


def states_of(path: str, pid: int) -> str | None:
    with fakenode.locked(path) as d:
        fakenode.discover(d)
        p = d["processes"].get(str(pid))
        return p["state"] if p else None


def init_pid(root: str, cid: str) -> int:
    return json.loads(subprocess.run(["runc", "--root", root, "state", cid], capture_output=True, text=True,
                                     check=True).stdout)["pid"]


def target_store(nodes) -> list[str]:
    store = nodes["b"]["store"]
    return sorted(e for e in os.listdir(store) if not e.startswith(".")) if os.path.isdir(store) else []


def assert_source_back(nodes, src: Counter, err: str) -> None:
    assert "resumed on their GPU" in err, err
    assert src.status() == "running"
    pid = init_pid(src.root, src.cid)
    assert states_of(nodes["a"]["gpu"], pid) == "running"  # restored and unlocked on its own GPU
    calls = [c[0] for c in driver(nodes["a"]["gpu"])["calls"] if c[0] != "state"]
    assert calls[:1] == ["lock"] and "restore" in calls and calls[-1] == "unlock", calls
    n = len(parse_ticks(src.buf.decode()))
    after = src.read_for(1.0)
    assert len(after) > n and after[-1][1] == after[-1][2]  # counting on, data intact


def test_gpu_container_moves_to_the_other_host_and_gpu(nodes, hosts):
    src = Counter(nodes)
    out = nodes["base"] / "target.out"
    recv = Receiver(nodes, hosts, 7931, "--restore", target_bundle(nodes), "--root", nodes["b"]["root"],
                    "--container-id", f"{src.cid}-b", "--output", str(out))
    try:
        res = migrate(nodes, hosts, 7931, src.cid)
        assert res.returncode == 0, res.stderr
        assert recv.proc.wait(60) == 0
    finally:
        recv.stop()
    data = json.loads(res.stdout)
    before = src.read_for(0.3)
    src.close()
    assert src.status() is None  # the source is gone (and with it its GPU memory)
    assert data["restored"] and data["gpu"]["pairs"] == [{"old": UA, "new": UB}]
    assert data["gpu"]["gpus"][0]["name"] == MODEL and data["phases"]["gpu_checkpoint_s"] >= 0
    rec = recv.results()[0]
    assert rec["restored"] and rec["gpu"]["pairs"] == [{"old": UA, "new": UB}]
    assert "gpu_restore_s" in rec["timings"]["restore"]
    pid = init_pid(nodes["b"]["root"], f"{src.cid}-b")
    procs_b = driver(nodes["b"]["gpu"])["processes"]
    assert procs_b[str(pid)]["state"] == "running" and procs_b[str(pid)]["gpu"] == UB
    assert procs_b[str(pid)]["remap"] == [[UA, UB]]
    deadline = time.monotonic() + 10
    while len(parse_ticks(out.read_text() if out.exists() else "")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = parse_ticks(out.read_text())
    assert after and after[0][0] == before[-1][0] + 1 and all(t[2] == before[-1][1] for t in after)
    ins = json.loads(subprocess.run([CLI, "inspect", data["name"], "--json"], capture_output=True, text=True,
                                    env=_env(nodes["b"])).stdout)
    assert ins["manifest"]["gpu"]["gpus"][0]["uuid"] == UA


def test_preflight_refusal_freezes_nothing_and_never_locks_the_gpu(nodes, hosts):
    with fakenode.locked(nodes["b"]["gpu"]) as d:
        d["gpus"][0]["memory_total"] = 2 * GIB  # the target GPU is too small
    src = Counter(nodes)
    recv = Receiver(nodes, hosts, 7932, "--restore", target_bundle(nodes), "--root", nodes["b"]["root"])
    try:
        res = migrate(nodes, hosts, 7932, src.cid)
        recv.proc.wait(60)
    finally:
        recv.stop()
    assert res.returncode == 8, res.stderr
    assert f"GPU {UB} has 2.0 GiB free" in res.stderr
    assert driver(nodes["a"]["gpu"])["calls"] == [] or \
        {c[0] for c in driver(nodes["a"]["gpu"])["calls"]} == {"state"}  # never locked
    assert src.status() == "running" and target_store(nodes) == []
    src.close()


def test_target_without_gpus_named_is_refused_before_the_freeze(nodes, hosts):
    src = Counter(nodes)
    bundle = make_bundle(str(nodes["base"] / "b" / "plain"), ["sh", "-c", "exit 3"])  # no GPU given
    recv = Receiver(nodes, hosts, 7933, "--restore", bundle, "--root", nodes["b"]["root"])
    try:
        res = migrate(nodes, hosts, 7933, src.cid)
    finally:
        recv.stop()
    assert res.returncode == 8 and "does not say which GPUs" in res.stderr, res.stderr
    assert src.status() == "running" and not driver(nodes["a"]["gpu"])["calls"]
    src.close()


def test_transfer_cut_resumes_the_source_on_its_gpu(nodes, hosts):
    src = Counter(nodes)
    recv = Receiver(nodes, hosts, 7934, "--restore", target_bundle(nodes), "--root", nodes["b"]["root"],
                    env=_env(nodes["b"], MIGRT_FAULT="receive:file:kill"))
    try:
        res = migrate(nodes, hosts, 7934, src.cid)
        assert recv.proc.wait(60) == -signal.SIGKILL
    finally:
        recv.stop()
    assert res.returncode != 0
    assert_source_back(nodes, src, res.stderr)
    assert target_store(nodes) == []
    src.close()


def test_gpu_restore_failing_on_the_target_resumes_the_source(nodes, hosts):
    with fakenode.locked(nodes["b"]["gpu"]) as d:
        d["fail"].append({"call": "restore", "message": "CUDA_ERROR_OUT_OF_MEMORY (injected)"})
    src = Counter(nodes)
    recv = Receiver(nodes, hosts, 7935, "--restore", target_bundle(nodes), "--root", nodes["b"]["root"],
                    "--container-id", f"{src.cid}-b")
    try:
        res = migrate(nodes, hosts, 7935, src.cid)
        recv.proc.wait(60)
    finally:
        recv.stop()
    assert res.returncode == 5, res.stderr
    assert "OUT_OF_MEMORY" in res.stderr and "the target removed" in res.stderr
    assert_source_back(nodes, src, res.stderr)
    assert target_store(nodes) == []  # the target removed what it received
    assert not os.path.exists(os.path.join(nodes["b"]["root"], f"{src.cid}-b"))  # and its half-restored container
    src.close()


@pytest.mark.parametrize("mode, port", [("lazy", 7936), ("direct", 7938)])
def test_lazy_migration_moves_the_gpu_state_too(nodes, hosts, mode, port):
    """Lazy, and direct (the same path, the target's tree held until every page is in: issue 18)."""
    src = Counter(nodes)
    out = nodes["base"] / f"target-{mode}.out"
    with lazy_pipe_limit():
        recv = Receiver(nodes, hosts, port, "--restore", target_bundle(nodes), "--root", nodes["b"]["root"],
                        "--container-id", f"{src.cid}-b", "--output", str(out))
        try:
            argv = in_ns(hosts["a"], CLI, "migrate", src.cid, "--to", f"{ADDR_B}:{port}", "--root", nodes["a"]["root"],
                         f"--{mode}", "--json")
            res = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=_env(nodes["a"]))
            assert res.returncode == 0, res.stderr
            assert recv.proc.wait(60) == 0
        finally:
            recv.stop()
    data = json.loads(res.stdout)
    before = src.read_for(0.3)
    src.close()
    assert data["mode"] == mode and data["restored"] and src.status() is None
    assert data["gpu"]["pairs"] == [{"old": UA, "new": UB}] and data["phases"]["gpu_checkpoint_s"] >= 0
    pid = init_pid(nodes["b"]["root"], f"{src.cid}-b")
    p = driver(nodes["b"]["gpu"])["processes"][str(pid)]
    assert p["state"] == "running" and p["gpu"] == UB and p["remap"] == [[UA, UB]]
    deadline = time.monotonic() + 10
    while len(parse_ticks(out.read_text() if out.exists() else "")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = parse_ticks(out.read_text())
    assert after and after[0][0] == before[-1][0] + 1 and all(t[2] == before[-1][1] for t in after)


def test_migrate_killed_during_the_gpu_checkpoint_its_guard_brings_the_gpu_state_back(nodes, hosts):
    src = Counter(nodes)
    with fakenode.locked(nodes["a"]["gpu"]) as d:  # SIGKILL of `migrt migrate` inside the driver's checkpoint
        d["fail"].append({"call": "checkpoint", "crash": True})
    recv = Receiver(nodes, hosts, 7937, "--restore", target_bundle(nodes), "--root", nodes["b"]["root"])
    try:
        res = migrate(nodes, hosts, 7937, src.cid)
    finally:
        recv.stop()
    assert res.returncode == -signal.SIGKILL, res.stderr
    pid = init_pid(src.root, src.cid)
    deadline = time.monotonic() + 30  # the guard acts once its owner is gone
    while states_of(nodes["a"]["gpu"], pid) != "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert states_of(nodes["a"]["gpu"], pid) == "running"
    assert src.status() == "running"
    n = len(parse_ticks(src.buf.decode()))
    assert len(src.read_for(1.0)) > n
    assert target_store(nodes) == []
    src.close()
