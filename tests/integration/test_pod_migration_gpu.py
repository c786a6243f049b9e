"""Pod-to-pod live migration of a GPU container, on simulated GPU nodes (MIGRT_FAKE_GPU,
migrt/gpu/fakenode.py): the two CRI nodes of tests/helpers/podnodes.py, each node's containerd (so
its migrt-runc) and agent seeing its own fake GPU (node A: GPU UA, node B: GPU UB and a GPU of
another model). The workload is hashticker (its memory hashed with every tick), marked as the one
CUDA process; its pod's bundle is given its node's GPU the way the NVIDIA toolkit's legacy mode says
it (NVIDIA_VISIBLE_DEVICES).

The pull takes the GPU steps of `migrt migrate`: B's create preflights the offer against the NEW
bundle's GPUs before anything is frozen, A's agent locks and checkpoints the GPU state before the
dump, B restores it onto B's GPU (remapped UA -> UB) once the copy runs. A new bundle without a GPU,
or with a GPU of another model, fails the create before the source froze: the source's GPU was
never locked and the source ticks on. (The real driver's side: tests/gpu/, on the GPU machine.)"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from migrt.gpu import fakenode
from tests.helpers.cri import CriError
from tests.helpers.migration import assert_continues
from tests.helpers.podnodes import pod_nodes
from tests.helpers.twohosts import ADDR_A, lazy_pipe_limit
from tests.integration.test_cri_pagefill import BIN_DEST, bin_dir  # noqa: F401 - the workload's fixture
from tests.integration.test_migrate_gpu import MODEL, UA, UB
from tests.integration.test_pod_migration import DATA_MIB, MIGRATABLE, _ticks, _wait_ticks

pytestmark = pytest.mark.integration
GIB = 1 << 30
OTHER_MODEL = "NVIDIA A100-SXM4-80GB"
UO = "GPU-cccccccc-0000-0000-0000-000000000003"  # node B's GPU of another model


@pytest.fixture(scope="module")
def gnodes(cri_stack, cri_stubs, tmp_path_factory, bin_dir):  # noqa: F811
    base = tmp_path_factory.mktemp("gpupods")
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"
    gpus = {"a": [{"uuid": UA, "name": MODEL, "memory_total": 140 * GIB, "pci_bus_id": "00000000:18:00.0",
                   "minor": 0}],
            "b": [{"uuid": UB, "name": MODEL, "memory_total": 140 * GIB, "pci_bus_id": "00000000:18:00.0",
                   "minor": 0},
                  {"uuid": UO, "name": OTHER_MODEL, "memory_total": 80 * GIB, "pci_bus_id": "00000000:2a:00.0",
                   "minor": 1}]}
    files = {}
    for name, state in (("a", "running"), ("b", "checkpointed")):
        files[name] = str(base / f"gpu-{name}.json")
        with open(files[name], "w") as fh:
            json.dump({"driver_version": "580.159", "marker": marker, "new_state": state,
                       "process_bytes": 4 * GIB, "gpus": gpus[name]}, fh)
    env = {n: {fakenode.ENV: f} for n, f in files.items()}
    with lazy_pipe_limit(), pod_nodes(base / "nodes", cri_stubs, "migration_stall_timeout: 5\n", env=env) as n:
        for node in n.values():
            node.bin_dir = bin_dir
            node.gpu = files[node.name]
        n["marker"] = marker
        yield n


@pytest.fixture
def clean(gnodes):
    yield gnodes
    for name in ("a", "b"):
        gnodes[name].cri.cleanup()


def _app(node, pod: str, gpu: str | None, marker: str) -> str:
    key, _, value = marker.partition("=")  # the fake's CUDA marker: this process is a CUDA process
    env = {key: value}
    if gpu:
        env["NVIDIA_VISIBLE_DEVICES"] = gpu
    return node.cri.create_container(pod, "app", node.ctd.image, [f"{BIN_DEST}/hashticker", str(DATA_MIB)],
                                     env=env, mounts=[(node.bin_dir, BIN_DEST)])


def _source(nodes, tag: str) -> tuple[str, str, int]:
    """A GPU counter pod on node A: (pod name, container id, its host pid)."""
    a = nodes["a"]
    name = f"gpu-{tag}-{uuid.uuid4().hex[:4]}"
    pod = a.cri.run_pod(name, "team-a", annotations=MIGRATABLE)
    cid = _app(a, pod, UA, nodes["marker"])
    a.cri.start(cid)
    _wait_ticks(a, cid, 3)
    pid = _pid(a, cid)
    with fakenode.locked(a.gpu) as d:  # the driver knows it: a CUDA process running on A's GPU
        assert fakenode.entry(d, pid)["state"] == "running" and d["processes"][str(pid)]["gpu"] == UA
    return name, cid, pid


def _target(nodes, name: str, gpu: str | None) -> str:
    b = nodes["b"]
    pod = b.cri.run_pod(f"pulled-{uuid.uuid4().hex[:6]}", "team-a",
                        annotations={"migrt.io/migrate-from": f"{ADDR_A}/team-a/{name}/app"})
    return _app(b, pod, gpu, nodes["marker"])


def _pid(node, cid: str) -> int:
    return json.loads(subprocess.run(["runc", "--root", node.root, "state", cid], capture_output=True, text=True,
                                     check=True).stdout)["pid"]


def _calls(node, pid: int) -> list[str]:
    return [c[0] for c in fakenode.read(node.gpu)["calls"] if c[1] == pid and c[0] != "state"]


def test_gpu_pod_pulled_onto_the_other_nodes_gpu(clean):
    a, b = clean["a"], clean["b"]
    name, scid, spid = _source(clean, "pull")
    tcid = _target(clean, name, UB)
    b.cri.start(tcid)  # kubelet's StartContainer: the create pulls, with the GPU steps
    assert b.cri.state_name(tcid) == "CONTAINER_RUNNING"
    a.cri.wait_state(scid, "CONTAINER_EXITED", timeout=60)  # the source is gone once every page is across
    before = _ticks(a, scid)
    assert_continues(before, _wait_ticks(b, tcid, 3))  # the very next tick, the same host memory
    (res,) = [r for r in a.agent_results() if r.get("mode") == "pull" and r.get("container_id") == scid]
    assert res["error"] is None and res["restored"] is True, res
    assert res["gpu"]["pairs"] == [{"old": UA, "new": UB}] and res["timings"]["gpu_checkpoint_s"] >= 0, res
    # A: the GPU state was locked and checkpointed before the dump; the process is gone, and its GPU free
    assert _calls(a, spid)[:2] == ["lock", "checkpoint"], _calls(a, spid)
    assert not fakenode.lives(str(spid), fakenode.read(a.gpu)["processes"][str(spid)])
    # B: the copy's GPU state was restored there, onto B's GPU, and runs
    tpid = _pid(b, tcid)
    assert _calls(b, tpid) == ["restore", "unlock"], _calls(b, tpid)
    proc = fakenode.read(b.gpu)["processes"][str(tpid)]
    assert proc["state"] == "running" and proc["gpu"] == UB and proc["remap"] == [[UA, UB]], proc
    pulled = [json.loads(line) for line in open(b.log) if '"pulled"' in line]
    assert pulled and "gpu_restore_s" in pulled[-1]["timings"]["restore"], pulled
    assert _wait_ticks(b, tcid, 2, after=before[-1][0] + 3)  # and it goes on
    for node in (a, b):
        assert node.staging() == [] and node.cli("ls", "--json").stdout.strip() == "[]"


@pytest.mark.parametrize("gpu, why", [
    (None, "does not say which GPUs"),
    (UO, f"GPU model mismatch: checkpoint GPU 0 was {MODEL} ({UA}), the new container's GPU 0 is {OTHER_MODEL}"),
])
def test_target_bundle_without_a_matching_gpu_is_refused_before_the_freeze(clean, gpu, why):
    a, b = clean["a"], clean["b"]
    name, scid, spid = _source(clean, "refuse")
    tcid = _target(clean, name, gpu)
    last = _ticks(a, scid)[-1][0]
    t0 = time.monotonic()
    with pytest.raises(CriError) as info:
        b.cri.start(tcid)
    assert time.monotonic() - t0 < 10
    assert "OCI runtime create failed: migrt: pull of container app of pod team-a/" in info.value.details
    assert why in info.value.details, info.value.details
    assert b.cri.state_name(tcid) != "CONTAINER_RUNNING"
    # nothing frozen: the source's GPU never locked, the source ticks on, on its GPU
    assert _calls(a, spid) == []
    assert fakenode.read(a.gpu)["processes"][str(spid)]["state"] == "running"
    assert a.cri.state_name(scid) == "CONTAINER_RUNNING"
    assert _wait_ticks(a, scid, 1, after=last)[0][0] == last + 1
    assert b.staging() == [] and a.staging() == []
    assert [c for c in b.runc_containers() if os.path.exists(os.path.join(b.root, c, "migrt-restored"))] == []
