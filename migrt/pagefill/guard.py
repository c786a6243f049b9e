"""The guard: the process a lazy restore starts first. It speaks CRIU's lazy-pages protocol, keeps a
duplicate of every userfaultfd, and forks the filler (engine.py), which does the copying.

Why two processes: when the last descriptor of a userfaultfd closes, the kernel unregisters its
ranges and a task that touches a page not yet copied gets a ZERO page: silent corruption. A filler
that dies (bug, OOM kill, SIGKILL) must therefore not be the only holder. The guard holds a copy of
each userfaultfd until the filler reports that task complete; if the filler dies first, faults stay
blocked, and the guard kills the restored container (SIGKILL to its init, then every process of its
cgroup), waits until it is gone, writes the failure where migrt and containerd will see it (the
status file, migrt's log, runc's --log), and only then lets the descriptors go.

CRIU's side (criu/uffd.c, CRIU 4.2): `criu restore --lazy-pages` connects once to
`lazy-pages.socket` in its work directory; each restored task sends its pid inside the container (an
int; negative for a zombie, which sends nothing else), then its userfaultfd (SCM_RIGHTS on one dummy
byte); once the whole tree is restored, CRIU sends LAZY_PAGES_RESTORE_FINISHED (0x52535446). An end of
the connection before that is a failed restore (CRIU kills the tree itself).

Filler <-> guard (SOCK_SEQPACKET): T <id> <vpid> + fd, F (restore finished), A (abort) from the guard;
K <id> + fd (a forked child's userfaultfd), D <id> (task complete: close it), E <error>, Z (all done)
from the filler. The caller (ops/restore.py through session.py) writes JSON lines on a pipe:
{"init_pid": N} once runc restore returned, {"abort": true} when the restore failed; EOF = gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable

from migrt import jsonsafe
from migrt.pagefill import images as images_mod
from migrt.pagefill.engine import REMOTE_CHUNK, Filler, write_json
from migrt.pagefill.remote import RemotePages
from migrt.pagefill.verify import VerifyError
from migrt.pagefill.verify import build as build_verifier

RESTORE_FINISHED = 0x52535446
KILL_WAIT_S = 10.0
EXIT_ABORTED = 2  # the restore failed before the fill could be done (exit 0: done, 1: failed)
ORPHAN_WAIT_S = 120.0


# A source of chunks not on disk yet (the Verifier's `source`), made from the verify hand-over, the
# plan's images directory and the descriptor to keep (registry/fill.py plugs the registry's in).
SourceFactory = Callable[[dict, str, "int | None"], object]


class Guard:
    def __init__(self, args: dict, source: SourceFactory | None = None) -> None:
        self.args = args
        self.source = source
        self.listen = socket.socket(fileno=args["listen_fd"])
        self.control = args["control_fd"]
        self.status_path = args["status"]
        self.conn: socket.socket | None = None
        self.fds: dict[int, int] = {}        # task id -> our duplicate of its userfaultfd
        self.next_id = 1
        self.finished = False
        self.criu_gone = False
        self.init_pid: int | None = None
        self.init_pidfd: int | None = None
        self.caller_gone = False
        self.aborted = False
        self.filler_pid = 0
        self.filler_sock: socket.socket | None = None
        self.filler_error: str | None = None
        self.filler_ok = False
        self.t0 = time.monotonic()
        self.buf = b""

    # -- start -----------------------------------------------------------------------------------
    def start(self) -> bool:
        """Plan the images and fork the filler; False when the images cannot be filled (the status
        says why, as plan_error). The restore holds the restored tree until the status says either
        (ops/pages.py PlanCheck): a manifest's record chose the filler, this plan is what counts."""
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:  # needs CAP_SYS_RESOURCE
            fh.write("-999")
        images = f"/proc/self/fd/{self.args['images_fd']}"
        remote = None
        if self.args.get("remote"):  # lazy migration: the pages are on the source node
            with open(self.args["remote"], encoding="utf-8") as fh:
                remote = json.load(fh)
            os.unlink(self.args["remote"])  # it holds the stream key: read once
        _late_plan_seam()
        try:
            plan = images_mod.plan(images, remote=remote is not None)
        except images_mod.ImageError as exc:
            write_json(self.status_path, {"state": "failed", "error": f"the images cannot be filled: {exc}",
                                          "plan_error": str(exc)})
            return False
        verifier = None
        if self.args.get("verify") and remote is None:  # pages images to verify chunk by chunk as they are filled
            try:
                with open(self.args["verify"], encoding="utf-8") as fh:
                    handover = json.load(fh)
                verifier = build_verifier(plan, handover)
                if verifier is not None and handover.get("registry"):  # chunks not here yet: from the registry
                    if self.source is None:
                        raise ValueError("a registry hand-over to a guard without a registry source")
                    verifier.source = self.source(handover, plan.images, self.args.get("keep_fd"))
            except (OSError, ValueError, KeyError, TypeError, VerifyError) as exc:
                write_json(self.status_path, {"state": "failed", "error": f"the restore's chunk digests are "
                                              f"unusable: {exc!r}"})
                return False
        # before the fork: the filler's own status ("filling") comes after this one
        write_json(self.status_path, {"state": "planned", "lazy_bytes": plan.lazy_bytes,
                                      "processes": len(plan.processes),
                                      **({"verify": verifier.snapshot()} if verifier else {})})
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the filler
            code = 1
            try:
                ours.close()
                self.listen.close()
                os.close(self.control)
                with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:
                    fh.write("0")
                code = Filler(plan, threads=self.args["threads"], guard=theirs, status_path=self.status_path,
                              post_restore=self.args.get("post_restore"),
                              remote=RemotePages(remote, REMOTE_CHUNK) if remote else None,
                              verifier=verifier).run()
            except BaseException as exc:  # noqa: BLE001 - report anything, then die
                with contextlib.suppress(OSError):
                    theirs.send(f"E filler crashed: {exc!r}".encode()[:4000])
            finally:
                os._exit(code)
        theirs.close()
        if self.args.get("keep_fd") is not None:  # the image lock of a lazy pull: the filler's alone
            with contextlib.suppress(OSError):
                os.close(self.args["keep_fd"])
        self.filler_pid = pid
        self.filler_pidfd = os.pidfd_open(pid)
        self.filler_sock = ours
        return True

    # -- CRIU --------------------------------------------------------------------------------------
    def _criu_readable(self) -> None:
        """One step of CRIU's protocol: a pid (+ its userfaultfd), or the end of the restore."""
        assert self.conn is not None
        try:
            data = self.conn.recv(4 - len(self.buf))
        except OSError:
            data = b""
        if not data:
            self.criu_gone = True
            return
        self.buf += data
        if len(self.buf) < 4:
            return
        (word,) = struct.unpack("<i", self.buf)
        self.buf = b""
        if word == RESTORE_FINISHED:
            self.finished = True
            self._to_filler(b"F")
            return
        if word < 0:
            return  # a zombie: nothing follows
        _msg, anc, _flags, _addr = self.conn.recvmsg(1, socket.CMSG_SPACE(4))
        fd = None
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS and len(raw) >= 4:
                fd = int.from_bytes(raw[:4], "little")
        if fd is None:
            self.filler_error = f"CRIU sent pid {word} without its userfaultfd"
            self.criu_gone = True
            return
        tid = self.next_id
        self.next_id += 1
        self.fds[tid] = fd
        self._to_filler(f"T {tid} {word}".encode(), fd)

    def _to_filler(self, msg: bytes, fd: int | None = None) -> None:
        if self.filler_sock is None:
            return
        try:
            if fd is None:
                self.filler_sock.send(msg)
            else:
                self.filler_sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))])
        except OSError:
            pass  # the filler is gone: its exit is handled on its own

    # -- filler ------------------------------------------------------------------------------------
    def _filler_readable(self) -> None:
        assert self.filler_sock is not None
        try:
            msg, anc, _f, _a = self.filler_sock.recvmsg(4096, socket.CMSG_SPACE(4))
        except OSError:
            msg, anc = b"", []
        if not msg:
            self.filler_sock.close()
            self.filler_sock = None
            return
        kind, _, rest = msg.decode(errors="replace").partition(" ")
        if kind == "K":
            for level, typ, raw in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS and len(raw) >= 4:
                    self.fds[int(rest)] = int.from_bytes(raw[:4], "little")
        elif kind == "D":
            fd = self.fds.pop(int(rest), None)
            if fd is not None:
                os.close(fd)
        elif kind == "E":
            self.filler_error = rest
        elif kind == "Z":
            self.filler_ok = True

    # -- the caller --------------------------------------------------------------------------------
    def _control_readable(self) -> None:
        try:
            data = os.read(self.control, 4096)
        except OSError:
            data = b""
        if not data:
            self.caller_gone = True
            return
        for line in data.decode(errors="replace").splitlines():
            try:
                msg = jsonsafe.loads(line, max_bytes=1 << 20)
            except ValueError:
                continue
            if msg.get("init_pid"):
                self.init_pid = int(msg["init_pid"])
                with contextlib.suppress(OSError):
                    self.init_pidfd = os.pidfd_open(self.init_pid)
            if msg.get("abort"):
                self.aborted = True
                self._to_filler(b"A")

    # -- main loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        if not self.start():
            # Nothing to guard: CRIU's tasks (should it have connected) are held at post-restore by the
            # restore's gate, which fails on our status; closing the socket makes CRIU fail sooner.
            self.listen.close()
            self._remove_run_dir()  # once the caller has read why
            return 1
        filler_status = None
        while True:
            sel = select.poll()
            watch = {}
            if self.conn is None and not self.criu_gone:
                sel.register(self.listen.fileno(), select.POLLIN)
                watch[self.listen.fileno()] = "listen"
            if self.conn is not None and not self.criu_gone:
                sel.register(self.conn.fileno(), select.POLLIN)
                watch[self.conn.fileno()] = "criu"
            if self.filler_sock is not None:
                sel.register(self.filler_sock.fileno(), select.POLLIN)
                watch[self.filler_sock.fileno()] = "filler"
            if filler_status is None:
                sel.register(self.filler_pidfd, select.POLLIN)
                watch[self.filler_pidfd] = "exit"
            if not self.caller_gone:
                sel.register(self.control, select.POLLIN)
                watch[self.control] = "control"
            for fd, _ev in sel.poll(1000):
                what = watch.get(fd)
                if what == "listen":
                    self.conn, _ = self.listen.accept()
                    self.listen.close()
                elif what == "criu":
                    self._criu_readable()
                elif what == "filler":
                    self._filler_readable()
                elif what == "exit":
                    # drain what the filler said before it went (E, D, Z)
                    while self.filler_sock is not None and select.select([self.filler_sock], [], [], 0)[0]:
                        self._filler_readable()
                    filler_status = os.waitpid(self.filler_pid, 0)[1]
                elif what == "control":
                    self._control_readable()
            if filler_status is not None:
                return self._after_filler(filler_status)
            if self.caller_gone and self.conn is None and not self.aborted:
                # the restore gave up before CRIU even connected
                self.aborted = True
                self._to_filler(b"A")
            if self.criu_gone and not self.finished and not self.aborted:
                # the restore failed (CRIU killed the tree) or never came: tell the filler to stop
                self.aborted = True
                self._to_filler(b"A")

    def _after_filler(self, status: int) -> int:
        if self.filler_ok and not self.fds:
            self._status_final("done")
            self._remove_run_dir()
            return 0
        if self.aborted and not self.filler_error:
            self._release_after_abort()
            self._status_final("aborted")
            self._remove_run_dir()
            return EXIT_ABORTED
        why = self.filler_error or _describe(status)
        return self._fail(f"the page filler failed ({why})")

    def _remove_run_dir(self) -> None:
        """Once the caller has gone (it may still read the final status)."""
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while not self.caller_gone and time.monotonic() < deadline:
            if select.select([self.control], [], [], 1.0)[0]:
                self._control_readable()
        run = self.args.get("run_dir")
        if run:
            shutil.rmtree(run, ignore_errors=True)

    def _release_after_abort(self) -> None:
        """The restore failed: CRIU (or the caller) kills the tree. Keep the descriptors until the
        caller has cleaned up (it closes its pipe), so nothing can read a zero page meanwhile."""
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while not self.caller_gone and time.monotonic() < deadline:
            if select.select([self.control], [], [], 1.0)[0]:
                self._control_readable()
        self._kill_container()
        self._close_all()

    def _fail(self, why: str) -> int:
        """The filler died with pages missing: the container must not run on."""
        self._status_final("failed", error=why)  # first: the caller may be about to ask why
        if not self.finished and self.conn is not None:
            # CRIU has not finished: its tasks may already wait on a page fault (CRIU waits on them),
            # so kill them; CRIU then fails the restore, and runc with it.
            for pid in _descendants(_peer_pid(self.conn)):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + ORPHAN_WAIT_S
        # The caller tells us the init pid right after runc restore; wait for it (or for its exit).
        while self.init_pidfd is None and not self.caller_gone and time.monotonic() < deadline:
            if select.select([self.control], [], [], 0.5)[0]:
                self._control_readable()
        if self.init_pidfd is None:
            self._find_init()
        killed = self._kill_container()
        msg = f"migrt: {why}; restored container {self.args.get('container_id') or ''} killed".rstrip()
        if not killed and self.fds:
            msg += " (its processes could not be found; their page faults stay blocked)"
        self._status_final("failed", error=why)
        if not self.aborted:  # else the caller reports the failed restore itself
            _runc_log(self.args.get("runc_log"), self.args.get("log_format") or "json", msg)
        _migrt_log(self.args.get("log_file"), why, self.args.get("container_id"), self._status(),
                   _tail(os.path.join(self.args.get("run_dir") or "", "guard.stderr")))
        if killed or self.aborted:  # aborted: the caller has removed the container already
            self._close_all()
        else:
            # nobody to kill, yet: keep blocking the faults of whatever still holds these ranges
            while self.fds and time.monotonic() < deadline:
                time.sleep(1.0)
            self._close_all()
        self._remove_run_dir()  # once the caller has read why (it is in migrt's log too)
        return 1

    def _find_init(self) -> None:
        root, cid = self.args.get("root"), self.args.get("container_id")
        if not root or not cid:
            return
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            with open(os.path.join(root, cid, "state.json")) as fh:
                self.init_pid = int(jsonsafe.load(fh)["init_process_pid"])
            self.init_pidfd = os.pidfd_open(self.init_pid)

    def _kill_container(self) -> bool:
        """SIGKILL the restored init (its pid namespace goes with it) and every process of its cgroup;
        wait until init is gone. False when there was no init to kill."""
        if self.init_pidfd is None:
            return False
        victims = _cgroup_pids(self.init_pid)
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        select.select([self.init_pidfd], [], [], KILL_WAIT_S)
        return True

    def _close_all(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def _status(self) -> dict:
        try:
            with open(self.status_path, encoding="utf-8") as fh:
                return jsonsafe.load(fh, max_bytes=1 << 20)
        except (OSError, ValueError):
            return {}

    def _status_final(self, state: str, error: str | None = None) -> None:
        data = self._status()
        data["state"] = state
        if error:
            data["error"] = error
        data["guard_s"] = round(time.monotonic() - self.t0, 3)
        write_json(self.status_path, data)


def _late_plan_seam() -> None:
    """Test seam (MIGRT_FILL_FAULT=plan_after_s:N): the guard plans N seconds late, as the guard of a
    huge checkpoint on a loaded node might, so that CRIU reaches post-restore before the plan."""
    spec = os.environ.get("MIGRT_FILL_FAULT", "")
    if spec.startswith("plan_after_s:"):
        with contextlib.suppress(ValueError):
            time.sleep(float(spec.split(":", 1)[1]))


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _peer_pid(conn: socket.socket) -> int | None:
    """The process at the other end of a unix socket (CRIU's restore, which connected)."""
    try:
        pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return None
    return pid or None


def _descendants(pid: int | None) -> list[int]:
    """Every descendant of pid (not pid itself), parents before children."""
    out: list[int] = []
    todo = [pid] if pid else []
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    kids = [int(x) for x in fh.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def _cgroup_pids(pid: int | None) -> list[int]:
    """Processes sharing pid's cgroup (v2, or v1's pids/memory hierarchy), never our own cgroup."""
    if not pid:
        return []
    try:
        theirs = _cgroups(pid)
        ours = _cgroups(os.getpid())
    except OSError:
        return []
    for ctrl in ("", "pids", "memory", "freezer"):
        path = theirs.get(ctrl)
        if not path or path == "/" or path == ours.get(ctrl):
            continue
        base = "/sys/fs/cgroup" if ctrl == "" else f"/sys/fs/cgroup/{ctrl}"
        if ctrl == "" and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            base = "/sys/fs/cgroup/unified"
        try:
            with open(os.path.join(base + path, "cgroup.procs")) as fh:
                return [int(x) for x in fh.read().split() if int(x) != os.getpid()]
        except (OSError, ValueError):
            continue
    return []


def _cgroups(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/cgroup") as fh:
        for line in fh:
            _hid, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def _runc_log(path: str | None, fmt: str, msg: str) -> None:
    if not path:
        return
    from migrt.runtime import runclog

    runclog.append(path, "error", msg, log_format=fmt)


def _tail(path: str, lines: int = 20) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return [ln.rstrip() for ln in fh.read().splitlines() if ln.strip()][-lines:]
    except OSError:
        return []


def _migrt_log(path: str | None, why: str, cid: str | None, status: dict, stderr: list[str]) -> None:
    if not path:
        return
    rec = {"event": "page_fill_failed", "level": "error", "component": "migrt-pagefill", "container": cid,
           "error": why, "status": status, "stderr": stderr,
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")


def main(argv: list[str], source: SourceFactory | None = None) -> int:
    args = json.loads(argv[0])
    # stdio is /dev/null (see session.py); anything unexpected still ends in the status file
    try:
        return Guard(args, source).run()
    except Exception as exc:  # noqa: BLE001
        write_json(args["status"], {"state": "failed", "error": f"page filler guard crashed: {exc!r}"})
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
