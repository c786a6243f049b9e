"""migration/bulk.py: a stop-and-copy transfer over several streams, each chunk checked as it arrives.

Chunks are made 64 KiB here (TREE_CHUNK and bulk.CHUNK patched together) so that files of a few
hundred KB span several chunks and streams."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from migrt import config
from migrt.errors import CheckpointInvalid
from migrt.migration import bulk
from migrt.migration.channel import RemoteError
from migrt.migration.protocol import AuthError
from migrt.migration.receive import ReceiveOptions, Receiver
from migrt.migration.wire import TransferError, accept, connect
from migrt.store import Store
from migrt.store import fsutil
from tests.unit.test_transfer_import import KEY, receiver_env  # noqa: F401 (fixture)

SMALL = 64 << 10


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(fsutil, "TREE_CHUNK", SMALL)
    monkeypatch.setattr(bulk, "CHUNK", SMALL)


def _serve_once(cfg, **opts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % s.getsockname()[1]
    recv = Receiver(cfg, ReceiveOptions(listen=address, once=True, **opts), lambda r: None)
    server = recv.bind()
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("result", recv.serve(server)), daemon=True)
    t.start()
    box["thread"], box["server"] = t, server
    return address, box


def _finish(box) -> dict:
    box["thread"].join(30)
    box["server"].close()
    return box["result"]


def _files(tmp_path: Path) -> dict[str, bytes]:
    """A pages file of several chunks (not a multiple of the chunk), small images, an empty one."""
    blobs = {"images/pages-1.img": os.urandom(5 * SMALL + 12345), "images/pages-2.img": os.urandom(3 * SMALL),
             "images/core-1.img": b"core" * 100, "images/empty.img": b"", "rootfs-diff.tar": os.urandom(1000)}
    for rel, data in blobs.items():
        (tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / rel).write_bytes(data)
    return blobs


def _offer(ch, name: str) -> dict:
    ch.send({"type": "offer", "name": name, "mode": "stop-and-copy", "container_id": "c1", "schema": 1})
    return ch.recv("ready")


def _send(ch, ready: dict, tmp_path: Path, blobs: dict, streams: int, **kw) -> dict:
    extra = bulk.open_streams(ch, ready["bulk"], streams - 1, tls=None, stall=10)
    try:
        return bulk.send([ch, *extra], [(rel, str(tmp_path / "src" / rel)) for rel in blobs], **kw)
    finally:
        for c in extra:
            c.close()


def test_files_arrive_over_several_streams_and_verify_as_the_store_hashes(receiver_env, tmp_path):
    cfg = config.load()
    address, box = _serve_once(cfg, streams=3)
    blobs = _files(tmp_path)
    ch = connect(address, KEY.encode())
    ready = _offer(ch, "bulky")
    assert ready["bulk"]["protocol"] == bulk.PROTOCOL and ready["bulk"]["streams"] == 3
    seen = []
    files = _send(ch, ready, tmp_path, blobs, 3, progress=seen.append)
    # what the sender reports is the store's own digest of the files (64 KiB tree here)
    assert files == fsutil.hash_tree(str(tmp_path / "src"), list(blobs))
    assert sum(seen) == sum(map(len, blobs.values()))
    ch.send({"type": "commit", "manifest": {"created": "x", "source": {"container_id": "c1"}, "files": files}})
    assert ch.recv("committed")["name"] == "bulky"
    ch.send({"type": "bye"})
    ch.close()
    result = _finish(box)
    assert result["error"] is None and result["committed"] and result["streams"] == 3
    assert result["bytes"] == sum(map(len, blobs.values()))
    ckpt = Store(cfg.store).get("bulky")
    ckpt.verify()  # the store hashes the files again: same digests as those checked on arrival
    for rel, data in blobs.items():
        assert (Path(ckpt.path) / rel).read_bytes() == data


def test_the_sender_takes_fewer_streams_than_the_receiver_offers(receiver_env, tmp_path):
    cfg = config.load()
    address, box = _serve_once(cfg, streams=4)
    blobs = _files(tmp_path)
    ch = connect(address, KEY.encode())
    ready = _offer(ch, "one")
    files = _send(ch, ready, tmp_path, blobs, 1, release=True)  # the migration connection alone
    ch.send({"type": "commit", "manifest": {"created": "x", "source": {"container_id": "c1"}, "files": files}})
    ch.recv("committed")
    ch.send({"type": "bye"})
    ch.close()
    assert _finish(box)["streams"] == 1
    Store(cfg.store).get("one").verify()
    # release=True gave the sent ranges back: the source files are holes now, their size kept
    src = tmp_path / "src" / "images" / "pages-1.img"
    assert src.stat().st_size == 5 * SMALL + 12345 and src.stat().st_blocks * 512 < SMALL


def test_a_chunk_altered_in_transit_fails_on_arrival(receiver_env, tmp_path, monkeypatch):
    """The sender's sum is of the file; the bytes on the wire differ in one chunk: the receiver stops
    at that chunk (before the commit), says why, and keeps nothing."""
    cfg = config.load()
    address, box = _serve_once(cfg, streams=2)
    blobs = _files(tmp_path)
    real = bulk._put_piece

    def tamper(ch, src, off, n, view):  # the bytes on the wire, not those hashed
        if src.rel == "images/pages-1.img" and off == 2 * SMALL:
            view = bytearray(view if view is not None else src.view(off, n, memoryview(bytearray(n))))
            view[100] ^= 1
        return real(ch, src, off, n, view)

    monkeypatch.setattr(bulk, "_put_piece", tamper)
    ch = connect(address, KEY.encode())
    ready = _offer(ch, "tampered")
    with pytest.raises(RemoteError, match=r"images/pages-1.img: sha256 mismatch in the chunk at 131072") as info:
        files = _send(ch, ready, tmp_path, blobs, 2)  # raises here, or (all sent already) at the commit:
        ch.send({"type": "commit", "manifest": {"created": "x", "source": {"container_id": "c1"}, "files": files}})
        ch.recv("committed")
    assert info.value.exit_code == 4  # CheckpointInvalid on the receiver, carried across
    ch.close()
    result = _finish(box)
    assert "corrupted in transit" in result["error"] and not result["committed"]
    assert Store(cfg.store).list() == []
    assert os.listdir(Path(cfg.store) / ".staging") == []


def _raw_sender(address: str, announce: dict, then) -> dict:
    ch = connect(address, KEY.encode())
    _offer(ch, "raw")
    ch.send({"type": "bulk", **announce})
    then(ch)
    with pytest.raises(TransferError) as info:
        ch.recv("committed")
    ch.close()
    return {"error": str(info.value)}


@pytest.mark.parametrize("announce, then, match", [
    ({"files": {"images/a.img": 3 * SMALL}, "streams": 1},
     lambda ch: ch.send({"type": "chunk", "path": "images/a.img", "offset": 5, "size": 10}), "chunks start every"),
    ({"files": {"images/a.img": 3 * SMALL}, "streams": 1},
     lambda ch: ch.send({"type": "chunk", "path": "images/b.img", "offset": 0, "size": SMALL}), "did not announce"),
    ({"files": {"images/a.img": 3 * SMALL}, "streams": 1},
     lambda ch: ch.send({"type": "chunk", "path": "images/a.img", "offset": 2 * SMALL, "size": 10}),
     "unexpected chunk"),
    ({"files": {"images/a.img": 10}, "streams": 1},
     lambda ch: (ch.send({"type": "chunk", "path": "images/a.img", "offset": 0, "size": 10}),
                 ch.sock.sendall(b"0123456789"), ch.send({"type": "end"})), "never arrived"),
    ({"files": {"images/a.img": 10}, "streams": 1},
     lambda ch: (ch.send({"type": "chunk", "path": "images/a.img", "offset": 0, "size": 10}),
                 ch.sock.sendall(b"0123456789"),
                 ch.send({"type": "sum", "path": "images/a.img", "offset": 0,
                          "sha256": hashlib.sha256(b"0123456789").hexdigest()}),
                 ch.send({"type": "sum", "path": "images/a.img", "offset": 0,
                          "sha256": hashlib.sha256(b"0123456789").hexdigest()})), "two sums"),
    ({"files": {"../etc/passwd": 10}, "streams": 1}, lambda ch: None, "refusing received file"),
    ({"files": {"images/a.img": 10}, "streams": 9}, lambda ch: None, "this receiver takes 2"),
])
def test_the_receiver_refuses_what_a_sender_may_not_send(receiver_env, announce, then, match):
    cfg = config.load()
    address, box = _serve_once(cfg, streams=2)
    _raw_sender(address, announce, then)
    result = _finish(box)
    assert match in result["error"]
    assert Store(cfg.store).list() == [] and os.listdir(Path(cfg.store) / ".staging") == []


def _pair(**accept_kw):
    """An authenticated channel pair over loopback (client, server)."""
    server = socket.create_server(("127.0.0.1", 0))
    box: dict = {}

    def run():
        conn, _ = server.accept()
        box["ch"] = accept(conn, KEY.encode(), **accept_kw)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    client = connect("127.0.0.1:%d" % server.getsockname()[1], KEY.encode(), **accept_kw)
    t.join(10)
    server.close()
    return client, box["ch"]


def test_only_the_migrations_own_peer_joins_its_streams():
    """A stream must prove it holds this migration's session (a key derived from it); one of another
    migration between the same nodes, or with a wrong token, is refused and does not count."""
    client, server = _pair()
    other, _other_server = _pair()
    listener = bulk.Listener(server, 2, tls=None, stall=5)
    offer = listener.offer()
    with pytest.raises((AuthError, TransferError)):
        bulk.open_streams(other, offer, 1, tls=None, stall=5)  # another migration's session
    with pytest.raises((AuthError, TransferError)):
        bulk.open_streams(client, {**offer, "token": "f" * 32}, 1, tls=None, stall=5)
    good = bulk.open_streams(client, offer, 1, tls=None, stall=5)
    taken = listener.take(1)
    good[0].send({"type": "x"})
    assert taken[0].recv("x") == {"type": "x"}
    for c in (*good, *taken, client, server, other, _other_server):
        c.close()


def test_the_listener_goes_with_its_migration_connection():
    client, server = _pair()
    listener = bulk.Listener(server, 3, tls=None, stall=5)
    port = listener.port
    server.close()
    for _ in range(50):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail("the bulk listener still accepts after its migration connection was closed")
    client.close()


def _roundtrip(base: Path, client, server, streams: int, **kw) -> tuple[dict, dict]:
    """bulk.send and bulk.receive between a channel pair, without a Receiver; (sent, received) or the
    receiver's error raised. The files of _files(base), made here unless they are there."""
    blobs = _files(base) if not (base / "src").exists() else \
        {str(p.relative_to(base / "src")): p.read_bytes() for p in (base / "src").rglob("*") if p.is_file()}
    listener = bulk.Listener(server, streams, tls=kw.get("tls"), stall=10)
    out: dict = {"fds": []}
    dst = base / "dst"

    def create(rel: str, size: int) -> int:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(dst / rel, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        out["fds"].append(fd)
        return fd

    def recv():
        try:
            msg = server.recv("bulk")
            extra = listener.take(msg["streams"] - 1)
            out["digests"] = bulk.receive([server, *extra], bulk.check_announcement(msg), create)
        except BaseException as exc:
            out["error"] = exc
            server.error(str(exc), getattr(exc, "exit_code", None))

    t = threading.Thread(target=recv, daemon=True)
    t.start()
    extra = bulk.open_streams(client, listener.offer(), streams - 1, tls=kw.get("tls"), stall=10)
    try:
        sent = bulk.send([client, *extra], [(rel, str(base / "src" / rel)) for rel in blobs], known=kw.get("known"))
    except BaseException as exc:
        out["sent_error"] = exc
    t.join(30)
    for fd in out["fds"]:
        os.close(fd)
    if "error" in out:
        raise out["error"]
    for rel, data in blobs.items():
        assert (dst / rel).read_bytes() == data
    return sent, out["digests"]


def test_over_tls(tmp_path):
    from tests.unit.test_transfer_tls import _ca, _node  # the same throwaway PKI

    pki = tmp_path / "pki"
    pki.mkdir()
    _ca(pki, "ca")
    a, b = _node(pki, "ca", "node-a"), _node(pki, "ca", "node-b")
    server_box: dict = {}
    listen = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = listen.accept()
        server_box["ch"] = accept(conn, KEY.encode(), tls=b)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    client = connect("127.0.0.1:%d" % listen.getsockname()[1], KEY.encode(), tls=a)
    t.join(10)
    server = server_box["ch"]
    sent, got = _roundtrip(tmp_path, client, server, 3, tls=a)
    assert {rel: fsutil.digest_of(e) for rel, e in sent.items()} == got
    client.close()
    server.close()
    listen.close()


def test_known_digests_are_sent_as_they_are_and_checked(tmp_path, monkeypatch):
    """Digests known from the dump (hashed as the pages were written) are not computed again by the
    sender; the receiver checks them against what arrived: a wrong one fails the transfer."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hashed = []
    real = bulk._send_chunk
    monkeypatch.setattr(bulk, "_send_chunk", lambda ch, src, off, n, known, *a:
                        (known is None and hashed.append(src.rel)) or real(ch, src, off, n, known, *a))
    client, server = _pair()
    blobs = _files(tmp_path / "a")
    chunks = fsutil.hash_chunks(str(tmp_path / "a" / "src"), ["images/pages-1.img"])
    known = {"images/pages-1.img": [c[2] for c in chunks["images/pages-1.img"]]}
    sent, got = _roundtrip(tmp_path / "a", client, server, 2, known=known)
    assert fsutil.digest_of(sent["images/pages-1.img"]) == got["images/pages-1.img"]
    assert "images/pages-1.img" not in hashed and "images/pages-2.img" in hashed
    client.close()
    server.close()
    client, server = _pair()
    wrong = {"images/pages-1.img": [b"\0" * 32] * len(known["images/pages-1.img"])}
    with pytest.raises(CheckpointInvalid, match="sha256 mismatch"):
        _roundtrip(tmp_path / "b", client, server, 2, known=wrong)
    client.close()
    server.close()
    assert blobs


@pytest.mark.parametrize("write", ["map", "pwrite"])
@pytest.mark.parametrize("hashing", ["inline", "overlap"])
def test_a_stream_hashes_inline_or_in_a_thread_of_its_own(tmp_path, monkeypatch, hashing, write):
    """Pieces of a quarter chunk: hashed in order by the stream or by its one hashing thread (a buffer
    used again only once its hash is done), the same digests either way; a piece corrupted on the wire
    in the middle of a chunk is still found."""
    monkeypatch.setenv("MIGRT_BULK_HASH", hashing)
    monkeypatch.setenv("MIGRT_BULK_WRITE", write)
    monkeypatch.setattr(bulk, "PIECE", SMALL // 4)
    threads = set()
    real_run = bulk._Hasher._run
    monkeypatch.setattr(bulk._Hasher, "_run", lambda self, h, view: threads.add(threading.current_thread().name)
                        or real_run(self, h, view))
    client, server = _pair()
    sent, got = _roundtrip(tmp_path / "a", client, server, 2)
    want = fsutil.hash_chunks(str(tmp_path / "a" / "src"), list(got))
    for rel, digest in got.items():
        assert fsutil.digest_of(sent[rel]) == digest == fsutil.fold_chunks([c[2] for c in want[rel]])
    assert threads == (set() if hashing == "inline" else {"migrt-bulk-hash_0"})
    client.close()
    server.close()

    real_put = bulk._put_piece

    def tamper(ch, src, off, n, view):  # the third piece of the second chunk, on the wire only
        if src.rel == "images/pages-1.img" and off == SMALL + 2 * (SMALL // 4):
            view = bytearray(view if view is not None else src.view(off, n, memoryview(bytearray(n))))
            view[7] ^= 1
        return real_put(ch, src, off, n, view)

    monkeypatch.setattr(bulk, "_put_piece", tamper)
    client, server = _pair()
    with pytest.raises(CheckpointInvalid, match=f"pages-1.img: sha256 mismatch in the chunk at {SMALL}"):
        _roundtrip(tmp_path / "b", client, server, 2)
    client.close()
    server.close()


def test_streams_hash_in_a_thread_of_their_own_where_cores_are_spare(monkeypatch):
    monkeypatch.delenv("MIGRT_BULK_HASH", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert [bulk._overlap(s) for s in (1, 2)] == [True, False]
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert [bulk._overlap(s) for s in (1, 2, 4, 8, 16)] == [True, True, True, False, False]
    monkeypatch.setenv("MIGRT_BULK_HASH", "inline")
    assert not bulk._overlap(1)


def test_auto_streams():
    assert [bulk.auto_streams(c) for c in (1, 2, 3, 4, 16, 64)] == [1, 1, 1, 2, 8, 8]


def test_chunks_of():
    assert bulk.chunks_of(0) == [(0, 0)]
    assert bulk.chunks_of(SMALL) == [(0, SMALL)]
    assert bulk.chunks_of(2 * SMALL + 1) == [(0, SMALL), (SMALL, SMALL), (2 * SMALL, 1)]


def test_a_stream_that_stalls_mid_chunk_times_out_at_both_ends(tmp_path, monkeypatch):
    """A piece moves in one blocking call (recv MSG_WAITALL, send) with the stall enforced by the
    kernel: a peer that stops in the middle of a chunk is still given up after `stall` seconds."""
    monkeypatch.setattr(bulk, "CHUNK", 8 << 20)  # a chunk larger than the loopback's buffers
    client, server = _pair(stall=0.5)
    fd = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 8 << 20)
    client.send({"type": "chunk", "path": "f", "offset": 0, "size": 8 << 20})
    client.sock.sendall(b"x" * 1000)  # then nothing
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="receiving f from .*timed out"):
        bulk.receive([server], {"f": 8 << 20}, lambda rel, size: fd)
    assert 0.4 < time.monotonic() - t0 < 3
    os.close(fd)
    client.close()
    server.close()

    client, server = _pair(stall=0.5)  # a receiver that reads nothing: the sender's send times out
    (tmp_path / "src").write_bytes(os.urandom(8 << 20))
    monkeypatch.setattr(bulk, "REASON_WAIT", 0.2)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="timed out"):
        bulk.send([client], [("f", str(tmp_path / "src"))], release=True)
    assert time.monotonic() - t0 < 4
    client.close()
    server.close()
