"""What `migrt receive` grants a peer before it has proved it holds the migration key: little (a frame
of a few KiB, a slot among a bounded few) and not for long (a deadline however slowly it talks); and
with --once, only an authenticated migration ends the receiver. A real `migrt receive` process, hostile
peers on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from migrt.migration import channel as chmod
from migrt.migration import protocol as p
from migrt.migration.wire import TransferError, connect
from migrt.store import Store
from tests.unit.test_transfer_import import KEY, _free_port, receiver_env  # noqa: F401 - fixture
from tests.unit.test_transfer_tls import pki  # noqa: F401 - fixture

MIGRT = Path(sys.executable).parent / "migrt"


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    return out


class ReceiveProcess:
    """`migrt receive --json` (--once unless told) on a free loopback port."""

    def __init__(self, env: dict, tmp_path: Path, once: bool = True) -> None:
        self.address = f"127.0.0.1:{_free_port()}"
        self.err = open(tmp_path / "receive.err", "w+b")
        self.proc = subprocess.Popen([str(MIGRT), "receive", "--listen", self.address, "--json",
                                      *(["--once"] if once else [])],
                                     env=env, stdout=subprocess.PIPE, stderr=self.err)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(_split(self.address), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise AssertionError(f"migrt receive did not listen: {self.stderr()}")
        time.sleep(0.3)  # the probe connection above: let it be reported and forgotten
        self.base = _status(self.proc.pid)

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def finish(self, timeout: float = 30) -> tuple[int, list[dict]]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, [json.loads(line) for line in out.decode().splitlines() if line.strip()]

    def stop(self) -> list[dict]:
        """SIGTERM (a receiver without --once) and what it reported."""
        self.proc.terminate()
        return self.finish()[1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


STALL = 3  # migration_stall_timeout: also the deadline of a connection that has not authenticated


@pytest.fixture
def stall_env(receiver_env):
    with open(receiver_env.config, "a") as fh:
        fh.write(f"migration_stall_timeout: {STALL}\n")
    return receiver_env


@pytest.fixture
def receive_proc(stall_env, tmp_path):
    rp = ReceiveProcess(stall_env.env, tmp_path)
    yield rp
    rp.kill()


@pytest.fixture
def server_proc(stall_env, tmp_path):
    """A receiver that serves until stopped (no --once)."""
    rp = ReceiveProcess(stall_env.env, tmp_path, once=False)
    yield rp
    rp.kill()


def _migrate_one(address: str, tmp_path: Path, name: str = "real") -> None:
    """A sender with the key: one small stop-and-copy checkpoint, committed on the receiver."""
    blob = tmp_path / "pages.img"
    blob.write_bytes(os.urandom(100_000))
    ch = connect(address, KEY.encode())
    ch.send({"type": "offer", "name": name, "mode": "stop-and-copy", "container_id": "c1", "schema": 1})
    ch.recv("ready")
    files = {"images/pages-1.img": ch.send_file(str(blob), "images/pages-1.img")}
    ch.send({"type": "commit", "manifest": {"created": "x", "source": {"container_id": "c1"}, "files": files}})
    assert ch.recv("committed")["name"] == name
    ch.send({"type": "bye"})
    ch.close()


def _plain_header(length: int) -> bytes:
    return p.HEADER.pack(p.PLAIN, length)


def test_unauthenticated_connections_cost_bounded_memory_and_threads(server_proc, stall_env, tmp_path):
    """Item 7: 100 connections each announcing an 8 MiB first frame took the receiver from 58 MB to
    854 MB, one thread each. Now such a frame is refused before anything is allocated, peers that
    trickle hold one of a bounded number of slots until the deadline, and a real sender still gets in."""
    address = _split(server_proc.address)
    big, trickle = [], []
    try:
        for _ in range(100):  # an 8 MiB frame announced, then 1 byte at a time
            s = socket.create_connection(address, timeout=5)
            s.sendall(_plain_header(p.MAX_JSON) + b"[")
            big.append(s)
        for _ in range(100):  # a header that never completes
            s = socket.create_connection(address, timeout=5)
            s.sendall(b"\x01")
            trickle.append(s)
        time.sleep(1.0)
        for s in trickle[-20:]:
            with contextlib.suppress(OSError):
                s.sendall(b"\x00")  # still talking, slowly
        now = _status(server_proc.proc.pid)
        grown_mib = (now["VmRSS"] - server_proc.base["VmRSS"]) / 1024
        assert grown_mib < 64, f"receiver grew by {grown_mib:.0f} MiB under 200 unauthenticated connections"
        assert now["Threads"] <= server_proc.base["Threads"] + 40, now  # the admission slots (32), a reaper
        _migrate_one(server_proc.address, tmp_path)  # the real migration gets a slot (the oldest idle one goes)
    finally:
        for s in big + trickle:
            s.close()
    Store(str(stall_env.store)).get("real").verify()


def test_a_trickling_peer_is_ended_at_the_pre_auth_deadline(server_proc):
    """One byte every half second never satisfies a read's timeout; the deadline ends it anyway."""
    s = socket.create_connection(_split(server_proc.address), timeout=5)
    t0 = time.monotonic()
    ended = None
    try:
        for byte in (_plain_header(30) + b'{"type":"hi","proto":2,"x":"' + b"a" * 100):
            s.sendall(bytes([byte]))
            time.sleep(0.5)
            if time.monotonic() - t0 > STALL + 5:
                break
    except OSError:
        ended = time.monotonic() - t0  # reset by the receiver
    finally:
        s.close()
    assert ended is not None and ended < STALL + 3, ended


