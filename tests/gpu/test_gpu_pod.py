"""The pod-level pull (migration/podpull.py) of a pod of two containers, a PyTorch process with its data
on GPU 0 and a CPU sidecar, from "node" A to "node" B (network namespaces, tests/gpu/twonodes.py), lazily
as `migrt migrate --lazy` moves one container: B's app is given GPU 1 (where there is one of the same
model), and both must go on with identical data, the source gone and its GPU free.

No containerd runs on the GPU machine, so the harness plays kubelet and containerd with the same calls
they make: the source pod's containers are runc containers of node A's runc root whose bundles carry
the CRI annotations containerd writes (pod, namespace, sandbox id, container name, image), A's node
agent (`migrt serve`) finds them there; the new pod's containers are created one after the other by
`migrt-runc create` in B's namespace (containerd's call of the runtime), bundles carrying the CRI
annotations and the pod's `migrt.io/migrate-from=<A>/team-a/<pod>` and `migrt.io/migrate-pod` list.
Each create pulls its part (the first one makes the cut: the app's CUDA processes locked and
checkpointed by the driver, then both containers frozen), the app's part restored onto B's GPU (its
host copy first) and paused, the sidecar's held at CRIU's pre-resume, both thawed together at the
last create: the code path of a pod on Kubernetes, less kubelet and containerd.

Figures (results.jsonl; results.md's "pod downtime s", "app gap s", "sidecar gap s"): each container's
gap as the application sees it (its status file's longest time between two counts: the last tick on A
to the first on B; the slowest container's is the pod's downtime), the agent's downtime of each part
(from its own hand-over), when each create returned, when the last page was in, the checksums. The
app's part runs from its runc restore until its GPU restore has ended (the driver's restore needs
running threads; its CUDA calls wait until then), then is paused until the sidecar's part is in.
Size: the smallest of MIGRT_GPU_TEST_GBS.

    python -m tests.gpu.test_gpu_pod --simulate     the same orchestration on simulated GPU nodes
                                                    (tests/gpu/simnode.py), on a machine without a GPU
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu import harness, twonodes
from tests.gpu.harness import Container, Workload
from tests.gpu.test_gpu_migrate import _placed, hosts, target_gpu  # noqa: F401 - hosts: the fixture
from tests.helpers.twohosts import ADDR_A, ADDR_B, in_ns

pytestmark = pytest.mark.gpu
AGENT_PORT = 7070
IMAGES = {"app": "local/gpu-app:1", "side": "local/sidecar:1"}
SIDECAR = """import hashlib, json, os, sys, time
D = "/data"
blob = bytearray(os.urandom(int(sys.argv[1]) << 20))
def w(p, o):
    open(p + ".tmp", "w").write(json.dumps(o)); os.replace(p + ".tmp", p)
w(D + "/side.ready.json", {"checksum": hashlib.sha256(blob).hexdigest(), "pid": os.getpid()})
count = 0
while True:
    count += 1
    w(D + "/side.status.json", {"count": count, "t": time.time()})
    for e in os.listdir(D):
        if e.startswith("side.verify-"):
            w(D + "/side.result-" + e.rsplit("-", 1)[1] + ".json",
              {"checksum": hashlib.sha256(blob).hexdigest(), "count": count})
            os.unlink(D + "/" + e)
    time.sleep(0.1)
