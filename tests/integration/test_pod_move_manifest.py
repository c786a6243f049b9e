"""What `migrt k8s move-manifest` writes, run through the real pull (docs/kubernetes.md): the
StatefulSet's two pulls, with the manifests it writes for each, on the two-node CRI rig of
test_pod_migration.py (tests/helpers/podnodes.py: two containerds in network namespaces, their agents,
pods driven through CRI as kubelet does). The API server's part (the objects, the controllers) is not
here: there is none on these machines, and the pods are made from the manifests by hand, as kubelet
would make them (name, namespace, hostname, annotations, the container)."""

from __future__ import annotations

import time

import pytest

from migrt.pods import move_manifest as mm
from tests.helpers.cri import CriError
from tests.helpers.migration import assert_continues
from tests.helpers.podnodes import pod_nodes
from tests.helpers.twohosts import ADDR_A, ADDR_B, lazy_pipe_limit
from tests.integration.test_cri_pagefill import BIN_DEST, bin_dir  # noqa: F401 - the workload's fixture
from tests.integration.test_pod_migration import DATA_MIB, _ticks, _wait_ticks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def nodes(cri_stack, cri_stubs, tmp_path_factory):
    with lazy_pipe_limit(), pod_nodes(tmp_path_factory.mktemp("moves"), cri_stubs,
                                      "migration_stall_timeout: 5\n") as n:
        yield n


def _run_all(node, pod: dict, workload: str) -> tuple[str, dict[str, str]]:
    """The pod of a manifest on `node`, as kubelet makes it, each container a hashticker started in turn:
    (pod id, {container name: container id})."""
    meta, spec = pod["metadata"], pod["spec"]
    pid = node.cri.run_pod(meta["name"], meta["namespace"], hostname=spec.get("hostname"),
                           annotations=meta.get("annotations"), labels=meta.get("labels"))
    cids = {}
    for c in spec["containers"]:
        cids[c["name"]] = node.cri.create_container(pid, c["name"], node.ctd.image,
                                                    [f"{BIN_DEST}/hashticker", str(DATA_MIB)],
                                                    mounts=[(workload, BIN_DEST)])
        node.cri.start(cids[c["name"]])
    return pid, cids


def _run(node, pod: dict, workload: str) -> tuple[str, str]:
    """(pod id, id of its container app)."""
    pid, cids = _run_all(node, pod, workload)
    return pid, cids["app"]


def _as_listed(pod: dict, host_ip: str, owner: dict | None = None) -> dict:
    """The manifest as `kubectl get pod -o json` would return it once it runs on the node of host_ip."""
    out = {**pod, "metadata": {**pod["metadata"], "uid": "uid-of-" + pod["metadata"]["name"], "resourceVersion": "1"},
           "status": {"phase": "Running", "hostIP": host_ip}}
    if owner:
        out["metadata"]["ownerReferences"] = [owner]
    return out


def _hostname(node, cid: str) -> str:
    code, out, err = node.cri.exec_sync(cid, ["hostname"])
    assert code == 0, err
    return out.strip()


SOURCE = {"apiVersion": "v1", "kind": "Pod",
          "metadata": {"name": "web-0", "namespace": "team-a",
                       "labels": {"app": "db", "statefulset.kubernetes.io/pod-name": "web-0"},
                       "annotations": {"migrt.io/migratable": "true"}},
          "spec": {"nodeName": "node-a", "hostname": "web-0", "subdomain": "web", "runtimeClassName": "migrt",
                   "containers": [{"name": "app", "image": "hashticker"}]}}
OWNER = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "s", "controller": True}


@pytest.fixture
def clean(nodes, bin_dir):  # noqa: F811
    for node in nodes.values():
        node.bin_dir = bin_dir
    yield nodes
    for node in nodes.values():
        node.cri.cleanup()


