"""A container that shares another's PID namespace (a Kubernetes pod with shareProcessNamespace, the
CRI default when no namespace options are sent): `migrt checkpoint` commits, then stops it, with no
process of it running after the dump, on the tests' runc 1.3 and on the release's runc 1.1.

runc >= 1.2 kills such a container through cgroup v2's cgroup.kill wherever cgroup2 is mounted, which
on a hybrid layout does not reach tasks the v1 freezer holds ("container init still running" after
10 s, the container left frozen); runc 1.1 kills its init, thaws it and kills the rest only later,
so those run after the dump. A "sandbox" container and an "app" container whose config.json joins the
sandbox's PID namespace (/proc/<sandbox pid>/ns/pid), both plain runc."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from tests.helpers.bundles import make_bundle
from tests.integration.conftest import run_cli

pytestmark = pytest.mark.integration

RELEASE_RUNC = "/usr/sbin/runc"  # the node release's (Debian 12: 1.1.5), packaging/setup-test.sh installs it

# The init (a shell), two idle children and a background writer, all in the shared PID namespace. The
# writer appends to /tmp/bg through fd 3 every 10 ms: the dump records that fd's position, so a file
# longer than the position proves that it wrote after the dump.
APP = ("sleep 1000 & sleep 1000 & (exec 3>>/tmp/bg; i=0; while true; do i=$((i+1)); echo $i >&3; sleep 0.01; done) & "
       "while true; do sleep 0.1; done")


@pytest.fixture(params=["runc", RELEASE_RUNC], ids=["runc-on-path", "release-runc"])
def runc(request, stack) -> str:
    if request.param == RELEASE_RUNC and not os.access(RELEASE_RUNC, os.X_OK):
        msg = f"{RELEASE_RUNC} (the release's runc) is missing: run packaging/setup-test.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return request.param


@pytest.fixture
def runc_root(runc, tmp_path):
    root = tmp_path / "runc-root"
    root.mkdir()
    yield str(root)
    for cid in sorted(os.listdir(root), key=lambda c: not c.startswith("app")):  # the app before its sandbox
        if _state(runc, str(root), cid).get("status") == "paused":  # left frozen by a failed stop: thaw, or delete hangs
            subprocess.run([runc, "--root", str(root), "resume", cid], capture_output=True, timeout=60)
        subprocess.run([runc, "--root", str(root), "delete", "--force", cid], capture_output=True, timeout=60)


@pytest.fixture
def env(runc, migrt_config, tmp_path) -> dict:
    """migrt's environment with a config naming this test's runc (the session's store and log)."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"runtime: {runc}\nstore: {migrt_config['store']}\nlog_file: {migrt_config['log']}\n"
                   "log_level: debug\n")
    return {**os.environ, "MIGRT_CONFIG": str(cfg)}


@pytest.fixture
def pipes():
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