"""


def _pod_nodes(node, net: dict, base: Path) -> dict:
    """twonodes' A and B, each with its node agent's address, its runc root as the agent's, and both
    agents as migration peers."""
    nodes = twonodes.make(node, base)
    for name, addr in (("a", ADDR_A), ("b", ADDR_B)):
        with open(nodes[name]["config"], "a") as fh:
            fh.write(f"agent_listen: {addr}:{AGENT_PORT}\nruntime_roots: [{json.dumps(nodes[name]['root'])}]\n"
                     f"migrate_peers: {json.dumps([ADDR_A, ADDR_B])}\npod_pull_deadline: 300\n")
    return nodes


def _agent(node, net: dict, nodes: dict, side: str) -> tuple[subprocess.Popen, Path]:
    out = nodes[side]["dir"] / "agent.out"
    err = nodes[side]["dir"] / "agent.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(in_ns(net[side], node.migrt, "serve", "--json"), stdout=o, stderr=e,
                                env=nodes[side]["env"])
    harness.wait_for(lambda: b"listening on" in err.read_bytes() or proc.poll() is not None, 60, "migrt serve")
    assert proc.poll() is None, err.read_text()
    return proc, out


def _annotations(pod: str, sandbox: str, name: str, **extra: str) -> dict:
    """What containerd writes into a pod container's bundle (and the pod's own annotations)."""
    return {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": name,
            "io.kubernetes.cri.sandbox-name": pod, "io.kubernetes.cri.sandbox-namespace": "team-a",
            "io.kubernetes.cri.sandbox-id": sandbox, "io.kubernetes.cri.image-name": IMAGES[name], **extra}


def _bundles(node, placed: dict, tag: str, data: Path, pod: str, side: str, gpu: int, args: dict, **extra) -> dict:
    sandbox = uuid.uuid4().hex
    return {name: node.bundle(f"{tag}-{name}-{side}", args[name], data, [gpu] if name == "app" else [],
                              annotations=_annotations(pod, sandbox, name, **extra), **placed)
            for name in ("app", "side")}


@contextlib.contextmanager
def _pod_netns(prefix: str) -> Iterator[str]:
    """The new pod's own network namespace (its sandbox's, as on Kubernetes: not the node's), loopback
    up: the pod's hold drops TCP on its loopback (pods/netlock.py) while the node's pull goes on."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _status(root: str, cid: str) -> str | None:
    r = subprocess.run(["runc", "--root", root, "state", cid], capture_output=True, text=True)
    return json.loads(r.stdout)["status"] if r.returncode == 0 else None


def pod_pull(node, net: dict, *, simulated: bool = False) -> dict:
    """The whole case; returns the figures it records."""
    assert net["netns"], "a lazy pull needs the two nodes' network namespaces (iproute2's ip)"
    gb = min(harness.gbs())
    tag = f"gpod-{gb:g}".replace(".", "p")
    nodes = _pod_nodes(node, net, node.base / "gpod")
    data = node.data_dir(tag)
    (data / "sidecar.py").write_text(SIDECAR)
    pod, dst_gpu = f"trainer-{uuid.uuid4().hex[:4]}", target_gpu(node)
    cids = {n: f"{tag}-{n}-{uuid.uuid4().hex[:4]}" for n in ("app", "side")}
    agents = []
    with _pod_netns("gpod-b") as pod_ns:
        new = _bundles(node, {"netns": pod_ns, "criu_config": net["criu_config"]}, tag, data, f"{pod}-moved", "b",
                       dst_gpu, {"app": node.workload_args("fresh", "0"), "side": [node.python, "-c", "pass"]},
                       **{"migrt.io/migrate-from": f"{ADDR_A}/team-a/{pod}",
                          "migrt.io/migrate-pod": ",".join(f"{n}={i}" for n, i in IMAGES.items())})
        try:
            agents = [_agent(node, net, nodes, s) for s in ("a", "b")]
            ready = _source_pod(node, net, nodes, tag, data, pod, cids, gb)
            return _move(node, net, nodes, data, new, cids, ready, dst_gpu, gb, agents[0][1], simulated)
        finally:
            for proc, _ in agents:
                proc.terminate()
                proc.wait(30)
            for name in ("a", "b"):
                for cid in cids.values():
                    twonodes.remove(nodes[name]["root"], cid if name == "a" else f"{cid}-b")


def _source_pod(node, net: dict, nodes: dict, tag: str, data: Path, pod: str, cids: dict, gb: float) -> dict:
    """The pod on node A, created in kubelet's order (the app, then the sidecar), both counting: their
    ready files (the checksums)."""
    src = _bundles(node, _placed(net, "a"), tag, data, pod, "a", 0, {
        "app": node.workload_args("w", str(gb)), "side": [node.python, "/data/sidecar.py", "256"]},
        **{"migrt.io/migratable": "true"})
    root = nodes["a"]["root"]
    for name in ("app", "side"):
        c = Container(node, cids[name], ["runc", "--root", root, "create", "--bundle", src[name], cids[name]],
                      src[name], env=nodes["a"]["env"])
        assert c.rc == 0, c.output()
        subprocess.run(["runc", "--root", root, "start", cids[name]], check=True, env=node.env)
    app, side = Workload(data, "w"), Workload(data, "side")
    ready = {"app": app.ready(), "side": side.ready()}
    app.counting_past(3)
    side.counting_past(3)
    return ready


