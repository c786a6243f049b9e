"""A checkpoint with GPU state restored by `migrt-runc create` with the real runc and CRIU, on the
simulated GPU node (MIGRT_FAKE_GPU, migrt/gpu/fakenode.py). The GPU preflight (the GPUs, their free
memory) and the driver's load run while CRIU restores: the restore gate holds the restored tree at
CRIU's post-restore until they have passed. A preflight that fails there makes CRIU kill the tree:
no GPU call on it, no container left, the checkpoint intact and the reason in runc's --log."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from migrt.gpu import fakenode
from tests.helpers.bundles import make_bundle
from tests.integration.conftest import SHIM, run_cli
from tests.integration.test_gpu_pause import GIB, driver, fake_gpu, runc_root  # noqa: F401 - fixtures
from tests.integration.test_runc import Piped, _state
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration


def checkpoint_marked(runc_root: str, tmp_path, fake_gpu, name: str) -> tuple[int, str]:
    """A counter whose init is a (simulated) CUDA process, checkpointed: its last tick and checksum."""
    marker = json.loads(fake_gpu.read_text())["marker"]
    sid = f"gsrc-{uuid.uuid4().hex[:6]}"
    bundle = make_bundle(str(tmp_path / sid), ["sh", "-c", COUNTER], env=[marker])
    src = Piped(["runc", "--root", runc_root, "create", sid], bundle)
    assert src.rc == 0, src.read_for(0.5)
    subprocess.run(["runc", "--root", runc_root, "start", sid], check=True)
    assert len(parse_ticks(src.read_for(1.0))) >= 2
    run_cli("checkpoint", sid, "--root", runc_root, "--name", name)
    last = parse_ticks(src.read_for(0.3))[-1]
    src.close()
    with fakenode.locked(str(fake_gpu)) as d:  # what is restored arrives checkpointed, as on a real node
        d["new_state"] = "checkpointed"
    return last[0], last[2]


def create(runc_root: str, tmp_path, name: str) -> tuple[Piped, str, str]:
    did = f"gdst-{uuid.uuid4().hex[:6]}"
    bundle = make_bundle(str(tmp_path / did), ["sh", "-c", "echo fresh"], env=[f"MIGRT_RESTORE={name}"])
    log = os.path.join(bundle, "log.json")
    dst = Piped([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle", bundle,
                 "--pid-file", os.path.join(bundle, "init.pid"), did], bundle)
    return dst, did, log


def gpu_calls(fake_gpu) -> list[str]:
    return [c[0] for c in driver(fake_gpu)["calls"] if c[0] in ("lock", "checkpoint", "restore", "unlock")]


def restored_event(migrt_config, did: str) -> dict:
    for line in reversed(open(migrt_config["log"]).read().splitlines()):
        ev = json.loads(line)
        if ev.get("event") == "restored" and ev.get("container_id") == did:
            return ev
    raise AssertionError(f"no restored event for {did}")


def test_gpu_checkpoint_restores_with_the_preflight_behind_criu(runc_root, fake_gpu, migrt_config, tmp_path):
    tick, digest = checkpoint_marked(runc_root, tmp_path, fake_gpu, "gpu-start-ok")
    assert gpu_calls(fake_gpu) == ["lock", "checkpoint"]
    dst, did, log = create(runc_root, tmp_path, "gpu-start-ok")
    try:
        assert dst.rc == 0, open(log).read() if os.path.exists(log) else ""
        assert gpu_calls(fake_gpu) == ["lock", "checkpoint", "restore", "unlock"]
        after = parse_ticks(dst.read_for(1.0))
        assert after and after[0][0] == tick + 1 and all(t[2] == digest for t in after)
        ev = restored_event(migrt_config, did)
        t = ev["timings"]
        assert ev["restore_gate"] == "held" and t["gpu_preflight_s"] >= 0 and t["gpu_driver_s"] >= 0
        assert "gpu_preflight" not in t["start_marks"]  # nothing of the GPU before the runc call
        assert t["gpu_restore_s"] >= 0
    finally:
        dst.close()


def test_a_failing_preflight_stops_the_restore_at_the_gate_and_keeps_the_checkpoint(runc_root, fake_gpu,
                                                                                     migrt_config, tmp_path):
    checkpoint_marked(runc_root, tmp_path, fake_gpu, "gpu-start-full")
    with fakenode.locked(str(fake_gpu)) as d:  # the GPU now has too little memory for the checkpoint's 4 GiB
        d["gpus"][0]["memory_total"] = 1 * GIB
    dst, did, log = create(runc_root, tmp_path, "gpu-start-full")
    try:
        assert dst.rc == 8, open(log).read()
        lines = [json.loads(ln) for ln in open(log).read().splitlines()]
        assert "has 1.0 GiB free" in lines[-1]["msg"] and "4.0 GiB" in lines[-1]["msg"], lines[-1]
        assert any(ln.get("level") == "error" and not ln["msg"].startswith("migrt:") for ln in lines[:-1]), lines
        assert gpu_calls(fake_gpu) == ["lock", "checkpoint"]  # no GPU call on what CRIU had restored
        assert not os.path.exists(os.path.join(runc_root, did)) and _state(runc_root, did) == {}
        assert not [f for f in os.listdir(os.path.dirname(log)) if f.startswith(".migrt")]  # view, work dir
    finally:
        dst.close()
    run_cli("inspect", "gpu-start-full", "--verify")  # intact, and restores once the memory is there:
    with fakenode.locked(str(fake_gpu)) as d:
        d["gpus"][0]["memory_total"] = 80 * GIB
    dst, did, log = create(runc_root, tmp_path, "gpu-start-full")
    try:
        assert dst.rc == 0, open(log).read()
        assert gpu_calls(fake_gpu) == ["lock", "checkpoint", "restore", "unlock"]
    finally:
        dst.close()


def test_through_the_page_filler_the_gpu_restore_waits_for_its_own_memory(runc_root, fake_gpu, migrt_config,
                                                                          tmp_path, monkeypatch):
    """The real filler's status, keyed by pids inside the container, and the restored host pid meet:
    the GPU restore of the container's init starts once its memory is complete."""
    tick, digest = checkpoint_marked(runc_root, tmp_path, fake_gpu, "gpu-start-lazy")
    monkeypatch.setenv("MIGRT_RESTORE_PAGES", "lazy")
    dst, did, log = create(runc_root, tmp_path, "gpu-start-lazy")
    try:
        assert dst.rc == 0, open(log).read() if os.path.exists(log) else ""
        assert gpu_calls(fake_gpu) == ["lock", "checkpoint", "restore", "unlock"]
        ev = restored_event(migrt_config, did)
        assert ev["pages"]["mode"] == "lazy"
        (one,) = ev["timings"]["gpu_restores"]
        assert one["pid"] == ev["pid"] and one["vpid"] == 1
        assert 0 <= one["memory_in_s"] <= one["gpu_restore_start_s"] and one["gpu_restore_s"] >= 0
        after = parse_ticks(dst.read_for(1.0))
        assert after and after[0][0] == tick + 1 and all(t[2] == digest for t in after)
    finally:
        dst.close()
