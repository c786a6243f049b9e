"""Lazy pages (post-copy) and pre-dump support: feature checks, and the target's `criu lazy-pages`
daemon, which fetches memory pages from the source's page server on demand (userfaultfd) and in
the background until every page has arrived.

Why lazy migration hung on these machines (CRIU 4.2.1, runc 1.3.6, kernel 6.18), see
docs/migration.md: CRIU's page server on the source asks for a 3.2 MiB pipe (F_SETPIPE_SZ). Above
/proc/sys/fs/pipe-max-size (1 MiB by default) that needs CAP_SYS_RESOURCE, which root lacks in
some sandboxes; CRIU ignores the EPERM, splices into fd -1 (EBADF) at the first page request and
drops the connection. The restore then fails and CRIU deadlocks in its clean-up (the restored
tasks are killed while still ptrace-seized), so `runc restore --lazy-pages` never returns.
`lazy_preflight()` catches this before anything is frozen.
"""

from __future__ import annotations

import os
import subprocess
import time

from migrt.criu.logs import error_lines
from migrt.criu.version import criu_binary
from migrt.errors import PreconditionFailed, RuntimeFailed

# CRIU's PIPE_MAX_SIZE (page-pipe.h) times the page size: the tee pipe its page server asks for.
CRIU_TEE_PIPE = 3354624
RECOMMENDED_PIPE_MAX = 4 << 20
CAP_SYS_RESOURCE = 24


def criu_feature(feature: str) -> bool:
    crit = criu_binary()
    if not crit:
        return False
    try:
        return subprocess.run([crit, "check", "--feature", feature], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def soft_dirty() -> bool:
    """Can pre-dump rounds be incremental (CONFIG_MEM_SOFT_DIRTY)?"""
    return criu_feature("mem_dirty_track")


def _has_cap(bit: int) -> bool:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


def pipe_max_size() -> int:
    try:
        with open("/proc/sys/fs/pipe-max-size") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 0


def lazy_problem(role: str) -> str | None:
    """Why lazy migration cannot work on this node in `role` ("source" or "target"), or None."""
    if not criu_binary():
        return "criu is not installed"
    if role == "target" and not criu_feature("uffd-noncoop"):
        return "the kernel has no usable userfaultfd (criu check --feature uffd-noncoop fails)"
    if role == "source" and not _has_cap(CAP_SYS_RESOURCE) and pipe_max_size() < CRIU_TEE_PIPE:
        return (f"fs.pipe-max-size is {pipe_max_size()} and this process lacks CAP_SYS_RESOURCE: CRIU's page "
                f"server needs a {CRIU_TEE_PIPE}-byte pipe and would drop the target at its first page request; "
                f"run 'sysctl -w fs.pipe-max-size={RECOMMENDED_PIPE_MAX}' (and persist it in /etc/sysctl.d)")
    return None


def lazy_preflight(role: str) -> None:
    problem = lazy_problem(role)
    if problem:
        raise PreconditionFailed(f"lazy migration is not possible on this {role} node: {problem}")


class LazyPagesDaemon:
    """`criu lazy-pages --page-server --address A --port P -D images -W work`: started before
    `runc restore --lazy-pages --work-path work`, which finds it through work/lazy-pages.socket."""

    def __init__(self, images: str, work: str, address: str, port: int, log: str) -> None:
        crit = criu_binary()
        if not crit:
            raise RuntimeFailed("criu is not installed on the target")
        self.work = work
        self.log = log
        self.socket = os.path.join(work, "lazy-pages.socket")
        # The images directory is handed over as an open descriptor: the caller may rename it (commit)
        # while CRIU is still starting up.
        dirfd = os.open(images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        argv = [crit, "lazy-pages", "--page-server", "--address", address, "--port", str(port),
                "-D", f"/proc/self/fd/{dirfd}", "-W", work, "-o", self.log, "-v2"]
        self.stderr = os.path.join(work, "lazy-pages.stderr")
        try:
            with open(self.stderr, "wb") as err:
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                             start_new_session=True, pass_fds=(dirfd,))
        except OSError as exc:
            raise RuntimeFailed(f"cannot run {crit}: {exc}") from exc
        finally:
            os.close(dirfd)

    def wait_listening(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise self.failure("criu lazy-pages exited before it was ready")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeFailed(f"criu lazy-pages did not create {self.socket} within {timeout:.0f} s")
            time.sleep(0.005)

    def wait(self, timeout: float | None = None) -> None:
        """Until every page has arrived (the daemon exits 0)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeFailed(f"criu lazy-pages still fetching pages after {timeout:.0f} s") from exc
        if self.proc.returncode != 0:
            raise self.failure(f"criu lazy-pages failed (exit status {self.proc.returncode})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def failure(self, msg: str) -> RuntimeFailed:
        """`msg` with the daemon's error lines (its log, else its stderr)."""
        details = error_lines(self.log)
        if not details:
            try:
                with open(self.stderr, encoding="utf-8", errors="replace") as fh:
                    details = [ln.strip() for ln in fh.read().splitlines() if ln.strip()][-4:]
            except OSError:
                pass
        return RuntimeFailed(msg, details=details)
