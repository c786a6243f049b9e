"""Lazy pages (post-copy) and pre-dump support: the feature checks a lazy migration needs.

A lazy migration (migration/migrate.py) dumps with `runc checkpoint --lazy-pages`, whose CRIU
leaves the memory in the frozen tasks and waits for a lazy-pages client on its page server; migrt
ends that page server at once (runtime/control.py) and serves the memory itself (migration/
pageserve.py) to the target's page filler (pagefill/), which CRIU's `restore --lazy-pages` hands
the restored tasks' userfaultfds to.

Why CRIU's own lazy migration hung on these machines (CRIU 4.2.1, runc 1.3.6, kernel 6.18), see
docs/migration.md: CRIU's page server asks for a 3.2 MiB pipe (F_SETPIPE_SZ); above
/proc/sys/fs/pipe-max-size (1 MiB by default) that needs CAP_SYS_RESOURCE, which root lacks in some
sandboxes; CRIU ignores the EPERM and splices into fd -1 at the first page request. migrt never
asks CRIU's page server for a page, so that limit no longer matters for the transfer (the tests run
at the 1 MiB default to keep it so). But a lazy dump keeps every page of the memory it leaves in the
tasks referenced from CRIU's page pipes, each pipe holding at most min(fs.pipe-max-size, 3.2 MiB)
and costing two descriptors: 2 x memory / pipe size descriptors, under RLIMIT_NOFILE's hard limit
(CRIU cannot raise it without CAP_SYS_RESOURCE). Measured: 8 GiB at 1 MiB pipes = 16k descriptors;
32 GiB on the GPU machine (hard limit 20000, 1 MiB pipes) failed with "Can't make pipe for
page-pipe: Too many open files". `lazy_dump_problem()` says so before anything is frozen.

migrt's own CRIU build carries a patch (packaging/criu/patches/0001-lazy-dump-without-page-pipes.patch)
that, with MIGRT_CRIU_LAZY_NO_PIPES=1 in its environment (runtime/control.py LazyCheckpoint sets it),
splices no lazy page into a pipe at all: the lazy dump then holds a few descriptors whatever the
memory. `unpiped_lazy_dump()` finds out whether the CRIU in use has it (the variable's name in its
binary); without it the old limit applies.
"""

from __future__ import annotations

import os
import resource
import subprocess

from migrt.criu.binary import criu_binary
from migrt.criu.version import run_query
from migrt.errors import PreconditionFailed


def criu_feature(feature: str) -> bool:
    crit = criu_binary()
    if not crit:
        return False
    try:
        return run_query([crit, "check", "--feature", feature], 30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def soft_dirty() -> bool:
    """Can pre-dump rounds be incremental (CONFIG_MEM_SOFT_DIRTY)?"""
    return criu_feature("mem_dirty_track")


def lazy_problem(role: str) -> str | None:
    """Why lazy migration cannot work on this node in `role` ("source" or "target"), or None."""
    if not criu_binary():
        return "criu is not installed"
    if role == "target" and not criu_feature("uffd-noncoop"):
        return "the kernel has no usable userfaultfd (criu check --feature uffd-noncoop fails)"
    return None


def lazy_preflight(role: str) -> None:
    problem = lazy_problem(role)
    if problem:
        raise PreconditionFailed(f"lazy migration is not possible on this {role} node: {problem}")


# CRIU's PIPE_MAX_SIZE (page-pipe.h) in bytes: its page pipes never grow beyond this
CRIU_PIPE_MAX = 3354624
FD_MARGIN = 512  # CRIU's own descriptors besides the page pipes
CAP_SYS_RESOURCE = 24


def pipe_max_size() -> int:
    try:
        with open("/proc/sys/fs/pipe-max-size") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def _has_cap(bit: int) -> bool:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


NO_PIPES_ENV = "MIGRT_CRIU_LAZY_NO_PIPES"  # the patch's switch (runtime/control.py sets it for every lazy dump)
_unpiped: dict[tuple[str, int, int], bool] = {}


def unpiped_lazy_dump(criu: str | None = None) -> bool:
    """Whether the CRIU in use keeps a lazy dump's pages out of page pipes when asked (migrt's patch:
    the switch's name is in its binary), and the environment does not turn it off."""
    if os.environ.get(NO_PIPES_ENV) == "0":  # tests: CRIU's own behaviour
        return False
    path = criu or criu_binary()
    if not path:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _unpiped:
        needle = NO_PIPES_ENV.encode()
        found = False
        try:
            with open(path, "rb") as fh:
                tail = b""
                while chunk := fh.read(1 << 20):
                    if needle in tail + chunk:
                        found = True
                        break
                    tail = chunk[-len(needle):]
        except OSError:
            found = False
        _unpiped[key] = found
    return _unpiped[key]


def lazy_dump_fds(memory_bytes: int) -> int:
    """Descriptors a lazy dump of this much memory holds open (its page pipes, two fds each; a few
    with migrt's CRIU, which keeps no lazy page in a pipe)."""
    if unpiped_lazy_dump():
        return FD_MARGIN
    pipe = max(4096, min(pipe_max_size(), CRIU_PIPE_MAX))
    return 2 * (-(-memory_bytes // pipe)) + FD_MARGIN


def lazy_dump_problem(memory_bytes: int) -> str | None:
    """Why a lazy dump of this much memory would run out of descriptors here, or None."""
    need = lazy_dump_fds(memory_bytes)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or need <= hard or _has_cap(CAP_SYS_RESOURCE):
        return None
    pipe = min(pipe_max_size(), CRIU_PIPE_MAX)
    fix = ("use migrt's own CRIU build (packaging/build-criu.sh: its lazy dumps keep no page pipes), or raise the "
           "hard limit of open files for migrt (e.g. LimitNOFILE in its unit, or ulimit -Hn as a privileged parent)")
    if pipe < CRIU_PIPE_MAX:
        fix += (f", or 'sysctl -w fs.pipe-max-size={4 << 20}' (3.2 MiB pipes: {lazy_dump_fds_at(memory_bytes)} "
                "descriptors)")
    return (f"a lazy dump of {memory_bytes >> 20} MiB needs about {need} open files for CRIU's page pipes "
            f"({pipe >> 10} KiB each), over this node's hard limit of {hard}; {fix}")


def lazy_dump_fds_at(memory_bytes: int, pipe: int = CRIU_PIPE_MAX) -> int:
    return 2 * (-(-memory_bytes // pipe)) + FD_MARGIN
