"""A stop-and-copy transfer over several streams at once, every chunk checked as it arrives.

One migration connection (a Channel) moves ~0.8 GiB/s at best: one thread sends, hashes and reads
the file in turn, and the receiver receives, hashes and writes in turn. Here the files travel as
64 MiB chunks (the store's tree-digest unit, store/fsutil.py TREE_CHUNK) over `streams` connections
at once, each served by its own thread at both ends, which also hashes what its stream carries (one
core per stream at each end; hashlib lets the GIL go, so the streams hash in parallel). Where cores
are to spare (streams * 2 <= CPUs, up to OVERLAP_MAX streams: _overlap), each stream instead hands
its pieces to one hashing thread of its own, which hashes piece k, in order, while the stream moves
piece k + 1 (_Hasher): a piece then costs the stream the longer of the two, not their sum:

    sender                                          receiver (the migration connection's server)
                                         <- ready   {"bulk": {"protocol", "port", "token", "streams"}}
    open streams-1 data connections  -- TCP -->     port: a listener of this migration only
       (TLS when configured), join handshake        (token; HMAC proofs both ways with a key derived
                                                     from the migration's session key, which never travels)
    bulk {"files": {rel: size}, "streams": n} -->   creates every file at its size, reserves the space
    on every stream, any number of times:
      chunk {"path", "offset", "size"} + raw bytes  -> received straight into a shared mapping of the file
      sum {"path", "offset", "sha256"}              -> compared with the sha256 the receiver computed of
                                                       what it received; a mismatch ends the transfer
    end                                             -> every chunk of every file arrived and matched

The sender's sums are those of the file it sends: computed by the stream's thread from a mapping of
the file, piece by piece, each piece then sent (sendfile for a file that is kept: no copy; from the
mapping for one released as it goes), or known before (the parallel dump hashes what it writes:
pagedump, `known=`). A sum follows its chunk at once (the receiver accepts it any time before `end`).
The receiver hashes each piece where it landed (the mapping, or the buffer it pwrites), right after
it arrived (or while the next arrives). Either way a chunk's digest waits for all of its pieces'
hashes before it is sent or compared, and a buffer is filled again only once its hash is done (two
per stream then). Pieces (4 MiB) move in one call each: see "whole pieces in one call" below. The
receiver folds the chunk digests into each file's manifest digest; the sealed `commit` then compares
them with the sender's manifest as before (importer.verify). Stream 0 is the migration connection itself.

Chunks are taken by the streams from one queue (biggest files' chunks spread over every stream), so
a stream never idles while another has work. A chunk is 64 MiB at most and aligned to TREE_CHUNK
in its file; the receiver refuses any other offset or size, a chunk announced twice, a file not in
the announcement, and a transfer that ends with a chunk missing or unmatched.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import hmac
import os
import queue
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from migrt import faults
from migrt.errors import CheckpointInvalid, MigrtError
from migrt.kernel import mm
from migrt.kernel.files import TREE_CHUNK
from migrt.kernel.libc import libc
from migrt.migration import protocol as p
from migrt.migration.channel import Channel, RemoteError, io_errors, punch_hole, recv_exact, send_all
from migrt.migration.protocol import AuthError, TransferError
from migrt.migration.tls import TLSFiles, wrap_client, wrap_server
from migrt.store import hugetmpfs
from migrt.store.fsutil import fold_chunks, make_entry

PROTOCOL = "migrt-bulk/1"
CHUNK = TREE_CHUNK
MAGIC = b"MGBK1"
NONCE = 32
MAX_STREAMS = 64
MAX_FILES = 100_000
JOIN_TIMEOUT = 15.0
PIECE = 4 << 20  # what a stream receives (or sends) and then hashes at a time (still in the caches)
MAPPED_FROM = 2  # more streams than this receive straight into mappings (pwrite() serializes on the file's lock)
OVERLAP_MAX = 4  # at most this many streams hash in a thread of their own (when CPUs allow: _overlap)
DEPTH = 2  # pieces a stream has in hand when it hashes in a thread of its own: one hashed, one moving
LISTEN_POLL = 1.0  # the listener notices within this long that its migration connection was closed
REASON_WAIT = 3.0  # a sender whose stream broke waits this long for the receiver's reason
_DIGEST = 32

Progress = Callable[[int], None]

def auto_streams(cpus: int | None = None) -> int:
    """Streams when `migration_streams` is 0: half the CPUs (each stream keeps one core busy at each end,
    the hashing the other half), from 1 to 8."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def streams_key(ch: Channel) -> bytes:
    """The data connections' key: derived from the migration connection's session key (never sent)."""
    return hmac.new(ch._out.key, b"migrt-bulk-key", "sha256").digest()