def test_a_trickling_tls_handshake_is_ended_at_the_deadline_too(stall_env, pki, tmp_path):
    """Inside TLS the reads are the ssl module's: the deadline shuts the socket under them."""
    tls = pki["b"]
    with open(stall_env.config, "a") as fh:
        fh.write(f"migration_tls: {{cert: {tls.cert}, key: {tls.key}, ca: {tls.ca}}}\n")
    rp = ReceiveProcess(stall_env.env, tmp_path, once=False)
    try:
        s = socket.create_connection(_split(rp.address), timeout=5)
        t0, ended = time.monotonic(), None
        try:
            for byte in b"\x16\x03\x01\x02\x00" + b"\x01" * 200:  # a ClientHello's record, byte by byte
                s.sendall(bytes([byte]))
                time.sleep(0.5)
                if time.monotonic() - t0 > STALL + 5:
                    break
        except OSError:
            ended = time.monotonic() - t0
        finally:
            s.close()
        assert ended is not None and ended < STALL + 3, ended
    finally:
        rp.kill()


def test_once_ends_only_after_an_authenticated_migration(receive_proc, tmp_path):
    """Item 8: an HTTP `GET /` ended `migrt receive --once`; the real migration then got "Connection
    refused". Neither that nor a peer with the wrong key counts now."""
    address = _split(receive_proc.address)
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        try:
            got = s.recv(100)
        except ConnectionResetError:
            got = b""
        assert got == b""  # the receiver hung up on it
    with pytest.raises(TransferError):
        connect(receive_proc.address, b"w" * 32)
    time.sleep(0.5)
    assert receive_proc.proc.poll() is None, receive_proc.stderr()
    _migrate_one(receive_proc.address, tmp_path)
    rc, reports = receive_proc.finish()
    assert rc == 0
    assert [r.get("authenticated", False) for r in reports] == [False, False, False, True], reports


def test_deeply_nested_json_before_authentication_is_a_protocol_error(server_proc, tmp_path):
    """'[[[[...' in the first frame made a RecursionError (an internal error); now it is the peer's
    protocol error, and the receiver goes on."""
    with socket.create_connection(_split(server_proc.address), timeout=5) as s:
        body = b"[" * 4000
        s.sendall(_plain_header(len(body)) + body)
        with contextlib.suppress(OSError):
            s.recv(100)
    _migrate_one(server_proc.address, tmp_path)
    time.sleep(0.3)
    reports = server_proc.stop()
    nested = [r for r in reports if "nested" in (r.get("error") or "")]
    assert nested and nested[0]["exit_code"] == 9 and "internal error" not in nested[0]["error"], reports


def test_client_refuses_a_deeply_nested_hello_without_a_traceback():
    server = socket.create_server(("127.0.0.1", 0))

    def rogue() -> None:
        conn, _ = server.accept()
        with conn:
            chmod._recv_frame(conn, "client")
            body = b'{"type":"hello","x":' + b"[" * 4000
            conn.sendall(_plain_header(len(body)) + body)
            conn.recv(1)

    t = threading.Thread(target=rogue, daemon=True)
    t.start()
    try:
        with pytest.raises(TransferError, match="does not speak the migrt protocol|nested too deeply"):
            connect("127.0.0.1:%d" % server.getsockname()[1], KEY.encode())
    finally:
        t.join(5)
        server.close()