def test_statefulset_first_pull_with_the_manifest_it_writes(clean, bin_dir):  # noqa: F811
    """web-0 on node a -> web-0-moving on node b: the copy move-manifest writes pulls the source and goes
    on with its next tick and its memory, under the hostname the application had."""
    a, b = clean["a"], clean["b"]
    spod, scid = _run(a, SOURCE, bin_dir)
    _wait_ticks(a, scid, 3)
    first = mm.move(_as_listed(SOURCE, ADDR_A, OWNER), mm.MoveOptions(to_node="node-b"))
    assert first.pod["metadata"]["name"] == "web-0-moving"
    assert first.migrate_from == f"{ADDR_A}/team-a/web-0/app"
    _, mcid = _run(b, first.pod, bin_dir)
    a.cri.wait_state(scid, "CONTAINER_EXITED", timeout=60)
    assert_continues(_ticks(a, scid), _wait_ticks(b, mcid, 2))
    assert _hostname(b, mcid) == "web-0"
    a.cri.delete_pod(spod)  # the source goes (its StatefulSet, orphan-deleted, recreates nothing)
    assert b.cri.state_name(mcid) == "CONTAINER_RUNNING"


def test_statefulset_second_pull_on_the_same_node(clean, bin_dir):  # noqa: F811
    """web-0-moving on node b -> web-0 on node b, from b's own agent (the name comes back): the agent's
    staging and the pulling create's import share b's one store under two names (migrate.staging_name)."""
    b = clean["b"]
    first = mm.move(_as_listed(SOURCE, ADDR_A, OWNER), mm.MoveOptions(to_node="node-b"))
    moving = {**first.pod, "metadata": {**first.pod["metadata"], "annotations": {
        k: v for k, v in first.pod["metadata"]["annotations"].items() if k != "migrt.io/migrate-from"}}}
    mpod, mcid = _run(b, moving, bin_dir)  # as the first pull left it: running on b (started fresh here)
    _wait_ticks(b, mcid, 3)
    second = mm.move(_as_listed(first.pod, ADDR_B), mm.MoveOptions(to_node="node-b"))
    assert second.pod["metadata"]["name"] == "web-0" and second.plan.kind == "StatefulSet (second pull)"
    assert second.migrate_from == f"{ADDR_B}/team-a/web-0-moving/app"
    _, fcid = _run(b, second.pod, bin_dir)
    b.cri.wait_state(mcid, "CONTAINER_EXITED", timeout=60)
    assert_continues(_ticks(b, mcid), _wait_ticks(b, fcid, 2))
    assert _hostname(b, fcid) == "web-0"
    b.cri.delete_pod(mpod)
    assert b.cri.state_name(fcid) == "CONTAINER_RUNNING"


def _duo(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team-a", "annotations": {"migrt.io/migratable": "true"}},
            "spec": {"nodeName": "node-a", "runtimeClassName": "migrt",
                     "containers": [{"name": "app", "image": "hashticker"}, {"name": "side", "image": "hashticker"}]}}


def test_two_containers_separate_cuts_each_pulls_its_namesake(clean, bin_dir):  # noqa: F811
    """--separate-cuts writes <agent>/<ns>/<pod>: every container of the copy pulls its namesake (each
    frozen on its own), and both go on with their next tick."""
    a, b = clean["a"], clean["b"]
    src = _duo("duo-cuts")
    _, scids = _run_all(a, src, bin_dir)
    for cid in scids.values():
        _wait_ticks(a, cid, 3)
    moved = mm.move(_as_listed(src, ADDR_A), mm.MoveOptions(to_node="node-b", separate_cuts=True))
    assert moved.migrate_from == f"{ADDR_A}/team-a/duo-cuts" and moved.containers == ["app", "side"]
    _, tcids = _run_all(b, moved.pod, bin_dir)
    for name, cid in scids.items():
        a.cri.wait_state(cid, "CONTAINER_EXITED", timeout=60)
        assert_continues(_ticks(a, cid), _wait_ticks(b, tcids[name], 2))


