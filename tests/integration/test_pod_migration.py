"""Live migration into the pod that kubelet creates: a new pod on node B whose container carries
`migrt.io/migrate-from=<node A>/<namespace>/<pod>/<container>` pulls the running container from node
A's agent (`migrt serve`) inside its own CreateContainer/StartContainer (migrt-runc `create`).

Two "nodes" on this machine (tests/helpers/podnodes.py): network namespaces joined by a veth pair,
each with its own containerd (CRI, CNI bridge), migrt config, key, store, runc root and agent. Pods
are driven through CRI the way kubelet drives them. The workload is hashticker (hashticker.c: 64 MiB
of random data, their hash printed with every tick, a tick every 0.5 s), bind-mounted into both pods.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from tests.helpers.cri import CriError, read_cri_log
from tests.helpers.migration import assert_continues
from tests.helpers.podnodes import AGENT_PORT, pod_nodes
from tests.helpers.twohosts import ADDR_A, ADDR_B, lazy_pipe_limit
from tests.integration.test_cri_pagefill import BIN_DEST, bin_dir  # noqa: F401 - the workload's fixture
from tests.integration.workloads import parse_ticks

pytestmark = pytest.mark.integration

DATA_MIB = 64
MIGRATABLE = {"migrt.io/migratable": "true"}


@pytest.fixture(scope="module")
def nodes(cri_stack, cri_stubs, tmp_path_factory):
    with lazy_pipe_limit(), pod_nodes(tmp_path_factory.mktemp("pods"), cri_stubs,
                                      "migration_stall_timeout: 5\n") as n:
        yield n


@pytest.fixture
def clean(nodes, bin_dir):
    for node in nodes.values():
        node.bin_dir = bin_dir
    yield nodes
    for node in nodes.values():
        node.cri.cleanup()


def _app(node, pod: str) -> str:
    """The workload's container in `pod` (what the source and the pulling pod both run)."""
    return node.cri.create_container(pod, "app", node.ctd.image, [f"{BIN_DEST}/hashticker", str(DATA_MIB)],
                                     mounts=[(node.bin_dir, BIN_DEST)])


def _ticks(node, cid: str) -> list:
    return parse_ticks(read_cri_log(node.cri.status(cid).log_path))


def _wait_ticks(node, cid: str, n: int, timeout: float = 30, after: int = 0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        ticks = [t for t in _ticks(node, cid) if t[0] > after]
        if len(ticks) >= n:
            return ticks
        if time.monotonic() > deadline:
            raise AssertionError(f"container {cid[:12]} on node {node.name}: fewer than {n} ticks after {after} "
                                 f"({node.cri.state_name(cid)})")
        time.sleep(0.1)


def _source(node, tag: str, annotations: dict | None = MIGRATABLE, namespace: str = "team-a") -> tuple[str, str, str]:
    """A counter pod on `node`: (pod name, pod id, container id)."""
    name = f"counter-{tag}-{uuid.uuid4().hex[:4]}"
    pod = node.cri.run_pod(name, namespace, annotations=annotations)
    cid = _app(node, pod)
    node.cri.start(cid)
    _wait_ticks(node, cid, 3)
    return name, pod, cid


def _target(node, spec: str, namespace: str = "team-a", name: str | None = None) -> tuple[str, str]:
    """The pod that pulls: same container spec, the migrate-from annotation. (pod id, container id)"""
    pod = node.cri.run_pod(name or f"pulled-{uuid.uuid4().hex[:6]}", namespace,
                           annotations={"migrt.io/migrate-from": spec})
    return pod, _app(node, pod)


def _no_copy_on(node) -> None:
    """Nothing of a pull left on a node: no restored container, no staging directory, no checkpoint."""
    restored = [c for c in node.runc_containers() if os.path.exists(os.path.join(node.root, c, "migrt-restored"))]
    assert restored == [], restored
    assert node.staging() == []
    assert node.cli("ls", "--json").stdout.strip() == "[]"


def test_pod_pulls_a_running_container_and_its_restart_is_refused(clean):
    a, b = clean["a"], clean["b"]
    name, spod, scid = _source(a, "pull")
    tpod, tcid = _target(b, f"{ADDR_A}/team-a/{name}/app", name=name)  # a StatefulSet's pod: the same name
    t0 = time.monotonic()
    b.cri.start(tcid)  # kubelet's StartContainer: runc create pulls, start is a no-op
    start_s = time.monotonic() - t0
    assert b.cri.state_name(tcid) == "CONTAINER_RUNNING"
    # the source goes once every page is across; the target goes on with the very next tick, same memory
    st = a.cri.wait_state(scid, "CONTAINER_EXITED", timeout=60)
    before = _ticks(a, scid)
    assert_continues(before, _wait_ticks(b, tcid, 3))
    (res,) = [r for r in a.agent_results() if r.get("mode") == "pull"]
    assert res["error"] is None and res["restored"] is True and res["container_id"] == scid
    assert res["target"]["container_id"] == tcid and res["to"] == f"{ADDR_B}:{AGENT_PORT}"
    assert 0 < res["downtime_s"] < start_s + 1
    assert res["pages"]["bytes"] >= DATA_MIB << 20 and res["pages"]["streams"] >= 2
    # nothing left in either store; the pull's checkpoint (pageless) is gone from B's
    for node in (a, b):
        assert node.staging() == [] and node.cli("ls", "--json").stdout.strip() == "[]"
    # kubelet on A restarts the exited container (RemoveContainer + CreateContainer of the same name in
    # the same sandbox): refused, naming where it went, until the pod is deleted
    a.cri.remove(scid)
    again = _app(a, spod)
    with pytest.raises(CriError) as info:
        a.cri.start(again)
    assert "migrt: container app of pod team-a/" in info.value.details
    assert f"was migrated to node {ADDR_B}" in info.value.details and tcid in info.value.details
    assert st.exit_code != 0
    # the pod is deleted: its record goes, and a new pod of the same name starts normally on A
    a.cri.delete_pod(spod)
    fresh = a.cri.run_pod(name, "team-a")
    cid = _app(a, fresh)
    a.cri.start(cid)
    assert _wait_ticks(a, cid, 1)[0][0] == 1  # a fresh start
    assert [n for n in os.listdir(a.root) if n.startswith(".migrt-moved-")] == []
