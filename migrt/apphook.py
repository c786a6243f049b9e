"""Be told before migrt takes this process's GPU state, and after it is back: the application hook.

For what the NVIDIA driver cannot checkpoint by itself (NCCL communicators between processes, CUDA
IPC mappings: docs/gpu.md, "Multi-GPU jobs"), the application tears it down when migrt asks and
rebuilds it afterwards. Standard library only, one file: copy it into your application, or import
it as migrt.apphook where migrt is installed.

    from apphook import AppHook                    # or: from migrt.apphook import AppHook

    def before(request):                           # no peer state may survive this
        dist.destroy_process_group()
    def after(request):                            # request["reason"]: restored | resumed | aborted
        dist.init_process_group("nccl", ...)

    hook = AppHook("rank0", on_checkpoint=before, on_restore=after, inline=True).start()
    while training:
        hook.safe_point()                          # inline=True: the callbacks run here, between steps
        step()

With inline=False the callbacks run in the hook's own thread as soon as migrt asks.

Ranks that run collectives must reach their safe point at the same step, or one waits in a
collective for a peer that already stopped. Agree on it each step, e.g.

    flag = torch.tensor([int(hook.pending())], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        hook.safe_point(timeout=60)                # the request reaches every rank within moments

The protocol (version 1), for applications in other languages:
  - The process listens on a unix stream socket <dir>/<name>.sock inside its container: <dir> is
    $MIGRT_HOOK_DIR if set when the process started, else /run/migrt/hooks; <name> matches
    [A-Za-z0-9._-]{1,64}. One socket per process that holds GPU peer state (each rank its own).
    The directory must exist in a restored container too (an image layer, a tmpfs CRIU dumps, a
    volume); CRIU recreates the socket there.
  - migrt connects (as root, from the host, through /proc/PID/root), sends one JSON line
        {"migrt_hook": 1, "event": "pre-checkpoint" | "post-restore", "id": "...",
         "deadline_s": 30.0, "reason": "...", "container": "..."}
    and reads one JSON line back: {"ok": true} or {"ok": false, "error": "why"}.
  - "pre-checkpoint" comes before any GPU lock. Answer ok once the process holds no peer state
    (communicators destroyed, IPC handles closed) and runs no GPU work that needs a peer; create
    none until "post-restore". No answer within deadline_s, or ok false: migrt refuses and freezes
    nothing; the processes that had answered ok then get "post-restore" with reason "aborted".
  - "post-restore" comes once the process runs on the GPU again: reason "resumed" (the same
    process, after `migrt checkpoint --leave-running`, `migrt gpu resume`, an undo), "restored" (a
    restored copy, in a new container) or "aborted" (nothing was taken). Rebuild, then answer;
    migrt waits up to deadline_s and only reports a missing answer.
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import stat
import threading
import time
from collections.abc import Callable

DEFAULT_DIR = "/run/migrt/hooks"
DIR_ENV = "MIGRT_HOOK_DIR"
VERSION = 1
PRE, POST = "pre-checkpoint", "post-restore"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

Callback = Callable[[dict], None]


class HookError(RuntimeError):
    pass


class AppHook:
    """Listen for migrt's requests at <dir>/<name>.sock; on_checkpoint/on_restore get the request."""

    def __init__(self, name: str | None = None, *, on_checkpoint: Callback | None = None,
                 on_restore: Callback | None = None, inline: bool = False, directory: str | None = None) -> None:
        self.name = name or f"pid-{os.getpid()}"
        if not _NAME.fullmatch(self.name):
            raise HookError(f"hook name {self.name!r}: use 1 to 64 of A-Z a-z 0-9 . _ -")
        self.directory = directory or os.environ.get(DIR_ENV) or DEFAULT_DIR
        self.path = os.path.join(self.directory, self.name + ".sock")
        self.on_checkpoint, self.on_restore, self.inline = on_checkpoint, on_restore, inline
        self.events: list[dict] = []  # what was asked and answered, for the application's own log
        self._sock: socket.socket | None = None
        self._inode: int | None = None
        self._pending: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._down = False  # on_checkpoint ran, on_restore not yet

    # -- setting up --------------------------------------------------------------------------------
    def start(self) -> AppHook:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        if os.path.lexists(self.path):
            self._clear_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(8)
        self._sock, self._inode = sock, os.stat(self.path).st_ino
        self._thread = threading.Thread(target=self._serve, name="migrt-apphook", daemon=True)
        self._thread.start()
        return self

    def _clear_stale(self) -> None:
        if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
            raise HookError(f"{self.path} exists and is no socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except OSError:
            os.unlink(self.path)  # left by a process that is gone
            return
        finally:
            probe.close()
        raise HookError(f"{self.path} is in use by another live process; give each process its own name")

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            try:
                if os.stat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
            except OSError:
                pass
            self._sock.close()
            self._sock = None

    # -- serving -----------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed and self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            try:
                request = _read_request(conn)
            except (OSError, ValueError, RecursionError):  # any process of the container may connect
                conn.close()
                continue
            request["_received"] = time.monotonic()
            if self.inline:
                self._pending.put((conn, request))
            else:
                self._handle(conn, request)

    def pending(self) -> bool:
        """Inline mode: migrt has asked and the request waits for safe_point()."""
        return not self._pending.empty()

    def safe_point(self, timeout: float | None = 0) -> bool:
        """Inline mode: run what migrt asked for, here. After on_checkpoint ran this waits for the
        post-restore (the GPU is about to be taken; CUDA calls would block anyway) and runs
        on_restore before returning. True when a request was handled."""
        try:
            conn, request = self._pending.get(timeout=timeout) if timeout else self._pending.get_nowait()
        except queue.Empty:
            return False
        self._handle(conn, request)
        while self._down:  # torn down: wait for the GPU state to come back (or for the abort)
            conn, request = self._pending.get()
            self._handle(conn, request)
        return True

    def _handle(self, conn: socket.socket, request: dict) -> None:
        """Answer one request. on_restore runs at a post-restore only if on_checkpoint ran (even
        if it failed: what it tore down must come back) since the last post-restore."""
        event = request.get("event")
        deadline = request.pop("_received") + float(request.get("deadline_s") or 0)
        answer: dict = {"ok": True, "pid": os.getpid()}
        fn = None
        if request.get("migrt_hook") != VERSION or event not in (PRE, POST):
            answer = {"ok": False, "error": f"unknown request {request.get('migrt_hook')!r}/{event!r}"}
        elif event == PRE and time.monotonic() > deadline:
            conn.close()  # migrt gave up on us already (it says "aborted" next): tear nothing down
            self.events.append({**request, "answer": "expired"})
            return
        elif event == PRE:
            fn, self._down = self.on_checkpoint, True
        elif self._down:
            fn, self._down = self.on_restore, False
        else:
            answer["note"] = "nothing was torn down"
        try:
            if fn is not None:
                fn(request)
        except Exception as exc:  # noqa: BLE001 - reported to migrt (a refused checkpoint, a logged restore)
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            conn.sendall((json.dumps(answer) + "\n").encode())
        except OSError:
            pass
        finally:
            conn.close()
        self.events.append({**request, "answer": answer})


def _read_request(conn: socket.socket, limit: int = 65536) -> dict:
    conn.settimeout(10)
    buf = b""
    while b"\n" not in buf and len(buf) < limit:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
    conn.settimeout(None)
    data = json.loads(buf.split(b"\n", 1)[0] or b"{}")  # at most `limit` bytes: RecursionError at worst
    if not isinstance(data, dict):
        raise ValueError("request is not an object")
    return data
