"""kubelet's checkpoint API cancelled: containerd's CRI CheckpointContainer with a deadline shorter
than the dump. containerd kills the runtime and its CRIU mid-dump, which leaves the container frozen
(measured: runc state paused, tasks in D state, CRI still says running: containerd paused it for the
checkpoint and a cancelled call never resumes it). migrt-runc records the
checkpoint in the journal and leaves a watchdog that thaws it once runc/CRIU are gone and containerd
did not resume it (ops/runc_checkpoint.py). Asserts: running again by itself, nothing partial, the
next checkpoint works."""

from __future__ import annotations

import json
import tarfile
import time
import uuid

import pytest

from tests.faults.conftest import counter
from tests.helpers.cri import CriError, read_cri_log
from tests.integration.conftest import run_cli
from tests.integration.workloads import parse_ticks

# containerd 2.1+ only (conftest: not collected for containerd 1.7, which has no CRI CheckpointContainer)
pytestmark = [pytest.mark.integration, pytest.mark.cri_checkpoint_api]


def _ticks(cri, cid: str) -> int:
    return len(parse_ticks(read_cri_log(cri.status(cid).log_path)))


def _wait_more_ticks(cri, cid: str, more: int, timeout: float = 30) -> None:
    start = _ticks(cri, cid)
    deadline = time.monotonic() + timeout
    while _ticks(cri, cid) < start + more:
        if time.monotonic() > deadline:
            raise AssertionError(f"container {cid[:12]} stopped ticking ({cri.state_name(cid)})")
        time.sleep(0.1)


def test_cri_checkpoint_cancelled_by_a_short_deadline(cri, cri_containerd, migrt_config, tmp_path):
    pod = cri.run_pod(f"cancel-{uuid.uuid4().hex[:6]}", "team-a")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", counter(mb=300)])
    cri.start(cid)
    _wait_more_ticks(cri, cid, 3, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(CriError) as info:
        cri.call("CheckpointContainer", cri.api.CheckpointContainerRequest(
            container_id=cid, location=str(tmp_path / "cancelled.tar"), timeout=1), timeout=0.5)
    assert info.value.code in ("DEADLINE_EXCEEDED", "CANCELLED"), info.value
    # nobody runs migrt: migrt-runc's watchdog thaws what containerd left frozen (grace 10 s)
    _wait_more_ticks(cri, cid, 3, timeout=45)
    thawed_after = time.monotonic() - t0
    assert cri.state_name(cid) == "CONTAINER_RUNNING"
    # migrt's store: nothing partial, nothing left to recover
    assert run_cli("ls", "--json").stdout.strip() == "[]"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = json.loads(run_cli("recover", "--list", "--json").stdout)
        if not [e for e in listed["journal"] if e.get("container") == cid]:
            break
        time.sleep(0.2)
    assert [e for e in listed["journal"] if e.get("container") == cid] == [] and listed["incomplete"] == []
    # the next checkpoint, with time enough, succeeds and the container still runs
    good = str(tmp_path / "good.tar")
    cri.checkpoint_container(cid, good, timeout=120)
    with tarfile.open(good) as tar:
        assert any(m.endswith("inventory.img") for m in tar.getnames())
    assert cri.state_name(cid) == "CONTAINER_RUNNING"
    _wait_more_ticks(cri, cid, 2)
    assert thawed_after < 45
