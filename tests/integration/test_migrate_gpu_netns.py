"""The GPU rig's two-node layout on simulated GPU nodes, as bench/gpu_migration.py runs it on the GPU
machine: each node's container joins its node's network namespace by path (tests/gpu/rig.py bundles:
the host's directories bound read-only, /data from the host), the source in A, the restored copy in
B, so that the frozen source and the copy never share abstract unix sockets (the workload holds a
listening one; in one namespace the restore failed with "Can't bind ... Address already in use").
`migrt migrate` in A, `migrt receive --restore` in B; runc and CRIU are real, the GPU is the
simulated one (migrt/gpu/fakenode.py), whose checkpoint makes the workload map and fill its "host
copy of the GPU memory" as the driver does (host_copy).

Lazy: the copy runs in B while the source stays frozen serving its pages; the host copy is recorded
as the process's gpu_backing, the filler fetches it first (the rest paced), the GPU restore starts
once it is in, the rest of the memory arrives after it. Stop-and-copy: with the rig's CRIU
configuration file (`network-lock skip`, passed by runc from the org.criu.config annotation, as on
a GPU machine without xt_mark). Both: every byte identical, the copy's network namespace is B's.
(The real driver's side: bench/gpu_migration.py --modes "copy lazy" on the GPU machine.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.gpu import rig
from tests.helpers.twohosts import ADDR_B, in_ns, lazy_pipe_limit, two_hosts
from tests.integration.conftest import CLI
from tests.integration.test_migrate_gpu import UA, UB, Receiver, _env, init_pid, sim_nodes

pytestmark = pytest.mark.integration
PYTHON = "/usr/bin/python3"
WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_workload.py")
DATA_MIB, COPY_MIB = 48, 8
SOCKET = "migrt-netns-test"  # the same abstract name in the source and its copy


@pytest.fixture(scope="module")
def hosts(stack):
    with two_hosts("gnet") as h:
        yield h


@pytest.fixture(scope="module")
def needed():
    return rig.probe(PYTHON)["paths"]


@pytest.fixture
def nodes(stack, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(WORKLOAD, data / "workload.py")
    for out in sim_nodes(tmp_path, checkpoint_signal=10, checkpoint_ack="/tmp/gpu-copy"):
        out["data"] = data
        yield out


def bundle(nodes, needed, name: str, args: list[str], netns: str, gpu: str, criu_config: str | None) -> str:
    return rig.make_bundle(str(nodes["base"] / name), args=args, data_dir=str(nodes["data"]), needed=needed,
                           gpu_minors=None, env=["PATH=/usr/bin:/bin", nodes["marker"], f"NVIDIA_VISIBLE_DEVICES={gpu}"],
                           netns=netns, criu_config=criu_config)


def read(nodes, name: str) -> dict | None:
    try:
        return json.loads((nodes["data"] / name).read_text())
    except (OSError, ValueError):
        return None


def wait_for(fn, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if v := fn():
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start_source(nodes, needed, hosts, criu_config: str | None) -> str:
    cid = f"gnet-{uuid.uuid4().hex[:6]}"
    path = bundle(nodes, needed, f"src-{cid}", [PYTHON, "/data/workload.py", str(DATA_MIB), str(COPY_MIB), SOCKET],
                  hosts["a"], UA, criu_config)
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    try:  # pipes as stdio, as containerd's shim gives (CRIU keeps them external)
        res = subprocess.run(["runc", "--root", nodes["a"]["root"], "run", "-d", "--bundle", path, cid], stdin=r_in,
                             stdout=w_out, stderr=w_out, timeout=60)
    finally:
        for fd in (r_in, w_in, w_out):
            os.close(fd)
    nodes["source_out"] = r_out
    assert res.returncode == 0
    wait_for(lambda: read(nodes, "ready.json"), 60, "the workload's start")
    return cid


def netns_inode(path: str) -> int:
    return os.stat(path).st_ino


def migrate(nodes, needed, hosts, port: int, *, lazy: bool, criu_config: str | None, receiver_env: dict):
    cid = start_source(nodes, needed, hosts, criu_config)
    ready = read(nodes, "ready.json")
    target = bundle(nodes, needed, f"dst-{cid}", ["sh", "-c", "echo fresh; exit 3"], hosts["b"], UB, criu_config)
    recv = Receiver(nodes, hosts, port, "--restore", target, "--root", nodes["b"]["root"],
                    "--container-id", f"{cid}-b", "--output", str(nodes["base"] / "target.out"), env=receiver_env)
    try:
        argv = in_ns(hosts["a"], CLI, "migrate", cid, "--to", f"{ADDR_B}:{port}", "--root", nodes["a"]["root"],
                     "--json", *(["--lazy"] if lazy else []))
        res = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=_env(nodes["a"]))
        assert res.returncode == 0, res.stderr
        assert recv.proc.wait(60) == 0
    finally:
        recv.stop()
    os.close(nodes.pop("source_out"))
    data = json.loads(res.stdout)
    assert data["restored"] and data["gpu"]["pairs"] == [{"old": UA, "new": UB}]
    assert subprocess.run(["runc", "--root", nodes["a"]["root"], "state", cid], capture_output=True).returncode != 0
    # the copy runs in B's network namespace (the source ran in A's), with every byte as it was
    pid = init_pid(nodes["b"]["root"], f"{cid}-b")
    assert netns_inode(f"/proc/{pid}/ns/net") == netns_inode(f"/run/netns/{hosts['b']}")
    assert netns_inode(f"/run/netns/{hosts['a']}") != netns_inode(f"/run/netns/{hosts['b']}")
    count = read(nodes, "status.json")["count"]
    wait_for(lambda: (s := read(nodes, "status.json")) and s["count"] > count + 2, 30, "the copy counting on")
    (nodes["data"] / "verify-1").write_text("")
    result = wait_for(lambda: read(nodes, "result-1.json"), 30, "the copy's hashes")
    copy = read(nodes, "copy.json")
    assert result == {"sha256": ready["sha256"], "copy": copy["sha256"], "socket": SOCKET}
    return data, recv.results()[0], copy, pid


def test_lazy_gpu_migration_with_a_network_namespace_per_node_fetches_the_gpu_copy_first(nodes, needed, hosts):
    # the background copy paced (16 MiB/s): the GPU restore starting only once ALL memory is in would
    # leave nothing for after the restore; the order says it went once the host copy was in
    with lazy_pipe_limit():
        data, rec, copy, pid = migrate(nodes, needed, hosts, 7941, lazy=True, criu_config=None,
                                       receiver_env=_env(nodes["b"], MIGRT_FILL_PACE_MIBS="16"))
    assert data["mode"] == "lazy" and data["pages"]["bytes"] >= (DATA_MIB + COPY_MIB) << 20
    restore = rec["timings"]["restore"]
    [g] = restore["gpu_restores"]
    assert g["vpid"] == 1 and g["waited_for"] == "gpu_backing", restore
    # the host copy (8 MiB) was in long before the rest (48 MiB and the interpreter's heap at 16 MiB/s)
    assert rec["timings"]["pages_s"] > 1.0, rec["timings"]
    assert g["memory_in_s"] <= g["gpu_restore_start_s"]
    p = json.loads(open(nodes["b"]["gpu"]).read())["processes"][str(pid)]
    assert p["state"] == "running" and p["gpu"] == UB


def test_stop_and_copy_with_a_network_namespace_per_node_and_the_rig_s_criu_config(nodes, needed, hosts):
    conf, said = rig.criu_config_file(str(nodes["base"]), force_skip=True)
    assert said.startswith("skip")
    data, rec, copy, _ = migrate(nodes, needed, hosts, 7942, lazy=False, criu_config=conf,
                                 receiver_env=_env(nodes["b"]))
    assert data["mode"] == "stop-and-copy"
    ins = json.loads(subprocess.run([CLI, "inspect", data["name"], "--json"], capture_output=True, text=True,
                                    env=_env(nodes["b"])).stdout)
    [proc] = ins["manifest"]["gpu"]["processes"]
    # the host copy the driver (here: the workload) made during the GPU checkpoint, recorded for the restore
    assert any(a <= copy["address"] and copy["address"] + copy["bytes"] <= b for a, b in proc["gpu_backing"])
    # runc handed CRIU the rig's configuration file (org.criu.config) on the dump
    dump_log = os.path.join(nodes["b"]["store"], data["name"], "logs", "dump.log")
    assert f"Would overwrite RPC settings with values from {conf}" in open(dump_log).read()
