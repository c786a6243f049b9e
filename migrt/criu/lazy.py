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
asks CRIU's page server for a page, so the source needs no sysctl (the tests run at the 1 MiB
default to keep it so).
"""

from __future__ import annotations

import subprocess

from migrt.criu.version import criu_binary
from migrt.errors import PreconditionFailed


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
