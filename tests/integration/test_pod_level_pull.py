"""The pod-level pull (migration/podpull.py, issue 29) on two CRI "nodes" (tests/helpers/podnodes.py):
a new pod on node B whose annotations say `migrt.io/migrate-from=<node A>/<namespace>/<pod>` and
`migrt.io/migrate-pod=<name>=<image>,...` pulls every container of the source pod with ONE cut,
one create after the other as kubelet makes them, the parts held frozen (pods/hold.py) until the last.

The source pod (creation order, as kubelet starts a pod with a native sidecar):
    native  a "native sidecar" (an init container with restartPolicy Always: to containerd a
            container like the others, started first): hashticker with 8 MiB
    app     hashticker with 64 MiB (its memory's hash in every tick) and, beside it, the server end of
            a TCP connection over the pod's loopback (tcpticker serve)
    side    the client end (tcpticker client): a round trip every 0.25 s on the one connection, whose
            local port it prints with each tick; a broken connection is never re-made
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from tests.helpers.cri import CriError
from tests.helpers.migration import assert_continues
from tests.helpers.podnodes import pod_nodes, procs
from tests.helpers.twohosts import ADDR_A, lazy_pipe_limit
from tests.integration.test_cri_pagefill import BIN_DEST, bin_dir  # noqa: F401 - the workloads' fixture
from tests.integration.test_pod_migration import _ticks, _wait_for, _wait_ticks

pytestmark = pytest.mark.integration

HERE = os.path.dirname(os.path.abspath(__file__))
MIGRATABLE = {"migrt.io/migratable": "true"}
PORT = 7400
DEADLINE_S = 20  # the nodes' pod_pull_deadline (each part takes seconds on this loaded 2-core machine)
NAMES = ("native", "app", "side")


@pytest.fixture(scope="module")
def nodes(cri_stack, cri_stubs, tmp_path_factory):
    config = f"migration_stall_timeout: 5\npod_pull_deadline: {DEADLINE_S}\ncriu_options:\n  tcp_established: true\n"
    with lazy_pipe_limit(), pod_nodes(tmp_path_factory.mktemp("podpull"), cri_stubs, config) as n:
        yield n


@pytest.fixture(scope="module")
def pod_bin(bin_dir):  # noqa: F811 - the fixture imported above
    gcc = shutil.which("gcc") or shutil.which("cc")
    subprocess.run([gcc, "-static", "-O2", "-o", os.path.join(bin_dir, "tcpticker"),
                    os.path.join(HERE, "tcpticker.c")], check=True)
    return bin_dir


@pytest.fixture
def clean(nodes, pod_bin):
    yield nodes
    for node in nodes.values():
        node.cri.cleanup()


def _commands(app_mib: int = 64) -> dict[str, list[str]]:
    return {"native": [f"{BIN_DEST}/hashticker", "8"],
            "app": ["sh", "-c", f"{BIN_DEST}/tcpticker serve {PORT} & exec {BIN_DEST}/hashticker {app_mib}"],
            "side": [f"{BIN_DEST}/tcpticker", "client", str(PORT)]}


def _containers(node, pod: str, image: str | None = None, commands: dict | None = None) -> dict[str, str]:
    """The pod's three containers, created (not started): {name: container id}."""
    commands = commands or _commands()
    return {n: node.cri.create_container(pod, n, image or node.ctd.image, commands[n],
                                         mounts=[(node.bin_dir, BIN_DEST)]) for n in NAMES}


def _source(node, pod_bin, annotations: dict | None = MIGRATABLE) -> tuple[str, str, dict[str, str]]:
    node.bin_dir = pod_bin
    name = f"trio-{uuid.uuid4().hex[:6]}"
    pod = node.cri.run_pod(name, "team-a", annotations=annotations)
    cids = {}
    for n, cmd in _commands().items():  # one after the other, as kubelet does
        cids[n] = node.cri.create_container(pod, n, node.ctd.image, cmd, mounts=[(node.bin_dir, BIN_DEST)])
        node.cri.start(cids[n])
    for cid in cids.values():
        _wait_ticks(node, cid, 3)
    return name, pod, cids


def _image_name(node, cid: str) -> str:
    """The image as containerd gives it to the container (io.kubernetes.cri.image-name)."""
    return node.cri.status(cid).image.image


def _target(node, pod_bin, source: str, parts: dict[str, str]) -> str:
    node.bin_dir = pod_bin
    return node.cri.run_pod(f"moved-{uuid.uuid4().hex[:6]}", "team-a", annotations={
        "migrt.io/migrate-from": f"{ADDR_A}/team-a/{source}",
        "migrt.io/migrate-pod": ",".join(f"{n}={img}" for n, img in parts.items())})