def _state(runc: str, root: str, cid: str) -> dict:
    out = subprocess.run([runc, "--root", root, "state", cid], capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _run_detached(runc: str, root: str, cid: str, bundle: str, pipes: list[int]) -> int:
    """`runc run --detach` with a fresh pipe as stdio (what containerd's shim gives; CRIU dumps pipes as
    external); runc's own errors go to its --log."""
    r, w = os.pipe()
    pipes.append(r)
    log = os.path.join(bundle, "runc.log")
    try:
        rc = subprocess.run([runc, "--root", root, "--log", log, "run", "--detach", cid], cwd=bundle,
                            stdin=subprocess.DEVNULL, stdout=w, stderr=w, timeout=60).returncode
    finally:
        os.close(w)
    with open(log) as fh:
        assert rc == 0, fh.read()
    return _state(runc, root, cid)["pid"]


def _join_pid_namespace(bundle: str, pid: int) -> None:
    path = os.path.join(bundle, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    for ns in cfg["linux"]["namespaces"]:
        if ns["type"] == "pid":
            ns["path"] = f"/proc/{pid}/ns/pid"
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)


def _live_in_namespace(ns_pid: int) -> set[int]:
    """Host pids of the live (not zombie: a sandbox that is `sleep` reaps nothing) processes whose PID
    namespace is that of `ns_pid`."""
    want = os.readlink(f"/proc/{ns_pid}/ns/pid")
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != want:
                continue
            with open(f"/proc/{entry}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(int(entry))
        except (OSError, IndexError):
            pass
    return out


def _dumped_position(images: str, suffix: str) -> int:
    """The position CRIU recorded for the regular file ending in `suffix` (O_APPEND: its size then)."""
    import pycriu

    with open(os.path.join(images, "files.img"), "rb") as fh:
        entries = pycriu.images.load(fh)["entries"]
    pos = [e["reg"].get("pos", 0) for e in entries if "reg" in e and e["reg"].get("name", "").endswith(suffix)]
    assert len(pos) == 1, f"{suffix} in files.img: {pos}"
    return int(pos[0])


def test_checkpoint_stops_container_sharing_a_pid_namespace(runc, runc_root, env, migrt_config, tmp_path, pipes):
    sandbox, app = f"sandbox-{uuid.uuid4().hex[:6]}", f"app-{uuid.uuid4().hex[:6]}"
    sandbox_pid = _run_detached(runc, runc_root, sandbox,
                                make_bundle(str(tmp_path / "sandbox"), ["sleep", "100000"], runc=runc), pipes)
    app_bundle = make_bundle(str(tmp_path / "app"), ["sh", "-c", APP], runc=runc)
    _join_pid_namespace(app_bundle, sandbox_pid)
    app_pid = _run_detached(runc, runc_root, app, app_bundle, pipes)
    bg = os.path.join(app_bundle, "rootfs", "tmp", "bg")
    deadline = time.monotonic() + 10
    while not (os.path.exists(bg) and os.path.getsize(bg) > 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.readlink(f"/proc/{app_pid}/ns/pid") == os.readlink(f"/proc/{sandbox_pid}/ns/pid")
    app_pids = _live_in_namespace(sandbox_pid) - {sandbox_pid}
    assert app_pid in app_pids and len(app_pids) >= 4  # sh, two sleeps, the writer

    name = f"shared-pidns-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    res = run_cli("checkpoint", app, "--root", runc_root, "--name", name, check=False, env=env)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    assert took < 10, f"checkpoint took {took:.1f} s"  # runc's own wait for a kill that does not land is 10 s
    assert _state(runc, runc_root, app) == {}, "the checkpointed container must be gone"
    assert not (app_pids & _live_in_namespace(sandbox_pid)), "a process of the app survived its checkpoint"
    written = os.path.getsize(bg)
    dumped = _dumped_position(os.path.join(migrt_config["store"], name, "images"), "/tmp/bg")
    assert written == dumped, f"the app wrote {written - dumped} byte(s) after its dump"
    assert _state(runc, runc_root, sandbox).get("status") == "running", "the sandbox must be left alone"
    journal = json.loads(run_cli("recover", "--list", "--json", env=env).stdout)["journal"]
    assert not [e for e in journal if e.get("container") == app], journal


def test_recovery_finishes_the_stop_of_a_committed_checkpoint(runc, runc_root, env, migrt_config, tmp_path, pipes):
    """migrt killed right after the commit (the fault seam, tests/faults/): the next command finishes the
    stop, through the same kill-while-frozen, and says so only when it happened."""
    sandbox, app = f"sandbox-{uuid.uuid4().hex[:6]}", f"app-{uuid.uuid4().hex[:6]}"
    sandbox_pid = _run_detached(runc, runc_root, sandbox,
                                make_bundle(str(tmp_path / "sandbox"), ["sleep", "100000"], runc=runc), pipes)
    app_bundle = make_bundle(str(tmp_path / "app"), ["sh", "-c", APP], runc=runc)
    _join_pid_namespace(app_bundle, sandbox_pid)
    _run_detached(runc, runc_root, app, app_bundle, pipes)
    bg = os.path.join(app_bundle, "rootfs", "tmp", "bg")
    deadline = time.monotonic() + 10
    while not (os.path.exists(bg) and os.path.getsize(bg) > 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    app_pids = _live_in_namespace(sandbox_pid) - {sandbox_pid}

    name = f"shared-pidns-{uuid.uuid4().hex[:6]}"
    res = run_cli("checkpoint", app, "--root", runc_root, "--name", name, check=False,
                  env={**env, "MIGRT_FAULT": "checkpoint:committed:kill"})
    assert res.returncode == -9, (res.returncode, res.stderr)
    assert _state(runc, runc_root, app).get("status") == "paused"  # committed, still frozen

    rec = run_cli("recover", "--wait", "30", check=False, env=env)
    assert rec.returncode == 0, rec.stdout + rec.stderr
    assert f"stopped container {app}" in rec.stdout, rec.stdout
    assert _state(runc, runc_root, app) == {}, "recovery must have stopped the container"
    assert not (app_pids & _live_in_namespace(sandbox_pid)), "a process of the app survived its checkpoint"
    dumped = _dumped_position(os.path.join(migrt_config["store"], name, "images"), "/tmp/bg")
    assert os.path.getsize(bg) == dumped, "the app wrote after its dump"


def _verbose_pid(cri, *, container: str | None = None, pod: str | None = None) -> int:
    if container:
        resp = cri.call("ContainerStatus", cri.api.ContainerStatusRequest(container_id=container, verbose=True))
    else:
        resp = cri.call("PodSandboxStatus", cri.api.PodSandboxStatusRequest(pod_sandbox_id=pod, verbose=True))
    return int(json.loads(resp.info["info"])["pid"])


def _freezer_files(pid: int) -> list[tuple[str, str]]:
    """(file, value that thaws) for the freezer of each hierarchy holding `pid`: v1 freezer.state, v2
    cgroup.freeze (under /sys/fs/cgroup/unified on a hybrid layout)."""
    v2 = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    out = []
    with open(f"/proc/{pid}/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "freezer":
                out.append((f"/sys/fs/cgroup/freezer{path}/freezer.state", "THAWED"))
            elif controllers == "":
                out.append((f"{v2}{path}/cgroup.freeze", "0"))
    return out


def _of_container(pids: set[int], cid: str) -> set[int]:
    """Those of `pids` whose cgroup path names container `cid` (containerd's cgroups end in its id)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cgroup") as fh:
                if cid in fh.read():
                    out.add(pid)
        except OSError:
            pass
    return out


def test_cri_pod_without_namespace_options(cri, cri_containerd):
    """Through containerd's CRI, a pod and a container sent without namespace options (the CRI default:
    the pod's PID namespace, the sandbox's pause its init): `migrt checkpoint` stops the container."""
    pod = cri.run_pod(f"shared-{uuid.uuid4().hex[:6]}", "default", handler="migrt", namespace_options=False)
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", APP], namespace_options=False)
    cri.start(cid)
    cri.wait_state(cid, "CONTAINER_RUNNING")
    app_pid, pause_pid = _verbose_pid(cri, container=cid), _verbose_pid(cri, pod=pod)
    assert os.readlink(f"/proc/{app_pid}/ns/pid") == os.readlink(f"/proc/{pause_pid}/ns/pid")
    deadline = time.monotonic() + 10
    while len(_of_container(_live_in_namespace(pause_pid), cid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    app_pids = _of_container(_live_in_namespace(pause_pid), cid)  # not the sandbox's own
    assert app_pid in app_pids and len(app_pids) >= 4

    freezers = _freezer_files(app_pid)

    name = f"cri-shared-pidns-{uuid.uuid4().hex[:6]}"
    try:
        started = time.monotonic()
        res = run_cli("checkpoint", cid, "--name", name, check=False)
        took = time.monotonic() - started
        assert res.returncode == 0, res.stderr
        assert took < 10, f"checkpoint took {took:.1f} s"
        cri.wait_state(cid, "CONTAINER_EXITED")
        assert not (app_pids & _live_in_namespace(pause_pid)), "a process of the app survived its checkpoint"
        run_cli("inspect", "--verify", name)
    finally:  # a container left frozen would hang containerd's StopPodSandbox, and the fixtures' teardown
        for path, thawed in freezers:
            if os.path.exists(path):
                with open(path, "w") as fh:
                    fh.write(thawed)
    cri.remove(cid)
    cri.delete_pod(pod)
