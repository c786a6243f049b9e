"""`migrt checkpoint --pod`: a whole pod cut at one instant, and restored into a new pod by the pod
annotation migrt.io/restore (issue 29), through containerd's CRI driven as kubelet drives it.

The pod (team-a/trio), its containers created in this order (kubelet starts native sidecars first;
to CRI a native sidecar is just a container created before the others):
  native   COUNTER: ~400 KB of random data in memory, its hash printed at every tick;
  app      COUNTER too, and a TCP echo server on 127.0.0.1:9000 (busybox `nc -l -e cat`);
  sidecar  connects to the app over the pod's loopback once, then sends `ping N` every 0.2 s on that
           one connection and prints every echo it reads back (`echo ping N`); if the connection
           breaks, its nc ends and so does the container: new echoes after the restore prove that
           both ends of the same connection were restored and still talk.
"""

from __future__ import annotations

import glob
import json
import os
import time
import uuid

import pytest

from tests.helpers.cri import CriError, read_cri_log
from tests.integration.conftest import run_cli
from tests.integration.test_registry import registry as registry  # the fixture
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration

APP = f"nc -l -p 9000 -e cat & {COUNTER}"
SIDECAR = ('i=0; while true; do i=$((i+1)); echo "ping $i"; sleep 0.2; done | nc 127.0.0.1 9000 '
           '| while read -r l; do echo "echo $l"; done')
ORDER = (("native", COUNTER), ("app", APP), ("sidecar", SIDECAR))


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _log(cri, cid: str) -> str:
    return read_cri_log(cri.status(cid).log_path)


def _echoes(text: str) -> list[int]:
    return [int(line.split()[2]) for line in text.splitlines()
            if line.startswith("echo ping ") and line.split()[2].isdigit()]


