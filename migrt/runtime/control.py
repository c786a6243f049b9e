"""What a migration asks of the lower runtime by its path: pause, resume, destroy (LowerRuntime's verbs),
and CRIU's lazy dump (the images without the private anonymous memory, which stays in the frozen
tasks for migrt to read: lazy migration, the parallel dump), run through LowerRuntime.spawn.
Failures become RuntimeFailed here, quoting runc's last error and CRIU's error lines."""

from __future__ import annotations

import os
import resource
import select
import socket
import struct
import subprocess
import time

from migrt.criu.logs import error_lines
from migrt.criu.options import CriuOptions
from migrt.errors import RuntimeFailed
from migrt.kernel.procs import end_child
from migrt.runtime.messages import last_error
from migrt.runtime.runc import LowerRuntime

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import Any

PS_IOV_CLOSE = 0x1023  # criu/page-xfer.c


def pause(runtime: str, root: str, cid: str) -> None:
    LowerRuntime(runtime).pause(root, cid)


def resume(runtime: str, root: str, cid: str) -> None:
    LowerRuntime(runtime).resume(root, cid)


def destroy(runtime: str, root: str, cid: str) -> None:
    """Kill and delete; a frozen container is killed before it is thawed (runtime/stop.py)."""
    LowerRuntime(runtime).stop(root, cid)


