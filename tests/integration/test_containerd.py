"""migrt-runc under a real containerd 2.1 (private root and socket), through `ctr --runc-binary`."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from tests.integration.conftest import SHIM, run_cli
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _run_detached(ctd, cid: str, log: str, *extra: str, cmd: str = COUNTER) -> None:
    ctd.ctr("run", "-d", "--runc-binary", SHIM, "--log-uri", f"file://{log}", *extra, ctd.image, cid, "sh", "-c", cmd)


def _wait_ticks(path: str, n: int, timeout: float = 20) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(open(path).read()) if os.path.exists(path) else []
        if len(ticks) >= n:
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} ticks in {path}: {open(path).read() if os.path.exists(path) else 'no file'}")


def _remove(ctd, cid: str) -> None:
    ctd.ctr("task", "kill", "-s", "KILL", cid, check=False)
    for _ in range(50):
        if ctd.ctr("task", "delete", cid, check=False).returncode == 0:
            break
        if "not found" in ctd.ctr("task", "delete", cid, check=False).stderr:
            break
        time.sleep(0.1)
    ctd.ctr("containers", "delete", cid, check=False)


def _checkpointed_counter(ctd, tmp_path, *, leave_running: bool = False, name: str | None = None) -> tuple[str, str, list]:
    cid = _id("src")
    log = str(tmp_path / f"{cid}.log")
    _run_detached(ctd, cid, log)
    _wait_ticks(log, 5)
    name = name or _id("ck")
    args = ["checkpoint", cid, "--name", name] + (["--leave-running"] if leave_running else [])
    res = run_cli(*args)
    assert res.stdout.strip() == name
    before = parse_ticks(open(log).read())
    if not leave_running:
        _remove(ctd, cid)
    return cid, name, before


def _ctr_run_fg(ctd, cid: str, *extra: str, cmd: str = COUNTER) -> subprocess.Popen:
    return subprocess.Popen(
        [ctd.binary("ctr"), "--address", ctd.sock, "--namespace", ctd.namespace, "run", "--runc-binary", SHIM, *extra,
         ctd.image, cid, "sh", "-c", cmd],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# -- ordinary containers: migrt must be invisible -------------------------------------------------

def test_plain_run_exit_code(containerd):
    res = containerd.ctr("run", "--rm", "--runc-binary", SHIM, containerd.image, _id("plain"),
                         "sh", "-c", "echo hello; exit 3", check=False)
    assert res.returncode == 3
    assert "hello" in res.stdout


def test_plain_exec_ps_kill_delete(containerd, tmp_path):
    cid = _id("plain")
    containerd.ctr("run", "-d", "--runc-binary", SHIM, containerd.image, cid, "sh", "-c",
                   "trap 'exit 42' TERM; while true; do sleep 0.1; done")
    try:
        res = containerd.ctr("task", "exec", "--exec-id", "e1", cid, "sh", "-c", "echo in-$((40+2))")
        assert res.stdout.strip() == "in-42"
        res = containerd.ctr("task", "exec", "--exec-id", "e2", cid, "sh", "-c", "exit 5", check=False)
        assert res.returncode == 5
        ps = containerd.ctr("task", "ps", cid).stdout
        assert len([line for line in ps.splitlines()[1:] if line.strip()]) >= 1
        containerd.ctr("task", "kill", "-s", "TERM", cid)
        for _ in range(100):
            if "STOPPED" in containerd.ctr("task", "ls").stdout.split(cid, 1)[-1].splitlines()[0]:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("task did not stop after SIGTERM")
        res = containerd.ctr("task", "delete", cid, check=False)
        assert "exit code 42" in res.stderr or res.returncode == 42  # the workload's own TERM handler
    finally:
        _remove(containerd, cid)
    assert cid not in containerd.containers()


# -- checkpoint and restore ---------------------------------------------------------------------

def test_checkpoint_and_restore_through_containerd(containerd, migrt_config, tmp_path):
    src, name, before = _checkpointed_counter(containerd, tmp_path)
    last = before[-1]
    assert last[1] == last[2]  # data intact before the dump
    ls = json.loads(run_cli("ls", "--json").stdout)
    assert name in [c["name"] for c in ls]

    dst = _id("dst")
    proc = _ctr_run_fg(containerd, dst, "--env", f"MIGRT_RESTORE={name}", cmd="echo started-fresh; exit 9")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "RUNNING" not in containerd.ctr("task", "ls").stdout:
            time.sleep(0.1)
        time.sleep(1.0)
        # the restored process runs inside the new container: exec into it works
        res = containerd.ctr("task", "exec", "--exec-id", "probe", dst, "sh", "-c", "touch /tmp/stop; echo ok")
        assert res.stdout.strip() == "ok"
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 7, (out, err)  # the restored workload's own exit status
    assert "started-fresh" not in out
    after = parse_ticks(out)
    assert after, out
    assert after[0][0] > last[0]  # the counter resumed where it stopped, not from 1
    assert all(t[1] == last[1] and t[2] == last[1] for t in after)  # in-memory data identical
    _remove(containerd, dst)
    # nothing left behind: no runc state, no work dirs, no restore views
    ns_root = f"/run/containerd/runc/{containerd.namespace}"
    assert not os.path.exists(os.path.join(ns_root, dst))
    assert os.listdir(os.path.join(migrt_config["store"], ".tmp")) == []
    # the checkpoint is still intact and restorable
    run_cli("inspect", name, "--verify")


@pytest.mark.parametrize("bad,expect", [
    ("no-such-checkpoint", "not found"),
    ("../etc", "invalid checkpoint name"),
    ("/etc/passwd", "invalid checkpoint name"),
])
def test_bad_restore_names_fail_clearly(containerd, bad, expect):
    res = containerd.ctr("run", "--rm", "--runc-binary", SHIM, "--env", f"MIGRT_RESTORE={bad}",
                         containerd.image, _id("bad"), "sh", "-c", "echo fresh", check=False)
    assert res.returncode != 0
    assert "OCI runtime create failed" in res.stderr
    assert expect in res.stderr
    assert "fresh" not in res.stdout


def test_tampered_checkpoint_refused_and_kept(containerd, migrt_config, tmp_path):
    src, name, _ = _checkpointed_counter(containerd, tmp_path, leave_running=True)
    try:
        ckpt = os.path.join(migrt_config["store"], name)
        pages = sorted(f for f in os.listdir(os.path.join(ckpt, "images")) if f.startswith("pages-"))
        target = os.path.join(ckpt, "images", pages[0])
        with open(target, "r+b") as fh:
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0xFF]))
        res = containerd.ctr("run", "--rm", "--runc-binary", SHIM, "--env", f"MIGRT_RESTORE={name}",
                             containerd.image, _id("tamp"), "sh", "-c", "echo fresh", check=False)
        assert res.returncode != 0
        assert "OCI runtime create failed" in res.stderr and "sha256 mismatch" in res.stderr
        assert os.path.exists(target)  # the checkpoint is kept
        res = run_cli("inspect", name, "--verify", check=False)
        assert res.returncode == 4 and "sha256 mismatch" in res.stderr
        # the source keeps running after a --leave-running checkpoint
        assert "RUNNING" in containerd.ctr("task", "ls").stdout.split(src, 1)[1].splitlines()[0]
    finally:
        _remove(containerd, src)


def test_fallback_fresh_starts_original_command(containerd):
    res = containerd.ctr("run", "--rm", "--runc-binary", SHIM, "--env", "MIGRT_RESTORE=missing-ckpt",
                         "--env", "MIGRT_RESTORE_FALLBACK=fresh", containerd.image, _id("fresh"),
                         "sh", "-c", "echo started-fresh; exit 4", check=False)
    assert res.returncode == 4
    assert "started-fresh" in res.stdout


def test_failed_restore_leaves_checkpoint_usable(containerd, migrt_config, tmp_path):
    """A new container that lacks a bind mount the old one had is refused before CRIU runs, with an
    error naming the mount; nothing is left behind; the same checkpoint then restores into a
    container that has the mount."""
    vol = tmp_path / "vol"
    vol.mkdir()
    mount = ["--mount", f"type=bind,src={vol},dst=/data,options=rbind:rw"]
    cid = _id("vsrc")
    log = str(tmp_path / "vsrc.log")
    _run_detached(containerd, cid, log, *mount, cmd="exec 3>/data/held; " + COUNTER)
    _wait_ticks(log, 3)
    name = _id("vck")
    run_cli("checkpoint", cid, "--name", name)
    _remove(containerd, cid)

    bad = _id("nomnt")
    res = containerd.ctr("run", "--rm", "--runc-binary", SHIM, "--env", f"MIGRT_RESTORE={name}",
                         containerd.image, bad, "sh", "-c", "echo fresh", check=False)
    assert res.returncode != 0
    assert "OCI runtime create failed" in res.stderr, res.stderr
    assert "lacks the mount destination /data" in res.stderr, res.stderr
    assert not os.path.exists(f"/run/containerd/runc/{containerd.namespace}/{bad}")
    assert os.listdir(os.path.join(migrt_config["store"], ".tmp")) == []
    run_cli("inspect", name, "--verify")

    good = _id("mnt")
    proc = _ctr_run_fg(containerd, good, *mount, "--env", f"MIGRT_RESTORE={name}")
    try:
        time.sleep(2.0)
        containerd.ctr("task", "exec", "--exec-id", "stop", good, "touch", "/tmp/stop")
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 7, err
    assert parse_ticks(out)
    _remove(containerd, good)
