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

import json
import os
import signal
import subprocess

from migrt.errors import RuntimeFailed
from migrt.runtime.runc import collapse_lines, runc_message


def _call(runtime: str, root: str, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([runtime, "--root", root, *args], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeFailed(f"{os.path.basename(runtime)} {args[0]} {args[-1]}: {exc}") from exc


def _status(runtime: str, root: str, cid: str) -> str | None:
    """The container's status, None when the runtime does not know it (gone)."""
    out = _call(runtime, root, ["state", cid], timeout=30)
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout).get("status")
    except (ValueError, AttributeError):
        return None


def _failure(out: subprocess.CompletedProcess) -> str:
    msgs = "\n".join(runc_message(line) for line in (out.stderr or "").splitlines())
    return collapse_lines(msgs) or f"exit status {out.returncode}"


def _tasks(runtime: str, root: str, cid: str) -> list[int]:
    out = _call(runtime, root, ["ps", "--format", "json", cid], timeout=30)
    if out.returncode == 0:
        try:
            pids = json.loads(out.stdout or "[]")
            if isinstance(pids, list) and all(isinstance(p, int) and p > 0 for p in pids):
                return pids
        except ValueError:
            pass
    raise RuntimeFailed(f"cannot list the processes of frozen container {cid} ({_failure(out)}); it is left frozen, "
                        f"nothing of it ran: run 'migrt recover'")


def kill_frozen(runtime: str, root: str, cid: str) -> list[int]:
    """SIGKILL every task of a frozen container, then thaw it so that the kill lands. Returns the pids."""
    pids = _tasks(runtime, root, cid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = _call(runtime, root, ["resume", cid])
    # on cgroup v2 the kill lands in the frozen cgroup already: then there is nothing left to resume
    if out.returncode != 0 and _status(runtime, root, cid) == "paused":
        raise RuntimeFailed(f"container {cid} was killed while frozen but cannot be thawed for the kill to land "
                            f"({_failure(out)}); it stays frozen: run 'migrt recover'")
    return pids


def stop(runtime: str, root: str, cid: str) -> None:
    """Kill and delete container `cid` (runtime root `root`), never letting a frozen one run again.
    A container the runtime no longer knows is nothing to stop (its leftovers are still deleted)."""
    if _status(runtime, root, cid) == "paused":
        kill_frozen(runtime, root, cid)
    out = _call(runtime, root, ["delete", "--force", cid])
    if out.returncode != 0 and _status(runtime, root, cid) is not None:
        raise RuntimeFailed(f"cannot delete container {cid} under {root}: {_failure(out)}; "
                            f"run 'migrt recover', or '{os.path.basename(runtime)} --root {root} delete --force {cid}'")
