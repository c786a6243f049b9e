"""Checkpoint images between podman and migrt through a real registry (docker-registry, TLS, basic
auth): podman's `container checkpoint --create-image` + `podman push` restored by reference in a
Kubernetes pod through containerd's CRI (on a node whose config allows checkpoints that record no
Kubernetes namespace), and migrt's `push --format cri` restored by
`podman container restore IMAGE`."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest

from tests.helpers.cri import read_cri_log
from tests.integration.conftest import run_cli
from tests.integration.test_podman import _wait_ticks, podman, unbound_allowed  # noqa: F401 - fixtures
from tests.integration.test_registry import registry  # noqa: F401 - the registry fixture
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def podman_image(podman, registry, tmp_path_factory):  # noqa: F811
    """A counter checkpointed by podman into a checkpoint image, pushed with podman to the registry."""
    certs = tmp_path_factory.mktemp("podman-certs")
    shutil.copy(registry.ca_file, certs / "ca.crt")
    ctr = f"pmimg-{uuid.uuid4().hex[:6]}"
    podman.run_detached(ctr, podman.image, COUNTER)
    _wait_ticks(lambda: podman.logs(ctr), 5)
    ref = registry.ref(f"podman/{ctr}", "v1")
    podman("container", "checkpoint", "--create-image", ref, ctr, timeout=300)
    before = parse_ticks(podman.logs(ctr))
    podman("rm", "--force", "--time", "0", ctr)
    podman("push", "--cert-dir", str(certs), "--authfile", registry.auth_file, ref, timeout=300)
    podman("rmi", ref)
    return {"ref": ref, "before": before, "certs": str(certs), "ctr": ctr}


def test_podman_checkpoint_image_restored_by_reference_in_a_pod(cri, cri_containerd, podman_image, registry,  # noqa: F811
                                                                 migrt_config, unbound_allowed):  # noqa: F811
    """podman's image records no Kubernetes namespace: the node's config allows that (unbound_allowed)."""
    pod = cri.run_pod("from-podman-image", "default")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", "echo started-fresh; " + COUNTER],
                               env={"MIGRT_RESTORE": "oci:" + podman_image["ref"]})
    with registry.also_in_netns(cri_containerd.network.netns_path):  # the shim runs in containerd's namespace
        cri.start(cid)
    cri.wait_state(cid, "CONTAINER_RUNNING")
    path = cri.status(cid).log_path
    ticks = _wait_ticks(lambda: read_cri_log(path), 3)
    last = podman_image["before"][-1]
    assert last[0] < ticks[0][0] <= last[0] + 2, (ticks[0], last)  # resumed where podman froze it
    assert all(t[1] == last[1] and t[2] == last[1] for t in ticks)  # in-memory data identical
    assert "started-fresh" not in read_cri_log(path)
    store = migrt_config["store"]
    pulled = [n for n in os.listdir(store) if n.startswith(f"oci-{podman_image['ctr']}-")]
    assert len(pulled) == 1
    with open(os.path.join(store, pulled[0], "manifest.json")) as fh:
        m = json.load(fh)
    assert m["imported"]["producer"] == "podman" and m["pulled"]["reference"] == podman_image["ref"]
    run_cli("inspect", pulled[0], "--verify")


def test_migrt_cri_image_restored_by_podman(podman, podman_image, registry, migrt_config):  # noqa: F811
    """podman's checkpoint, pulled into migrt's store, pushed again by migrt as a CRI checkpoint
    image, then pulled and restored by podman itself: the counter goes on."""
    name = run_cli("pull", podman_image["ref"], "--name", f"via-migrt-{uuid.uuid4().hex[:4]}").stdout.strip()
    ref = registry.ref("team/migrt-cri", "v1")
    out = json.loads(run_cli("push", name, ref, "--format", "cri", "--json").stdout)
    assert out["layers"] == 1
    podman("pull", "--cert-dir", podman_image["certs"], "--authfile", registry.auth_file, ref, timeout=300)
    ctr = podman("container", "restore", ref, timeout=300).stdout.strip()
    try:
        ticks = _wait_ticks(lambda: podman.logs(ctr), len(podman_image["before"]) + 3)
        last = podman_image["before"][-1]
        after = [t for t in ticks if t[0] > last[0]]
        assert after and after[0][0] <= last[0] + 2, (after[:1], last)
        assert all(t[1] == last[1] and t[2] == last[1] for t in after)
    finally:
        podman("rm", "--force", "--time", "0", ctr, check=False)
    run_cli("rm", name)