def _runc_status(node, cid: str) -> str | None:
    res = subprocess.run(["runc", "--root", node.root, "state", cid], capture_output=True, text=True)
    return __import__("json").loads(res.stdout)["status"] if res.returncode == 0 else None


def _still(node, cids, seconds: float = 1.2) -> list:
    """The containers' last ticks, checked not to move for `seconds` (frozen)."""
    before = [_ticks(node, c)[-1:] for c in cids]
    time.sleep(seconds)
    assert [_ticks(node, c)[-1:] for c in cids] == before
    return before


def _all_run_on(node, cids: dict[str, str], after: dict[str, int] | None = None) -> None:
    for n, cid in cids.items():
        last = (after or {}).get(n, 0)
        ticks = _wait_ticks(node, cid, 2, after=last)
        assert not any(line.startswith("broken") for line in _log(node, cid)), (n, _log(node, cid)[-3:])
        assert ticks[0][1] == ticks[0][2]  # hashes unchanged / the very connection


def _log(node, cid: str) -> list[str]:
    from tests.helpers.cri import read_cri_log

    return read_cri_log(node.cri.status(cid).log_path).splitlines()


def test_a_pod_moves_whole_with_one_cut_and_its_loopback_connection_survives(clean, pod_bin):
    a, b = clean["a"], clean["b"]
    name, _, src = _source(a, pod_bin)
    parts = {n: _image_name(a, src[n]) for n in NAMES}
    tpod = _target(b, pod_bin, name, parts)
    tgt = _containers(b, tpod)
    b.cri.start(tgt["native"])  # the first part: the whole source pod freezes at once
    frozen = _still(a, src.values())
    assert b.cri.state_name(tgt["native"]) == "CONTAINER_RUNNING"  # what CRI reports for a held part
    assert _runc_status(b, tgt["native"]) == "paused"               # runc's view: its cgroup frozen
    assert _ticks(b, tgt["native"]) == []                            # it has not run
    b.cri.start(tgt["app"])
    assert _runc_status(b, tgt["app"]) == "paused" and _ticks(b, tgt["native"]) == []
    b.cri.start(tgt["side"])  # the last part: every part thawed together
    for n in NAMES:
        assert_continues(frozen[NAMES.index(n)], _wait_ticks(b, tgt[n], 3))
    time.sleep(1.0)
    _all_run_on(b, tgt)
    assert all(_runc_status(b, c) == "running" for c in tgt.values())
    for cid in src.values():
        a.cri.wait_state(cid, "CONTAINER_EXITED", timeout=60)
    results = [r for r in a.agent_results() if r.get("mode") == "pull"]
    assert sorted(r["pod"]["part"] for r in results) == sorted(NAMES), results
    assert all(r["error"] is None and r["restored"] for r in results), results
    for node in (a, b):
        assert node.staging() == [] and node.cli("ls", "--json").stdout.strip() == "[]"


def test_a_mismatched_pod_is_refused_before_anything_is_frozen(clean, pod_bin):
    a, b = clean["a"], clean["b"]
    name, _, src = _source(a, pod_bin)
    for parts, expect in (
        ({"native": _image_name(a, src["native"]), "app": "example.org/other:1", "side": _image_name(a, src["side"])},
         "container app: image 'example.org/other:1', the source pod's is"),
        ({"native": _image_name(a, src["native"]), "app": _image_name(a, src["app"])},
         "container side: the new pod has no container of that name"),
    ):
        tpod = _target(b, pod_bin, name, parts)
        cid = b.cri.create_container(tpod, "native", b.ctd.image, _commands()["native"],
                                     mounts=[(pod_bin, BIN_DEST)])
        last = {n: _ticks(a, c)[-1][0] for n, c in src.items()}
        with pytest.raises(CriError) as info:
            b.cri.start(cid)
        assert expect in info.value.details and "nothing was frozen" in info.value.details, info.value.details
        assert all(_runc_status(a, c) == "running" for c in src.values())
        _all_run_on(a, src, after=last)  # never frozen: the next tick of each, the connection the same
    assert [c for c in b.runc_containers() if os.path.exists(os.path.join(b.root, c, "migrt-restored"))] == []


