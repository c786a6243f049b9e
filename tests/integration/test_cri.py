"""migrt through containerd's CRI plugin, driven the way kubelet drives it (RunPodSandbox,
CreateContainer, StartContainer, ExecSync, ...) with runtime handler `migrt`.

The restore scenario: a container in pod A (namespace team-a) writes to its root filesystem and to a
volume (a host directory bind-mounted at /data, like an emptyDir) and keeps state in memory;
`migrt checkpoint <container id>`; pod A is deleted; pod B (new sandbox, new IP, new volume directory
holding a copy of the old volume) asks for the checkpoint with MIGRT_RESTORE and resumes it.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import time
import uuid
import tomllib
from dataclasses import dataclass

import pytest

from tests.helpers.cri import CriError, read_cri_log
from tests.integration.conftest import SHIM, run_cli
from tests.integration.conftest_cri import new_client
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration

# COUNTER, after changing its root filesystem (a new file, a deleted file) and the volume (a file,
# and fd 3 kept open on /data/held, appended to at every tick).
_TICK_TO_VOLUME = 'echo "$i" >&3; [ -f /tmp/stop ]'
VOLUME_COUNTER = ("echo rootfs-change > /etc/migrt-marker; rm /bin/wc; echo v1 > /data/volume-file; "
                  "exec 3>>/data/held; " + COUNTER.replace("[ -f /tmp/stop ]", _TICK_TO_VOLUME, 1))
assert _TICK_TO_VOLUME in VOLUME_COUNTER


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _wait_ticks(cri, cid: str, n: int, timeout: float = 30) -> list:
    path = cri.status(cid).log_path
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(read_cri_log(path))
        if len(ticks) >= n:
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} ticks in {path}: {read_cri_log(path)[-2000:]!r}; "
                         f"container {cri.state_name(cid)}")


def _exec_ok(cri, cid: str, script: str) -> str:
    code, out, err = cri.exec_sync(cid, ["sh", "-c", script])
    assert code == 0, f"exec {script!r}: exit {code}, stdout {out!r}, stderr {err!r}"
    return out


@dataclass
class Source:
    """A checkpoint of VOLUME_COUNTER taken in pod team-a/counter, which is gone afterwards."""
    name: str
    pod_id: str
    pod_ip: str
    container_id: str
    volume: str
    ticks: list


@pytest.fixture(scope="module")
def source(cri_containerd, cri_stubs, tmp_path_factory) -> Source:
    base = tmp_path_factory.mktemp("cri-source")
    client = new_client(cri_containerd, cri_stubs, str(base / "kubelet"))
    try:
        vol = base / "volume-a"
        vol.mkdir()
        pod = client.run_pod("counter", "team-a")
        ip = client.pod_ip(pod)
        cid = client.create_container(pod, "app", cri_containerd.image, ["sh", "-c", VOLUME_COUNTER],
                                      mounts=[(str(vol), "/data")])
        client.start(cid)
        _wait_ticks(client, cid, 5)
        name = _uid("cri-ck")
        res = run_cli("checkpoint", cid, "--name", name)
        assert res.stdout.strip() == name
        ticks = parse_ticks(read_cri_log(client.status(cid).log_path))
        assert ticks and ticks[-1][1] == ticks[-1][2], ticks  # in-memory data intact before the dump
        client.wait_state(cid, "CONTAINER_EXITED")
        client.delete_pod(pod)
        yield Source(name, pod, ip, cid, str(vol), ticks)
    finally:
        client.cleanup()
        client.close()


def _restore_pod(cri, ctd, source: Source, tmp_path, *, namespace: str = "team-a", name: str = "counter-restored",
                 with_volume: bool = True, env: dict | None = None) -> tuple[str, str, str]:
    """A new pod whose container asks for `source`'s checkpoint; returns (pod id, container id, volume).
    The new volume directory holds a copy of the old one (what moving an emptyDir does)."""
    vol = str(tmp_path / f"volume-{uuid.uuid4().hex[:6]}")
    shutil.copytree(source.volume, vol)
    pod = cri.run_pod(name, namespace)
    cid = cri.create_container(pod, "app", ctd.image, ["sh", "-c", VOLUME_COUNTER],
                               env={"MIGRT_RESTORE": source.name, **(env or {})},
                               mounts=[(vol, "/data")] if with_volume else [])
    return pod, cid, vol


def _assert_resumed(cri, cid: str, source: Source) -> list:
    """The container runs the checkpointed process: counter continues, memory identical."""
    last = source.ticks[-1]
    after = _wait_ticks(cri, cid, 2)
    assert after[0][0] > last[0], f"counter restarted: first tick {after[0]} after {last} (fresh start, not a restore)"
    assert all(t[1] == last[1] and t[2] == last[1] for t in after), (after, last)
    return after


# -- an ordinary container through handler migrt: migrt must be invisible ---------------------------

def test_ordinary_container_with_migrt_handler(cri, cri_containerd):
    pod = cri.run_pod(_uid("plain"), "default", handler="migrt")
    assert cri.api.PodSandboxState.Name(cri.pod_status(pod).state) == "SANDBOX_READY"
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c",
                               "echo hello-stdout; echo hello-stderr >&2; while true; do sleep 0.2; done"])
    cri.start(cid)
    st = cri.wait_state(cid, "CONTAINER_RUNNING")

    # the task really runs through migrt-runc
    info = json.loads(cri.call("ContainerStatus", cri.api.ContainerStatusRequest(container_id=cid, verbose=True)).info["info"])
    assert info["runtimeType"] == "io.containerd.runc.v2"
    assert info["runtimeOptions"]["binary_name"] == SHIM, info["runtimeOptions"]

    assert _exec_ok(cri, cid, "echo in-$((40+2))").strip() == "in-42"
    code, _out, err = cri.exec_sync(cid, ["sh", "-c", "echo oops >&2; exit 3"])
    assert (code, err.strip()) == (3, "oops")
    assert _exec_ok(cri, cid, "hostname").strip() == cri.pods[pod].config.hostname

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "hello-stderr" not in open(st.log_path).read():
        time.sleep(0.1)
    lines = open(st.log_path).read().splitlines()
    assert any(line.split(" ", 3)[1:] == ["stdout", "F", "hello-stdout"] for line in lines), lines
    assert any(line.split(" ", 3)[1:] == ["stderr", "F", "hello-stderr"] for line in lines), lines

    cri.stop(cid, timeout=1)
    assert cri.state_name(cid) == "CONTAINER_EXITED"
    cri.remove(cid)
    cri.delete_pod(pod)
    assert pod not in [p.id for p in cri.list_pods()]


def test_sandbox_is_never_restored(cri, cri_containerd, source):
    """A pod whose sandbox config asks for a restore (the pod annotation migrt.io/restore reaches the
    sandbox's config.json through the handler's pod_annotations): the pause container starts as itself."""
    pod = cri.run_pod(_uid("sbx"), "team-a", handler="migrt", annotations={"migrt.io/restore": source.name})
    status = cri.pod_status(pod)
    assert cri.api.PodSandboxState.Name(status.state) == "SANDBOX_READY", status
    bundle = cri_containerd.bundle(pod)
    with open(os.path.join(bundle, "config.json")) as fh:
        ann = json.load(fh)["annotations"]
    assert ann.get("migrt.io/restore") == source.name, ann  # the request did reach migrt-runc
    assert ann.get("io.kubernetes.cri.container-type") == "sandbox", ann
    with open(os.path.join(bundle, "init.pid")) as fh:
        pid = int(fh.read())
    deadline = time.monotonic() + 10
    while True:  # `runc start` returns when it has told runc init to exec: the exec may still be on its way
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode()
        if "runc init" not in cmdline or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "sleep 3600" in cmdline and "tick" not in cmdline, cmdline  # the pause loop, not the counter


# -- checkpoint with `migrt checkpoint`, restore into a new pod -------------------------------------

def test_restore_into_new_pod(cri, cri_containerd, source, tmp_path):
    pod, cid, vol = _restore_pod(cri, cri_containerd, source, tmp_path)
    assert pod != source.pod_id
    assert cri.pod_ip(pod) != source.pod_ip  # new sandbox, new network namespace, new IP
    t0 = time.monotonic()
    cri.start(cid)
    restore_s = time.monotonic() - t0
    assert restore_s < 120, f"StartContainer took {restore_s:.1f} s (kubelet's default runtime request timeout)"
    cri.wait_state(cid, "CONTAINER_RUNNING")

    after = _assert_resumed(cri, cid, source)  # read from the NEW pod's CRI log file
    assert _exec_ok(cri, cid, "echo in-$((40+2))").strip() == "in-42"
    assert _exec_ok(cri, cid, "cat /data/volume-file").strip() == "v1"
    assert _exec_ok(cri, cid, "readlink /proc/1/fd/3").strip() == "/data/held"

    # fd 3 now writes into the NEW volume directory; the old one is left alone
    old_size = os.path.getsize(os.path.join(source.volume, "held"))
    new_held = os.path.join(vol, "held")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.getsize(new_held) <= old_size:
        time.sleep(0.1)
    assert os.path.getsize(new_held) > old_size
    assert os.path.getsize(os.path.join(source.volume, "held")) == old_size
    assert int(open(new_held).read().split()[-1]) >= after[0][0]

    # stopping it works like for any container
    _exec_ok(cri, cid, "touch /tmp/stop")
    st = cri.wait_state(cid, "CONTAINER_EXITED")
    assert st.exit_code == 7  # the workload's own exit status
    run_cli("inspect", source.name, "--verify")  # the checkpoint stays usable


def test_restore_reapplies_rootfs_changes(cri, cri_containerd, source, tmp_path):
    """Changes the process made to its own root filesystem (a new file, a deleted file) come back."""
    _pod, cid, _vol = _restore_pod(cri, cri_containerd, source, tmp_path, name="counter-rootfs")
    cri.start(cid)
    _assert_resumed(cri, cid, source)
    assert _exec_ok(cri, cid, "cat /etc/migrt-marker").strip() == "rootfs-change"
    code, out, err = cri.exec_sync(cid, ["sh", "-c", "test -e /bin/wc"])
    assert code == 1, ("/bin/wc was deleted before the checkpoint but exists after the restore", out, err)


def test_restored_container_sees_new_pod_hostname(cri, cri_containerd, source, tmp_path):
    _pod, cid, _vol = _restore_pod(cri, cri_containerd, source, tmp_path, name="counter-moved")
    cri.start(cid)
    _assert_resumed(cri, cid, source)
    assert _exec_ok(cri, cid, "cat /etc/hostname").strip() == "counter-moved"
    assert _exec_ok(cri, cid, "hostname").strip() == "counter-moved"  # the new sandbox's UTS namespace


@pytest.mark.parametrize("ns", ["uts", "ipc", "net"])
def test_restored_container_joins_new_sandbox_namespace(cri, cri_containerd, source, tmp_path, ns):
    """The restored process lives in the new pod's shared namespaces (as a fresh container would)."""
    pod, cid, _vol = _restore_pod(cri, cri_containerd, source, tmp_path, name=f"counter-{ns}")
    cri.start(cid)
    _assert_resumed(cri, cid, source)
    with open(os.path.join(cri_containerd.bundle(pod), "init.pid")) as fh:
        sandbox_pid = int(fh.read())
    inside = _exec_ok(cri, cid, f"readlink /proc/1/ns/{ns}").strip()
    assert inside == os.readlink(f"/proc/{sandbox_pid}/ns/{ns}"), f"restored process's {ns} namespace is {inside}"


