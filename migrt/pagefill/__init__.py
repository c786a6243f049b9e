"""migrt's page filler: a lazy restore whose memory is copied by several threads, from local images
or (lazy migration, remote.py) from the source node's page server over several streams.

`runc restore --lazy-pages` restores the process tree without its private anonymous memory; each
restored task hands its userfaultfd to us over CRIU's lazy-pages socket, and the tree resumes at once.
The filler (engine.py) then copies every lazy range with UFFDIO_COPY straight from the mmap'ed
pages images, page faults first, biggest ranges next, in several threads; the guard (guard.py) keeps
a duplicate of every userfaultfd so that a dying filler can never leave a task reading zero pages:
it kills the container instead. images.py reads what to copy; session.py is the restore's handle.

The public surface: `plan()` / `ImageError` (can these images be filled?), `problem()` (can this node
do it?), `PageFill` (start, link, restored, wait, check, abort, detach), `container_vpid()`.
"""

from __future__ import annotations

from migrt.pagefill.images import ImageError, Plan, plan
from migrt.pagefill.session import PageFill, container_vpid

__all__ = ["ImageError", "PageFill", "Plan", "container_vpid", "plan", "problem"]


def problem() -> str | None:
    """Why this node cannot restore through the filler, or None."""
    from migrt.criu.lazy import criu_feature
    from migrt.pagefill.uffd import usable

    why = usable()
    if why:
        return why
    if not criu_feature("uffd-noncoop"):
        return "criu check --feature uffd-noncoop fails (CRIU cannot restore with --lazy-pages here)"
    return None
