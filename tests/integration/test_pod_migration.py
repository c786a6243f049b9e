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
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.cri import CriError, read_cri_log
from tests.helpers.migration import assert_continues
from tests.helpers.podnodes import AGENT_PORT, pod_nodes, procs
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


def _refusal(what: str, namespace: str) -> str:
    """What the agent answers a pull it does not serve, whatever the reason."""
    return (f"{ADDR_A}:{AGENT_PORT}: no migratable {what} for a pod of namespace {namespace!r} on node {ADDR_A}: a "
            "pull takes a running container (never a pod's sandbox) whose pod opted in (migrt.io/migratable=true) "
            "and is in the pulling pod's namespace; nothing was touched (the node agent's log says why)")


def _runc_status(node, cid: str) -> str | None:
    res = subprocess.run(["runc", "--root", node.root, "state", cid], capture_output=True, text=True)
    return json.loads(res.stdout)["status"] if res.returncode == 0 else None


def test_refusals_come_before_anything_is_frozen_and_say_the_same_whatever_the_reason(clean):
    """No opt-in, another namespace, no such pod, an unknown id, the source pod's sandbox (its pause
    container, opted in with its pod) by id: the create fails at once with one text that names only
    what the pod asked for; the agent's report has the reason; nothing was frozen or left behind."""
    a, b = clean["a"], clean["b"]
    plain_name, _, plain_cid = _source(a, "plain", annotations=None)
    name, spod, scid = _source(a, "optin")
    nobody, unknown = f"nobody-{uuid.uuid4().hex[:4]}", uuid.uuid4().hex * 2
    cases = [  # (what the pod names, its namespace, the container the agent found, the reason it reports)
        (spod, "team-a", spod, "it is a pod's sandbox (pause container), never handed over"),
        (f"team-a/{plain_name}/app", "team-a", plain_cid, "its pod has not opted in"),
        (f"team-a/{plain_name}/app", "team-b", plain_cid, "its pod has not opted in"),
        (f"team-a/{name}/app", "team-b", scid, "namespace 'team-a', the pulling pod in 'team-b'"),
        (f"team-a/{nobody}/app", "team-b", None, "no such container on this node"),
        (unknown, "team-b", None, "no such container on this node"),
    ]
    for source, namespace, found, reason in cases:
        what = f"container app of pod {source.rsplit('/', 1)[0]}" if "/" in source else f"container {source}"
        _, tcid = _target(b, f"{ADDR_A}/{source}", namespace=namespace)
        last = _ticks(a, scid)[-1][0]
        t0 = time.monotonic()
        with pytest.raises(CriError) as info:
            b.cri.start(tcid)
        assert time.monotonic() - t0 < 10, source  # within seconds, far from kubelet's deadline
        assert (f"OCI runtime create failed: migrt: pull of {what} from {ADDR_A}:{AGENT_PORT} failed: "
                f"{_refusal(what, namespace)}") in info.value.details, (source, info.value.details)
        assert a.root not in info.value.details and reason not in info.value.details
        assert b.cri.state_name(tcid) != "CONTAINER_RUNNING"
        # the agent says why, to its own report only
        (res,) = [r for r in a.agent_results() if r.get("mode") == "pull" and r["error"] == _refusal(what, namespace)
                  .split(": ", 1)[1]]
        assert res["container_id"] == found and reason in res["reason"] and res["name"] is None, res
        # the source and its sandbox were never frozen: they run, and the source ticks on
        assert a.cri.state_name(scid) == "CONTAINER_RUNNING" and _runc_status(a, spod) == "running"
        assert _wait_ticks(a, scid, 1, after=last)[0][0] == last + 1
    assert a.cri.state_name(plain_cid) == "CONTAINER_RUNNING"
    _no_copy_on(b)
    assert a.staging() == []


LISTENER = """
import socket, sys
srv = socket.create_server(("127.0.0.1", int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, peer = srv.accept()
    with open(sys.argv[1], "a") as fh:
        fh.write(f"{peer}\\n")
    with conn:
        conn.settimeout(5)
        try:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 Bad Request\\r\\nContent-Length: 0\\r\\n\\r\\n")
        except OSError:
            pass
"""


