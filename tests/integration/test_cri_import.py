"""kubelet's own checkpoint (CRI CheckpointContainer, served by containerd 2.1's CRI plugin) of a
container running with handler `migrt`, imported with `migrt import` and restored into a new pod
with MIGRT_RESTORE: the counter goes on with the same in-memory data, the writable-layer changes
made before the checkpoint come back, and the namespace binding holds for imported checkpoints too.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass

import pytest

from tests.helpers.cri import CriError, read_cri_log
from tests.integration.conftest import run_cli
from tests.integration.conftest_cri import new_client
from tests.integration.workloads import COUNTER, parse_ticks

# kubelet's checkpoint API (CRI CheckpointContainer) is served by containerd 2.1+ only: these tests are
# not collected for containerd 1.7 (conftest.py); 1.7's pods restore imported checkpoints in test_podman.py.
pytestmark = [pytest.mark.integration, pytest.mark.cri_checkpoint_api]

ROOTFS_COUNTER = "echo rootfs-change > /etc/migrt-marker; rm /bin/wc; " + COUNTER


def _wait_ticks(cri, cid: str, n: int, timeout: float = 30) -> list:
    path = cri.status(cid).log_path
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(read_cri_log(path))
        if len(ticks) >= n:
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} ticks in {path}: {read_cri_log(path)[-2000:]!r}")


@dataclass
class Imported:
    name: str
    manifest: dict
    before: list  # ticks logged before CheckpointContainer was called
    after: list   # ticks logged when it returned (the container keeps running)


@pytest.fixture(scope="module")
def imported(cri_containerd, cri_stubs, migrt_config, tmp_path_factory) -> Imported:
    """CheckpointContainer of a counter in pod team-a/counter (handler migrt), the pod deleted, the
    archive imported with `migrt import`."""
    assert cri_containerd.config_version >= 3, "collected for a containerd without CRI CheckpointContainer"
    base = tmp_path_factory.mktemp("cri-import")
    client = new_client(cri_containerd, cri_stubs, str(base / "kubelet"))
    try:
        pod = client.run_pod("counter", "team-a")
        cid = client.create_container(pod, "app", cri_containerd.image, ["sh", "-c", ROOTFS_COUNTER])
        client.start(cid)
        before = _wait_ticks(client, cid, 5)
        # kubelet's location: /var/lib/kubelet/checkpoints/checkpoint-<pod>_<namespace>-<container>-<time>.tar
        location = str(base / f"checkpoint-counter_team-a-app-{uuid.uuid4().hex[:6]}.tar")
        client.checkpoint_container(cid, location)
        after = parse_ticks(read_cri_log(client.status(cid).log_path))
        assert client.state_name(cid) == "CONTAINER_RUNNING"  # kubelet's checkpoint leaves it running
        client.delete_pod(pod)

        name = f"kcp-{uuid.uuid4().hex[:6]}"
        res = run_cli("import", location, "--name", name, "--json")
        manifest = json.loads(res.stdout)
        assert manifest["name"] == name
        yield Imported(name, manifest, before, after)
    finally:
        client.cleanup()
        client.close()


def test_import_records_the_source(imported, migrt_config):
    m = imported.manifest
    assert m["source"]["cri"]["pod_namespace"] == "team-a"
    assert m["source"]["cri"]["pod_name"] == "counter"
    assert m["source"]["cri"]["container_name"] == "app"
    assert m["imported"]["format"] == "kubernetes-checkpoint-archive"
    assert m["versions"]["criu"] and m["versions"]["migrt"] is None
    assert m["rootfs"]["captured"] is True and m["rootfs"]["deleted"] >= 1
    with open(os.path.join(migrt_config["store"], imported.name, "manifest.json")) as fh:
        stored = json.load(fh)
    dests = {x["destination"] for x in stored["mounts"]}
    assert {"/etc/hosts", "/dev/termination-log"} <= dests
    with open(os.path.join(migrt_config["store"], imported.name, "rootfs-diff.json")) as fh:
        assert "bin/wc" in json.load(fh)["deleted"]
    run_cli("inspect", imported.name, "--verify")


def test_imported_checkpoint_resumes_in_new_pod(cri, cri_containerd, imported):
    pod = cri.run_pod("counter-imported", "team-a")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", "echo started-fresh; " + COUNTER],
                               env={"MIGRT_RESTORE": imported.name})
    t0 = time.monotonic()
    cri.start(cid)
    assert time.monotonic() - t0 < 120, "StartContainer beyond kubelet's default runtime request timeout"
    cri.wait_state(cid, "CONTAINER_RUNNING")
    ticks = _wait_ticks(cri, cid, 3)
    first, last_before, last_after = ticks[0], imported.before[-1], imported.after[-1]
    # the process resumes where CheckpointContainer froze it, not from 1
    assert last_before[0] < first[0] <= last_after[0] + 1, (first, last_before, last_after)
    h = last_before[1]
    assert all(t[1] == h and t[2] == h for t in ticks), (ticks, h)  # in-memory data identical
    log = read_cri_log(cri.status(cid).log_path)
    assert "started-fresh" not in log
    # the writable layer came back: the new file, and the deletion
    code, out, _ = cri.exec_sync(cid, ["cat", "/etc/migrt-marker"])
    assert (code, out.strip()) == (0, "rootfs-change")
    code, _, _ = cri.exec_sync(cid, ["sh", "-c", "test -e /bin/wc"])
    assert code == 1
    run_cli("inspect", imported.name, "--verify")  # the checkpoint stays as it was


def test_imported_checkpoint_refused_in_other_namespace(cri, cri_containerd, imported):
    pod = cri.run_pod("counter-elsewhere", "team-b")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", COUNTER],
                               env={"MIGRT_RESTORE": imported.name})
    with pytest.raises(CriError) as err:
        cri.start(cid)
    assert "team-a" in err.value.details and "team-b" in err.value.details, err.value.details
    assert cri.state_name(cid) != "CONTAINER_RUNNING"