def test_restore_refused_in_other_namespace(cri, cri_containerd, source, tmp_path):
    """A checkpoint taken in Kubernetes namespace team-a does not restore into team-b."""
    _pod, cid, _vol = _restore_pod(cri, cri_containerd, source, tmp_path, namespace="team-b")
    with pytest.raises(CriError) as err:
        cri.start(cid)
    msg = err.value.details
    assert "team-a" in msg and "team-b" in msg, msg
    assert cri.state_name(cid) != "CONTAINER_RUNNING"
    run_cli("inspect", source.name, "--verify")


def test_restore_missing_mount_is_named(cri, cri_containerd, source, tmp_path):
    """The new pod lacks the volume the checkpointed process uses: the error names /data."""
    _pod, cid, _vol = _restore_pod(cri, cri_containerd, source, tmp_path, with_volume=False)
    with pytest.raises(CriError) as err:
        cri.start(cid)
    msg = err.value.details
    assert "/data" in msg, msg
    assert "mount" in msg.lower(), msg
    assert cri.state_name(cid) != "CONTAINER_RUNNING"
    run_cli("inspect", source.name, "--verify")


def test_broken_checkpoint_fails_then_fallback_fresh(cri, cri_containerd, migrt_config, tmp_path):
    pod = cri.run_pod(_uid("fb-src"), "team-a")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", COUNTER])
    cri.start(cid)
    _wait_ticks(cri, cid, 3)
    name = _uid("cri-broken")
    run_cli("checkpoint", cid, "--name", name)
    cri.delete_pod(pod)
    images = os.path.join(migrt_config["store"], name, "images")
    pages = sorted(f for f in os.listdir(images) if f.startswith("pages-"))
    with open(os.path.join(images, pages[0]), "r+b") as fh:
        b = fh.read(1)
        fh.seek(0)
        fh.write(bytes([b[0] ^ 0xFF]))

    fresh_cmd = ["sh", "-c", "echo started-fresh; " + COUNTER]
    pod = cri.run_pod(_uid("fb-fail"), "team-a")
    failing = cri.create_container(pod, "app", cri_containerd.image, fresh_cmd, env={"MIGRT_RESTORE": name})
    with pytest.raises(CriError) as err:
        cri.start(failing)
    assert "sha256 mismatch" in err.value.details, err.value.details

    pod = cri.run_pod(_uid("fb-fresh"), "team-a")
    cid = cri.create_container(pod, "app", cri_containerd.image, fresh_cmd,
                               env={"MIGRT_RESTORE": name, "MIGRT_RESTORE_FALLBACK": "fresh"})
    cri.start(cid)
    cri.wait_state(cid, "CONTAINER_RUNNING")
    ticks = _wait_ticks(cri, cid, 2)
    assert ticks[0][0] == 1
    assert "started-fresh" in read_cri_log(cri.status(cid).log_path)


