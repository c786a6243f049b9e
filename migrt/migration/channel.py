"""An authenticated connection between two migrt nodes: sealed JSON messages and raw file streams.

OSError and socket timeouts become TransferError here and nowhere else.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from migrt.errors import UsageError
from migrt.kernel import mm
from migrt.migration import protocol as p
from migrt.migration.protocol import AuthError, TransferError
from migrt.migration.tls import TLSFiles, wrap_client, wrap_server
from migrt.pagefill.remote import page_key
from migrt.store.fsutil import TreeHasher, make_entry

CHUNK = 8 << 20
TLS_HANDSHAKE = b"\x16"  # first byte of a TLS ClientHello record
CONNECT_TIMEOUT = 15.0
HANDSHAKE_TIMEOUT = 15.0
STALL_TIMEOUT = 10.0  # default: no byte and no message from the peer for this long = it is gone or stuck

Progress = Callable[[int], None]


class RemoteError(TransferError):
    """The peer reported a failure; carries the peer's exit code (e.g. 5 when its restore failed)."""

    def __init__(self, message: str, exit_code: object = None) -> None:
        super().__init__(message)
        if isinstance(exit_code, int) and not isinstance(exit_code, bool) and 0 < exit_code < 128:
            self.exit_code = exit_code


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT or [IPv6]:PORT."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"invalid address {text!r}: expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


@contextlib.contextmanager
def io_errors(what: str) -> Iterator[None]:
    try:
        yield
    except TransferError:
        raise
    except TimeoutError as exc:
        raise TransferError(f"{what}: timed out waiting for the peer") from exc
    except OSError as exc:
        raise TransferError(f"{what}: {exc.strerror or exc}") from exc


def send_all(sock: socket.socket, data) -> None:
    """sendall whose timeout counts from the last byte that left, not from the start (socket.sendall's
    timeout bounds the whole call: 8 MiB over a slow link would time out while bytes still flow)."""
    mv = memoryview(data).cast("B")
    while mv:
        mv = mv[sock.send(mv):]


def _keepalive(sock: socket.socket) -> None:
    """Notice a vanished peer within about 30 s even while we wait on it for minutes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give the pages of a sent range back to the system (tmpfs stores: keeps memory flat while a
    checkpoint as large as the container is streamed). Best effort."""
    from migrt.kernel.libc import libc

    libc.fallocate(fd, mm.FALLOC_FL_KEEP_SIZE | mm.FALLOC_FL_PUNCH_HOLE, offset, length)