# -- connecting the data streams ----------------------------------------------------------------

class Listener:
    """The receiving side's listener for one migration's data connections: it accepts, in a thread, up
    to `streams - 1` connections from the migration peer's address, authenticates them (TLS when the
    nodes have it, then the join proofs) and queues them for `take()`."""

    def __init__(self, ch: Channel, streams: int, *, tls: TLSFiles | None, stall: float) -> None:
        self.ch = ch
        self.streams = max(1, min(MAX_STREAMS, streams))
        self.tls = tls
        self.stall = stall
        self.key = streams_key(ch)
        self.token = secrets.token_hex(16)
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.sock: socket.socket | None = None
        self.port = None
        if self.streams == 1:  # the migration connection alone: nothing to listen for
            return
        family = socket.AF_INET6 if ":" in ch.local_host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((ch.local_host, 0))
            self.sock.listen(MAX_STREAMS)
        except OSError as exc:
            self.sock.close()
            raise TransferError(f"cannot listen for data streams on {ch.local_host}: {exc.strerror or exc}") from exc
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="migrt-bulk-accept").start()

    def offer(self) -> dict:
        """What `ready` carries (the sender's open_streams connects with it)."""
        return {"protocol": PROTOCOL, "port": self.port, "token": self.token, "streams": self.streams}

    def _accept(self) -> None:
        """Until streams - 1 joined, or the migration connection is closed (then the listener goes too:
        the receiver needs no clean-up of its own for it)."""
        joined, sock = 0, self.sock
        if sock is None:
            return  # one stream: nothing listens
        sock.settimeout(LISTEN_POLL)
        try:
            while joined < self.streams - 1 and not self._closed and self.ch.sock.fileno() != -1:
                try:
                    conn, addr = sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                conn.settimeout(None)
                if addr[0] != self.ch.peer_host:  # only the migration's peer may join it
                    conn.close()
                    continue
                try:
                    self._ready.put(_join_server(conn, self.key, self.token, tls=self.tls, stall=self.stall))
                    joined += 1
                except (TransferError, OSError):
                    conn.close()
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            if self.ch.sock.fileno() == -1:
                self.close()

    def take(self, n: int) -> list[Channel]:
        """n authenticated data connections, waiting at most JOIN_TIMEOUT (+ stall) for them."""
        out: list[Channel] = []
        deadline = time.monotonic() + JOIN_TIMEOUT + self.stall
        try:
            while len(out) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise queue.Empty
                out.append(self._ready.get(timeout=left))
        except queue.Empty:
            for c in out:
                c.close()
            raise TransferError(f"{self.ch.peer} announced {n + 1} streams but only {len(out) + 1} connected "
                                f"within {JOIN_TIMEOUT + self.stall:.0f} s (a firewall on port {self.port}?)") from None
        return out

    def close(self) -> None:
        self._closed = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self.sock.close()
        while True:  # joined but never taken
            try:
                self._ready.get_nowait().close()
            except queue.Empty:
                break