# -- kubelet's checkpoint API (CRI CheckpointContainer) through handler migrt ------------------------

def test_cri_checkpoint_container_through_migrt(cri, cri_containerd, tmp_path):
    pod = cri.run_pod(_uid("kcp"), "team-a")
    cid = cri.create_container(pod, "app", cri_containerd.image, ["sh", "-c", COUNTER])
    cri.start(cid)
    _wait_ticks(cri, cid, 3)
    location = str(tmp_path / "checkpoint.tar")
    if cri_containerd.config_version < 3:  # what README "Neighbours" says: 1.7 has no kubelet checkpoint API
        with pytest.raises(CriError) as err:
            cri.checkpoint_container(cid, location)
        assert err.value.code == "UNIMPLEMENTED", err.value
        assert not os.path.exists(location) and cri.state_name(cid) == "CONTAINER_RUNNING"
        return
    cri.checkpoint_container(cid, location)
    assert os.path.isfile(location)
    with tarfile.open(location) as tar:
        members = tar.getnames()
    assert any(m.endswith("inventory.img") for m in members), members
    assert any(m.startswith("checkpoint/pages-") or "/pages-" in m for m in members), members
    # kubelet's checkpoint leaves the container running
    assert cri.state_name(cid) == "CONTAINER_RUNNING"
    before = len(_wait_ticks(cri, cid, 1))
    _wait_ticks(cri, cid, before + 2)


def test_handler_comes_from_migrt_install(cri_containerd):
    """The handler `migrt` every CRI test uses is the one `migrt install containerd` wrote: a drop-in
    imported by the main config, in the config version of that containerd (3 for 2.x, 2 for 1.7)."""
    res = cri_containerd.install_result
    assert res["version"] == cri_containerd.config_version
    assert os.path.isfile(res["dropin"]) and res["changed"]
    with open(os.path.join(cri_containerd.base, "config.toml"), "rb") as fh:
        assert res["dropin"] in tomllib.load(fh)["imports"]