class Channel:
    """One authenticated connection. `peer` is "host:port" of the other side.

    Liveness: every wait on the peer ends after `stall` seconds without a byte or a message from it
    (TransferError). A side busy with long local work (dumping, committing, restoring) says so with
    `busy()`, which sends an `alive` message every `stall / 4` seconds; `recv` skips them. So a
    peer that died, hangs or lost the network is noticed within `stall` seconds, however long the
    work of a healthy one takes."""

    def __init__(self, sock: socket.socket, session: bytes, *, is_server: bool,
                 stall: float = STALL_TIMEOUT) -> None:
        self.sock = sock
        self.peer = "{}:{}".format(*sock.getpeername()[:2])
        self.peer_host = sock.getpeername()[0]
        self.local_host = sock.getsockname()[0]
        self.pages_key = page_key(session)  # the page streams' key (pagefill/remote.py): never on the wire
        self.on_alive: Callable[[dict], None] | None = None  # sees the peer's heartbeats (progress)
        mine, theirs = (b"S", b"C") if is_server else (b"C", b"S")
        self._out = p.Sealer(session, mine)
        self._in = p.Sealer(session, theirs)
        self._buf = bytearray(CHUNK)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="migrt-hash")
        self._send_lock = threading.Lock()  # a message or a whole file at a time (busy() sends from a thread)
        self.stall = stall
        sock.settimeout(stall)

    # -- messages ----------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        with self._send_lock:
            body = self._out.seal(p.encode(msg))
            with io_errors(f"sending {msg.get('type')} to {self.peer}"):
                send_all(self.sock, p.HEADER.pack(p.SEALED, len(body)) + body)

    def recv(self, *expected: str) -> dict:
        """The next message (`alive` ones skipped); an `error` message from the peer is raised as
        RemoteError. No message for `stall` seconds raises TransferError."""
        while True:
            kind, payload = _recv_frame(self.sock, self.peer)
            if kind != p.SEALED:
                raise TransferError(f"{self.peer} sent an unsealed message after authentication")
            msg = p.decode(self._in.open(payload))
            if msg["type"] != "alive":
                break
            if self.on_alive is not None:
                self.on_alive(msg)
        if msg["type"] == "error":
            raise RemoteError(f"{self.peer}: {msg.get('error', 'unknown error')}", msg.get("exit_code"))
        if expected and msg["type"] not in expected:
            raise TransferError(f"{self.peer} sent {msg['type']!r}, expected {' or '.join(expected)}")
        return msg

    @contextlib.contextmanager
    def busy(self, what: str, info: Callable[[], dict] | None = None, every: float | None = None) -> Iterator[None]:
        """Tell the peer every stall/4 seconds (or `every`) that we are working on `what` (and not
        gone), with what `info()` says of the progress."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(min(every or self.stall / 4, self.stall / 4)):
                try:
                    self.send({"type": "alive", "doing": what, **(info() if info else {})})
                except TransferError:
                    return

        t = threading.Thread(target=beat, daemon=True, name="migrt-alive")
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def error(self, text: str, exit_code: int | None = None) -> None:
        """Tell the peer why we give up (best effort: the connection may already be gone)."""
        with contextlib.suppress(TransferError):
            self.send({"type": "error", "error": text, "exit_code": exit_code})

    # -- files -------------------------------------------------------------------------------
    def send_file(self, path: str, rel: str, *, progress: Progress | None = None, release: bool = False) -> dict:
        """Announce and stream one file; return {"size", "sha256"} of what was sent. The hash runs in
        a second thread alongside the send. release=True punches out each range once sent."""
        with io_errors(f"reading {path}"):
            fd = os.open(path, (os.O_RDWR if release else os.O_RDONLY) | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            with self._send_lock:
                return self._send_file(fd, path, rel, size, progress, release)
        finally:
            os.close(fd)

    def _send_file(self, fd: int, path: str, rel: str, size: int, progress: Progress | None, release: bool) -> dict:
        body = self._out.seal(p.encode({"type": "file", "path": rel, "size": size}))
        with io_errors(f"sending file to {self.peer}"):
            send_all(self.sock, p.HEADER.pack(p.SEALED, len(body)) + body)
        h = TreeHasher()
        mv = memoryview(self._buf)
        off = 0
        while off < size:
            with io_errors(f"reading {path}"):
                n = os.preadv(fd, [mv[: min(CHUNK, size - off)]], off)
            if n <= 0:
                raise TransferError(f"{path} shrank while being sent ({off} of {size} bytes)")
            chunk = mv[:n]
            hashing = self._pool.submit(h.update, chunk)
            try:
                with io_errors(f"sending {rel} to {self.peer}"):
                    send_all(self.sock, chunk)
            finally:
                hashing.result()
            if release:
                punch_hole(fd, off, n)
            off += n
            if progress:
                progress(n)
        return make_entry(size, h.hexdigest())

    def recv_file(self, fd: int, size: int, *, progress: Progress | None = None) -> str:
        """Receive exactly `size` raw bytes into fd; return their manifest digest (see store.fsutil)."""
        h = TreeHasher()
        mv = memoryview(self._buf)
        left = size
        while left:
            want = min(CHUNK, left)
            got = 0
            with io_errors(f"receiving from {self.peer}"):
                while got < want:
                    n = self.sock.recv_into(mv[got:want])
                    if not n:
                        raise TransferError(f"{self.peer} closed the connection in the middle of a file "
                                            f"({size - left + got} of {size} bytes)")
                    got += n
            chunk = mv[:got]
            hashing = self._pool.submit(h.update, chunk)
            try:
                with io_errors("writing a received file"):
                    done = 0
                    while done < got:
                        done += os.write(fd, chunk[done:])
            finally:
                hashing.result()
            left -= got
            if progress:
                progress(got)
        return h.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with contextlib.suppress(OSError):
            self.sock.close()


def recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    with io_errors(f"receiving from {peer}"):
        while got < n:
            k = sock.recv_into(mv[got:])
            if not k:
                raise TransferError(f"{peer} closed the connection")
            got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, peer: str, limit: int = p.MAX_JSON) -> tuple[int, bytes]:
    """One frame; its length is checked against `limit` before anything is allocated for it."""
    kind, length = p.HEADER.unpack(recv_exact(sock, p.HEADER.size, peer))
    if kind not in (p.PLAIN, p.SEALED) or length > limit:
        raise TransferError(f"{peer} does not speak the migrt protocol (frame type {kind}, length {length})")
    return kind, recv_exact(sock, length, peer)


def _send_plain(sock: socket.socket, msg: dict, peer: str) -> None:
    body = p.encode(msg)
    with io_errors(f"sending to {peer}"):
        sock.sendall(p.HEADER.pack(p.PLAIN, len(body)) + body)


def _recv_plain(sock: socket.socket, peer: str, expected: str) -> dict:
    kind, payload = _recv_frame(sock, peer, p.MAX_HANDSHAKE)  # nobody is authenticated yet: small frames only
    if kind != p.PLAIN:
        raise TransferError(f"{peer} sent a sealed message during the handshake")
    msg = p.decode(payload)
    if msg["type"] == "error":
        cls = AuthError if msg.get("auth") else TransferError
        raise cls(f"{peer} refused the connection: {msg.get('error')}")
    if msg["type"] != expected:
        raise TransferError(f"{peer} sent {msg['type']!r} during the handshake, expected {expected!r}")
    return msg


def _hex(msg: dict, field: str, peer: str) -> bytes:
    try:
        val = bytes.fromhex(msg.get(field) or "")
    except ValueError:
        val = b""
    if len(val) != 32:
        raise TransferError(f"{peer} sent a malformed {field}")
    return val


def connect(address: str, key: bytes, *, timeout: float = CONNECT_TIMEOUT, tls: TLSFiles | None = None,
            stall: float = STALL_TIMEOUT) -> Channel:
    """Connect to a receiver and authenticate both ways (client side), inside TLS when `tls` is given."""
    host, port = parse_address(address)
    peer = f"{host}:{port}"
    with io_errors(f"connecting to {peer}"):
        sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _keepalive(sock)
        sock.settimeout(HANDSHAKE_TIMEOUT)
        if tls:
            sock = wrap_client(sock, tls, peer)
        else:  # the client speaks first either way, so a TLS receiver can tell us it wants TLS
            _send_plain(sock, {"type": "hi", "proto": p.PROTOCOL}, peer)
        hello = _recv_plain(sock, peer, "hello")
        if hello.get("proto") != p.PROTOCOL:
            raise TransferError(f"{peer} speaks migrt protocol {hello.get('proto')}, this node {p.PROTOCOL}; "
                                "upgrade the older node")
        cs = _hex(hello, "challenge", peer)
        cc = secrets.token_bytes(32)
        _send_plain(sock, {"type": "auth", "proto": p.PROTOCOL, "challenge": cc.hex(),
                           "mac": p.client_proof(key, cs, cc).hex()}, peer)
        welcome = _recv_plain(sock, peer, "welcome")
        if not hmac.compare_digest(_hex(welcome, "mac", peer), p.server_proof(key, cs, cc)):
            raise AuthError(f"{peer} does not hold the migration key (its proof is wrong); refusing to send to it")
        return Channel(sock, p.session_key(key, cs, cc), is_server=False, stall=stall)
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, key: bytes, *, tls: TLSFiles | None = None, stall: float = STALL_TIMEOUT) -> Channel:
    """Authenticate a freshly accepted connection (server side). Raises AuthError for a wrong key."""
    peer = "{}:{}".format(*sock.getpeername()[:2])
    _keepalive(sock)
    sock.settimeout(HANDSHAKE_TIMEOUT)
    with io_errors(f"receiving from {peer}"):
        first = sock.recv(1, socket.MSG_PEEK)
    if first == TLS_HANDSHAKE and not tls:
        raise TransferError(f"{peer} speaks TLS; this node has no 'migration_tls' configured")
    if first != TLS_HANDSHAKE and tls:
        _send_plain(sock, {"type": "error", "error": "this receiver requires TLS: configure 'migration_tls' "
                                                     "(certificates from the same CA) on the sending node"}, peer)
        raise TransferError(f"{peer} connected without TLS; refused")
    if tls:
        sock = wrap_server(sock, tls, peer)
    else:
        _recv_plain(sock, peer, "hi")
    cs = secrets.token_bytes(32)
    _send_plain(sock, {"type": "hello", "proto": p.PROTOCOL, "challenge": cs.hex()}, peer)
    auth = _recv_plain(sock, peer, "auth")
    if auth.get("proto") != p.PROTOCOL:
        _send_plain(sock, {"type": "error", "error": f"protocol {auth.get('proto')} is not supported "
                                                      f"(this node speaks {p.PROTOCOL})"}, peer)
        raise TransferError(f"{peer} speaks migrt protocol {auth.get('proto')}")
    cc = _hex(auth, "challenge", peer)
    if not hmac.compare_digest(_hex(auth, "mac", peer), p.client_proof(key, cs, cc)):
        _send_plain(sock, {"type": "error", "auth": True,
                           "error": "authentication failed: the migration keys of the two nodes differ"}, peer)
        raise AuthError(f"{peer} failed authentication (wrong migration key); connection refused")
    _send_plain(sock, {"type": "welcome", "mac": p.server_proof(key, cs, cc).hex()}, peer)
    return Channel(sock, p.session_key(key, cs, cc), is_server=True, stall=stall)