def open_streams(ch: Channel, offer: dict, n: int, *, tls: TLSFiles | None, stall: float) -> list[Channel]:
    """n data connections to the peer's bulk listener, each joined to this migration."""
    key = streams_key(ch)
    out: list[Channel] = []
    try:
        for _ in range(n):
            peer = f"{ch.peer_host}:{offer['port']}"
            with io_errors(f"connecting stream to {peer}"):
                sock = socket.create_connection((ch.peer_host, int(offer["port"])), timeout=JOIN_TIMEOUT)
            try:
                out.append(_join_client(sock, key, str(offer["token"]), tls=tls, stall=stall, peer=peer))
            except BaseException:
                sock.close()
                raise
    except BaseException:
        for c in out:
            c.close()
        raise
    return out


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _join_server(sock: socket.socket, key: bytes, token: str, *, tls: TLSFiles | None, stall: float) -> Channel:
    """S -> C MAGIC | ns;  C -> S nc | token (32) | HMAC(key, client | ns | nc | token);
    S -> C HMAC(key, server | ns | nc); both then seal with HMAC(key, session | ns | nc)."""
    peer = "{}:{}".format(*sock.getpeername()[:2])
    _tune(sock)
    sock.settimeout(JOIN_TIMEOUT)
    if tls:
        sock = wrap_server(sock, tls, peer)
    ns = secrets.token_bytes(NONCE)
    with io_errors(f"stream handshake with {peer}"):
        sock.sendall(MAGIC + ns)
        got = recv_exact(sock, NONCE + 32 + _DIGEST, peer)
    nc, tok, mac = got[:NONCE], got[NONCE:NONCE + 32], got[NONCE + 32:]
    if not hmac.compare_digest(tok, token.encode()[:32].ljust(32, b"\0")) or \
            not hmac.compare_digest(mac, p.client_proof(key, ns, nc + tok)):
        raise AuthError(f"{peer} tried to join a migration it does not belong to")
    with io_errors(f"stream handshake with {peer}"):
        sock.sendall(p.server_proof(key, ns, nc + tok))
    sock.settimeout(stall)
    return Channel(sock, p.session_key(key, ns, nc + tok), is_server=True, stall=stall)


def _join_client(sock: socket.socket, key: bytes, token: str, *, tls: TLSFiles | None, stall: float,
                 peer: str) -> Channel:
    _tune(sock)
    sock.settimeout(JOIN_TIMEOUT)
    if tls:
        sock = wrap_client(sock, tls, peer)
    with io_errors(f"stream handshake with {peer}"):
        hello = recv_exact(sock, len(MAGIC) + NONCE, peer)
        if not hello.startswith(MAGIC):
            raise TransferError(f"{peer} is not a migrt stream listener")
        ns, nc = hello[len(MAGIC):], secrets.token_bytes(NONCE)
        tok = token.encode()[:32].ljust(32, b"\0")
        sock.sendall(nc + tok + p.client_proof(key, ns, nc + tok))
        proof = recv_exact(sock, _DIGEST, peer)
    if not hmac.compare_digest(proof, p.server_proof(key, ns, nc + tok)):
        raise AuthError(f"{peer} could not prove it belongs to this migration; refusing to send to it")
    sock.settimeout(stall)
    return Channel(sock, p.session_key(key, ns, nc + tok), is_server=False, stall=stall)


# -- chunks ----------------------------------------------------------------------------------------

def chunks_of(size: int) -> list[tuple[int, int]]:
    """(offset, size) of every chunk of a file: TREE_CHUNK-aligned; an empty file has one empty chunk."""
    return [(off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)] or [(0, 0)]


