"""Stopping a container for good, frozen or not, on every cgroup layout (v1, v2, hybrid) and whether it
has its own PID namespace or shares one (a pod with shareProcessNamespace, the CRI default when no
namespace options are sent).

`<runtime> delete --force` alone does not do it for a frozen container:
- runc >= 1.2 kills a container without its own PID namespace through cgroup v2's `cgroup.kill`
  wherever cgroup2 is mounted, and does not thaw it. On a hybrid layout the v1 freezer holds the
  tasks: the kill does not land, runc gives up after 10 s ("container init still running") and the
  container stays frozen.
- runc 1.1 kills only the init, thaws the cgroup, then kills the rest: in between, the other
  processes of a shared-namespace container run, after a checkpoint that must be their last state.

The rule: SIGKILL every task while the container is still frozen (a frozen task can neither fork nor
exit, so the list is complete and no pid is reused meanwhile), then thaw it so that the kill lands (a
task leaving the freezer acts on the pending fatal signal before it returns to user space, so none
runs again), and only then delete it. The task list comes from the runtime's own `ps`: which cgroup
holds them is its business.
"""

from __future__ import annotations

import os
import signal

from migrt import jsonsafe
from migrt.errors import RuntimeFailed
from migrt.runtime.messages import stderr_message

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    import subprocess
    from typing import Protocol

    class Runner(Protocol):
        """What the rule needs of the lower runtime: runtime/runc.py's LowerRuntime, which stops by it."""

        path: str

        def run(self, root: str | None, args: list[str], *, timeout: float | None = 60,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]: ...

        def status(self, root: str | None, container_id: str) -> str | None: ...


def _failure(out: subprocess.CompletedProcess[str]) -> str:
    return stderr_message(out.stderr, out.returncode)


def _tasks(rt: Runner, root: str, cid: str) -> list[int]:
    out = rt.run(root, ["ps", "--format", "json", cid], timeout=30)
    if out.returncode == 0:
        try:
            pids = jsonsafe.loads(out.stdout or "[]")
            if isinstance(pids, list) and all(isinstance(p, int) and p > 0 for p in pids):
                return pids
        except ValueError:
            pass
    raise RuntimeFailed(f"cannot list the processes of frozen container {cid} ({_failure(out)}); it is left frozen, "
                        f"nothing of it ran: run 'migrt recover'")


def kill_frozen(rt: Runner, root: str, cid: str) -> list[int]:
    """SIGKILL every task of a frozen container, then thaw it so that the kill lands. Returns the pids."""
    pids = _tasks(rt, root, cid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = rt.run(root, ["resume", cid])
    # on cgroup v2 the kill lands in the frozen cgroup already: then there is nothing left to resume
    if out.returncode != 0 and rt.status(root, cid) == "paused":
        raise RuntimeFailed(f"container {cid} was killed while frozen but cannot be thawed for the kill to land "
                            f"({_failure(out)}); it stays frozen: run 'migrt recover'")
    return pids


def stop(rt: Runner, root: str, cid: str) -> None:
    """Kill and delete container `cid` (runtime root `root`), never letting a frozen one run again.
    A container the runtime no longer knows is nothing to stop (its leftovers are still deleted)."""
    if rt.status(root, cid) == "paused":
        kill_frozen(rt, root, cid)
    out = rt.run(root, ["delete", "--force", cid])
    if out.returncode != 0 and rt.status(root, cid) is not None:
        raise RuntimeFailed(f"cannot delete container {cid} under {root}: {_failure(out)}; "
                            f"run 'migrt recover', or '{os.path.basename(rt.path)} --root {root} delete --force {cid}'")