def test_a_pod_that_did_not_opt_in_gets_the_one_refusal_and_is_never_frozen(clean, pod_bin):
    a, b = clean["a"], clean["b"]
    name, _, src = _source(a, pod_bin, annotations=None)
    tpod = _target(b, pod_bin, name, {n: _image_name(a, src[n]) for n in NAMES})
    cid = b.cri.create_container(tpod, "native", b.ctd.image, _commands()["native"], mounts=[(pod_bin, BIN_DEST)])
    last = {n: _ticks(a, c)[-1][0] for n, c in src.items()}
    with pytest.raises(CriError) as info:
        b.cri.start(cid)
    assert (f"no migratable container native of pod team-a/{name} for a pod of namespace 'team-a' on node "
            f"{ADDR_A}") in info.value.details, info.value.details
    assert "opted in to live migration (annotation" not in info.value.details  # the reason stays on node A
    (res,) = [r for r in a.agent_results() if r.get("mode") == "pull" and r.get("reason")]
    assert "its pod has not opted in" in res["reason"], res
    _all_run_on(a, src, after=last)


def _one_pod_copy(a, src: dict[str, str], b, tgt: dict[str, str], frozen_at: dict[str, int]) -> None:
    """The source pod runs whole again, every container with its memory and its connection; nothing of
    the pull is left on the target."""
    deadline = time.monotonic() + 60
    while any(_runc_status(a, c) != "running" for c in src.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_runc_status(a, c) for c in src.values()] == ["running"] * 3
    _all_run_on(a, src, after=frozen_at)
    _wait_for("the target's parts removed", lambda: all(b.cri.state_name(c) != "CONTAINER_RUNNING"
                                                        for c in tgt.values() if _exists(b, c)), timeout=60)
    restored = [c for c in b.runc_containers() if os.path.exists(os.path.join(b.root, c, "migrt-restored"))]
    assert restored == [], restored


def _exists(node, cid: str) -> bool:
    try:
        node.cri.status(cid)
    except CriError:
        return False
    return True


def test_exactly_one_copy_of_the_pod_whatever_breaks(clean, pod_bin):
    """One container's image missing on the target (its create never comes), the target's create killed
    at kubelet's deadline, the source's agent killed mid-way: the source pod resumes whole, the target
    keeps nothing."""
    a, b = clean["a"], clean["b"]

    # 1. the third container never comes (its image cannot be pulled): the deadline gives the pod up
    name, _, src = _source(a, pod_bin)
    tpod = _target(b, pod_bin, name, {n: _image_name(a, src[n]) for n in NAMES})
    tgt = _containers(b, tpod)
    b.cri.start(tgt["native"])
    b.cri.start(tgt["app"])
    frozen_at = {n: _ticks(a, c)[-1][0] for n, c in src.items()}
    t0 = time.monotonic()
    _one_pod_copy(a, src, b, {k: tgt[k] for k in ("native", "app")}, frozen_at)
    assert time.monotonic() - t0 < DEADLINE_S + 20
    with pytest.raises(CriError, match="given up"):  # kubelet's retry of a part: refused, nothing frozen
        b.cri.start(tgt["side"])
    assert all(_runc_status(a, c) == "running" for c in src.values())

    # 2. the target's second create killed at kubelet's deadline while its images arrive
    name, _, src = _source(a, pod_bin)
    tpod = _target(b, pod_bin, name, {n: _image_name(a, src[n]) for n in NAMES})
    tgt = _containers(b, tpod)
    b.cri.start(tgt["native"])
    frozen_at = {n: _ticks(a, c)[-1][0] for n, c in src.items()}
    with a.throttled("256kbit"):
        with pytest.raises(CriError) as info:
            b.cri.start(tgt["app"], timeout=2)
        assert info.value.code == "DEADLINE_EXCEEDED", info.value
        _one_pod_copy(a, src, b, {k: tgt[k] for k in ("native", "app")}, frozen_at)

    # 3. the source's agent killed after the first part: the second part finds no cut, the pod is given
    #    up on the target, the source's guards resume every container
    name, _, src = _source(a, pod_bin)
    tpod = _target(b, pod_bin, name, {n: _image_name(a, src[n]) for n in NAMES})
    tgt = _containers(b, tpod)
    b.cri.start(tgt["native"])
    frozen_at = {n: _ticks(a, c)[-1][0] for n, c in src.items()}
    try:
        a.agent.send_signal(signal.SIGKILL)
        a.agent.wait()
        a.start_agent()
        with pytest.raises(CriError):
            b.cri.start(tgt["app"])
        _one_pod_copy(a, src, b, {"native": tgt["native"]}, frozen_at)
    finally:
        a.stop_agent()
        a.start_agent()
    _wait_for("the guards' end", lambda: not procs((b"migrt.migration.guard",)), timeout=60)
    for node in (a, b):
        assert node.staging() == []