def _wait(what, cond, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def _pod(cri, ctd, name: str, annotations: dict | None = None) -> tuple[str, dict[str, str]]:
    """The trio, each container started once the one before it runs (the app listening before the sidecar)."""
    pod = cri.run_pod(name, "team-a", annotations={"migrt.io/migratable": "true", **(annotations or {})})
    cids = {}
    for cname, script in ORDER:
        cids[cname] = cri.create_container(pod, cname, ctd.image, ["sh", "-c", script])
        cri.start(cids[cname])
        if cname != "sidecar":
            _wait(f"{cname} ticking", lambda c=cids[cname]: parse_ticks(_log(cri, c)))
    return pod, cids


def _ls(name: str) -> list[dict]:
    return [c for c in json.loads(run_cli("ls", "--json").stdout) if c.get("name") == name]


def test_a_pod_is_cut_at_one_instant_and_restored_into_a_new_pod(cri, cri_containerd, migrt_config):
    ctd = cri_containerd
    pod, cids = _pod(cri, ctd, _uid("trio"))
    _wait("echoes over the pod's loopback", lambda: len(_echoes(_log(cri, cids["sidecar"]))) >= 3)
    name = _uid("trio-ck")
    res = run_cli("checkpoint", "--pod", f"team-a/{cri.pods[pod].name}", "--name", name, "--tcp-established",
                  "--json", check=False)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [p["name"] for p in data["pod"]["parts"]] == ["native", "app", "sidecar"], data["pod"]
    assert [p["container_id"] for p in data["pod"]["parts"]] == [cids[c] for c, _ in ORDER]
    print(f"\npod checkpoint of 3 containers: {json.dumps(data['timings'])}")
    for cid in cids.values():  # destroyed, all of them (no --leave-running)
        cri.wait_state(cid, "CONTAINER_EXITED")
    before = {c: _log(cri, cid) for c, cid in cids.items()}
    last_echo = _echoes(before["sidecar"])[-1]
    assert _ls(name) and _ls(name)[0]["containers"] == ["native", "app", "sidecar"]
    top = os.path.join(migrt_config["store"], name)
    with open(os.path.join(top, "manifest.json")) as fh:
        files = json.load(fh)["files"]
    assert sorted(os.listdir(os.path.join(top, "parts"))) == ["app", "native", "sidecar"]  # no store bookkeeping
    assert {f.split("/")[:2][1] for f in files} == {"app", "native", "sidecar"} and all(
        f.startswith("parts/") for f in files), sorted(files)[:5]
    assert all(f"parts/{c}/manifest.json" in files and f"parts/{c}/images/inventory.img" in files for c, _ in ORDER)
    run_cli("inspect", "--verify", name)
    cri.delete_pod(pod)

    listed = ",".join(f"{c}={ctd.image}" for c, _ in ORDER)  # the new pod's containers that take a part
    new = cri.run_pod(_uid("trio-new"), "team-a", annotations={"migrt.io/restore": name,
                                                               "migrt.io/migrate-pod": listed})
    init = cri.create_container(new, "setup", ctd.image, ["sh", "-c", "echo init-ran"])  # not listed: runs fresh
    cri.start(init)
    cri.wait_state(init, "CONTAINER_EXITED")
    assert cri.status(init).exit_code == 0 and "init-ran" in _log(cri, init)
    t0 = time.monotonic()
    restored = {}
    for cname, _script in ORDER:  # kubelet's order; the new command lines are ignored by a restore
        restored[cname] = cri.create_container(new, cname, ctd.image, ["sh", "-c", "echo fresh; sleep 1000"])
        cri.start(restored[cname])
    start_s = time.monotonic() - t0
    for cname in ("native", "app"):
        last = parse_ticks(before[cname])[-1]
        after = _wait(f"{cname} ticking again", lambda c=restored[cname]: parse_ticks(_log(cri, c)))
        assert after[0][0] > last[0], (cname, after[0], last)  # its next tick, not a fresh start
        assert all(t[1] == t[2] == last[1] for t in after), (cname, after, last)  # its memory, intact
        assert "fresh" not in _log(cri, restored[cname])
    try:
        echoes = _wait("new echoes on the restored connection",
                       lambda: [e for e in _echoes(_log(cri, restored["sidecar"])) if e > last_echo][:5])
    except AssertionError as exc:
        st = cri.status(restored["sidecar"])
        net = cri.exec_sync(restored["app"], ["sh", "-c", "netstat -tn; ps"])
        raise AssertionError(f"{exc}; exit {st.exit_code} {st.reason}; app's view {net}; "
                             f"sidecar {cri.state_name(restored['sidecar'])}, last echo {last_echo}, its log: "
                             f"{_log(cri, restored['sidecar'])[-300:]!r}; before: {before['sidecar'][-200:]!r}; "
                             f"app: {_log(cri, restored['app'])[-200:]!r}") from None
    assert echoes[0] == last_echo + 1 or echoes[0] > last_echo, echoes
    for cid in restored.values():
        assert cri.state_name(cid) == "CONTAINER_RUNNING"
    print(f"pod restore, 3 creates and starts: {start_s:.2f} s")
    cri.delete_pod(new)
    run_cli("rm", name)


def test_a_container_the_pod_checkpoint_lacks_is_refused_by_name(cri, cri_containerd):
    ctd = cri_containerd
    pod, cids = _pod(cri, ctd, _uid("pair"))
    name = _uid("pair-ck")
    run_cli("checkpoint", "--pod", f"team-a/{cri.pods[pod].name}", "--name", name, "--leave-running",
            "--tcp-established")
    for cid in cids.values():  # --leave-running: all of them run on
        assert cri.state_name(cid) == "CONTAINER_RUNNING"
    n = len(_echoes(_log(cri, cids["sidecar"])))
    _wait("echoes after the cut", lambda: len(_echoes(_log(cri, cids["sidecar"]))) > n + 2)
    new = cri.run_pod(_uid("other"), "team-a", annotations={"migrt.io/restore": name})
    native = cri.create_container(new, "native", ctd.image, ["sh", "-c", "sleep 1000"])
    cri.start(native)  # restored, and held: the pod is not whole yet
    time.sleep(0.6)  # three ticks' time
    assert not parse_ticks(_log(cri, native)), _log(cri, native)
    other = cri.create_container(new, "other", ctd.image, ["sh", "-c", "sleep 1000"])
    with pytest.raises(CriError) as info:
        cri.start(other)
    assert f"pod checkpoint {name} has no container 'other' (it has native, app, sidecar)" in str(info.value), \
        str(info.value)
    (record,) = glob.glob(f"/run/containerd/runc/*/.migrt-hold-{new}.json")
    with open(record) as fh:
        held = json.load(fh)
    assert held["state"] == "abandoned" and "no container 'other'" in held["reason"], held  # given up at once
    cri.delete_pod(new)
    cri.delete_pod(pod)
    run_cli("rm", name)


def test_a_new_pod_that_does_not_match_is_refused_at_its_first_create(cri, cri_containerd):
    """With the new pod's list (migrt.io/migrate-pod), its first create checks the whole pod: another image
    for the sidecar refuses the native sidecar's create already, before anything is restored or held."""
    ctd = cri_containerd
    pod, cids = _pod(cri, ctd, _uid("mis"))
    name = _uid("mis-ck")
    run_cli("checkpoint", "--pod", f"team-a/{cri.pods[pod].name}", "--name", name, "--leave-running",
            "--tcp-established")
    listed = f"native={ctd.image},app={ctd.image},sidecar=registry.example/other:1"
    new = cri.run_pod(_uid("mis-new"), "team-a", annotations={"migrt.io/restore": name, "migrt.io/migrate-pod": listed})
    first = cri.create_container(new, "native", ctd.image, ["sh", "-c", "sleep 1000"])
    with pytest.raises(CriError) as info:
        cri.start(first)
    said = str(info.value)
    assert (f"pod checkpoint {name} does not match the new pod (migrt.io/migrate-pod): container sidecar: image "
            f"'registry.example/other:1', the checkpoint's is '{ctd.image}'; nothing was restored") in said, said
    assert not glob.glob(f"/run/containerd/runc/*/.migrt-hold-{new}.json")  # no part restored, none held
    for cid in cids.values():
        assert cri.state_name(cid) == "CONTAINER_RUNNING"
    cri.delete_pod(new)
    # one container asking for its part by env (MIGRT_RESTORE): restored alone, no pod to wait for
    alone = cri.run_pod(_uid("alone"), "team-a")
    one = cri.create_container(alone, "native", ctd.image, ["sh", "-c", "echo fresh; sleep 1000"],
                               env={"MIGRT_RESTORE": name})
    cri.start(one)
    ticks = _wait("the native sidecar ticking on its own", lambda: parse_ticks(_log(cri, one)))
    assert ticks[0][1] == ticks[0][2] == parse_ticks(_log(cri, cids["native"]))[0][1]  # its memory
    assert not glob.glob(f"/run/containerd/runc/*/.migrt-hold-{alone}.json")
    cri.delete_pod(alone)
    cri.delete_pod(pod)
    run_cli("rm", name)


def test_a_failure_in_the_middle_leaves_every_container_running_and_nothing_listed(cri, cri_containerd,
                                                                                    migrt_config):
    ctd = cri_containerd
    pod, cids = _pod(cri, ctd, _uid("fail"))
    _wait("echoes", lambda: len(_echoes(_log(cri, cids["sidecar"]))) >= 2)
    name = _uid("fail-ck")
    env = {**os.environ, "MIGRT_FAULT": "checkpoint-pod:dump:sidecar:fail"}  # native and app dumped already
    res = run_cli("checkpoint", "--pod", f"team-a/{cri.pods[pod].name}", "--name", name, "--tcp-established",
                  check=False, env=env)
    assert res.returncode != 0
    assert "injected fault at checkpoint-pod:dump:sidecar" in res.stderr, res.stderr
    assert f"pod team-a/{cri.pods[pod].name}: checkpoint of container sidecar" in res.stderr, res.stderr
    for cname, cid in cids.items():
        assert cri.state_name(cid) == "CONTAINER_RUNNING", cname
        ticks = len(parse_ticks(_log(cri, cid))) if cname != "sidecar" else len(_echoes(_log(cri, cid)))
        _wait(f"{cname} going on", lambda c=cid, n=ticks, s=cname: (len(parse_ticks(_log(cri, c))) if s != "sidecar"
                                                                    else len(_echoes(_log(cri, c)))) > n + 2)
    assert not _ls(name)
    store = migrt_config["store"]
    assert not [e for e in os.listdir(os.path.join(store, ".staging")) if e.startswith(name)]
    cri.delete_pod(pod)


def test_a_real_dump_failure_names_the_container(cri, cri_containerd):
    """CRIU refuses an established connection without --tcp-established: the error names the container,
    and every container runs on."""
    ctd = cri_containerd
    pod, cids = _pod(cri, ctd, _uid("notcp"))
    _wait("echoes", lambda: len(_echoes(_log(cri, cids["sidecar"]))) >= 2)
    name = _uid("notcp-ck")
    res = run_cli("checkpoint", "--pod", f"team-a/{cri.pods[pod].name}", "--name", name, check=False)
    assert res.returncode == 5, res.stderr
    assert "checkpoint of container app" in res.stderr, res.stderr
    for cid in cids.values():
        assert cri.state_name(cid) == "CONTAINER_RUNNING"
    assert not _ls(name)
    cri.delete_pod(pod)


def test_a_pod_checkpoint_travels_as_one_image_and_restores_by_reference(cri, cri_containerd, registry,
                                                                         migrt_config):
    """Pushed as ONE image (every part's files its layers), removed here, pulled back ahead of time
    (`migrt pull`, as docs/registry.md advises; this rig's containerd runs in a network namespace of its
    own, which cannot reach the registry on the host's loopback) and restored into a new pod by the pod
    annotation migrt.io/restore=oci:REF@sha256:...: every create finds it pulled, by that digest."""
    ctd = cri_containerd
    pod, cids = _pod(cri, ctd, _uid("moved"))
    _wait("echoes", lambda: len(_echoes(_log(cri, cids["sidecar"]))) >= 2)
    name = _uid("moved-ck")
    run_cli("checkpoint", "--pod", f"team-a/{cri.pods[pod].name}", "--name", name, "--tcp-established")
    before = {c: _log(cri, cid) for c, cid in cids.items()}
    cri.delete_pod(pod)
    ref = registry.ref("team/trio", "v1")
    pushed = json.loads(run_cli("push", name, ref, "--json").stdout)
    res = run_cli("export", name, "-o", os.path.join(migrt_config["base"], "x.tar"), check=False)
    assert res.returncode == 2 and "is a whole pod's" in res.stderr, res.stderr
    run_cli("rm", name)
    pinned = f"{ref}@{pushed['digest']}"
    got = json.loads(run_cli("pull", pinned, "--json").stdout)
    assert got["name"].startswith("oci-trio-")

    new = cri.run_pod(_uid("moved-new"), "team-a", annotations={"migrt.io/restore": f"oci:{pinned}"})
    restored = {}
    for cname, _script in ORDER:
        restored[cname] = cri.create_container(new, cname, ctd.image, ["sh", "-c", "echo fresh; sleep 1000"])
        cri.start(restored[cname])
    last = parse_ticks(before["app"])[-1]
    after = _wait("app ticking again", lambda: parse_ticks(_log(cri, restored["app"])))
    assert after[0][0] > last[0] and all(t[1] == t[2] == last[1] for t in after), (after, last)
    last_echo = _echoes(before["sidecar"])[-1]
    _wait("new echoes on the restored connection",
          lambda: [e for e in _echoes(_log(cri, restored["sidecar"])) if e > last_echo])
    pulled = [c for c in json.loads(run_cli("ls", "--json").stdout) if c.get("containers")
              and c["name"].startswith("oci-trio-")]
    assert len(pulled) == 1 and pulled[0]["containers"] == ["native", "app", "sidecar"], pulled
    assert pushed["digest"].split(":")[1][:16] in pulled[0]["name"]
    cri.delete_pod(new)
    run_cli("rm", pulled[0]["name"])


@pytest.mark.parametrize("phase, after", [("frozen", "CONTAINER_RUNNING"), ("committed", "CONTAINER_EXITED")])
def test_recovery_after_a_killed_pod_checkpoint(cri, cri_containerd, phase, after):
    """migrt killed with the pod frozen (the fault seam): the next command thaws every container and keeps
    nothing; killed once the checkpoint is committed: it finishes the stop of all of them."""
    ctd = cri_containerd
    pod, cids = _pod(cri, ctd, _uid(f"kill-{phase}"))
    name = _uid("kill-ck")
    res = run_cli("checkpoint", "--pod", f"team-a/{cri.pods[pod].name}", "--name", name, "--tcp-established",
                  check=False, env={**os.environ, "MIGRT_FAULT": f"checkpoint-pod:{phase}:kill"})
    assert res.returncode == -9, (res.returncode, res.stderr)
    rec = run_cli("recover", "--wait", "30", check=False)
    assert rec.returncode == 0, rec.stdout + rec.stderr
    for cid in cids.values():
        assert (f"thawed container {cid}" if phase == "frozen" else f"stopped container {cid}") in rec.stdout, \
            rec.stdout
        cri.wait_state(cid, after)
    assert bool(_ls(name)) == (phase == "committed")
    if phase == "frozen":
        n = len(parse_ticks(_log(cri, cids["app"])))
        _wait("the app going on", lambda: len(parse_ticks(_log(cri, cids["app"]))) > n + 2)
    else:
        run_cli("rm", name)
    cri.delete_pod(pod)
