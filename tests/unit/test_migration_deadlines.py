"""Deadlines and the dead man's switch of a migration: the progress watchdog, the channel's stall
timeout and heartbeats, and the guard process acting when its owner dies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from migrt.migration import watchdog
from migrt.migration.channel import Channel
from migrt.migration.guard import Guard, running_guards
from migrt.migration.protocol import TransferError


def _popen(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_silent_child_is_killed_after_the_stall_deadline():
    proc = _popen("import time; time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(watchdog.Stuck, match="no progress for 0.6 s"):
        watchdog.supervise(proc, stall=0.6, what="sleeper")
    assert 0.6 <= time.monotonic() - t0 < 5
    assert proc.poll() is not None  # killed, reaped


def test_a_working_child_outlives_the_deadline():
    proc = _popen("import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass")
    assert watchdog.supervise(proc, stall=0.5, what="busy") == 0


def test_a_check_kills_at_once():
    proc = _popen("import time; time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(watchdog.Stuck, match="the daemon died"):
        watchdog.supervise(proc, stall=30, what="x", check=lambda: "the daemon died")
    assert time.monotonic() - t0 < 5


def test_kill_tree_takes_the_grandchildren():
    proc = _popen("import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)")
    time.sleep(0.5)
    kids = [p.pid for p in watchdog.tree(proc.pid)[1:]]
    assert kids
    watchdog.kill_tree(proc)
    time.sleep(0.2)
    for pid in kids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                assert fh.read().split()[2] == "Z"  # dead, waiting for its (dead) parent's reaper
        except FileNotFoundError:
            pass


def _pair(stall: float) -> tuple[Channel, Channel]:
    """Two ends of a loopback TCP connection, as channels sharing a session key."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return Channel(a, b"k" * 32, is_server=False, stall=stall), Channel(b, b"k" * 32, is_server=True, stall=stall)


def test_a_silent_peer_is_given_up_after_the_stall_timeout():
    client, server = _pair(stall=0.5)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="timed out"):
        client.recv("ready")
    assert time.monotonic() - t0 < 3


def test_a_busy_peer_keeps_the_other_side_waiting():
    client, server = _pair(stall=0.4)

    def work():
        with server.busy("restore"):
            time.sleep(1.5)  # far longer than the stall timeout
        server.send({"type": "restored", "pid": 7})

    t = threading.Thread(target=work)
    t.start()
    assert client.recv("restored")["pid"] == 7  # the `alive` messages in between were skipped
    t.join()


def _wait_gone(tag: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while running_guards(tag):
        assert time.monotonic() < deadline, "the guard did not finish"
        time.sleep(0.05)


def test_the_guard_acts_when_its_owner_dies(tmp_path):
    """A child process owns a guard and is SIGKILLed: the guard applies the last instruction."""
    victim = tmp_path / "staging"
    victim.mkdir()
    (victim / "f").write_text("x")
    log = tmp_path / "migrt.log"
    tag = f"unit-{os.getpid()}-{time.monotonic_ns()}"
    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from migrt.migration.guard import Guard\n"
        f"g = Guard({tag!r}, {str(log)!r}); g.arm({{'do': 'remove', 'remove': [{str(victim)!r}]}})\n"
        "print('armed', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "armed"
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while victim.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    _wait_gone(tag)
    assert not victim.exists()
    rec = json.loads(log.read_text().splitlines()[-1])
    assert rec["event"] == "migration_guard" and rec["do"] == "remove" and rec["outcome"] == "cleaned up"


def test_a_disarmed_guard_does_nothing(tmp_path):
    victim = tmp_path / "keep"
    victim.mkdir()
    tag = f"unit-{os.getpid()}-{time.monotonic_ns()}"
    g = Guard(tag)
    g.arm({"do": "remove", "remove": [str(victim)]})
    g.disarm()
    _wait_gone(tag)
    assert victim.exists()
