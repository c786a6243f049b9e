"""migrt-runc's `checkpoint` without GPU state (containerd's task checkpoint, kubelet's checkpoint API),
recorded in the store's journal around the lower runtime's own checkpoint (argv untouched).

Why: containerd cancels a CRI CheckpointContainer whose deadline passes, and runc and its CRIU are
killed mid-dump: measured here (containerd 2.1.9, runc 1.3.6, CRIU 4.2.1), the container is left
frozen for good (runc state `paused`, its processes in D state) while CRI still reports it running.
It is containerd that froze it: its CRI checkpoint pauses the task, dumps, resumes, and a cancelled
call never resumes. A `runc resume` brings it back intact. So: before the dump, record the container
and whether it was paused by someone else (a pod's container never is: Kubernetes has no pause);
after it, a detached watchdog (it outlives a killed migrt-runc) waits until no runc/CRIU works on the
images any more and containerd had its chance to resume, thaws the container if it is still frozen,
and drops the record. A watchdog that could not finish leaves the record to the next migrt command
or `migrt recover` (ops/recover.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from migrt.errors import MigrtError
from migrt.gpu import procs
from migrt.oci.bundle import Bundle
from migrt.runtime import lower as lower_mod
from migrt.runtime.argv import Call
from migrt.store import Store, journal

# Standard library only in migrt-runc's own process (tests/unit/test_gpu_ops.py checks): the config
# is read for its `store:` line alone; the watchdog, a process of its own, imports the rest.
CRI_TYPE = "io.kubernetes.cri.container-type"
DEFAULT_STORE = "/var/lib/migrt"


def _pod_container(state: dict | None) -> bool:
    """A Kubernetes pod's container (CRI annotations in its config.json). Kubernetes has no pause: a
    pod's container found paused at checkpoint time was paused by containerd for this checkpoint
    (containerd 2.1's CRI checkpoint pauses, dumps, resumes; cancelled, it never resumes)."""
    bundle = Bundle.of_state(state)
    return bundle is not None and bundle.annotations.get(CRI_TYPE) == "container"


def _frozen(state: dict | None) -> bool:
    """The container's freezer says frozen (cgroup v1 freezer.state, v2 cgroup.freeze), read from the
    paths in runc's state.json: no runc call."""
    paths = (state or {}).get("cgroup_paths") or {}
    for path, name, frozen in ((paths.get("freezer"), "freezer.state", ("FROZEN", "FREEZING")),
                               (paths.get(""), "cgroup.freeze", ("1",))):
        if not path:
            continue
        try:
            with open(os.path.join(path, name), encoding="ascii") as fh:
                return fh.read().strip() in frozen
        except OSError:
            continue
    return False


def checkpoint(call: Call, run: Callable[[], int]) -> int:
    """`run()` runs the lower runtime's checkpoint (as a child) and returns its exit status."""
    cmd, cid, root = call.cmd, call.container_id, call.root
    work = cmd.value("work-path")
    entry = None
    try:
        state = procs.runc_state(root, cid)
        if state is not None:
            paused, pod = _frozen(state), _pod_container(state)
            store = Store(lower_mod.configured_value("store") or DEFAULT_STORE)
            store.ensure()
            entry = journal.begin(
                store.root, "runc-checkpoint", phase="dumping", container=cid, root=root,
                was_paused=paused and not pod, paused_by_containerd=paused and pod,
                leave_running=cmd.has("leave-running"),
                image_dir=os.path.abspath(call.image_path),
                work=os.path.abspath(work) if work else None)
    except (MigrtError, OSError, ValueError):
        entry = None  # recording is a safety net, never a reason to refuse a checkpoint
    watching = entry is not None and _spawn_watchdog(entry)
    rc = run()
    if entry:
        entry.update("returned", rc=rc)
        if watching:
            entry.release()  # the watchdog holds the lock too (inherited) and ends the record
        else:
            entry.end()
    return rc


GRACE_S = 10.0  # containerd resumes the task right after the runtime returns; a cancelled call never does


def _spawn_watchdog(entry: journal.Entry) -> bool:
    """A detached process (double fork, own session, no stdio: containerd waits for its pipes to
    close) that outlives migrt-runc: once migrt-runc is gone (returned or killed) and no runc/CRIU
    works on the images any more, it thaws the container if it was left frozen (after a grace for
    containerd's own resume), then ends the journal record. It shares the record's lock (the open
    file is inherited), so no other recovery acts meanwhile."""
    owner = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid:
        os.waitpid(pid, 0)
        return True
    try:  # first child
        os.setsid()
        if os.fork():
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        keep = entry.lock_fd
        os.closerange(3, keep)
        os.closerange(keep + 1, 65536)
        _watch(entry, owner)
    finally:
        os._exit(0)


def _watch(entry: journal.Entry, owner: int) -> None:
    from migrt import config as config_mod
    from migrt.ops import recover

    start = procs.start_time(owner)
    while procs.start_time(owner) == start and start is not None:
        time.sleep(0.1)
    d = entry.data
    try:
        cfg = config_mod.load()
    except MigrtError:
        entry.release()  # left for `migrt recover`
        return
    try:
        recover.wait_helpers([d.get("image_dir"), d.get("work")], 600)
    except recover.Pending:
        entry.release()  # left for `migrt recover`
        return
    if d.get("paused_by_containerd"):
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and _status(cfg, d) == "paused":
            time.sleep(0.2)
    actions: list[str] = []
    try:
        recover.handle_runc_checkpoint(cfg, entry, actions)
    except (MigrtError, OSError):
        entry.release()
        return
    entry.end()


def _status(cfg, d: dict) -> str | None:
    return "paused" if _frozen(procs.runc_state(d.get("root") or "", d.get("container") or "")) else "other"