def test_two_containers_by_default_move_as_one_pod_level_pull(clean, bin_dir):  # noqa: F811
    """No option: the manifest lists both containers with their images (migrt.io/migrate-pod), and the
    copy's two creates pull them from one cut of the source pod: both go on with their next tick."""
    a, b = clean["a"], clean["b"]
    src = _duo("duo-pod")
    for c in src["spec"]["containers"]:  # the image the rig's creates give (io.kubernetes.cri.image-name)
        c["image"] = a.ctd.image
    _, scids = _run_all(a, src, bin_dir)
    for cid in scids.values():
        _wait_ticks(a, cid, 3)
    moved = mm.move(_as_listed(src, ADDR_A), mm.MoveOptions(to_node="node-b"))
    assert moved.migrate_from == f"{ADDR_A}/team-a/duo-pod" and moved.containers == ["app", "side"]
    assert moved.pod["metadata"]["annotations"]["migrt.io/migrate-pod"] == f"app={a.ctd.image},side={a.ctd.image}"
    _, tcids = _run_all(b, moved.pod, bin_dir)
    for name, cid in scids.items():
        a.cri.wait_state(cid, "CONTAINER_EXITED", timeout=60)
        assert_continues(_ticks(a, cid), _wait_ticks(b, tcids[name], 2))
    deadline = time.monotonic() + 30
    while len(parts := _pod_parts(a, "team-a/duo-pod")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(parts) == ["app", "side"]  # the two parts of one pod-level pull, each handed over


def _pod_parts(node, pod: str) -> list[str]:
    return [r["pod"]["part"] for r in node.agent_results()
            if r.get("mode") == "pull" and not r.get("error") and (r.get("pod") or {}).get("pod") == pod]


def test_two_containers_one_named_pulls_and_the_other_starts_fresh(clean, bin_dir):  # noqa: F811
    """--container app writes <agent>/<ns>/<pod>/app: app pulls, side starts fresh on the target and its
    namesake on the source runs on (the operator deletes the source pod afterwards)."""
    a, b = clean["a"], clean["b"]
    src = _duo("duo-one")
    _, scids = _run_all(a, src, bin_dir)
    _wait_ticks(a, scids["app"], 3)
    moved = mm.move(_as_listed(src, ADDR_A), mm.MoveOptions(to_node="node-b", container="app"))
    assert moved.migrate_from == f"{ADDR_A}/team-a/duo-one/app"
    _, tcids = _run_all(b, moved.pod, bin_dir)
    a.cri.wait_state(scids["app"], "CONTAINER_EXITED", timeout=60)
    assert_continues(_ticks(a, scids["app"]), _wait_ticks(b, tcids["app"], 2))
    assert _wait_ticks(b, tcids["side"], 1)[0][0] == 1  # a fresh start
    assert a.cri.state_name(scids["side"]) == "CONTAINER_RUNNING"


def test_a_restart_of_the_copy_pulls_again_unless_the_annotation_is_gone(clean, bin_dir):  # noqa: F811
    """After the move the copy keeps migrt.io/migrate-from: a restart of its container (kubelet's
    RemoveContainer + CreateContainer in the same sandbox) pulls again, from a source that is gone, and
    fails. With the annotation removed from the sandbox config the CreateContainer request carries (what
    kubelet sends once `kubectl annotate pod COPY migrt.io/migrate-from-` is done: on paper, no kubelet
    here), containerd passes none to the bundle and the container starts fresh."""
    a, b = clean["a"], clean["b"]
    src = {**SOURCE, "metadata": {**SOURCE["metadata"], "name": "solo"}, "spec": {**SOURCE["spec"], "hostname": None}}
    spod, scid = _run(a, src, bin_dir)
    _wait_ticks(a, scid, 3)
    moved = mm.move(_as_listed(src, ADDR_A), mm.MoveOptions(to_node="node-b"))
    tpod, tcid = _run(b, moved.pod, bin_dir)
    a.cri.wait_state(scid, "CONTAINER_EXITED", timeout=60)
    a.cri.delete_pod(spod)
    b.cri.stop(tcid, timeout=0)
    b.cri.remove(tcid)
    again = b.cri.create_container(tpod, "app", b.ctd.image, [f"{BIN_DEST}/hashticker", str(DATA_MIB)],
                                   mounts=[(bin_dir, BIN_DEST)], log_path="app/1.log")  # kubelet: attempt 1
    with pytest.raises(CriError) as info:
        b.cri.start(again)
    assert f"pull of container app of pod team-a/solo from {ADDR_A}:7070 failed" in info.value.details
    b.cri.remove(again)
    del b.cri.pods[tpod].config.annotations["migrt.io/migrate-from"]
    fresh = b.cri.create_container(tpod, "app", b.ctd.image, [f"{BIN_DEST}/hashticker", str(DATA_MIB)],
                                   mounts=[(bin_dir, BIN_DEST)], log_path="app/2.log")
    b.cri.start(fresh)
    assert _wait_ticks(b, fresh, 1)[0][0] == 1  # a fresh start
