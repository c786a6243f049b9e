"""podman (the node release's: Debian 12's 4.3) as a neighbour, with private storage
(tests/helpers/podman.py):

- its checkpoint archives (`podman container checkpoint --export`, zstd by default, gzip and
  uncompressed too) imported with `migrt import` and restored into a Kubernetes pod through
  containerd's CRI with MIGRT_RESTORE, on a node whose config allows checkpoints that record no
  Kubernetes namespace (refused otherwise): the counter goes on with the same in-memory data, the
  writable-layer changes (a new file, a deleted one) and the /dev/shm files come back;
- podman running a container with `--runtime migrt-runc` through `podman container checkpoint` and
  `podman container restore` (podman asks `migrt-runc checkpoint --help` first);
- a checkpoint taken under containerd restored by podman through migrt-runc (MIGRT_RESTORE): refused
  with podman's default seccomp profile and masked paths (the counter ran without them), restored in a
  container that asks for no more than it had.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass

import pytest

from migrt.criu import tasks as criu_tasks
from tests.helpers.cri import CriError, read_cri_log
from tests.helpers.podman import Podman
from tests.integration.conftest import SHIM, run_cli
from tests.integration.test_containerd import _checkpointed_counter
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration

# the writable layer and /dev/shm changed before the counter starts
CHANGES = "echo podman-change > /etc/migrt-marker; rm /bin/wc; echo shm-data > /dev/shm/migrt-shm; "


@pytest.fixture(scope="module")
def podman(stack, tmp_path_factory):
    if not shutil.which("podman"):
        msg = "podman is missing (run packaging/setup-host.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    pm = Podman(str(tmp_path_factory.mktemp("podman")))
    try:
        pm.image = pm.load_busybox()
        yield pm
    finally:
        pm.stop()


def _wait_ticks(read, n: int, timeout: float = 30) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(read())
        if len(ticks) >= n:
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} ticks: {read()[-2000:]!r}")


@dataclass
class Exported:
    name: str
    manifest: dict
    before: list  # ticks logged when podman checkpointed (and stopped) the container


def _export_and_import(podman, tmp_path, compress: str) -> Exported:
    ctr = f"pm-{uuid.uuid4().hex[:6]}"
    podman.run_detached(ctr, podman.image, CHANGES + COUNTER)
    _wait_ticks(lambda: podman.logs(ctr), 5)
    archive = str(tmp_path / f"{ctr}.tar{'.zst' if compress == 'zstd' else '.gz' if compress == 'gzip' else ''}")
    podman("container", "checkpoint", "--export", archive, "--compress", compress, ctr)
    before = parse_ticks(podman.logs(ctr))
    assert podman.state(ctr) == "exited"  # checkpoint without --leave-running stops it
    podman("rm", ctr)
    name = f"pmck-{compress}-{uuid.uuid4().hex[:6]}"
    manifest = json.loads(run_cli("import", archive, "--name", name, "--json").stdout)
    return Exported(name, manifest, before)


@pytest.mark.parametrize("compress", ["zstd", "gzip", "none"])
def test_podman_archive_imports(podman, migrt_config, tmp_path, compress):
    exp = _export_and_import(podman, tmp_path, compress)
    m = exp.manifest
    assert m["imported"]["producer"] == "podman"
    assert m["source"]["image"] == podman.image
    assert m["source"]["container_name"].startswith("pm-")
    assert m["rootfs"]["captured"] is True and m["rootfs"]["deleted"] == 1
    assert m["devshm"]["entries"] >= 1
    ckpt = os.path.join(migrt_config["store"], exp.name)
    with open(os.path.join(ckpt, "rootfs-diff.json")) as fh:
        assert json.load(fh)["deleted"] == ["bin/wc"]
    run_cli("inspect", exp.name, "--verify")


@pytest.fixture(scope="module")
def exported(podman, stack, migrt_config, tmp_path_factory) -> Exported:
    return _export_and_import(podman, tmp_path_factory.mktemp("podman-export"), "zstd")


@pytest.fixture
def unbound_allowed(migrt_config):
    """The node's config allows checkpoints that record no Kubernetes namespace into pods (podman's
    archives record none); the session's config is put back afterwards."""
    path = migrt_config["config"]
    with open(path) as fh:
        old = fh.read()
    with open(path, "w") as fh:
        fh.write(old + "allow_unbound_checkpoints: true\n")
    try:
        yield
    finally:
        with open(path, "w") as fh:
            fh.write(old)


def test_podman_checkpoint_is_refused_in_a_pod_unless_the_node_allows_it(cri, cri_containerd, exported):
    pod = cri.run_pod("from-podman-refused", "default")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", "echo started-fresh"],
                               env={"MIGRT_RESTORE": exported.name})
    with pytest.raises(CriError, match=f"checkpoint {exported.name} records no Kubernetes namespace.*"
                                       "allow_unbound_checkpoints: true"):
        cri.start(cid)
    cri.remove(cid)
    cri.delete_pod(pod)


