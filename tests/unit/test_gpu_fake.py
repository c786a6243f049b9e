"""The GPU layer on the fake backend: the state machine, suspend/resume of many processes with undo,
preflight, GPU visibility from config.json, the GPU record and the device node fix-up."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from migrt.errors import PreconditionFailed
from migrt.gpu import devnodes, preflight, records, session, visible
from migrt.gpu.backend import CHECKPOINTED, FAILED, LOCKED, RUNNING, GpuError, uuid_bytes, uuid_text
from migrt.gpu.fake import FakeGpuBackend, IllegalTransition
from migrt.gpu.inventory import Gpu, Inventory

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
U2 = "GPU-22222222-2222-2222-2222-222222222222"
GIB = 1 << 30


def inventory(*gpus: Gpu, driver: str = "580.159") -> Inventory:
    return Inventory(source="nvml", driver_version=driver, gpus=list(gpus))


def h100(index: int, uuid: str, free_gib: int = 70) -> Gpu:
    return Gpu(index=index, uuid=uuid, name="NVIDIA H100 80GB HBM3", pci_bus_id=f"00000000:{index + 0x10:02X}:00.0",
               minor=index, memory_total=80 * GIB, memory_used=(80 - free_gib) * GIB, memory_free=free_gib * GIB)


def section(gpus: list[Gpu], mem_gib: int = 8, driver: str = "580.159") -> dict:
    return {
        "schema": 1, "driver_version": driver,
        "gpus": [{"uuid": g.uuid, "name": g.name, "pci_bus_id": g.pci_bus_id, "memory_total": g.memory_total,
                  "index": g.index, "minor": g.minor} for g in gpus],
        "processes": [{"pid": 100, "gpus": [g.uuid for g in gpus], "memory_bytes": mem_gib * GIB * len(gpus),
                       "gpu_memory": {g.uuid: mem_gib * GIB for g in gpus}}],
    }


# -- the fake's state machine ---------------------------------------------------------------------------
def test_full_cycle_and_states():
    b = FakeGpuBackend([7])
    assert b.state(7) == RUNNING
    b.lock(7, 1000)
    assert b.state(7) == LOCKED
    b.checkpoint(7)
    assert b.state(7) == CHECKPOINTED
    b.restore(7)
    assert b.state(7) == LOCKED
    b.unlock(7)
    assert b.state(7) == RUNNING
    assert [c for c, _, _ in b.calls if c != "state"] == ["lock", "checkpoint", "restore", "unlock"]
    assert b.calls[1] == ("lock", 7, 1000)


@pytest.mark.parametrize("steps, bad", [
    ([], "checkpoint"), ([], "restore"), ([], "unlock"),
    (["lock"], "lock"), (["lock"], "restore"),
    (["lock", "checkpoint"], "lock"), (["lock", "checkpoint"], "checkpoint"), (["lock", "checkpoint"], "unlock"),
])
def test_illegal_transitions_raise_and_change_nothing(steps, bad):
    b = FakeGpuBackend([7])
    for s in steps:
        getattr(b, s)(7)
    before = b.state(7)
    with pytest.raises(IllegalTransition, match=f"{bad} \\(pid 7\\): process is {before}"):
        getattr(b, bad)(7)
    assert b.state(7) == before


def test_unknown_pid_is_not_found():
    with pytest.raises(GpuError, match="NOT_FOUND") as info:
        FakeGpuBackend([1]).lock(2)
    assert info.value.code == 500


def test_injected_failure_fires_once():
    b = FakeGpuBackend([1])
    b.fail("lock", 1)
    with pytest.raises(GpuError, match="injected"):
        b.lock(1)
    assert b.state(1) == RUNNING
    b.lock(1)
    assert b.state(1) == LOCKED


def test_uuid_text_round_trip():
    raw = uuid_bytes("GPU-8c2d6a5e-1b2c-3d4e-5f60-718293a4b5c6")
    assert len(raw) == 16 and raw[:2] == b"\x8c\x2d"
    assert uuid_text(raw) == "GPU-8c2d6a5e-1b2c-3d4e-5f60-718293a4b5c6"
    with pytest.raises(ValueError):
        uuid_bytes("GPU-123")


# -- suspend_all / resume_all ---------------------------------------------------------------------------
def test_suspend_all_locks_everyone_before_any_checkpoint():
    b = FakeGpuBackend([1, 2, 3])
    session.suspend_all([1, 2, 3], b, 5000)
    assert all(b.state(p) == CHECKPOINTED for p in (1, 2, 3))
    order = [c for c, _, _ in b.calls if c in ("lock", "checkpoint")]
    assert order[:3] == ["lock"] * 3 and order[3:] == ["checkpoint"] * 3
    assert {extra for c, _, extra in b.calls if c == "lock"} == {5000}


def test_suspend_all_runs_the_processes_in_parallel():
    """Each lock waits for all three to be inside lock(): only passes if they run at once."""
    barrier = threading.Barrier(3, timeout=5)

    class Slow(FakeGpuBackend):
        def lock(self, pid, timeout_ms=0):
            barrier.wait()
            super().lock(pid, timeout_ms)

    b = Slow([1, 2, 3])
    session.suspend_all([1, 2, 3], b)
    assert all(b.state(p) == CHECKPOINTED for p in (1, 2, 3))


@pytest.mark.parametrize("parallel", [True, False])
def test_failed_lock_undoes_everything(parallel):
    b = FakeGpuBackend([1, 2, 3])
    b.fail("lock", 2, message="CUDA_ERROR_TIMEOUT")
    with pytest.raises(GpuError) as info:
        session.suspend_all([1, 2, 3], b, parallel=parallel)
    assert "GPU lock of 3 process(es) failed" in str(info.value) and "CUDA_ERROR_TIMEOUT" in str(info.value)
    assert "every process was resumed" in str(info.value)
    assert {p: b.state(p) for p in (1, 2, 3)} == {1: RUNNING, 2: RUNNING, 3: RUNNING}
    assert b.calls_of("checkpoint") == []
    assert sorted(b.calls_of("unlock")) == [1, 3]


@pytest.mark.parametrize("parallel", [True, False])
def test_failed_checkpoint_undoes_everything(parallel):
    b = FakeGpuBackend([1, 2, 3])
    b.fail("checkpoint", 3)
    with pytest.raises(GpuError, match="GPU checkpoint of 3 process\\(es\\) failed") as info:
        session.suspend_all([1, 2, 3], b, parallel=parallel)
    assert info.value.pid == 3
    assert {p: b.state(p) for p in (1, 2, 3)} == {1: RUNNING, 2: RUNNING, 3: RUNNING}
    assert sorted(b.calls_of("restore")) == [1, 2]  # the checkpointed ones came back first
    assert sorted(b.calls_of("unlock")) == [1, 2, 3]


def test_undo_that_cannot_resume_says_so_and_still_resumes_the_others():
    b = FakeGpuBackend([1, 2])
    b.fail("checkpoint", 2, to_failed=True)  # the driver leaves it 'failed'
    with pytest.raises(GpuError) as info:
        session.suspend_all([1, 2], b)
    assert "1 process(es) could NOT be resumed" in str(info.value)
    assert any("undo pid 2" in d and "failed" in d for d in info.value.details)
    assert b.state(1) == RUNNING and b.state(2) == FAILED


def test_undo_when_the_state_query_fails_uses_what_it_knows():
    b = FakeGpuBackend([1, 2])
    b.fail("checkpoint", 2)
    b.fail("state", 1, times=5)
    with pytest.raises(GpuError):
        session.suspend_all([1, 2], b)
    assert b.states == {1: RUNNING, 2: RUNNING}


def test_resume_all_restores_then_unlocks_with_the_remap():
    b = FakeGpuBackend({1: CHECKPOINTED, 2: CHECKPOINTED})
    remap = [(uuid_bytes(U0), uuid_bytes(U1))]
    session.resume_all([1, 2], b, remap)
    assert b.states == {1: RUNNING, 2: RUNNING}
    assert b.remaps == {1: remap, 2: remap}
    order = [c for c, _, _ in b.calls]
    assert order.index("unlock") > max(i for i, c in enumerate(order) if c == "restore")


def test_resume_all_failure_names_the_process_and_resumes_the_rest():
    b = FakeGpuBackend({1: CHECKPOINTED, 2: CHECKPOINTED, 3: CHECKPOINTED})
    b.fail("restore", 2, message="CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(GpuError, match="GPU restore of 1 of 3 process\\(es\\) failed \\(pids 2\\)"):
        session.resume_all([1, 2, 3], b)
    assert b.states == {1: RUNNING, 2: CHECKPOINTED, 3: RUNNING}


def test_resume_if_needed_from_mixed_states():
    b = FakeGpuBackend({1: CHECKPOINTED, 2: LOCKED, 3: RUNNING})
    session.resume_if_needed([1, 2, 3], b)
    assert b.states == {1: RUNNING, 2: RUNNING, 3: RUNNING}
    assert b.calls_of("restore") == [1]


# -- preflight ------------------------------------------------------------------------------------------
def test_preflight_same_gpus_needs_no_remap():
    g0, g1 = h100(0, U0), h100(1, U1)
    p = preflight.check(section([g0]), inventory(g0, g1), [U0], what="checkpoint c")
    assert p.pairs == [(U0, U0)] and p.remap() is None and not p.moved


def test_preflight_other_gpu_gives_the_driver_pairs():
    g0, g1 = h100(0, U0), h100(1, U1)
    p = preflight.check(section([g0]), inventory(g0, g1), [U1], what="checkpoint c")
    assert p.remap() == [(uuid_bytes(U0), uuid_bytes(U1))]


def test_preflight_pairs_in_pci_order_whatever_the_config_order():
    g0, g1, g2 = h100(0, U0), h100(1, U1), h100(2, U2)
    p = preflight.check(section([g1, g0]), inventory(g0, g1, g2), [U2, U1], what="checkpoint c")
    assert p.pairs == [(U0, U1), (U1, U2)]


def test_preflight_without_targets_uses_the_same_gpus_if_present():
    g0 = h100(0, U0)
    assert preflight.check(section([g0]), inventory(g0), None, what="c").pairs == [(U0, U0)]
    with pytest.raises(PreconditionFailed, match="does not say which GPUs"):
        preflight.check(section([g0]), inventory(h100(0, U1)), None, what="c")


@pytest.mark.parametrize("case, match", [
    ("count", "ran on 1 GPU\\(s\\).*gets 2"),
    ("model", "GPU model mismatch.*H100.*A100"),
    ("driver", "taken with NVIDIA driver 580.159; this node has 575.51.03, which is older"),
    ("memory", "has 4.0 GiB free; the checkpoint's processes held 8.0 GiB"),
    ("absent", "GPU\\(s\\) GPU-2222.* are not on this node"),
    ("nodriver", "no usable NVIDIA driver"),
])
def test_preflight_mismatches_are_clear(case, match):
    g0, g1 = h100(0, U0), h100(1, U1)
    sec, inv, targets = section([g0]), inventory(g0, g1), [U1]
    if case == "count":
        targets = [U0, U1]
    elif case == "model":
        inv = inventory(g0, Gpu(index=1, uuid=U1, name="NVIDIA A100-SXM4-80GB", pci_bus_id="x", minor=1))
    elif case == "driver":
        inv = inventory(g0, g1, driver="575.51.03")
    elif case == "memory":
        inv = inventory(g0, h100(1, U1, free_gib=4))
    elif case == "absent":
        targets = [U2]
    elif case == "nodriver":
        inv = Inventory(source="none", error="no driver")
    with pytest.raises(PreconditionFailed, match=match) as info:
        preflight.check(sec, inv, targets, what="checkpoint c")
    assert info.value.exit_code == 8 and str(info.value).startswith("checkpoint c")


def test_newer_driver_is_fine():
    g0 = h100(0, U0)
    preflight.check(section([g0], driver="570.86"), inventory(g0, driver="580.159"), [U0], what="c")


# -- which GPUs config.json gives -----------------------------------------------------------------------
INV3 = inventory(h100(0, U0), h100(1, U1), h100(2, U2))


@pytest.mark.parametrize("config, expect", [
    ({"linux": {"devices": [{"path": "/dev/nvidia2", "type": "c", "major": 195, "minor": 2},
                            {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}]}}, [U2]),
    ({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}, [U0, U1, U2]),
    ({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=1,GPU-00000000-0000-0000-0000-000000000000"]}}, [U1, U0]),
    ({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}, []),
    ({"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=2"}}, [U2]),
    ({"annotations": {"cdi.k8s.io/a": "nvidia.com/gpu=GPU-11111111-1111-1111-1111-111111111111,vendor.com/x=1"}}, [U1]),
    ({"process": {"env": ["PATH=/bin"]}}, None),
    # the resolved device nodes win over an image's NVIDIA_VISIBLE_DEVICES=all
    ({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]},
      "linux": {"devices": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]}}, [U1]),
])
def test_visible_from_config(config, expect):
    assert visible.from_config(config, INV3) == expect


@pytest.mark.parametrize("config, match", [
    ({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=7"]}}, "index 7"),
    ({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=MIG-abc"]}}, "no MIG"),
    ({"linux": {"devices": [{"path": "/dev/nvidia9", "type": "c", "major": 195, "minor": 9}]}}, "minor 9"),
])
def test_visible_from_config_errors(config, match):
    with pytest.raises(visible.VisibleError, match=match):
        visible.from_config(config, INV3)


# -- the record -----------------------------------------------------------------------------------------
def test_record_describes_processes_and_gpus_and_round_trips(tmp_path):
    inv = inventory(h100(0, U0), h100(1, U1))
    inv.processes = {os.getpid(): [(U1, 3 * GIB)]}
    sec = records.describe([os.getpid()], inv, [U1])
    assert sec["gpus"][0]["uuid"] == U1 and sec["gpus"][0]["name"].startswith("NVIDIA H100")
    proc = sec["processes"][0]
    assert proc["pid"] == os.getpid() and proc["gpus"] == [U1] and proc["memory_bytes"] == 3 * GIB
    assert proc["ns_pid"] and proc["comm"]
    records.write_image_file(str(tmp_path), sec)
    assert records.read_image_file(str(tmp_path)) == json.loads(json.dumps(sec))
    assert records.read_image_file(str(tmp_path / "none")) is None
    (tmp_path / records.IMAGE_FILE).write_text(json.dumps({"schema": 99}))
    with pytest.raises(ValueError, match="schema 99"):
        records.read_image_file(str(tmp_path))


def test_visible_at_checkpoint_prefers_config_then_dev_then_usage():
    inv = inventory(h100(0, U0), h100(1, U1))
    inv.processes = {5: [(U1, 1)]}
    assert records.visible_at_checkpoint([U0], [U1], [5], inv) == [U0]
    assert records.visible_at_checkpoint(None, [U1], [5], inv) == [U1]
    assert records.visible_at_checkpoint(None, None, [5], inv) == [U1]
    assert records.visible_at_checkpoint(None, None, [6], inv) == [U0, U1]


# -- /dev/nvidia* in the restored container ----------------------------------------------------------------
def test_devnodes_sync_creates_fixes_and_removes(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.fail("this test needs root (mknod); the unit tests run as root in CI")
    host = {"nvidiactl": os.makedev(195, 255), "nvidia-uvm": os.makedev(511, 0), "nvidia1": os.makedev(195, 1)}
    monkeypatch.setattr(devnodes, "_host_rdev", lambda name: host.get(name))
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia0", 0o666 | stat.S_IFCHR, os.makedev(195, 0))    # the old GPU: goes
    os.mknod(dev / "nvidia-uvm", 0o666 | stat.S_IFCHR, os.makedev(235, 0))  # old node's major: fixed
    os.mknod(dev / "nvidiactl", 0o666 | stat.S_IFCHR, os.makedev(195, 255))  # right: kept
    (dev / "null").write_text("")
    changes = devnodes.sync(0, [1], dev_dir=str(dev))
    assert sorted(os.listdir(dev)) == ["null", "nvidia-uvm", "nvidia1", "nvidiactl"]
    assert os.stat(dev / "nvidia1").st_rdev == os.makedev(195, 1)
    assert os.stat(dev / "nvidia-uvm").st_rdev == os.makedev(511, 0)
    assert stat.S_IMODE(os.stat(dev / "nvidia1").st_mode) == 0o666
    assert changes == ["removed nvidia0", "recreated nvidia-uvm (511:0)", "created nvidia1 (195:1)"]
    assert devnodes.sync(0, [1], dev_dir=str(dev)) == []


# -- migrt inspect / migrt doctor --------------------------------------------------------------------------
def test_inspect_renders_the_gpu_section():
    from migrt.cli.gpu_render import gpu_lines

    inv = inventory(h100(0, U0))
    inv.cuda_driver_version = 13000
    inv.processes = {os.getpid(): [(U0, 8 * GIB)]}
    sec = records.describe([os.getpid()], inv, [U0])
    sec["timings"]["gpu_checkpoint_s"] = 4.6
    lines = gpu_lines(sec)
    assert lines[0] == ("gpu:        NVIDIA driver 580.159 (CUDA 13.0), 1 GPU(s), 1 CUDA process(es), "
                        "GPU checkpoint 4.60 s")
    assert lines[1].startswith(f"  GPU 0  NVIDIA H100 80GB HBM3  {U0}  80.0 GiB  bus 00000000:10:00.0")
    assert f"pid {os.getpid():>7}" in lines[2] and lines[2].endswith(f"8.0 GiB on {U0}")
    assert gpu_lines({})[0].startswith("gpu:        NVIDIA driver ?, 0 GPU(s), 0 CUDA process(es)")


def test_doctor_without_gpu_is_one_warning():
    from migrt.node.doctor_gpu import gpu_checks

    checks = gpu_checks("/usr/sbin/runc", inv=Inventory(source="none", error="no driver"))
    assert [(c["name"], c["status"]) for c in checks] == [("gpu", "warn")]
    assert checks[0]["detail"] == "no GPU: no driver"


def test_doctor_on_a_gpu_node(monkeypatch, tmp_path):
    from migrt.node import doctor_gpu

    class Api:
        def available(self):
            return True

        def driver_api_version(self):
            return 13000

    g = h100(0, U0)
    g.persistence_mode = False
    monkeypatch.setattr(doctor_gpu, "thp_setting", lambda path=None: "madvise")
    monkeypatch.setattr(doctor_gpu, "CDI_SPECS", (str(tmp_path / "none*.yaml"),))
    conf = tmp_path / "runc.conf"
    conf.write_text("# criu options\naction-script /nonexistent/cuda-criu-action\n")
    monkeypatch.setattr(doctor_gpu, "CRIU_CONFIGS", (str(conf),))
    checks = {c["name"]: c for c in doctor_gpu.gpu_checks("/usr/sbin/runc", backend=Api(), inv=inventory(g))}
    assert checks["gpu driver"]["status"] == "ok" and "1 x NVIDIA H100" in checks["gpu driver"]["detail"]
    assert checks["gpu checkpoint API"]["detail"] == "cuCheckpointProcess* present (driver API 13.0)"
    assert checks["gpu persistence mode"]["status"] == "warn"
    assert checks["transparent huge pages"]["status"] == "warn" and "1.57x" in checks["transparent huge pages"]["fix"]
    assert checks["gpu container runtime"]["status"] == "warn"
    assert checks["gpu CRIU hook"]["status"] == "fail"
    old = doctor_gpu.gpu_checks("/usr/bin/nvidia-container-runtime", backend=Api(),
                                inv=inventory(h100(0, U0), driver="575.51.03"))
    names = {c["name"]: c["status"] for c in old}
    assert names["gpu checkpoint API"] == "warn" and names["gpu container runtime"] == "ok"
    # the one-line answer for a migration target
    target = checks["gpu containers (restore and migrate here)"]
    assert target["status"] == "ok" and target["detail"].startswith("yes, onto any GPU of the same model")
    assert "GPU 0 NVIDIA H100 80GB HBM3 70.0 GiB free" in target["detail"]
    assert "only onto the GPUs they left" in {c["name"]: c for c in old}["gpu containers (restore and migrate here)"]["detail"]

    class NoApi(Api):
        def available(self):
            return False

        def unavailable_reason(self):
            return "libcuda.so.1 has no cuCheckpointProcessLock"

    none = {c["name"]: c for c in doctor_gpu.gpu_checks("/usr/sbin/runc", backend=NoApi(), inv=inventory(g))}
    assert none["gpu containers (restore and migrate here)"]["status"] == "fail"
    assert "no cuCheckpointProcessLock" in none["gpu containers (restore and migrate here)"]["detail"]


def test_gpu_report_table(tmp_path):
    from tests.gpu import report

    rows = [{"test": "roundtrip", "gb": 2.0, "processes": 1, "gpu_checkpoint_s": 1.234, "image_bytes": 3 << 30,
             "gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159", "torch": "2.9.0"},
            {"test": "pair", "gb": 2.0, "processes": 2, "gpu_restore_s": 0.5, "gpu": "NVIDIA H100 80GB HBM3",
             "driver": "580.159", "torch": "2.9.0"}]
    text = report.render(rows)
    lines = text.splitlines()
    assert lines[0] == "| test | GB | procs | GPU ckpt s | GPU restore s | image GiB |"
    assert lines[2] == "| roundtrip | 2.00 | 1 | 1.23 | - | 3.00 |"
    assert lines[3] == "| pair | 2.00 | 2 | - | 0.50 | - |"
    assert lines[-1] == "GPU NVIDIA H100 80GB HBM3, driver 580.159, torch 2.9.0"
