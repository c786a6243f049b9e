"""A pod-level pull's init container (migration/initran.py, issue 29) on two CRI "nodes": the source
pod ran a regular init container (it appends a line to a file of a host directory and prints), then
its three containers (test_pod_level_pull.py's trio). On the target, the new pod's init container of
the same name and image is created as an exit(0): it exits 0, the file gets no second line, its log is
empty; then the trio moves with one cut as before."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers.migration import assert_continues
from tests.integration.test_cri_pagefill import BIN_DEST, bin_dir  # noqa: F401 - the workloads' fixture
from tests.integration.test_pod_level_pull import (  # noqa: F401 - nodes, clean, pod_bin: fixtures
    MIGRATABLE,
    NAMES,
    _commands,
    _containers,
    _image_name,
    _log,
    _still,
    _target,
    _wait_ticks,
    clean,
    nodes,
    pod_bin,
)

pytestmark = pytest.mark.integration

INIT = ["sh", "-c", "echo ran >> /marker/runs; echo init-output"]


def _init(node, pod: str, marker: str) -> str:
    """The pod's init container, run to completion (exit 0), as kubelet runs it before the others."""
    cid = node.cri.create_container(pod, "setup", node.ctd.image, INIT, mounts=[(marker, "/marker")])
    node.cri.start(cid)
    st = node.cri.wait_state(cid, "CONTAINER_EXITED", timeout=60)
    assert st.exit_code == 0, st
    return cid


def test_an_init_container_that_ran_on_the_source_is_not_run_again(clean, pod_bin, tmp_path):  # noqa: F811 - the fixtures imported above
    a, b = clean["a"], clean["b"]
    marker = tmp_path / "marker"
    marker.mkdir()
    a.bin_dir = pod_bin
    name = f"trio-{uuid.uuid4().hex[:6]}"
    pod = a.cri.run_pod(name, "team-a", annotations=MIGRATABLE)
    init_a = _init(a, pod, str(marker))
    assert (marker / "runs").read_text() == "ran\n" and _log(a, init_a) == ["init-output"]
    src = {}
    for n, cmd in _commands().items():
        src[n] = a.cri.create_container(pod, n, a.ctd.image, cmd, mounts=[(pod_bin, BIN_DEST)])
        a.cri.start(src[n])
    for cid in src.values():
        _wait_ticks(a, cid, 3)

    tpod = _target(b, pod_bin, name, {n: _image_name(a, src[n]) for n in NAMES})
    init_b = _init(b, tpod, str(marker))  # exit 0 without its program
    assert (marker / "runs").read_text() == "ran\n" and _log(b, init_b) == []
    (res,) = [r for r in a.agent_results() if "init_ran" in r]
    assert res["init_ran"] is True and res["error"] is None, res
    assert "no longer in the source pod" in res["reason"], res  # containerd deleted it when it exited
    with open(b.log) as fh:
        assert "init_container_skipped" in fh.read()

    tgt = _containers(b, tpod)
    for n in NAMES:
        b.cri.start(tgt[n])
        if n == "native":
            frozen = _still(a, src.values())
    for n in NAMES:
        assert_continues(frozen[NAMES.index(n)], _wait_ticks(b, tgt[n], 3))
    for cid in src.values():
        a.cri.wait_state(cid, "CONTAINER_EXITED", timeout=60)


def test_an_init_container_of_a_source_that_did_not_opt_in_runs_fresh(clean, pod_bin, tmp_path):  # noqa: F811 - the fixtures imported above
    a, b = clean["a"], clean["b"]
    marker = tmp_path / "marker"
    marker.mkdir()
    a.bin_dir = pod_bin
    name = f"trio-{uuid.uuid4().hex[:6]}"
    pod = a.cri.run_pod(name, "team-a")
    _init(a, pod, str(marker))
    src = _containers(a, pod)
    for cid in src.values():
        a.cri.start(cid)
    tpod = _target(b, pod_bin, name, {n: _image_name(a, src[n]) for n in NAMES})
    init_b = _init(b, tpod, str(marker))  # the agent's one refusal: it runs, as before
    assert (marker / "runs").read_text() == "ran\nran\n" and _log(b, init_b) == ["init-output"]
    (res,) = [r for r in a.agent_results() if r.get("reason") and "opted in" in r["reason"]]
    assert res["error"], res
