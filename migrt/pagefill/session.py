"""A lazy restore's page filler as the restore sees it: start it before `runc restore --lazy-pages`,
link its socket into runc's work directory, tell it the restored init's pid, and wait for whole
processes (or just check on them) through its status file.

The guard (guard.py) runs in its own session with /dev/null as stdio, so it outlives the shim's
`create` and never holds the container's pipes; it removes its run directory once the fill is over
and the caller has gone (after a failure, migrt's log keeps the status and the guard's stderr).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from migrt import jsonsafe
from migrt.errors import RuntimeFailed

RUN_BASE = "/run/migrt/fill"
SOCKET_NAME = "lazy-pages.socket"  # what CRIU connects to, relative to its work directory
PLAN_WAIT_S = 120.0  # the guard plans the images before anything else (0.5 s at 32 GiB on the GPU machine)


def _run_dir() -> str:
    for base in (RUN_BASE, os.path.join(tempfile.gettempdir(), "migrt-fill")):
        try:
            os.makedirs(base, mode=0o700, exist_ok=True)
            return tempfile.mkdtemp(prefix="f-", dir=base)
        except OSError:
            continue
    raise RuntimeFailed(f"cannot create a run directory for the page filler under {RUN_BASE}")


class PageFill:
    def __init__(self, run_dir: str, proc: subprocess.Popen, control_w: int, threads: int) -> None:
        self.run_dir = run_dir
        self.proc = proc
        self.control_w: int | None = control_w
        self.threads = threads
        self.socket_path = os.path.join(run_dir, SOCKET_NAME)
        self.status_path = os.path.join(run_dir, "status.json")
        self.started = time.monotonic()  # the restore's timings say when things happened relative to this
        self.post_restore: str | None = None  # the file that lets it copy before CRIU's end of restore
        self._last: dict = {}

    @classmethod
    def start(cls, images: str, *, threads: int, container_id: str | None = None, root: str | None = None,
              runc_log: str | None = None, log_format: str = "json", log_file: str | None = None,
              post_restore: str | bool | None = None, remote: dict | None = None,
              verify: dict | None = None, keep_fd: int | None = None,
              entry: str = "migrt.pagefill.guard") -> PageFill:
        """Start the guard (and through it the filler) for a restore from `images`. post_restore: a
        file that appears once every task is restored (not resumed): copying may start then, before
        CRIU's end-of-restore message; True: one in the run directory, for the caller to create
        (`fill.post_restore`; a direct migration's restore does, ops/pages.py FilledFirst). remote: the
        pages are on the source node (lazy migration):
        {"address", "port", "key" (hex), "tls" (None or {cert, key, ca}), "timeout"} (remote.py).
        verify: pages images not verified yet, which the filler verifies chunk by chunk before it copies
        from them: {"checkpoint": name, "files": {basename: {"rel", "size", "chunks"}}} (verify.py), and
        with a "registry" section the chunks not on disk yet come from there (registry.py). keep_fd: a
        descriptor the filler holds until it ends (a lazy pull's image lock). entry: the guard's module
        (migrt.registry.fill: the guard with the registry's source of chunks)."""
        run = _run_dir()
        if post_restore is True:
            post_restore = os.path.join(run, "post-restore")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        images_fd = control_r = control_w = -1
        try:
            sock.bind(os.path.join(run, SOCKET_NAME))
            sock.listen(16)
            images_fd = os.open(images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            control_r, control_w = os.pipe2(os.O_CLOEXEC)
            args: dict[str, object] = {"listen_fd": sock.fileno(), "images_fd": images_fd, "control_fd": control_r,
                    "status": os.path.join(run, "status.json"), "threads": threads, "container_id": container_id,
                    "root": root, "runc_log": runc_log, "log_format": log_format, "log_file": log_file,
                    "run_dir": run, "post_restore": post_restore, "keep_fd": keep_fd}
            if verify is not None:  # in a file of our 0700 run directory (too big for argv)
                args["verify"] = path = os.path.join(run, "verify.json")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(verify, fh)
            if remote is not None:  # in a file of our 0700 run directory: the key stays off argv
                args["remote"] = path = os.path.join(run, "remote.json")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(remote, fh)
            # the guard imports migrt from where we did (a venv, a checkout)
            pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (pkg_parent, os.environ.get("PYTHONPATH")) if p)}
            with open(os.path.join(run, "guard.stderr"), "wb") as err:
                proc = subprocess.Popen([sys.executable, "-m", entry, json.dumps(args)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                        pass_fds=(sock.fileno(), images_fd, control_r,
                                                  *(() if keep_fd is None else (keep_fd,))),
                                        start_new_session=True)
        except OSError as exc:
            if control_w >= 0:
                os.close(control_w)
            raise RuntimeFailed(f"cannot start the page filler: {exc}") from exc
        finally:
            sock.close()
            for fd in (images_fd, control_r):
                if fd >= 0:
                    os.close(fd)
        fill = cls(run, proc, control_w, threads)
        fill.post_restore = post_restore or None
        return fill

    def link(self, work_dir: str) -> None:
        """CRIU finds the filler through lazy-pages.socket in runc's work directory."""
        os.symlink(self.socket_path, os.path.join(work_dir, SOCKET_NAME))

    def _say(self, msg: dict) -> None:
        if self.control_w is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.control_w, (json.dumps(msg) + "\n").encode())

    def restored(self, init_pid: int) -> None:
        """runc restore returned: the guard knows whom to kill should the filler fail."""
        self._say({"init_pid": init_pid})

    def abort(self) -> None:
        """The restore failed (the caller removes the container): the filler stops."""
        self._say({"abort": True})
        self.detach()

    def detach(self) -> None:
        """We go away; the guard and the filler carry on alone."""
        if self.control_w is not None:
            with contextlib.suppress(OSError):
                os.close(self.control_w)
            self.control_w = None

    def status(self) -> dict:
        """The filler's last status; {"state": "done"} once the guard exited cleanly (it removes its
        run directory then), {"state": "failed", ...} when it did not."""
        try:
            with open(self.status_path, encoding="utf-8") as fh:
                self._last = jsonsafe.load(fh, max_bytes=1 << 20)
        except (OSError, ValueError):
            code = self.proc.poll()
            if code is not None and not os.path.exists(self.status_path):
                st = dict(self._last)
                if code == 0:
                    st["state"] = "done"
                elif code == 2:
                    st["state"] = "aborted"
                else:
                    st.update(state="failed", error=st.get("error") or self._stderr() or f"guard exit status {code}")
                return st
        return dict(self._last)

    def _stderr(self) -> str:
        try:
            with open(os.path.join(self.run_dir, "guard.stderr"), encoding="utf-8", errors="replace") as fh:
                lines = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def check(self) -> dict:
        st = self.status()
        if st.get("state") == "failed":
            raise RuntimeFailed(f"the page filler failed: {st.get('error') or 'unknown error'}")
        return st

    def completed(self) -> set[int] | None:
        """Without waiting: the processes (pids inside the container) whose memory is all in; None
        once every process's is (the fill is over: a process without lazy memory is never listed).
        Raises RuntimeFailed when the filler failed or the restore was aborted."""
        st = self.check()
        if st.get("state") == "done":
            return None
        if st.get("state") == "aborted":
            raise RuntimeFailed("the page filler stopped: the restore was aborted")
        if not st.get("restore_finished"):
            return set()
        return {int(p) for p, rec in (st.get("pids") or {}).items() if rec.get("done")}

    def gpu_ready(self) -> dict[int, str] | None:
        """Without waiting: the processes (pids inside the container) whose GPU restore may start, with
        what was waited for: "gpu_backing" when the filler has copied their first ranges (the driver's
        host copy of their GPU memory, engine.py), "memory" when all their memory is in; None once the
        fill is over. Raises RuntimeFailed as completed() does."""
        st = self.check()
        if st.get("state") == "done":
            return None
        if st.get("state") == "aborted":
            raise RuntimeFailed("the page filler stopped: the restore was aborted")
        out = {}
        for p, rec in (st.get("pids") or {}).items():
            if rec.get("done") and st.get("restore_finished"):
                out[int(p)] = "memory"
            elif rec.get("first_done"):
                out[int(p)] = "gpu_backing"
        return out

    def planned(self, timeout: float = PLAN_WAIT_S, interval: float = 0.005) -> dict:
        """Until the guard has planned the images (status "planned", or later ones): that status. The
        plan is what the filler copies, made from the images themselves. Raises RuntimeFailed when it
        could not be made (`plan_error` in the status says why), when the filler failed or stopped, or
        when no verdict came in time."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.check()
            if st.get("state") == "aborted":
                raise RuntimeFailed("the page filler stopped: the restore was aborted")
            if st.get("state"):
                return st
            if time.monotonic() > deadline:
                raise RuntimeFailed(f"the page filler has not planned the images after {timeout:.0f} s")
            time.sleep(interval)

    def wait(self, vpids: list[int] | None = None, timeout: float | None = None, interval: float = 0.01,
             stall: float | None = None) -> dict:
        """Until the given processes (pids inside the container; None: all) have all their memory.
        Raises RuntimeFailed when the filler failed, the time ran out, or (stall) no byte was copied
        for that many seconds (a lazy migration's source gone quiet), not counting the time a held
        pod part's filler waits for its pod's release (engine.py: it copies nothing meanwhile)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        want = None if vpids is None else {str(p) for p in vpids}
        last, t_last = -1, time.monotonic()
        while True:
            st = self.check()
            if st.get("state") == "done":
                return st
            if st.get("state") == "aborted":
                raise RuntimeFailed("the page filler stopped: the restore was aborted")
            pids = st.get("pids") or {}
            if want is not None and st.get("restore_finished") and want <= set(pids) \
                    and all(pids[p].get("done") for p in want):
                return st
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise RuntimeFailed(f"the page filler has not finished after {timeout:.0f} s "
                                    f"({st.get('copied_bytes', 0) >> 20} of {st.get('lazy_bytes', 0) >> 20} MiB)")
            copied = st.get("copied_bytes") or 0
            if copied != last or st.get("held"):
                last, t_last = copied, now
            elif stall is not None and now - t_last > stall:
                raise RuntimeFailed(f"no memory page arrived for {stall:.0f} s "
                                    f"({copied >> 20} of {(st.get('lazy_bytes') or 0) >> 20} MiB in)")
            time.sleep(interval)

    def stop(self, timeout: float = 30.0) -> None:
        """Tests and failed restores: wait for the guard to exit (it does once the container is gone)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)


def container_vpid(host_pid: int) -> int | None:
    """The pid of a host process inside its own pid namespace (the key of CRIU's images)."""
    try:
        with open(f"/proc/{host_pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None