class _Failure:
    """The first error of any thread. The data streams are shut down, which wakes their threads; the
    migration connection (chs[0]) must still carry the reason to the peer: the receiver only stops
    reading it (its thread wakes up), the sender leaves it alone (its thread stops between pieces)."""

    def __init__(self, chs: list[Channel], *, receiving: bool) -> None:
        self.chs = chs
        self.receiving = receiving
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.event = threading.Event()

    def set(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        self.event.set()
        for ch in self.chs[1:]:
            with contextlib.suppress(OSError):
                ch.sock.shutdown(socket.SHUT_RDWR)
        if self.receiving:
            with contextlib.suppress(OSError):
                self.chs[0].sock.shutdown(socket.SHUT_RD)

    def check(self) -> None:
        if self.event.is_set():
            raise TransferError("transfer stopped")


def _run_threads(target, chs: list[Channel], failure: _Failure, counter: list[int], progress: Progress | None,
                 name: str) -> None:
    threads = [threading.Thread(target=target, args=(i, ch), daemon=True, name=f"migrt-{name}-{i}")
               for i, ch in enumerate(chs)]
    for t in threads:
        t.start()
    reported = 0
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
                if progress and counter[0] > reported:
                    now = counter[0]
                    progress(now - reported)
                    reported = now
    except BaseException as exc:  # Ctrl-C: stop the streams, then let it through
        failure.set(exc)
        for t in threads:
            t.join()
        raise
    if progress and counter[0] > reported:
        progress(counter[0] - reported)


def _overlap(streams: int) -> bool:
    """Does each stream hash in a thread of its own, while it moves the next piece? Where cores are to
    spare for it: streams * 2 <= CPUs (a core per stream for the socket and the copies, one for
    sha256), and up to OVERLAP_MAX streams (many streams keep the cores busy anyway: 8 and 16 on the
    16-core host were measured hashing inline). MIGRT_BULK_HASH=inline|overlap decides instead
    (benchmarks)."""
    way = os.environ.get("MIGRT_BULK_HASH")
    if way in ("inline", "overlap"):
        return way == "overlap"
    return streams <= OVERLAP_MAX and streams * 2 <= (os.cpu_count() or 1)


class _Hasher:
    """A stream's sha256 of its pieces: inline (in the stream's thread, the piece then still in the
    caches), or, overlap, in one thread of the stream's own, in the order given (one worker), while
    the stream receives or sends the next piece. At most DEPTH pieces are in hand; a piece's buffer
    (where it cannot be a mapping's bytes) is free again once its hash is done: buffer() hands out one
    that no pending hash reads. A chunk's digest waits for all of its pieces' hashes. A hash that fails
    stops the transfer (failure); close() waits for the one running (it may read a mapping)."""

    def __init__(self, overlap: bool, failure: _Failure) -> None:
        self.failure = failure
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="migrt-bulk-hash") if overlap else None
        self.depth = DEPTH if overlap else 1
        self.bufs: list[memoryview | None] = [None] * self.depth
        self.pending: collections.deque[Future] = collections.deque()
        self.hashed = 0  # pieces handed to update(): piece i was in bufs[i % depth], if in a buffer

    def wait_room(self) -> None:
        """Until fewer than DEPTH pieces are still being hashed (a mapping's bytes too: hashed while
        they are still in the caches, not a chunk later)."""
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()

    def buffer(self) -> memoryview:
        """A piece buffer that no pending hash reads."""
        self.wait_room()
        i = self.hashed % self.depth
        buf = self.bufs[i]
        if buf is None:
            buf = self.bufs[i] = memoryview(bytearray(PIECE))
        return buf

    def update(self, h, view: memoryview) -> None:
        self.hashed += 1
        if self.pool is None:
            h.update(view)
        else:
            self.pending.append(self.pool.submit(self._run, h, view))

    def _run(self, h, view: memoryview) -> None:
        if self.failure.event.is_set():
            return
        try:
            h.update(view)
        except BaseException as exc:  # noqa: BLE001 - stops every stream
            self.failure.set(exc)

    def digest(self, h) -> bytes:
        while self.pending:
            self.pending.popleft().result()
        self.failure.check()  # a piece that was not hashed: not a digest
        return h.digest()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()


# -- whole pieces in one call ------------------------------------------------------------------------
# A socket with a Python timeout is non-blocking underneath: recv_into returns what is there (often
# 64 KiB on loopback), send what fits, and every call takes the GIL again; with many streams that
# costs more than the copies. So a plain (non-TLS) stream moves a piece with the socket blocking and
# the stall enforced by the kernel (SO_RCVTIMEO / SO_SNDTIMEO): one recv(MSG_WAITALL) or send() per
# piece. A call that times out with some bytes moved returns them (the next call waits a full stall
# again); one that moved nothing fails with EAGAIN, reported as the timeout it is.

@contextlib.contextmanager
def _blocking(ch: Channel) -> Iterator[socket.socket]:
    sock = ch.sock
    sock.settimeout(None)
    try:
        yield sock
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(ch.stall)


def _kernel_stall(ch: Channel) -> None:
    """The stall timeout for _blocking (ignored while the socket has a Python timeout)."""
    if isinstance(ch.sock, ssl.SSLSocket):
        return
    tv = struct.pack("@ll", int(ch.stall), int(ch.stall % 1 * 1e6))
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        ch.sock.setsockopt(socket.SOL_SOCKET, opt, tv)


def _recv_full(ch: Channel, view: memoryview) -> int:
    """Fill view from the stream; fewer bytes only when the peer closed it."""
    got, n = 0, len(view)
    if isinstance(ch.sock, ssl.SSLSocket):
        while got < n:
            k = ch.sock.recv_into(view[got:])
            if not k:
                break
            got += k
        return got
    with _blocking(ch) as sock:
        while got < n:
            try:
                k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            except BlockingIOError:
                raise TimeoutError("timed out") from None
            if not k:
                break
            got += k
    return got


