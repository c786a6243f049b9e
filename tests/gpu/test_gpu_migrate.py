"""`migrt migrate` of a PyTorch container with its data on GPU 0, from "node" A to "node" B (network
namespaces, tests/gpu/twonodes.py) whose restore bundle gives the container GPU 1: it must continue on
GPU 1 with identical data; the source is gone and GPU 0 free. And a receiver whose GPU cannot hold
the data refuses before anything is frozen. Size: the smallest of MIGRT_GPU_TEST_GBS."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.gpu import harness, rig, twonodes
from tests.gpu.harness import Workload

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hosts(node):
    """The two nodes; with network namespaces, each node's container joins its node's namespace and
    the bundles name the rig's CRIU configuration (`network-lock skip` where CRIU's iptables lock
    cannot work: the GPU machines' kernels lack xt_mark), as bench/gpu_migration.py does."""
    with twonodes.hosts("mgpu") as h:
        h = dict(h)
        h["criu_config"] = rig.criu_config_file(str(node.base))[0] if h["netns"] else None
        yield h


def _placed(hosts, side: str) -> dict:
    """netns / criu_config arguments of a container on node `side` ("a" or "b")."""
    return {"netns": hosts[side], "criu_config": hosts["criu_config"]} if hosts["netns"] else {}


def target_gpu(node) -> int:
    return 1 if len(node.gpus) > 1 and node.gpus[1].name == node.gpus[0].name else 0


def test_pytorch_container_moves_to_the_node_with_the_other_gpu(node, hosts):
    gb = min(harness.gbs())
    nodes = twonodes.make(node, node.base / "mig")
    tag = f"gmig-{gb:g}".replace(".", "p")
    src, data = twonodes.start_source(node, nodes, tag, gb, gpu=0, **_placed(hosts, "a"))
    w = Workload(data, "w")
    dst_gpu = target_gpu(node)
    target_cid = f"{src.cid}-b"
    try:
        ready = w.ready()
        w.counting_past(3)
        bundle = node.bundle(f"{tag}-b", node.workload_args("fresh", "0"), data, [dst_gpu], **_placed(hosts, "b"))
        progress = twonodes.Progress(data / "w.status.json")
        out, rec, res = twonodes.migrate(node, hosts, nodes, src, bundle, 7951, target_cid=target_cid)
        app_gap = progress.stop()
        assert res.returncode == 0, f"{res.stderr}\n{node.tail_logs()}"
        assert out["restored"] and rec.get("restored"), rec
        pairs = out["gpu"]["pairs"]
        assert pairs == [{"old": node.gpus[0].uuid, "new": node.gpus[dst_gpu].uuid}]
        last = w.status()["count"]
        w.counting_past(last)
        check = w.verify()
        assert check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
        pid = int(json.loads(subprocess.run(["runc", "--root", nodes["b"]["root"], "state", target_cid],
                                            capture_output=True, text=True, check=True).stdout)["pid"])
        assert harness.gpu_of_pid(pid) == [node.gpus[dst_gpu].uuid]
        st = subprocess.run(["runc", "--root", nodes["a"]["root"], "state", src.cid], capture_output=True)
        assert st.returncode != 0  # the source is gone
        node.record("migrate to the node with the other GPU", gb=gb, processes=1,
                    same_gpu=dst_gpu == 0, netns=hosts["netns"], downtime_s=out["downtime_s"], app_gap_s=app_gap, total_s=out["total_s"],
                    sent_gib=round(out["bytes"] / (1 << 30), 2), gpu_checkpoint_s=out["phases"].get("gpu_checkpoint_s"),
                    dump_s=out["phases"].get("dump_s"), transfer_s=out["phases"].get("transfer_s"),
                    restore_s=out["phases"].get("restore_s"),
                    gpu_restore_s=(rec.get("timings", {}).get("restore") or {}).get("gpu_restore_s"))
    finally:
        twonodes.remove(nodes["a"]["root"], src.cid)
        twonodes.remove(nodes["b"]["root"], target_cid)


def test_receiver_without_room_on_its_gpu_refuses_before_the_freeze(node, hosts):
    gb = min(harness.gbs())
    nodes = twonodes.make(node, node.base / "mig-pf")
    tag = f"gmigpf-{gb:g}".replace(".", "p")
    src, data = twonodes.start_source(node, nodes, tag, gb, gpu=0, **_placed(hosts, "a"))
    w = Workload(data, "w")
    dst_gpu = target_gpu(node)
    hog = None
    try:
        w.ready()
        w.counting_past(3)
        from migrt.gpu import inventory

        free = inventory.take().by_uuid(node.gpus[dst_gpu].uuid).memory_free
        hog = subprocess.Popen([node.python, "-c", (
            "import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device=f'cuda:{sys.argv[2]}'); "
            "print('held', flush=True); time.sleep(600)"), str(free - int(gb * (1 << 30)) // 2), str(dst_gpu)],
            stdout=subprocess.PIPE, text=True, env=node.env)
        assert hog.stdout.readline().strip() == "held"
        bundle = node.bundle(f"{tag}-b", node.workload_args("fresh", "0"), data, [dst_gpu], **_placed(hosts, "b"))
        t0 = time.monotonic()
        out, rec, res = twonodes.migrate(node, hosts, nodes, src, bundle, 7952, target_cid=f"{src.cid}-b")
        refused_after = time.monotonic() - t0
        assert res.returncode == 8, res.stderr
        assert "free" in res.stderr and node.gpus[dst_gpu].uuid in res.stderr
        st = json.loads(subprocess.run(["runc", "--root", nodes["a"]["root"], "state", src.cid], capture_output=True,
                                       text=True, check=True).stdout)
        assert st["status"] == "running"
        n = w.status()["count"]
        w.counting_past(n)  # never stopped
        node.record("GPU migration refused by the target's preflight", gb=gb, processes=1,
                    refused_after_s=round(refused_after, 3))
    finally:
        if hog:
            hog.kill()
            hog.wait()
        twonodes.remove(nodes["a"]["root"], src.cid)
