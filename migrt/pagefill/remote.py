"""Pages from the source node (lazy migration): the wire between migrt's page server on the source
(migration/pageserve.py, which reads the frozen source processes' memory with process_vm_readv) and
the filler on the target, whose copy threads fetch the ranges they copy, each over its own TCP
connection (a stream), so that several requests are always in flight and no thread waits for another.

One stream (after TLS, when the nodes have `migration_tls`):

    S -> C   b"MGPG1" + nonce (16 bytes)
    C -> S   HMAC-SHA256(key, b"migrt-pages" | nonce)           (32 bytes)
    S -> C   b"\\x00"                                            (welcome; a wrong answer: closed)
    C -> S   b"F" (this stream serves page faults) or b"B" (background copies: the server runs
             their thread at a lower CPU priority, so that faults go first on a busy node)
    C -> S   REQUEST (vpid, address, length)                     any number of times
    S -> C   status (i64: 0, or -errno) + `length` bytes when 0
    C -> S   REQUEST (0, 0, 0): every page is in (the server may end)

`key` is derived from the migration channel's session key (`page_key`): it never travels, so only
the peer that ran the authenticated handshake can read the source's memory, and only during that
migration. Without TLS, the pages travel in clear (as every other byte of a migration without TLS).
vpid is the pid inside the container (CRIU's images are keyed by it), address the page's address in
the source process, which is where the dump left it (the source stays frozen until the end).
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import socket
import ssl
import struct
import threading

from migrt.kernel import mm
from migrt.kernel.libc import libc

MAGIC = b"MGPG1"
NONCE = 16
REQUEST = struct.Struct("<QQQ")
STATUS = struct.Struct("<q")
MAX_REQUEST = 16 << 20
CONNECT_TIMEOUT = 10.0


class FetchError(Exception):
    """The source did not deliver a range (connection lost, refused, the source process gone)."""


def page_key(session_key: bytes) -> bytes:
    return hmac.new(session_key, b"migrt-pages-key", hashlib.sha256).digest()


def answer(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"migrt-pages" + nonce, hashlib.sha256).digest()


def tls_context(cert: str, key: str, ca: str, *, server: bool) -> ssl.SSLContext:
    """Mutual TLS 1.2+ with a private CA, no host names (nodes are addressed by IP): the migration
    channel's rules (migration/tls.py), shared with the page streams."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    return ctx


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise FetchError("the source closed the connection")
        got += k


def _anon_buffer(size: int) -> tuple[int, memoryview]:
    """Page-aligned memory (UFFDIO_COPY wants an aligned source) and a writable view of it."""
    addr = libc.mmap(None, size, mm.PROT_READ | mm.PROT_WRITE, mm.MAP_PRIVATE | mm.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise FetchError(f"cannot allocate a {size}-byte buffer: {os.strerror(ctypes.get_errno())}")
    return addr, memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


class _Stream:
    def __init__(self, spec: dict, chunk: int, background: bool = False) -> None:
        self.addr, self.view = _anon_buffer(chunk)
        try:
            sock = socket.create_connection((spec["address"], spec["port"]), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            raise FetchError(f"cannot connect to the source's page server {spec['address']}:{spec['port']}: "
                             f"{exc.strerror or exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if spec.get("tls"):
                t = spec["tls"]
                sock = tls_context(t["cert"], t["key"], t["ca"], server=False).wrap_socket(sock)
            sock.settimeout(spec.get("timeout") or 30.0)
            hello = recv_exact(sock, len(MAGIC) + NONCE)
            if not hello.startswith(MAGIC):
                raise FetchError("the source's page server speaks another protocol")
            sock.sendall(answer(bytes.fromhex(spec["key"]), hello[len(MAGIC):]))
            try:
                welcome = recv_exact(sock, 1)
            except FetchError:
                welcome = b""
            if welcome != b"\0":
                raise FetchError(f"the source's page server {spec['address']}:{spec['port']} refused this node "
                                 "(not this migration's key)")
            sock.sendall(b"B" if background else b"F")
        except (OSError, ssl.SSLError, FetchError) as exc:
            sock.close()
            if isinstance(exc, FetchError):
                raise
            raise FetchError(f"page server handshake failed: {exc}") from exc
        self.sock = sock

    def fetch(self, vpid: int, address: int, n: int) -> int:
        try:
            self.sock.sendall(REQUEST.pack(vpid, address, n))
            (status,) = STATUS.unpack(recv_exact(self.sock, STATUS.size))
            if status:
                raise FetchError(f"the source could not read {n} bytes at {address:#x} of pid {vpid}: "
                                 f"{os.strerror(-status)}")
            recv_into_exact(self.sock, self.view[:n])
        except (OSError, ssl.SSLError) as exc:
            raise FetchError(f"page stream to the source broke: {exc}") from exc
        return self.addr

    def close(self, bye: bool = False) -> None:
        try:
            if bye:
                self.sock.sendall(REQUEST.pack(0, 0, 0))
        except OSError:
            pass
        finally:
            self.sock.close()


class RemotePages:
    """What the filler copies from when the pages are on the source: `address()` fetches the range
    into the calling thread's own buffer over the thread's own stream and returns that buffer."""

    def __init__(self, spec: dict, chunk: int) -> None:
        self.spec = spec
        self.chunk = chunk
        self.size = 1 << 62  # no local file to check offsets against
        self._local = threading.local()
        self._streams: list[_Stream] = []
        self._lock = threading.Lock()
        self.fetched = 0

    def _stream(self, background: bool = False) -> _Stream:
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = _Stream(self.spec, self.chunk, background)
            with self._lock:
                self._streams.append(s)
        return s

    def connect(self, background: bool = False) -> None:
        self._stream(background)

    def address(self, vpid: int, offset: int, n: int) -> int:
        """Where the `n` bytes of process `vpid` at source address `offset` are now (n <= chunk)."""
        if n > self.chunk:
            raise FetchError(f"internal: a {n}-byte fetch is over the {self.chunk}-byte buffer")
        addr = self._stream().fetch(vpid, offset, n)
        with self._lock:
            self.fetched += n
        return addr

    def close(self, done: bool) -> None:
        """done: tell the source every page is in."""
        with self._lock:
            streams, self._streams = self._streams, []
        for i, s in enumerate(streams):
            s.close(bye=done and i == 0)