def _send_full(ch: Channel, view) -> None:
    """All of view into the stream."""
    if isinstance(ch.sock, ssl.SSLSocket):
        send_all(ch.sock, view)
        return
    mv = memoryview(view).cast("B")
    with _blocking(ch) as sock:
        while mv:
            try:
                mv = mv[sock.send(mv):]
            except BlockingIOError:
                raise TimeoutError("timed out") from None


def _map(fd: int, size: int, prot: int) -> tuple[int, memoryview | None]:
    """A shared mapping of the file and a memoryview over it ((0, None) where mmap fails)."""
    if not size:
        return 0, None
    addr = libc.mmap(None, size, prot, mm.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return 0, None
    return addr, memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


def _unmap(addr: int, view: memoryview | None, size: int) -> None:
    if view is not None:
        view.release()
    if addr:
        libc.munmap(addr, size)


# -- sending ---------------------------------------------------------------------------------------

class _Source:
    """One file to send, mapped (hashed and sent from the page cache: no copy into a buffer of ours)."""

    def __init__(self, rel: str, path: str, release: bool) -> None:
        self.rel, self.path = rel, path
        with io_errors(f"reading {path}"):
            self.fd = os.open(path, (os.O_RDWR if release else os.O_RDONLY) | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self.addr, self.map = _map(self.fd, self.size, mm.PROT_READ)

    def view(self, off: int, n: int, buf: memoryview) -> memoryview:
        """The file's bytes [off, off + n): from the mapping once its pages are in (MADV_POPULATE_READ:
        a file that shrank fails here, not with a SIGBUS), else read into buf."""
        if self.map is not None and libc.madvise(self.addr + off, n, mm.MADV_POPULATE_READ) == 0:
            return self.map[off:off + n]
        with io_errors(f"reading {self.path}"):
            got = os.preadv(self.fd, [buf[:n]], off)
        if got != n:
            raise TransferError(f"{self.path} shrank while being sent ({off + max(got, 0)} of {self.size} bytes)")
        return buf[:n]

    def close(self) -> None:
        _unmap(self.addr, self.map, self.size)
        self.addr, self.map = 0, None
        with contextlib.suppress(OSError):
            os.close(self.fd)


def send(chs: list[Channel], files: list[tuple[str, str]], *, release: bool = False,
         known: dict[str, list[bytes]] | None = None, progress: Progress | None = None) -> dict[str, dict]:
    """Send `files` ((relpath, path), in order of preference) over the streams `chs` (chs[0] is the
    migration connection); returns {rel: manifest entry} of what was sent. known: chunk digests of
    files whose bytes were hashed as they were written (not hashed again). A file that is kept goes
    out with sendfile (the kernel sending the page cache's pages); release=True copies each piece into
    the socket and punches out each chunk once it is sent (a tmpfs store does not hold the checkpoint
    twice; a page punched out while the socket still held it could be zeroed in place: see _sendfile)."""
    srcs = [_Source(rel, path, release) for rel, path in files]
    try:
        chs[0].send({"type": "bulk", "files": {s.rel: s.size for s in srcs}, "streams": len(chs)})
        digests: dict[str, dict[int, bytes]] = {s.rel: {} for s in srcs}
        for s in srcs:
            for i, d in enumerate((known or {}).get(s.rel) or []):
                digests[s.rel][i * CHUNK] = d
            if known and s.rel in known and len(digests[s.rel]) != len(chunks_of(s.size)):
                digests[s.rel] = {}  # a record that does not fit the file: hash it here
        work: queue.SimpleQueue = queue.SimpleQueue()
        order = sorted(((s, off, n) for s in srcs for off, n in chunks_of(s.size)), key=lambda c: (-c[2], c[0].rel))
        for item in order:
            work.put(item)
        failure = _Failure(chs, receiving=False)
        sent = [0]
        lock = threading.Lock()
        overlap = _overlap(len(chs))

        def stream(_i: int, ch: Channel) -> None:
            hasher = _Hasher(overlap, failure)
            try:
                _kernel_stall(ch)
                zero_copy = not release and not isinstance(ch.sock, ssl.SSLSocket)
                while True:
                    if failure.event.is_set():
                        return
                    try:
                        src, off, n = work.get_nowait()
                    except queue.Empty:
                        break
                    ch.send({"type": "chunk", "path": src.rel, "offset": off, "size": n})
                    d = _send_chunk(ch, src, off, n, digests[src.rel].get(off), zero_copy, hasher, failure)
                    digests[src.rel][off] = d
                    ch.send({"type": "sum", "path": src.rel, "offset": off, "sha256": d.hex()})
                    if release and n:
                        punch_hole(src.fd, off, n)
                    with lock:
                        sent[0] += n
                if not failure.event.is_set():
                    ch.send({"type": "end"})
            except BaseException as exc:  # noqa: BLE001 - raised in the calling thread
                failure.set(exc)
            finally:
                hasher.close()

        _run_threads(stream, chs, failure, sent, progress, "bulk-send")
        if failure.error is not None:
            raise _sender_error(chs[0], failure.error)
        return {s.rel: make_entry(s.size, fold_chunks([digests[s.rel][off] for off, _ in chunks_of(s.size)]))
                for s in srcs}
    finally:
        for s in srcs:
            s.close()


def _send_chunk(ch: Channel, src: _Source, off: int, n: int, known: bytes | None, zero_copy: bool,
                hasher: _Hasher, failure: _Failure) -> bytes:
    """The chunk, piece by piece: each handed to the stream's hasher (unless its digest is known), then
    sent (while the hasher hashes it, where the stream has a hashing thread). Returns the chunk's
    digest, once every piece is hashed."""
    h = None if known is not None else hashlib.sha256()
    done = 0
    while done < n:
        failure.check()
        k = min(PIECE, n - done)
        if h is not None or not zero_copy:
            view = src.view(off + done, k, hasher.buffer())
            if h is not None:
                hasher.update(h, view)
        else:
            view = None
        with io_errors(f"sending {src.rel} to {ch.peer}"):
            _put_piece(ch, src, off + done, k, None if zero_copy else view)
        done += k
    return known if known is not None else hasher.digest(h)  # h is None just when known is not


def _put_piece(ch: Channel, src: _Source, off: int, n: int, view: memoryview | None) -> None:
    """The file's bytes [off, off + n) on the wire: from view (copied into the socket), or, view None,
    with sendfile."""
    if view is None:
        _sendfile(ch, src, off, n)
    else:
        _send_full(ch, view)


def _sendfile(ch: Channel, src: _Source, off: int, n: int) -> None:
    """n bytes of the file at off, the kernel sending the page cache's pages themselves (a file kept
    after the transfer only: a range punched out while the socket still holds its pages is zeroed in
    place when it is part of a large folio, which a unit test caught on ext4)."""
    sock = ch.sock
    end = off + n
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    with io_errors(f"sending {src.rel} to {ch.peer}"):
        while off < end:
            try:
                k = os.sendfile(sock.fileno(), src.fd, off, end - off)
            except BlockingIOError:
                if not poller.poll(ch.stall * 1000):
                    raise TimeoutError("timed out") from None
                continue
            if k == 0:
                raise TransferError(f"{src.path} shrank while being sent ({off} of {src.size} bytes)")
            off += k


def _sender_error(ch: Channel, exc: BaseException) -> BaseException:
    """A broken stream usually means the receiver gave up: its reason comes on the migration connection
    (RemoteError, with the receiver's exit code), read within a few seconds."""
    if not isinstance(exc, (TransferError, OSError)) or isinstance(exc, RemoteError):
        return exc
    with contextlib.suppress(OSError):
        ch.sock.settimeout(REASON_WAIT)
    try:
        while True:
            ch.recv()  # anything but an error: keep looking
    except RemoteError as reason:
        return reason
    except (MigrtError, OSError):
        pass
    return exc if isinstance(exc, MigrtError) else TransferError(f"stream to {ch.peer} broke: {exc}")


# -- receiving -------------------------------------------------------------------------------------

class _Dest:
    """One announced file: created at its size, received straight into a shared mapping of it (or
    with pwrite where it cannot be mapped); chunk digests as they are checked."""

    def __init__(self, rel: str, size: int, fd: int, mapped: bool) -> None:
        self.rel, self.size, self.fd = rel, size, fd
        self.chunks = dict(chunks_of(size))  # offset -> size still expected
        self.computed: dict[int, bytes] = {}
        self.claimed: dict[int, bytes] = {}
        self.arrived: set[int] = set()
        self.addr, self.map = _map(fd, size, mm.PROT_READ | mm.PROT_WRITE) if mapped else (0, None)
        if self.addr:
            hugetmpfs.advise(self.addr, size)  # 2 MiB pages where the store's tmpfs gives them

    def view(self, off: int, n: int) -> memoryview | None:
        """The mapping's bytes [off, off + n), their pages allocated first (a store that fills up fails
        then in pwrite with ENOSPC, not with a SIGBUS in the copy); None: write them with pwrite."""
        if self.map is not None and libc.madvise(self.addr + off, n, mm.MADV_POPULATE_WRITE) == 0:
            return self.map[off:off + n]
        return None

    def pwrite(self, view: memoryview, off: int) -> None:
        while len(view):
            k = os.pwrite(self.fd, view, off)
            view, off = view[k:], off + k

    def close(self) -> None:
        _unmap(self.addr, self.map, self.size)
        self.addr, self.map = 0, None


def _mapped(streams: int) -> bool:
    """Do the streams receive into shared mappings (else pwrite)? MIGRT_BULK_WRITE=map|pwrite decides
    instead (benchmarks)."""
    way = os.environ.get("MIGRT_BULK_WRITE")
    if way in ("map", "pwrite"):
        return way == "map"
    return streams > MAPPED_FROM


def check_announcement(msg: dict) -> dict[str, int]:
    files = msg.get("files")
    streams = msg.get("streams")
    if not isinstance(files, dict) or len(files) > MAX_FILES or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in files.values()):
        raise CheckpointInvalid("the sender announced a malformed file list")
    if not isinstance(streams, int) or isinstance(streams, bool) or not 1 <= streams <= MAX_STREAMS:
        raise CheckpointInvalid(f"the sender announced {streams!r} streams")
    return files


def receive(chs: list[Channel], files: dict[str, int], create: Callable[[str, int], int], *,
            progress: Progress | None = None) -> dict[str, str]:
    """Receive the announced `files` ({rel: size}) over the streams `chs` (chs[0]: the migration
    connection), each created by create(rel, size) -> a read-write descriptor the caller owns (closed
    by the caller); returns {rel: manifest digest}. Every chunk is hashed as it lands (piece by piece,
    by its stream's thread, from where it landed) and compared with the sender's sum;
    CheckpointInvalid at the first mismatch, TransferError when a stream breaks."""
    dests: dict[str, _Dest] = {}
    mapped = _mapped(len(chs))
    try:
        for rel, size in files.items():
            dests[rel] = _Dest(rel, size, create(rel, size), mapped)
        failure = _Failure(chs, receiving=True)
        receiving = _Receiving(dests, failure, _overlap(len(chs)))
        _run_threads(receiving.stream, chs, failure, receiving.got, progress, "bulk-recv")
        if failure.error is not None:
            raise failure.error
        return _file_digests(dests)
    finally:
        for dest in dests.values():
            dest.close()


class _Receiving:
    """The streams' shared side of one receive: which chunks arrived, their computed and claimed
    digests (under `lock`), the bytes received so far (`got[0]`, for progress)."""

    def __init__(self, dests: dict[str, _Dest], failure: _Failure, overlap: bool) -> None:
        self.dests, self.failure, self.overlap = dests, failure, overlap
        self.got = [0]
        self.lock = threading.Lock()

    def verify(self, dest: _Dest, off: int) -> None:
        """Called under `lock` once both the computed and the claimed digest may be there."""
        have, want = dest.computed.get(off), dest.claimed.get(off)
        if have is not None and want is not None and have != want:
            raise CheckpointInvalid(f"received file {dest.rel}: sha256 mismatch in the chunk at {off} "
                                    "(corrupted in transit)")

    def stream(self, _i: int, ch: Channel) -> None:
        """One stream's thread: chunks and sums until "end"; its failure set for the calling thread."""
        hasher = _Hasher(self.overlap, self.failure)  # pieces that cannot land in a mapping land in its buffers
        try:
            _kernel_stall(ch)
            while True:
                msg = ch.recv("chunk", "sum", "end")
                if msg["type"] == "end":
                    return
                dest, off = _chunk_of(self.dests, msg)
                if msg["type"] == "sum":
                    self.claimed(dest, off, _digest(msg, dest.rel))
                else:
                    self.chunk(ch, hasher, dest, off, msg.get("size"))
                    faults.point("receive:file")  # test seam: a receiver killed mid-transfer
        except BaseException as exc:  # noqa: BLE001 - raised in the calling thread
            self.failure.set(exc)
        finally:
            hasher.close()  # no hash reads a mapping once the stream is gone

    def claimed(self, dest: _Dest, off: int, digest: bytes) -> None:
        with self.lock:
            if off in dest.claimed:
                raise CheckpointInvalid(f"received file {dest.rel}: two sums for the chunk at {off}")
            dest.claimed[off] = digest
            self.verify(dest, off)

    def chunk(self, ch: Channel, hasher: _Hasher, dest: _Dest, off: int, n: object) -> None:
        """A chunk's bytes, piece by piece, where they land (the file's mapping or a buffer written out),
        each piece hashed from there."""
        with self.lock:
            if off in dest.arrived or not isinstance(n, int) or dest.chunks.get(off) != n:
                raise CheckpointInvalid(f"received file {dest.rel}: unexpected chunk at {off} "
                                        f"({n!r} bytes)")
            dest.arrived.add(off)
        h = hashlib.sha256()
        done = 0
        while done < n:
            k = min(PIECE, n - done)
            hasher.wait_room()
            with io_errors(f"writing {dest.rel}"):
                view = mapped_view = dest.view(off + done, k)
            if view is None:
                view = hasher.buffer()[:k]
            with io_errors(f"receiving {dest.rel} from {ch.peer}"):
                if _recv_full(ch, view) != k:
                    raise TransferError(f"{ch.peer} closed a stream in the middle of {dest.rel} "
                                        f"(chunk at {off})")
            hasher.update(h, view)  # what landed: read back from the mapping, or the bytes written
            if mapped_view is None:
                with io_errors(f"writing {dest.rel}"):
                    dest.pwrite(view, off + done)
            done += k
            with self.lock:
                self.got[0] += k
        d = hasher.digest(h)
        with self.lock:
            dest.computed[off] = d
            self.verify(dest, off)


def _file_digests(dests: dict[str, _Dest]) -> dict[str, str]:
    """{rel: manifest digest} folded from each file's chunks, once every chunk came with its sum."""
    out = {}
    for rel, dest in dests.items():
        offs = sorted(dest.chunks)
        missing = [o for o in offs if o not in dest.computed or o not in dest.claimed]
        if missing:
            raise CheckpointInvalid(f"received file {rel}: the chunk at {missing[0]} never arrived "
                                    "(or without its sum)")
        out[rel] = fold_chunks([dest.computed[o] for o in offs])
    return out


def _chunk_of(dests: dict[str, _Dest], msg: dict) -> tuple[_Dest, int]:
    rel, off = msg.get("path"), msg.get("offset")
    dest = dests.get(rel) if isinstance(rel, str) else None
    if dest is None:
        raise CheckpointInvalid(f"received a chunk of {rel!r}, which the sender did not announce")
    if not isinstance(off, int) or isinstance(off, bool) or off not in dest.chunks:
        raise CheckpointInvalid(f"received file {rel}: a chunk at offset {off!r} (chunks start every "
                                f"{CHUNK >> 20} MiB)")
    return dest, off


def _digest(msg: dict, rel: str) -> bytes:
    try:
        d = bytes.fromhex(msg.get("sha256") or "")
    except ValueError:
        d = b""
    if len(d) != _DIGEST:
        raise CheckpointInvalid(f"received file {rel}: a malformed sum")
    return d


def receive_import(ch: Channel, msg: dict, imp, listener: Listener, *, progress: Progress | None = None) -> int:
    """The receiver's side of a `bulk` announcement (store/importer.py Import `imp`): the data streams
    it announced, every file created and its space reserved, received and checked, then recorded like
    a file received alone. Returns the bytes received."""
    from migrt.store.importer import check_relpath

    files = check_announcement(msg)
    n = msg["streams"]
    if n > listener.streams:
        raise CheckpointInvalid(f"the sender announced {n} streams; this receiver takes {listener.streams}")
    for rel in files:
        check_relpath(rel)
    total = sum(files.values())
    room = hugetmpfs.footprint(imp.path, files.values())  # a tmpfs with huge=always: whole 2 MiB pages
    imp.ensure_space(room)
    extra = listener.take(n - 1)
    fds: list[int] = []

    def create(rel: str, size: int) -> int:
        fds.append(imp.create(rel, size))
        return fds[-1]

    try:
        digests = receive([ch, *extra], files, create, progress=progress)
    finally:
        for c in extra:
            c.close()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    for rel, size in files.items():
        imp.record(rel, size, digests[rel])
    imp.space.wrote(room)
    return total