def _move(node, net: dict, nodes: dict, data: Path, new: dict, cids: dict, ready: dict, dst_gpu: int, gb: float,
          agent_out: Path, simulated: bool) -> dict:
    gaps = {n: twonodes.Progress(data / f"{f}.status.json") for n, f in (("app", "w"), ("side", "side"))}
    root_a, root_b = nodes["a"]["root"], nodes["b"]["root"]
    created, moved = {}, {n: f"{cid}-b" for n, cid in cids.items()}  # (ids apart: one cgroup tree)
    t0 = time.monotonic()
    for name in ("app", "side"):  # containerd's creates, one after the other: each pulls its part
        c = Container(node, moved[name], in_ns(net["b"], node.shim, "--root", root_b, "create", "--bundle",
                                               new[name], moved[name]), new[name], env=nodes["b"]["env"])
        created[name] = round(time.monotonic() - t0, 3)
        assert c.rc == 0, f"{c.output()}\n{node.tail_logs()}"
        if name == "app":
            assert _status(root_b, moved["app"]) == "paused"  # held until the sidecar's part is in
    harness.wait_for(lambda: all(_status(root_b, c) == "running" for c in moved.values()), 60, "the pod released")
    harness.wait_for(lambda: all(_status(root_a, c) is None for c in cids.values()), 600,
                     "the source pod gone (every page across)")
    pages_done = round(time.monotonic() - t0, 3)
    app, side = Workload(data, "w"), Workload(data, "side")
    app.counting_past(app.status()["count"])
    side.counting_past(side.status()["count"])
    gap = {n: p.stop() for n, p in gaps.items()}
    check = {"app": app.verify(), "side": side.verify()}
    assert check["app"]["checksum"] == ready["app"]["checksum"] and check["app"]["gpu_count"] == check["app"]["count"]
    assert check["side"]["checksum"] == ready["side"]["checksum"]
    pid = json.loads(subprocess.run(["runc", "--root", root_b, "state", moved["app"]], capture_output=True, text=True,
                                    check=True).stdout)["pid"]
    if not simulated:
        assert harness.gpu_of_pid(int(pid)) == [node.gpus[dst_gpu].uuid]
    parts = {r["pod"]["part"]: r for r in map(json.loads, agent_out.read_text().splitlines()) if r.get("pod")}
    assert sorted(parts) == ["app", "side"] and all(r.get("error") is None for r in parts.values()), parts
    assert parts["app"]["gpu"]["pairs"] == [{"old": node.gpus[0].uuid, "new": node.gpus[dst_gpu].uuid}]
    figures = {"gb": gb, "processes": 1, "lazy": True, "same_gpu": dst_gpu == 0, "netns": net["netns"],
               "app_gap_s": gap["app"], "side_gap_s": gap["side"], "pod_downtime_s": max(g or 0 for g in gap.values()),
               "creates_returned_s": created, "pages_done_s": pages_done,
               "part_downtime_s": {n: r.get("downtime_s") for n, r in parts.items()},
               "gpu_checkpoint_s": (parts["app"].get("timings") or {}).get("gpu_checkpoint_s"),
               "app_checksum_intact": True, "side_checksum_intact": True, "simulated": simulated}
    node.record("pod-level pull: GPU app + CPU sidecar, lazy", **figures)
    return figures


def test_a_gpu_pod_moves_lazily_with_one_cut_onto_the_other_gpu(node, hosts):  # noqa: F811 - the fixture
    pod_pull(node, hosts)


def simulate() -> int:
    """The same case on simulated GPU nodes (no GPU): tests/gpu/simnode.py, the host's Python."""
    from tests.gpu import rig, simnode

    node = simnode.make(harness.base_dir())
    with twonodes.hosts("sgpod") as h:
        h = dict(h)
        h["criu_config"] = rig.criu_config_file(str(node.base))[0] if h["netns"] else None
        print(json.dumps(pod_pull(node, h, simulated=True), indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--simulate"]:
        sys.exit("usage: python -m tests.gpu.test_gpu_pod --simulate")
    sys.exit(simulate())
