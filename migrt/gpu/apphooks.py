"""The application hook, migrt's side: tell the processes of a container that asked for it before
their GPU state is taken and after it is back (the protocol, and the application's side:
migrt/apphook.py). Standard library only (the CRIU hook uses it).

Who registered: without touching a process, the listening unix stream sockets of its network
namespace (/proc/PID/net/unix) bound directly under its hook directory ($MIGRT_HOOK_DIR of its
initial environment, else /run/migrt/hooks) with a name ending in .sock, that one of the
container's processes holds (/proc/PID/fd). A socket file nobody listens on is not a registration.

Delivery: each endpoint is reached through its holder's root (procview.open_in_root: no symlink,
no '..'), all in parallel (ranks tear their communicators down together, and rebuild together),
one JSON line each way, within one deadline for all.

    before_checkpoint(pids)  every registered process must answer "pre-checkpoint" ok in time, or
                             HookRefused (PreconditionFailed) is raised before anything is frozen,
                             after telling every process asked "post-restore" (aborted).
    Notified.after(reason)   "post-restore" to the processes told before (the same processes:
                             resumed, aborted); after_restore(pids) finds them anew in a restored
                             container. A missing answer there is reported, never fatal: the GPU
                             state is back either way.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from migrt import jsonsafe
from migrt.errors import PreconditionFailed
from migrt.gpu import procview
from migrt.text import printable

DEFAULT_DIR = "/run/migrt/hooks"
DIR_ENV = "MIGRT_HOOK_DIR"
VERSION = 1
PRE, POST = "pre-checkpoint", "post-restore"
RESTORED, RESUMED, ABORTED = "restored", "resumed", "aborted"
DEFAULT_TIMEOUT_S = 30.0
ABORT_NOTICE_S = 2.0  # how long an abort waits for a process that had not answered the pre-checkpoint
MAX_ANSWER = 65536  # bytes of one answer line
MAX_ANSWER_DEPTH = 16  # {"ok": false, "error": "..."} needs one level


class HookRefused(PreconditionFailed):
    """A process registered the application hook and did not answer 'pre-checkpoint' ok in time."""


@dataclass(frozen=True)
class Endpoint:
    pid: int  # the host pid of a process holding the listening socket (the one migrt reaches it through)
    path: str  # the socket, inside that process's root
    inode: int
    holders: tuple[int, ...]  # every process of the container holding it

    def name(self) -> str:
        return f"pid {self.pid} ({printable(self.path, 200)})"  # the path is the container's choice


@dataclass
class Reply:
    ok: bool
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def hook_dir(pid: int, proc: str | None = None) -> str:
    d = procview.environ(pid, proc).get(DIR_ENV) or DEFAULT_DIR
    return d.rstrip("/") or DEFAULT_DIR


def find(pids: list[int], proc: str | None = None) -> list[Endpoint]:
    """The registered endpoints among pids (see the module docstring), in pid order."""
    listening: dict[str, list[tuple[int, str]]] = {}  # network namespace -> (inode, path)
    held: dict[int, set[int]] = {p: procview.socket_inodes(p, proc) for p in pids}
    found: dict[int, Endpoint] = {}
    for pid in pids:
        try:
            ns = os.readlink(f"{procview.at(proc)}/{pid}/ns/net")
        except OSError:
            ns = f"pid:{pid}"
        if ns not in listening:
            listening[ns] = [(inode, path) for inode, path, typ, listen in procview.unix_sockets(pid, proc)
                             if listen and typ == procview.SOCK_STREAM and path.startswith("/")]
        d = hook_dir(pid, proc) + "/"
        for inode, path in listening[ns]:
            rest = path[len(d):] if path.startswith(d) else ""
            if inode in found or not rest.endswith(".sock") or "/" in rest or inode not in held[pid]:
                continue
            try:
                procview.safe_path(path)
            except ValueError:
                continue
            found[inode] = Endpoint(pid=pid, path=path, inode=inode,
                                    holders=tuple(p for p in pids if inode in held[p]))
    return sorted(found.values(), key=lambda e: (e.pid, e.path))


def _exchange(ep: Endpoint, request: dict, deadline: float, proc: str | None) -> Reply:
    t0 = time.monotonic()
    try:
        fd = procview.open_in_root(ep.pid, ep.path, proc=proc, want="socket")
    except (OSError, ValueError) as exc:
        return Reply(False, printable(f"cannot reach {ep.path}: {exc}", 300))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        sock.connect(f"/proc/self/fd/{fd}")
        sock.sendall((json.dumps(request) + "\n").encode())
        buf = b""
        while b"\n" not in buf and len(buf) <= MAX_ANSWER:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(4096)
            if not chunk:
                break
            buf += chunk
        line = buf.split(b"\n", 1)[0]
        if not line:
            return Reply(False, "closed the connection without an answer", time.monotonic() - t0)
        return _reply(line, time.monotonic() - t0)
    except TimeoutError:
        return Reply(False, f"no answer within {request['deadline_s']:g} s", time.monotonic() - t0)
    except OSError as exc:
        return Reply(False, printable(f"{type(exc).__name__}: {exc}", 300), time.monotonic() - t0)
    finally:
        sock.close()
        os.close(fd)


def _reply(line: bytes, seconds: float) -> Reply:
    """One answer line, read with the bounded reader; the application's words escaped and cut (they
    go into refusals that a terminal or containerd's log shows)."""
    try:
        answer = jsonsafe.loads(line, max_bytes=MAX_ANSWER, max_depth=MAX_ANSWER_DEPTH)
    except ValueError as exc:  # JSONRejected too, and bytes that are not UTF-8
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        return Reply(False, f"answered no JSON object ({printable(reason, 120)})", seconds)
    if not isinstance(answer, dict):
        return Reply(False, "answered no JSON object", seconds)
    if answer.get("ok") is True:
        return Reply(True, None, seconds)
    return Reply(False, f"answered: {printable(answer.get('error') or 'not ok', 500)}", seconds)