def test_podman_checkpoint_resumes_in_pod(cri, cri_containerd, exported, unbound_allowed):
    pod = cri.run_pod("from-podman", "default")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", "echo started-fresh; " + COUNTER],
                               env={"MIGRT_RESTORE": exported.name})
    cri.start(cid)
    cri.wait_state(cid, "CONTAINER_RUNNING")
    path = cri.status(cid).log_path
    ticks = _wait_ticks(lambda: read_cri_log(path), 3)
    last = exported.before[-1]
    assert last[0] < ticks[0][0] <= last[0] + 2, (ticks[0], last)  # resumed where podman froze it
    assert all(t[1] == last[1] and t[2] == last[1] for t in ticks)  # in-memory data identical
    assert "started-fresh" not in read_cri_log(path)
    assert cri.exec_sync(cid, ["cat", "/etc/migrt-marker"])[:2] == (0, "podman-change\n")
    assert cri.exec_sync(cid, ["sh", "-c", "test -e /bin/wc"])[0] == 1
    assert cri.exec_sync(cid, ["cat", "/dev/shm/migrt-shm"])[:2] == (0, "shm-data\n")
    run_cli("inspect", exported.name, "--verify")


def test_podman_runs_migrt_runc_through_checkpoint_and_restore(podman, migrt_config):
    help_ = subprocess.run([SHIM, "checkpoint", "--help"], capture_output=True, text=True, timeout=30)
    assert help_.returncode == 0 and "--image-path" in help_.stdout  # what podman asks first
    ctr = f"pmrt-{uuid.uuid4().hex[:6]}"
    podman.run_detached(ctr, podman.image, COUNTER, runtime=SHIM)
    try:
        assert podman("inspect", "--format", "{{.OCIRuntime}}", ctr).stdout.strip() == SHIM
        _wait_ticks(lambda: podman.logs(ctr), 5)
        podman("container", "checkpoint", ctr)
        before = parse_ticks(podman.logs(ctr))
        assert podman.state(ctr) == "exited"
        podman("container", "restore", ctr)
        assert podman.state(ctr) == "running"
        n = len(before)
        ticks = _wait_ticks(lambda: podman.logs(ctr), n + 3)[n:]
        last = before[-1]
        assert ticks[0][0] == last[0] + 1, (ticks[0], last)  # the same process, not a fresh start
        assert all(t[1] == last[1] and t[2] == last[1] for t in ticks)
    finally:
        podman("rm", "--force", "--time", "0", ctr, check=False)


def test_podman_restores_a_containerd_checkpoint_through_migrt_runc(podman, containerd, migrt_config, tmp_path):
    """The other way round: a counter checkpointed with `migrt checkpoint` under containerd comes back
    in podman (`podman run --runtime migrt-runc -e MIGRT_RESTORE=<name>`), across the engines'
    different root directory modes (containerd 0755, podman 0555)."""
    _src, name, before = _checkpointed_counter(containerd, tmp_path)
    ctr = f"pmrs-{uuid.uuid4().hex[:6]}"
    # ctr runs the counter without seccomp and with /sys/dev/block unmasked; podman's defaults ask for
    # both: a restore never grants more than the new container asks for, and says why through conmon
    with pytest.raises(RuntimeError) as refused:
        podman.run_detached(ctr, podman.image, "exit 3", "-e", f"MIGRT_RESTORE={name}", runtime=SHIM)
    assert "runs without a seccomp filter but the container asks for one" in str(refused.value), refused.value
    assert "leaves /sys/dev/block unmasked" in str(refused.value), refused.value
    podman("rm", "--force", "--time", "0", ctr, check=False)
    # nor fewer processes than it had (ctr's counter inherits containerd's RLIMIT_NPROC; podman asks 32768 here)
    nproc = max(th.rlimits_max[6] for th in criu_tasks.read(os.path.join(migrt_config["store"], name, "images")).threads
                if th.rlimits_max)
    podman.run_detached(ctr, podman.image, "echo started-fresh; exit 3", "-e", f"MIGRT_RESTORE={name}",
                        "--security-opt", "seccomp=unconfined", "--security-opt", "unmask=/sys/dev/block",
                        "--ulimit", f"nproc={nproc}:{nproc}", runtime=SHIM)
    try:
        ticks = _wait_ticks(lambda: podman.logs(ctr), 3)
        assert podman.state(ctr) == "running"
        last = before[-1]
        assert last[0] < ticks[0][0] <= last[0] + 2, (ticks[0], last)
        assert all(t[1] == last[1] and t[2] == last[1] for t in ticks)
        assert "started-fresh" not in podman.logs(ctr)
    finally:
        podman("rm", "--force", "--time", "0", ctr, check=False)
    run_cli("inspect", name, "--verify")
