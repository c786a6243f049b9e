"""The source's page server in a lazy migration: serves the memory of the frozen source container to
the target's page filler (pagefill/remote.py is the wire), several streams at once, one thread each,
reading straight from the source processes with process_vm_readv (through /proc/PID/mem where a VMA
has no PROT_READ: pagedump's reader, which the parallel dump uses too).

Why not CRIU's own page server: it serves one connection with one thread, and CRIU's `lazy-pages`
daemon on the target asks for one small range at a time (an 8 GiB migration took 55-83 s here). The
source container is frozen (cgroup freezer) and was dumped with --leave-running, so its memory stays
exactly as the dump saw it: CRIU's lazy dump is only asked for the images (its page server is closed
at once, see control.LazyCheckpoint.finish) and this server reads the pages from the tasks.

It runs as its own process (`python -m migrt.migration.pageserve`, a session of its own): a killed
`migrt migrate` does not cut a target that already runs off from its memory. Its settings come as one
JSON line on stdin (the stream key never appears on argv); it answers `port N` on stdout once it
listens (it is started before the freeze, so its start costs no downtime), then takes the map of the
dumped processes (pid inside the container -> host pid) as a second line and serves; it ends when
the target says every page is in, on SIGTERM from its owner, or once its owner is gone and no stream
has asked for anything for `idle_s`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hmac
import json
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

from migrt.kernel.procs import end_child
from migrt.pagedump import memory
from migrt.pagefill.remote import (
    MAGIC,
    MAX_REQUEST,
    NONCE,
    REQUEST,
    STATUS,
    FetchError,
    answer,
    recv_exact,
    tls_context,
)

EXIT_DONE, EXIT_STOPPED, EXIT_IDLE = 0, 3, 4
BACKGROUND_NICE = 10


class PageServer:
    def __init__(self, host: str, key: bytes, pids: dict[int, int], *, peer: str | None = None,
                 tls: dict | None = None, idle_s: float = 30.0, owner: int | None = None) -> None:
        self.key = key
        self.pids = pids              # pid inside the container -> host pid
        self.peer = peer              # only this address may connect (None: anyone with the key)
        self.tls = tls_context(tls["cert"], tls["key"], tls["ca"], server=True) if tls else None
        self.idle_s = idle_s
        self.owner = owner
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.bytes = self.requests = self.streams = self.refused = 0
        self.errors: list[str] = []

    # -- one stream --------------------------------------------------------------------------------
    def _handshake(self, sock: socket.socket) -> socket.socket | None:
        """The authenticated stream, or None (the caller closes `sock`)."""
        sock.settimeout(10)
        if self.tls:
            sock = self.tls.wrap_socket(sock, server_side=True)
        nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + nonce)
        if not hmac.compare_digest(recv_exact(sock, 32), answer(self.key, nonce)):
            sock.close()
            return None
        sock.sendall(b"\0")
        if recv_exact(sock, 1) == b"B":  # background copies: faults (b"F") go first on a busy node
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        sock.settimeout(None)
        return sock

    def _serve(self, raw: socket.socket, addr) -> None:
        sock = raw
        try:
            if self.peer and addr[0] != self.peer:
                raise PermissionError(f"connection from {addr[0]}, not from the target {self.peer}")
            authed = self._handshake(raw)
            if authed is None:
                raise PermissionError(f"{addr[0]} does not hold this migration's key")
            sock = authed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.streams += 1
            buf = (ctypes.c_char * MAX_REQUEST)()
            view = memoryview(buf).cast("B")
            reader = memory.Reader(self.pids)  # process_vm_readv; /proc/PID/mem where a VMA has no PROT_READ
            while True:
                vpid, address, n = REQUEST.unpack(recv_exact(sock, REQUEST.size))
                if vpid == 0 and n == 0:
                    self.done.set()
                    return
                pid = self.pids.get(vpid)
                if pid is None:
                    status = -errno.ESRCH
                elif not 0 < n <= MAX_REQUEST:
                    status = -errno.EINVAL
                else:
                    try:
                        reader.read(vpid, address, n, dest=ctypes.addressof(buf))
                        status = 0
                    except memory.ReadError:
                        status = -errno.EFAULT
                if status:
                    sock.sendall(STATUS.pack(status))
                    continue
                sock.sendall(STATUS.pack(0))
                sock.sendall(view[:n])
                with self.lock:
                    self.bytes += n
                    self.requests += 1
                    self.last = time.monotonic()
        except (PermissionError, ssl.SSLError) as exc:
            with self.lock:
                self.refused += 1
                self.errors.append(str(exc))
        except (OSError, FetchError):
            pass  # the target closed the stream (or lost it): the filler says what it makes of it
        finally:
            if "reader" in locals():
                reader.close()
            sock.close()

    # -- the server --------------------------------------------------------------------------------
    def serve(self) -> int:
        owner_fd = None
        if self.owner:
            try:
                owner_fd = os.pidfd_open(self.owner)
            except OSError:
                owner_fd = None
        owner_gone = owner_fd is None
        while not self.done.is_set():
            watch = [self.listener] + ([owner_fd] if owner_fd is not None and not owner_gone else [])
            ready, _, _ = select.select(watch, [], [], 0.2)
            if owner_fd is not None and owner_fd in ready:
                owner_gone = True
            if self.listener in ready:
                try:
                    conn, addr = self.listener.accept()
                except OSError:
                    continue
                threading.Thread(target=self._serve, args=(conn, addr), daemon=True).start()
            with self.lock:
                idle = time.monotonic() - self.last
            if owner_gone and idle > self.idle_s:
                return EXIT_IDLE
        return EXIT_DONE

    def stats(self) -> dict:
        with self.lock:
            return {"bytes": self.bytes, "requests": self.requests, "streams": self.streams,
                    "refused": self.refused, "errors": self.errors[-3:]}


class Handle:
    """The page server process as `migrt migrate` sees it."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        assert proc.stdin is not None and proc.stdout is not None  # started with both piped
        self.proc, self.port = proc, port
        self.stdin, self.stdout = proc.stdin, proc.stdout
        self.result: dict = {}

    @classmethod
    def start(cls, *, host: str, key: bytes, peer: str | None, tls: dict | None, idle_s: float,
              ready_timeout: float = 10.0) -> Handle:
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pkg_parent, os.environ.get("PYTHONPATH")) if p)}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "migrt.migration.pageserve"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        except OSError as exc:
            raise FetchError(f"cannot start the page server: {exc}") from exc
        cfg = {"host": host, "key": key.hex(), "peer": peer, "tls": tls, "idle_s": idle_s, "owner": os.getpid()}
        stdin, stdout = proc.stdin, proc.stdout
        assert stdin is not None and stdout is not None  # both piped above
        try:
            stdin.write((json.dumps(cfg) + "\n").encode())
            stdin.flush()
            ready, _, _ = select.select([stdout], [], [], ready_timeout)
            line = stdout.readline().decode() if ready else ""
        except OSError:
            line = ""
        if not line.startswith("port "):
            proc.kill()
            proc.wait()
            raise FetchError(f"the page server did not start (exit status {proc.returncode})")
        return cls(proc, int(line.split()[1]))

    def serve(self, pids: dict[int, int]) -> None:
        """The dump is done: these processes (pid inside the container -> host pid) may be read."""
        try:
            self.stdin.write((json.dumps(pids) + "\n").encode())
            self.stdin.close()
        except OSError as exc:
            raise FetchError(f"the page server is gone (exit status {self.proc.poll()})") from exc

    def _collect(self) -> dict:
        if not self.result:
            try:
                self.result = json.loads(self.stdout.readline() or "{}")
            except (OSError, ValueError):
                self.result = {}
            self.stdout.close()
        return self.result

    def wait(self, timeout: float) -> dict:
        """Until the target said every page is in (the server ends by itself); stopped after timeout."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.stop()
        return self._collect()

    def stop(self) -> dict:
        with contextlib.suppress(OSError):
            self.stdin.close()
        end_child(self.proc, 10)
        return self._collect()


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    server = PageServer(cfg["host"], bytes.fromhex(cfg["key"]), {}, peer=cfg.get("peer"), tls=cfg.get("tls"),
                        idle_s=float(cfg.get("idle_s", 30)), owner=cfg.get("owner"))
    stopped = threading.Event()

    def stop(_sig, _frame):
        stopped.set()
        server.done.set()

    signal.signal(signal.SIGTERM, stop)
    sys.stdout.write(f"port {server.port}\n")
    sys.stdout.flush()
    line = sys.stdin.readline()  # the dumped processes; EOF: the migration ended before the dump did
    if not line or stopped.is_set():
        return EXIT_STOPPED
    server.pids = {int(k): int(v) for k, v in json.loads(line).items()}
    code = server.serve()
    sys.stdout.write(json.dumps({"exit": "stopped" if stopped.is_set() else "done" if code == EXIT_DONE else "idle",
                                 **server.stats()}) + "\n")
    sys.stdout.flush()
    return EXIT_STOPPED if stopped.is_set() else code


if __name__ == "__main__":
    sys.exit(main())
