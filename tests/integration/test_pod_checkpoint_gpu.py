"""`migrt checkpoint --pod` of a pod with a GPU container and a CPU sidecar, on the simulated GPU nodes of
tests/integration/test_pod_migration_gpu.py (MIGRT_FAKE_GPU: node A's GPU UA, node B's UB): the GPU
container's state is locked and checkpointed by the driver before the pod is frozen, its part carries
the GPU section; the pod checkpoint, carried to node B's store, restores into a new pod there, the GPU
part onto B's GPU (remapped UA -> UB), both parts held until the last is in, then both run on with their
next tick and their memory. (The real driver: tests/gpu/, on the GPU machine; not run for a pod.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from migrt.gpu import fakenode, records
from tests.helpers.migration import assert_continues
from tests.integration.conftest import CLI
from tests.integration.test_cri_pagefill import bin_dir  # noqa: F401 - the workload's fixture
from tests.integration.test_migrate_gpu import UA, UB
from tests.integration.test_pod_migration import MIGRATABLE, _ticks, _wait_ticks
from tests.integration.test_pod_migration_gpu import _app, _calls, _pid, gnodes  # noqa: F401 - gnodes: fixture
from tests.integration.workloads import COUNTER

pytestmark = pytest.mark.integration


@pytest.fixture
def clean(gnodes):  # noqa: F811
    yield gnodes
    for name in ("a", "b"):
        gnodes[name].cri.cleanup()


def _gpu_pod(nodes) -> tuple[str, str, str, int]:
    """On node A: (pod name, GPU app's id, CPU sidecar's id, the app's host pid), both ticking."""
    a = nodes["a"]
    pod_name = f"gpupod-{uuid.uuid4().hex[:4]}"
    pod = a.cri.run_pod(pod_name, "team-a", annotations=MIGRATABLE)
    app = _app(a, pod, UA, nodes["marker"])
    a.cri.start(app)
    side = a.cri.create_container(pod, "sidecar", a.ctd.image, ["sh", "-c", COUNTER])
    a.cri.start(side)
    _wait_ticks(a, app, 3)
    _wait_ticks(a, side, 2)
    return pod_name, app, side, _pid(a, app)


def test_a_failure_after_the_gpu_lock_thaws_the_pod_then_resumes_the_gpu(clean):
    a = clean["a"]
    pod_name, app, side, app_pid = _gpu_pod(clean)
    name = f"gpufail-ck-{uuid.uuid4().hex[:6]}"
    res = subprocess.run([CLI, "checkpoint", "--pod", f"team-a/{pod_name}", "--name", name], capture_output=True,
                         text=True, timeout=120, env={**a.env(), "MIGRT_FAULT": "checkpoint-pod:dump:sidecar:fail"})
    assert res.returncode != 0 and "checkpoint of container sidecar" in res.stderr, res.stderr
    calls = _calls(a, app_pid)
    assert calls[:2] == ["lock", "checkpoint"] and calls[-2:] == ["restore", "unlock"], calls  # back on its GPU
    assert fakenode.read(a.gpu)["processes"][str(app_pid)]["state"] == "running"
    for cid in (app, side):
        assert a.cri.state_name(cid) == "CONTAINER_RUNNING"
        last = _ticks(a, cid)[-1][0]
        _wait_ticks(a, cid, 2, after=last)  # and they go on
    assert a.staging() == [] and name not in a.cli("ls", "--json").stdout


def test_a_gpu_pod_is_cut_with_its_gpu_state_and_restored_onto_another_gpu(clean):
    a, b = clean["a"], clean["b"]
    pod_name, app, side, app_pid = _gpu_pod(clean)

    name = f"gpupod-ck-{uuid.uuid4().hex[:6]}"
    data = json.loads(a.cli("checkpoint", "--pod", f"team-a/{pod_name}", "--name", name, "--json").stdout)
    assert [(p["name"], p["kind"]) for p in data["pod"]["parts"]] == [("app", "gpu"), ("sidecar", "container")]
    assert _calls(a, app_pid)[:2] == ["lock", "checkpoint"], _calls(a, app_pid)  # the driver's, before the dump
    parts = os.path.join(a.store, name, "parts")
    with open(os.path.join(parts, "app", "manifest.json")) as fh:
        assert json.load(fh)["gpu"]["processes"]
    assert os.path.exists(os.path.join(parts, "app", "images", records.IMAGE_FILE))  # only the GPU part's
    assert not os.path.exists(os.path.join(parts, "sidecar", "images", records.IMAGE_FILE))
    for cid in (app, side):
        a.cri.wait_state(cid, "CONTAINER_EXITED")
    before = {"app": _ticks(a, app), "sidecar": _ticks(a, side)}
    shutil.copytree(os.path.join(a.store, name), os.path.join(b.store, name), symlinks=True)  # the checkpoint moves
    b.cli("inspect", "--verify", name)

    new = b.cri.run_pod(f"gpupod-new-{uuid.uuid4().hex[:4]}", "team-a", annotations={"migrt.io/restore": name})
    tapp = _app(b, new, UB, clean["marker"])
    b.cri.start(tapp)  # the GPU part first: restored onto UB, then held (paused) until the sidecar is in
    tside = b.cri.create_container(new, "sidecar", b.ctd.image, ["sh", "-c", "echo fresh; sleep 1000"])
    b.cri.start(tside)
    assert_continues(before["app"], _wait_ticks(b, tapp, 3))
    assert_continues(before["sidecar"], _wait_ticks(b, tside, 2))
    tpid = _pid(b, tapp)
    assert _calls(b, tpid) == ["restore", "unlock"], _calls(b, tpid)
    proc = fakenode.read(b.gpu)["processes"][str(tpid)]
    assert proc["state"] == "running" and proc["gpu"] == UB and proc["remap"] == [[UA, UB]], proc
    assert a.staging() == [] and b.staging() == []
    b.cri.delete_pod(new)
    for node in (a, b):
        node.cli("rm", name)
