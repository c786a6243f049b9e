"""The pod-level pull (migration/podpull.py) of a pod with a GPU container and a CPU sidecar, on the
simulated GPU nodes of tests/integration/test_pod_migration_gpu.py (MIGRT_FAKE_GPU: node A's GPU UA,
node B's UB and a GPU of another model). The new pod on B says `migrt.io/migrate-from=<A>/team-a/<pod>`
and `migrt.io/migrate-pod=app=...,sidecar=...`; its first create (the GPU app) makes A's agent lock and
checkpoint the app's CUDA processes (the driver needs running tasks), then freeze the whole pod at once;
the app's part is restored onto UB running (its GPU restore, remapped UA -> UB), then paused in the
pod's hold; the sidecar's create brings the last part and both are thawed together.
Failures: the new app's GPU refused by B's preflight after the cut (another model), and the sidecar that
never comes (its image missing on B: the hold's deadline): the source pod runs on whole, its GPU state
restored and unlocked on UA, nothing kept on B. (The real driver: tests/gpu/test_gpu_pod.py.)"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from migrt.gpu import fakenode
from tests.helpers.cri import CriError
from tests.helpers.migration import assert_continues
from tests.helpers.twohosts import ADDR_A
from tests.integration.test_cri_pagefill import bin_dir  # noqa: F401 - the workload's fixture
from tests.integration.test_migrate_gpu import UA, UB
from tests.integration.test_pod_checkpoint_gpu import _gpu_pod
from tests.integration.test_pod_level_pull import _image_name, _runc_status
from tests.integration.test_pod_migration import _ticks, _wait_ticks
from tests.integration.test_pod_migration_gpu import UO, _app, _calls, _pid, gnodes  # noqa: F401 - gnodes: fixture
from tests.integration.workloads import COUNTER

pytestmark = pytest.mark.integration
DEADLINE_S = 30  # the nodes' pod_pull_deadline (the default)


@pytest.fixture
def clean(gnodes):  # noqa: F811
    yield gnodes
    for name in ("a", "b"):
        gnodes[name].cri.cleanup()


def _target(nodes, pod_name: str, parts: dict[str, str], gpu: str) -> tuple[str, str]:
    """The new pod on B, its GPU app created (not started): (pod sandbox id, app's id)."""
    b = nodes["b"]
    pod = b.cri.run_pod(f"moved-{uuid.uuid4().hex[:6]}", "team-a", annotations={
        "migrt.io/migrate-from": f"{ADDR_A}/team-a/{pod_name}",
        "migrt.io/migrate-pod": ",".join(f"{n}={img}" for n, img in parts.items())})
    return pod, _app(b, pod, gpu, nodes["marker"])


def _source_runs_whole(nodes, app: str, side: str, app_pid: int, frozen_at: dict[str, int]) -> None:
    """The source pod runs on: both containers with their next tick, the app's GPU state restored and
    unlocked on its own GPU; nothing of the pull left on B."""
    a, b = nodes["a"], nodes["b"]
    deadline = time.monotonic() + 60
    while any(_runc_status(a, c) != "running" for c in (app, side)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_runc_status(a, c) for c in (app, side)] == ["running", "running"]
    calls = _calls(a, app_pid)
    assert calls[:2] == ["lock", "checkpoint"] and calls[-2:] == ["restore", "unlock"], calls
    proc = fakenode.read(a.gpu)["processes"][str(app_pid)]
    assert proc["state"] == "running" and proc["gpu"] == UA, proc
    for name, cid in (("app", app), ("sidecar", side)):
        ticks = _wait_ticks(a, cid, 2, after=frozen_at[name])
        assert ticks[0][0] == frozen_at[name] + 1 and ticks[0][1] == ticks[0][2]  # the next tick, memory intact
    restored = [c for c in b.runc_containers() if os.path.exists(os.path.join(b.root, c, "migrt-restored"))]
    assert restored == [] and a.staging() == [] and b.staging() == []


def test_a_gpu_pod_moves_whole_with_one_cut_onto_the_other_nodes_gpu(clean):
    a, b = clean["a"], clean["b"]
    pod_name, app, side, app_pid = _gpu_pod(clean)
    parts = {"app": _image_name(a, app), "sidecar": _image_name(a, side)}
    pod, tapp = _target(clean, pod_name, parts, UB)
    b.cri.start(tapp)  # the first part: GPU locked, the whole source pod frozen, the app restored onto UB
    assert _calls(a, app_pid)[:2] == ["lock", "checkpoint"], _calls(a, app_pid)
    assert b.cri.state_name(tapp) == "CONTAINER_RUNNING" and _runc_status(b, tapp) == "paused"  # held
    tpid = _pid(b, tapp)
    assert _calls(b, tpid) == ["restore", "unlock"], _calls(b, tpid)  # restored running, then paused
    frozen = {"app": _ticks(a, app), "sidecar": _ticks(a, side)}
    held = _ticks(b, tapp)  # (restored running for its GPU restore: a tick may come out before the pause)
    time.sleep(1.0)
    assert _ticks(a, side) == frozen["sidecar"] and _ticks(b, tapp) == held  # the sidecar frozen, the app held
    tside = b.cri.create_container(pod, "sidecar", b.ctd.image, ["sh", "-c", COUNTER])
    b.cri.start(tside)  # the last part: both thawed together
    assert_continues(frozen["app"], _wait_ticks(b, tapp, 3))
    assert_continues(frozen["sidecar"], _wait_ticks(b, tside, 2))
    proc = fakenode.read(b.gpu)["processes"][str(tpid)]
    assert proc["state"] == "running" and proc["gpu"] == UB and proc["remap"] == [[UA, UB]], proc
    for cid in (app, side):
        a.cri.wait_state(cid, "CONTAINER_EXITED", timeout=60)
    assert not fakenode.lives(str(app_pid), fakenode.read(a.gpu)["processes"][str(app_pid)])  # A's GPU freed
    results = [r for r in a.agent_results() if r.get("mode") == "pull" and r.get("pod")]
    assert sorted(r["pod"]["part"] for r in results) == ["app", "sidecar"], results
    assert all(r["error"] is None and r["restored"] for r in results), results
    (gpu_part,) = [r for r in results if r["pod"]["part"] == "app"]
    assert gpu_part["gpu"]["pairs"] == [{"old": UA, "new": UB}], gpu_part
    for node in (a, b):
        assert node.staging() == [] and node.cli("ls", "--json").stdout.strip() == "[]"


def test_a_failed_gpu_pod_pull_resumes_the_source_whole_with_its_gpu_unlocked(clean):
    a, b = clean["a"], clean["b"]

    # 1. the new app is given a GPU of another model: B's preflight of the app's part (its offer comes
    #    after the cut) refuses; the source thaws, then its GPU state is restored and unlocked on UA
    pod_name, app, side, app_pid = _gpu_pod(clean)
    parts = {"app": _image_name(a, app), "sidecar": _image_name(a, side)}
    _, tapp = _target(clean, pod_name, parts, UO)
    with pytest.raises(CriError) as info:
        b.cri.start(tapp)
    assert "GPU model mismatch" in info.value.details, info.value.details
    frozen_at = {"app": _ticks(a, app)[-1][0], "sidecar": _ticks(a, side)[-1][0]}
    _source_runs_whole(clean, app, side, app_pid, frozen_at)
    a.cri.cleanup()

    # 2. the sidecar never comes (its image missing on B): the hold's deadline gives the pod up, the
    #    held GPU part is removed on B, its source resumes on its own GPU, the sidecar with it
    pod_name, app, side, app_pid = _gpu_pod(clean)
    parts = {"app": _image_name(a, app), "sidecar": _image_name(a, side)}
    pod, tapp = _target(clean, pod_name, parts, UB)
    b.cri.start(tapp)
    frozen_at = {"app": _ticks(a, app)[-1][0], "sidecar": _ticks(a, side)[-1][0]}
    t0 = time.monotonic()
    _source_runs_whole(clean, app, side, app_pid, frozen_at)
    assert time.monotonic() - t0 < DEADLINE_S + 30
    assert _runc_status(b, tapp) is None  # the held GPU part removed by its pull
    with pytest.raises(CriError, match="given up"):  # kubelet's retry: refused, nothing frozen again
        b.cri.start(b.cri.create_container(pod, "sidecar", b.ctd.image, ["sh", "-c", COUNTER]))
    assert _runc_status(a, app) == "running" and _runc_status(a, side) == "running"