def _configure(node, text: str) -> None:
    """Replace a node's migrt config atomically: containerd may run migrt-runc at any time."""
    with open(node.config + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(node.config + ".tmp", node.config)


def test_a_pod_makes_its_node_connect_only_to_migrate_peers(clean, tmp_path):
    """migrate-from naming an address outside node B's migrate_peers fails before any connection (a
    listener on B's loopback records none); once listed, the node connects, and whatever answered (an
    HTTP server, a closed port) the pod reads one line; what the network said is in B's migrt log."""
    a, b = clean["a"], clean["b"]
    name, _, scid = _source(a, "peers")
    accepts = tmp_path / "accepts"
    accepts.touch()
    listener = subprocess.Popen(b.ctd.network.wrap([sys.executable, "-c", LISTENER, str(accepts), "7073"]),
                                stdout=subprocess.PIPE)
    plain = Path(b.config).read_text()
    try:
        assert listener.stdout.readline() == b"listening\n"
        http, closed = "127.0.0.1:7073", f"{ADDR_A}:{AGENT_PORT + 1}"
        for address in (http, closed):
            _, tcid = _target(b, f"{address}/team-a/{name}/app")
            with pytest.raises(CriError) as info:
                b.cri.start(tcid)
            assert (f"migrt: pull of container app of pod team-a/{name} from {address} failed: {address} is not a "
                    f"node agent this node may pull from: migrate_peers in the node's migrt config ({b.config}) "
                    "does not list it") in info.value.details, info.value.details
        time.sleep(0.5)
        assert accepts.read_text() == ""  # nothing was contacted
        _configure(b, plain.replace(f"migrate_peers: {json.dumps([ADDR_A, ADDR_B])}",
                                    f"migrate_peers: {json.dumps([ADDR_A, ADDR_B, http, closed])}"))
        for address, detail in ((http, "frame type 72, length 1414811695"), (closed, "Connection refused")):
            _, tcid = _target(b, f"{address}/team-a/{name}/app")
            with pytest.raises(CriError) as info:
                b.cri.start(tcid)
            assert (f"migrt: pull of container app of pod team-a/{name} from {address} failed: cannot pull from "
                    f"{address} (see the node's migrt log)") in info.value.details, info.value.details
            assert "frame" not in info.value.details and "HTTP" not in info.value.details
            assert "refused" not in info.value.details.lower()
            events = [json.loads(line) for line in Path(b.log).read_text().splitlines() if "pull_unreachable" in line]
            assert any(e["address"] == address and detail in e["detail"] for e in events), events
        assert len(accepts.read_text().splitlines()) == 1  # the listed listener was contacted, once
    finally:
        _configure(b, plain)
        listener.kill()
        listener.wait()
    assert a.cri.state_name(scid) == "CONTAINER_RUNNING"
    _no_copy_on(b)


def _wait_for(what: str, probe, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (found := probe()):
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)
    return found


def _one_copy(a, scid: str, b, tcid: str, before: list) -> str:
    """Exactly one of the source and the pulled copy runs, and it goes on from where the source was frozen
    with its memory intact: returns "source" or "target"."""
    deadline = time.monotonic() + 60
    while True:
        states = (a.cri.state_name(scid), b.cri.state_name(tcid))
        if states.count("CONTAINER_RUNNING") == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert states.count("CONTAINER_RUNNING") == 1, states
    node, cid = (a, scid) if states[0] == "CONTAINER_RUNNING" else (b, tcid)
    time.sleep(1.0)  # the other stays gone
    assert (a.cri.state_name(scid), b.cri.state_name(tcid)).count("CONTAINER_RUNNING") == 1
    after = _wait_ticks(node, cid, 2, after=before[-1][0])
    assert after[0][0] == before[-1][0] + 1 or node is a, (before[-2:], after[:2])  # a resumed source may
    assert all(t[1] == before[-1][1] == t[2] for t in after), after                  # have ticked since
    return "source" if node is a else "target"


def test_exactly_one_copy_runs_whatever_breaks(clean):
    """The pages' connection cut (the source's page server killed) while they flow, the target's create
    killed (kubelet's deadline: containerd kills the runtime), the source's agent killed while the pages
    flow: afterwards exactly one copy runs, with its memory, and nothing is left behind."""
    a, b = clean["a"], clean["b"]

    # 1. pages cut: the target's copy cannot run without them and goes; the source resumes
    name, _, scid = _source(a, "cut")
    _, tcid = _target(b, f"{ADDR_A}/team-a/{name}/app")
    with a.throttled("40mbit"):
        b.cri.start(tcid)  # the copy runs; 64 MiB follow at 40 Mbit/s
        frozen_at = _ticks(a, scid)
        server = _wait_for("the page server", lambda: a.children(a.agent.pid, b"migrt.migration.pageserve"))
        os.kill(server[0], signal.SIGKILL)
        assert _one_copy(a, scid, b, tcid, frozen_at) == "source"
    res = [r for r in a.agent_results() if r.get("container_id") == scid][-1]
    assert "did not get all its memory pages" in res["error"] and "was resumed on this node" in res["error"]

    # 1b. the pulled copy stopped on its node while its pages still arrive: the source resumes (it must not
    #     be deleted for a copy that is gone)
    name, _, scid = _source(a, "stop")
    _, tcid = _target(b, f"{ADDR_A}/team-a/{name}/app")
    with a.throttled("40mbit"):
        b.cri.start(tcid)
        frozen_at = _ticks(a, scid)
        b.cri.stop(tcid, timeout=0)
        assert _one_copy(a, scid, b, tcid, frozen_at) == "source"

    # 2. the target's create killed while the images arrive (the source frozen): the source resumes and
    #    the target keeps nothing
    name, _, scid = _source(a, "kill")
    _, tcid = _target(b, f"{ADDR_A}/team-a/{name}/app")
    with a.throttled("256kbit"):
        t0 = time.monotonic()
        with pytest.raises(CriError) as info:
            b.cri.start(tcid, timeout=3)  # kubelet's deadline, shorter than this transfer
        assert info.value.code == "DEADLINE_EXCEEDED", info.value
        frozen_at = _ticks(a, scid)
        assert _one_copy(a, scid, b, tcid, frozen_at) == "source"
    assert time.monotonic() - t0 < 30
    _wait_for("the pull's guard", lambda: not procs((b"migrt.migration.guard", f"target:{scid}".encode())), timeout=30)
    _no_copy_on(b)

    # 3. the source's agent killed while the pages flow: its guard asks B's agent, the copy there runs
    #    on (the page server outlives the agent), the frozen source is deleted and its restart refused
    name, spod, scid = _source(a, "agent")
    _, tcid = _target(b, f"{ADDR_A}/team-a/{name}/app")
    try:
        with a.throttled("80mbit"):
            b.cri.start(tcid)
            frozen_at = _ticks(a, scid)
            a.agent.kill()
            assert _one_copy(a, scid, b, tcid, frozen_at) == "target"
    finally:
        a.stop_agent()
        a.start_agent()
    moved = [n for n in os.listdir(a.root) if n.startswith(".migrt-moved-")]
    assert moved and json.loads(open(os.path.join(a.root, moved[0])).read())["to"] == ADDR_B
    for node in (a, b):
        assert node.staging() == []


def test_pull_inside_mutual_tls(clean, tmp_path):
    """With migration_tls on both nodes the pull, its channel and its page streams run inside TLS; a
    node without TLS is refused by the agent before anything is touched."""
    a, b = clean["a"], clean["b"]

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
            "-subj", "/CN=migrt-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    plain = {}
    for node in (a, b):
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj",
                f"/CN=node-{node.name}", "-keyout", f"{node.name}.key", "-out", f"{node.name}.csr")
        openssl("x509", "-req", "-in", f"{node.name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-out", f"{node.name}.crt")
        plain[node.name] = open(node.config).read()
    tls = {n: plain[n] + f"migration_tls:\n  cert: {tmp_path}/{n}.crt\n  key: {tmp_path}/{n}.key\n"
              f"  ca: {tmp_path}/ca.crt\n" for n in plain}

    try:
        _configure(a, tls["a"])
        _configure(b, plain["b"])
        a.stop_agent()
        a.start_agent()
        name, _, scid = _source(a, "tls")
        _, tcid = _target(b, f"{ADDR_A}/team-a/{name}/app")
        with pytest.raises(CriError) as info:  # B speaks without TLS: refused, the source untouched
            b.cri.start(tcid)
        assert f"cannot pull from {ADDR_A}:{AGENT_PORT} (see the node's migrt log)" in info.value.details
        assert "TLS" not in info.value.details and "requires TLS" in Path(b.log).read_text()
        assert a.cri.state_name(scid) == "CONTAINER_RUNNING"
        _configure(b, tls["b"])
        _, tcid = _target(b, f"{ADDR_A}/team-a/{name}/app")
        b.cri.start(tcid)
        a.cri.wait_state(scid, "CONTAINER_EXITED", timeout=60)
        assert_continues(_ticks(a, scid), _wait_ticks(b, tcid, 2))
        (res,) = [r for r in a.agent_results() if r.get("mode") == "pull" and not r.get("error")]
        assert res["pages"]["bytes"] >= DATA_MIB << 20
    finally:
        _configure(a, plain["a"])
        _configure(b, plain["b"])
        a.stop_agent()
        a.start_agent()
