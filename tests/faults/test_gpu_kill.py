"""A migrt killed after the GPU lock, across real processes: the simulated GPU node (MIGRT_FAKE_GPU,
migrt/gpu/fakenode.py) keeps the driver's per-process state in a file, so the killed migrt and the
next command see the same driver. Real runc and CRIU; the container's shell is the "CUDA process"."""

from __future__ import annotations

import json
import uuid

import pytest

from migrt.gpu import fakenode

pytestmark = pytest.mark.integration
GIB = 1 << 30


@pytest.fixture
def gpu_node(node, tmp_path):
    path = tmp_path / "fake-gpu.json"
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"
    path.write_text(json.dumps({"driver_version": "580.159", "process_bytes": GIB, "marker": marker,
                                "gpus": [{"uuid": "GPU-00000000-0000-0000-0000-0000000000bb",
                                          "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GIB}]}))
    node.extra_env[fakenode.ENV] = str(path)
    node.container_env.append(marker)
    node.gpu_file = str(path)
    return node


def driver_states(node, cid: str) -> set[str]:
    pid = json.loads(__import__("subprocess").run(["runc", "--root", node.root, "state", cid], capture_output=True,
                                                  text=True).stdout)["pid"]
    with fakenode.locked(node.gpu_file) as d:
        fakenode.discover(d)
        return {p["state"] for k, p in d["processes"].items() if k == str(pid)}


@pytest.mark.parametrize("phase", ["freezing", "dumping", "committing"])
def test_killed_after_the_gpu_lock_the_next_command_restores_and_unlocks(gpu_node, phase):
    node = gpu_node
    cid = node.run(mb=2)
    assert driver_states(node, cid) == {"running"}
    res = node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck", fault=f"checkpoint:{phase}:kill",
                     check=False)
    assert res.returncode == -9, res.stderr
    [rec] = node.journal()
    assert rec["gpu_pids"] and rec["phase"] == phase
    assert driver_states(node, cid) == {"checkpointed"}  # what SIGKILL left: GPU memory out, locked
    out = node.migrt("ls")
    assert "resumed GPU processes" in out.stderr, out.stderr
    assert driver_states(node, cid) == {"running"}
    node.assert_running(cid)
    node.assert_clean_store()
    assert node.listed() == []
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck", "--leave-running")
    assert driver_states(node, cid) == {"running"}
    assert node.listed() == ["ck"]