def call(endpoints: list[Endpoint], event: str, timeout_s: float, *, proc: str | None = None,
         waits: dict[Endpoint, float] | None = None, **fields) -> dict[Endpoint, Reply]:
    """Send `event` to every endpoint at once; each answer within timeout_s (or its own waits[ep])."""
    if not endpoints:
        return {}
    now = time.monotonic()
    request = {"migrt_hook": VERSION, "event": event, "deadline_s": timeout_s, **fields}
    with ThreadPoolExecutor(max_workers=min(len(endpoints), 64), thread_name_prefix="migrt-apphook") as pool:
        futures = {ep: pool.submit(_exchange, ep, request, now + (waits or {}).get(ep, timeout_s), proc)
                   for ep in endpoints}
    return {ep: f.result() for ep, f in futures.items()}


@dataclass
class Notified:
    """The processes told "pre-checkpoint" (all answered ok), to be told "post-restore" later."""

    endpoints: list[Endpoint]
    op_id: str
    timeout_s: float
    proc: str | None = None
    seconds: float = 0.0
    replies: dict[Endpoint, Reply] = field(default_factory=dict)

    @property
    def pids(self) -> set[int]:
        return {p for ep in self.endpoints for p in ep.holders}

    def after(self, reason: str, *, what: str = "", waits: dict[Endpoint, float] | None = None) -> list[str]:
        """post-restore to every endpoint told before; returns what went wrong (empty: all answered)."""
        return _problems(call(self.endpoints, POST, self.timeout_s, proc=self.proc, waits=waits, id=self.op_id,
                              reason=reason, container=what))

    def to_dict(self) -> dict:
        return {"processes": sorted(self.pids), "seconds": round(self.seconds, 3),
                "sockets": [ep.path for ep in self.endpoints]}


def _problems(replies: dict[Endpoint, Reply]) -> list[str]:
    return [f"{ep.name()}: {r.error}" for ep, r in replies.items() if not r.ok]


def before_checkpoint(pids: list[int], *, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                      proc: str | None = None, endpoints: list[Endpoint] | None = None) -> Notified:
    """pre-checkpoint to every registered process among pids; HookRefused unless all answer ok."""
    eps = find(pids, proc) if endpoints is None else endpoints
    note = Notified(endpoints=eps, op_id=uuid.uuid4().hex[:12], timeout_s=timeout_s, proc=proc)
    if not eps:
        return note
    t0 = time.monotonic()
    note.replies = call(eps, PRE, timeout_s, proc=proc, id=note.op_id, container=what)
    note.seconds = time.monotonic() - t0
    bad = {ep: r for ep, r in note.replies.items() if not r.ok}
    if not bad:
        return note
    late = note.after(ABORTED, what=what, waits=dict.fromkeys(bad, ABORT_NOTICE_S))
    raise HookRefused(
        f"{what}: {len(bad)} of {len(eps)} process(es) that registered the application hook did not answer "
        f"'pre-checkpoint' in time ({'; '.join(f'{ep.name()}: {r.error}' for ep, r in bad.items())}); nothing "
        f"was frozen, the container keeps running, and the processes asked were told 'post-restore' (aborted)"
        + (f" ({len(late)} did not confirm)" if late else ""),
        details=late)


def after_restore(pids: list[int], *, what: str, reason: str = RESTORED, timeout_s: float = DEFAULT_TIMEOUT_S,
                  proc: str | None = None) -> tuple[list[Endpoint], list[str]]:
    """post-restore to the registered processes among pids (a restored container): (endpoints, problems)."""
    eps = find(pids, proc)
    return eps, _problems(call(eps, POST, timeout_s, proc=proc, id=uuid.uuid4().hex[:12], reason=reason,
                               container=what))