def _raise_nofile() -> None:
    """A lazy dump keeps every page pipe open until the target has fetched its pages (two fds per
    pipe of at most fs.pipe-max-size): give runc and CRIU the hard limit as their soft limit. CRIU
    tries this itself, but only up to fs.nr_open, which fails without CAP_SYS_RESOURCE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class PagePort(tuple[str, int]):
    """(host, port) for CRIU's lazy page server, reserved for it until release(): a socket of ours
    stays bound there with SO_REUSEADDR and never listens. The kernel then hands that port to no other
    socket (no bind to port 0, no connect()'s local port, no plain bind), while CRIU's own socket,
    SO_REUSEADDR too, can bind and listen on it. A port merely found free and let go was sometimes
    taken by the time CRIU bound it, after the whole dump ("Can't bind page server: Address already
    in use" in 1 lazy migration of 6)."""

    _sock: socket.socket | None

    def __new__(cls, sock: socket.socket) -> PagePort:
        host, port = sock.getsockname()[:2]
        self = super().__new__(cls, (host, port))
        self._sock = sock
        return self

    def release(self) -> None:
        """CRIU listens there now (or never will): the reservation has done its work."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def loopback_page_server() -> PagePort:
    """An address for CRIU's lazy page server that migrt only ends, never asks for a page: loopback, a
    port reserved for it (PagePort; LazyCheckpoint releases it once CRIU listens)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
    except OSError:
        s.close()
        raise
    return PagePort(s)


def criu_config_env(env: dict[str, Any] | None, work_path: str, lines: list[str], name: str) -> dict[str, Any]:
    """The environment for runc and its CRIU with CRIU_CONFIG_FILE naming `<work_path>/<name>`, which
    holds `lines` after those of the file the environment already named (carried over, first). CRIU
    reads that file after its global config and before the RPC options, in swrk mode too (runc passes
    its environment on), so no config.json, /etc/criu or node-wide setting changes. A file named there
    that cannot be read is an error (RuntimeFailed), never silently left out."""
    base = dict(os.environ if env is None else env)
    text = ""
    if base.get("CRIU_CONFIG_FILE"):
        try:
            with open(base["CRIU_CONFIG_FILE"], encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:  # dropping it would change what CRIU does behind the caller's back
            raise RuntimeFailed(f"CRIU_CONFIG_FILE {base['CRIU_CONFIG_FILE']} is set but unreadable: {exc}") from exc
        if text and not text.endswith("\n"):
            text += "\n"
    path = os.path.join(work_path, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text + "".join(f"{line}\n" for line in lines))
    return {**base, "CRIU_CONFIG_FILE": path}


def criu_address_env(env: dict[str, Any] | None, host: str, work_path: str) -> dict[str, Any]:
    """The environment for runc and its CRIU, with CRIU_CONFIG_FILE saying `address HOST`. CRIU's RPC
    service takes only the port of a lazy dump's page server (cr-service.c ignores the address when
    lazy_pages is set), so its page server listened on every address of the node."""
    return criu_config_env(env, work_path, [f"address {host}"], "criu-page-server.conf")


def end_page_server(address: tuple[str, int], timeout: float) -> None:
    """One PS_IOV_CLOSE to CRIU's lazy page server: the lazy dump ends (CRIU exits) with its images
    written and the memory left in the tasks. OSError when nothing listens there."""
    with socket.create_connection(address, timeout=timeout) as sk:
        sk.sendall(struct.pack("<I4xQQQ", PS_IOV_CLOSE, 0, 0, 0))
        # half-close at once: CRIU corks its socket, so its status would wait out the cork
        # (200 ms); our end-of-stream makes it end the session and flush
        sk.shutdown(socket.SHUT_WR)
        sk.recv(4)


class LazyCheckpoint:
    """`runc checkpoint --lazy-pages --page-server ADDR:PORT --status-fd FD --leave-running`.

    CRIU dumps everything but the lazy memory pages, says "ready" on the status fd, then waits on its
    page server; migrt asks it for nothing (finish()), so it exits with the memory left in the tasks.
    With a paused container and --leave-running the container stays frozen afterwards (never two
    running copies), so the caller decides: destroy it on success, resume it on failure."""

    def __init__(self, runtime: str, root: str, cid: str, *, image_path: str, work_path: str,
                 options: CriuOptions, page_server: tuple[str, int], env: dict[str, Any] | None = None) -> None:
        self.cid = cid
        self.work_path = work_path
        self.log = os.path.join(work_path, "runc.log")
        host, port = page_server
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.page_server = (host, port)
        self._reserved = page_server if isinstance(page_server, PagePort) else None
        r, w = os.pipe()
        self._status = r
        self._ready = False
        args = ["--log", self.log, "--log-format", "json", "checkpoint", "--lazy-pages", "--page-server", addr,
                "--status-fd", str(w), "--leave-running", "--image-path", image_path, "--work-path", work_path,
                *options.runc_flags(), cid]
        _raise_nofile()
        self.stderr_path = os.path.join(work_path, "runc.stderr")
        try:
            env = criu_address_env(env, host, work_path)
            # migrt's CRIU keeps no lazy page in a page pipe then (criu/lazy.py): nobody asks its page
            # server for one. Another CRIU ignores it. "0" in our environment keeps CRIU's way (tests).
            env.setdefault("MIGRT_CRIU_LAZY_NO_PIPES", "1")
            with open(self.stderr_path, "wb") as err:
                self.proc = LowerRuntime(runtime).spawn(root, args, stdout=subprocess.DEVNULL, stderr=err,
                                                        pass_fds=(w,), env=env)
        except OSError as exc:
            os.close(r)
            self._release()
            raise RuntimeFailed(f"cannot run {runtime}: {exc}") from exc
        finally:
            os.close(w)

    def wait_ready(self, timeout: float) -> None:
        """Until CRIU serves pages. A NUL byte means ready; EOF means the dump failed (CRIU then
        leaves the container as it was)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.abort()
                    raise RuntimeFailed(f"lazy checkpoint of {self.cid}: CRIU was not ready after {timeout:.0f} s")
                ready, _, _ = select.select([self._status], [], [], left)
                if ready:
                    data = os.read(self._status, 1)
                    if data == b"\0":
                        self._ready = True
                        return
                    self.proc.wait()
                    raise self._failure("lazy checkpoint")
        finally:
            os.close(self._status)
            self._status = -1
            self._release()  # CRIU listens on the port now, or has given up

    def finish(self, timeout: float) -> None:
        """Ask CRIU's page server for nothing: a PS_IOV_CLOSE right away ends the lazy dump with the
        images written and the memory left in the (frozen) tasks, which migrt's own page server
        (migration/pageserve.py) then serves. CRIU 4.2's request is `u32 cmd; u64 nr_pages; u64 vaddr;
        u64 dst_id` (32 bytes, natural alignment); it answers a 4-byte status."""
        if not self._ready:
            raise RuntimeFailed(f"lazy checkpoint of {self.cid}: CRIU is not serving pages")
        try:
            end_page_server(self.page_server, timeout)
        except OSError as exc:
            self.abort()
            raise RuntimeFailed(f"lazy checkpoint of {self.cid}: cannot end CRIU's page server: {exc}") from exc
        self._ready = False
        self.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Until CRIU exits (after finish(): at once)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeFailed(f"lazy checkpoint of {self.cid}: pages still being served after {timeout:.0f} s") \
                from exc
        if self.proc.returncode != 0:
            raise self._failure("serving memory pages")

    def abort(self) -> None:
        """Stop CRIU before the target took the pages, so that it puts the tasks back as they were.
        While it serves pages, the clean way is a bogus request on the page-server socket: CRIU
        fails the transfer and unwinds (a connection closed without a request would count as a
        finished transfer). Signals are the last resort."""
        self._release()
        if self.proc.poll() is not None:
            return
        if self._ready:
            try:
                with socket.create_connection(self.page_server, timeout=5) as sk:
                    sk.sendall(b"\xff" * 64)
                self.proc.wait(20)
                return
            except (OSError, subprocess.TimeoutExpired):
                pass
        end_child(self.proc, 20)

    def _release(self) -> None:
        if self._reserved is not None:
            self._reserved.release()
            self._reserved = None

    def _failure(self, what: str) -> RuntimeFailed:
        try:
            with open(self.stderr_path, encoding="utf-8", errors="replace") as fh:
                err = fh.read().strip()
        except OSError:
            err = ""
        msg = last_error(self.log) or (err.splitlines()[-1] if err else f"exit status {self.proc.returncode}")
        return RuntimeFailed(f"{what} of container {self.cid} failed: {msg}",
                             details=error_lines(os.path.join(self.work_path, "dump.log")))
