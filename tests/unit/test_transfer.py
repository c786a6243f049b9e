"""migrt.migration.wire: addresses, keys, the authenticated handshake, sealed messages, file streams."""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest

from migrt.errors import ConfigError, UsageError
from migrt.migration.wire import TransferError, accept, connect, load_key, parse_address
from migrt.migration import channel as chmod
from migrt.migration import protocol as p
from migrt.migration.protocol import AuthError

KEY = b"k" * 32


def test_parse_address():
    assert parse_address("198.51.100.2:7000") == ("198.51.100.2", 7000)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("node-b.example:1") == ("node-b.example", 1)
    for bad in ("198.51.100.2", ":80", "host:", "host:0", "host:65536", "host:x"):
        with pytest.raises(UsageError):
            parse_address(bad)


def test_load_key(tmp_path):
    with pytest.raises(ConfigError, match="migration_key_file"):
        load_key(None)
    with pytest.raises(ConfigError, match="No such file"):
        load_key(str(tmp_path / "absent"))
    key = tmp_path / "key"
    key.write_text("s3cret-s3cret-s3cret-s3cret\n")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_key(str(key))
    key.chmod(0o600)
    assert load_key(str(key)) == b"s3cret-s3cret-s3cret-s3cret"  # trailing newline stripped
    key.write_text("short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        load_key(str(key))
    link = tmp_path / "link"
    link.symlink_to(key)  # followed: a link of ours to a trusted file (tests/unit/test_trust.py has the refusals)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        load_key(str(link))


class Server:
    """A listening socket on 127.0.0.1 whose accepted connection is handed to `handler` in a thread."""

    def __init__(self, handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.result = None
        self.error: BaseException | None = None

        def run() -> None:
            conn, _ = self.sock.accept()
            try:
                self.result = handler(conn)
            except BaseException as exc:  # collected for the test's assertions
                self.error = exc
            finally:
                conn.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(10)
        self.sock.close()
        return self.result


def test_handshake_and_sealed_messages():
    def handler(conn):
        ch = accept(conn, KEY)
        msg = ch.recv("ping")
        ch.send({"type": "pong", "n": msg["n"] + 1})
        return msg

    srv = Server(handler)
    ch = connect(srv.address, KEY)
    ch.send({"type": "ping", "n": 41})
    assert ch.recv("pong")["n"] == 42
    ch.close()
    assert srv.join() == {"type": "ping", "n": 41}
    assert srv.error is None


def test_wrong_key_is_refused_on_both_sides():
    srv = Server(lambda conn: accept(conn, KEY))
    with pytest.raises(AuthError, match="keys of the two nodes differ"):
        connect(srv.address, b"x" * 32)
    srv.join()
    assert isinstance(srv.error, AuthError)


def test_client_refuses_a_server_without_the_key():
    """A rogue receiver that cannot prove the key gets nothing: the client checks the server's proof."""

    def rogue(conn):
        chmod._recv_frame(conn, "client")  # hi
        conn.sendall(_plain({"type": "hello", "proto": p.PROTOCOL, "challenge": os.urandom(32).hex()}))
        chmod._recv_frame(conn, "client")  # auth
        conn.sendall(_plain({"type": "welcome", "mac": os.urandom(32).hex()}))
        return conn.recv(1)  # b"": the client hung up without sending anything

    srv = Server(rogue)
    with pytest.raises(AuthError, match="does not hold the migration key"):
        connect(srv.address, KEY)
    assert srv.join() == b""


def _plain(msg: dict) -> bytes:
    body = p.encode(msg)
    return p.HEADER.pack(p.PLAIN, len(body)) + body


def test_tampered_and_replayed_messages_are_rejected():
    frames: list[bytes] = []

    def handler(conn):
        ch = accept(conn, KEY)
        ch.recv("one")
        return ch.recv("two")

    srv = Server(handler)
    ch = connect(srv.address, KEY)
    # replay: the first sealed frame sent twice; the second copy has the wrong sequence number
    body = ch._out.seal(p.encode({"type": "one"}))
    frames.append(p.HEADER.pack(p.SEALED, len(body)) + body)
    ch.sock.sendall(frames[0] + frames[0])
    srv.join()
    assert isinstance(srv.error, AuthError) and "integrity" in str(srv.error)
    ch.close()

    srv = Server(handler)
    ch = connect(srv.address, KEY)
    body = bytearray(ch._out.seal(p.encode({"type": "one"})))
    body[-3] ^= 0x01  # flip one bit of the JSON
    ch.sock.sendall(p.HEADER.pack(p.SEALED, len(body)) + bytes(body))
    srv.join()
    assert isinstance(srv.error, AuthError)
    ch.close()


def test_not_a_migrt_peer():
    def http(conn):
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        return None

    srv = Server(http)
    with pytest.raises(TransferError, match="does not speak the migrt protocol"):
        connect(srv.address, KEY)
    srv.join()


def test_connection_refused_is_a_transfer_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(TransferError, match="connecting to 127.0.0.1") as info:
        connect(f"127.0.0.1:{port}", KEY)
    assert info.value.exit_code == 9


def test_peer_error_carries_its_exit_code():
    def handler(conn):
        ch = accept(conn, KEY)
        ch.recv("offer")
        ch.error("restore failed: boom", 5)

    srv = Server(handler)
    ch = connect(srv.address, KEY)
    ch.send({"type": "offer"})
    with pytest.raises(chmod.RemoteError, match="restore failed: boom") as info:
        ch.recv("ready")
    assert info.value.exit_code == 5
    srv.join()


def test_file_stream_roundtrip_with_sha256_and_release(tmp_path):
    src = tmp_path / "pages.img"
    data = os.urandom(chmod.CHUNK * 2 + 12345)  # several chunks and a partial one
    src.write_bytes(data)
    dst = tmp_path / "received.img"

    def handler(conn):
        ch = accept(conn, KEY)
        msg = ch.recv("file")
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            return msg, ch.recv_file(fd, msg["size"])
        finally:
            os.close(fd)

    srv = Server(handler)
    ch = connect(srv.address, KEY)
    seen = []
    meta = ch.send_file(str(src), "images/pages.img", progress=seen.append, release=True)
    msg, digest = srv.join()
    ch.close()
    want = hashlib.sha256(data).hexdigest()
    assert meta == {"size": len(data), "sha256": want} and digest == want
    assert msg == {"type": "file", "path": "images/pages.img", "size": len(data)}
    assert dst.read_bytes() == data and sum(seen) == len(data)
    st = os.stat(src)
    assert st.st_size == len(data) and st.st_blocks * 512 < len(data) // 2  # sent ranges given back


def test_truncated_stream_is_detected(tmp_path):
    def handler(conn):
        ch = accept(conn, KEY)
        msg = ch.recv("file")
        fd = os.open(tmp_path / "part", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            return ch.recv_file(fd, msg["size"])
        finally:
            os.close(fd)

    srv = Server(handler)
    ch = connect(srv.address, KEY)
    ch.send({"type": "file", "path": "images/x.img", "size": 1 << 20})
    ch.sock.sendall(b"y" * 1000)
    ch.close()
    srv.join()
    assert isinstance(srv.error, TransferError)
    assert "closed the connection in the middle of a file (1000 of 1048576 bytes)" in str(srv.error)
