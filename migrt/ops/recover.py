"""Recovery: bring back what a migrt killed mid-operation left (store/journal.py records it).

Every command of the CLI runs `recover(...)` first (briefly; `migrt recover` waits longer), and so
do checkpoint and restore themselves. Only *stale* entries are touched (their owner is gone: its
journal lock is free). What is done, per operation and the furthest phase recorded:

checkpoint  The rule: until the checkpoint is committed the workload is the truth. Wait for the
            dead migrt's helpers (runc, CRIU: any process still holding files under its staging or
            work directory) to end (a lazy dump's CRIU, which waits on its page server for ever, is
            told to end: ops/dump.py), then
            - committed (the checkpoint exists and carries this entry's id): finish the operation:
              stop the container (its checkpoint is complete), or with --leave-running resume it;
            - not committed, container still there: thaw it if migrt froze it, resume its GPU
              processes (restore + unlock), delete the staging directory (the workload runs, so
              those images are worth nothing);
            - not committed, container gone (a node reboot, someone else's kill): the staging
              directory may hold the only copy of the workload: it is KEPT under .incomplete/
              (never deleted by migrt; listed by `migrt recover`), not committed: its files were
              never fsync'd and may be torn.
restore     The checkpoint is only read, so it is intact. A container restored half-way (no
            restored-marker: runc or the GPU restore did not finish) is deleted; the caller
            (containerd, a person) retries.
gpu-checkpoint (migrt-runc's checkpoint of a container with CUDA processes): resume the processes
            the dead migrt-runc suspended, if the container still runs.
runc-checkpoint (migrt-runc's checkpoint without GPU state, e.g. a CRI checkpoint containerd
            cancelled): thaw the container the killed runc/CRIU left frozen.
receive, import: the data lives elsewhere (the source node, the archive): the staging goes.
checkpoint-pod (`migrt checkpoint --pod`, ops/pod_checkpoint.py): as checkpoint, for every container
            of the pod it froze: committed, they are stopped (or resumed under --leave-running); not
            committed, each is thawed and the staging directory (every part) goes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field

from migrt import log as log_mod
from migrt import names
from migrt.config import Config
from migrt.errors import MigrtError
from migrt.gpu import select as gpu_select
from migrt.gpu import session
from migrt.gpu.backend import GpuError
from migrt.runtime.cleanup import clear_container, unmount_under
from migrt.runtime.markers import is_restored
from migrt.runtime.runc import ContainerState, LowerRuntime
from migrt.store import Store, journal
from migrt.store import manifest as mf

AUTO_WAIT_S = 5.0     # the next command waits this long for a dead operation's helpers
COMMAND_WAIT_S = 120.0  # `migrt recover` (a large dump may take minutes to end)


class Pending(MigrtError):
    exit_code = 6


@dataclass
class Outcome:
    id: str
    op: str
    phase: str
    container: str | None
    status: str                 # recovered | pending | failed
    actions: list[str] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def line(self) -> str:
        what = f"interrupted {self.op} ({self.phase})" + (f" of container {self.container}" if self.container else "")
        if self.status == "recovered":
            return f"{what}: " + ("; ".join(self.actions) or "nothing to undo")
        return f"{what}: {self.status}: {self.error}"


# -- helpers of a dead operation ---------------------------------------------------------------------
def holders(paths: list[str | None]) -> list[int]:
    """Processes (not this one) with a cwd or an open file under any of `paths` (runc, CRIU)."""
    roots = [os.path.realpath(p) for p in paths if p]
    if not roots:
        return []
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        links = [f"/proc/{entry}/cwd"]
        with contextlib.suppress(OSError):
            links += [f"/proc/{entry}/fd/{fd}" for fd in os.listdir(f"/proc/{entry}/fd")]
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if any(target == r or target.startswith(r + "/") for r in roots):
                found.append(int(entry))
                break
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def wait_helpers(paths: list[str | None], wait_s: float, poke=None) -> None:
    """CRIU outlives a killed runc and finishes its dump (then leaves the tasks as it found them):
    never thaw or delete under it. Pending if it is still at work after wait_s. poke(pids), when
    given, is called at every look while helpers remain (a lazy dump's CRIU must be told to end)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = holders(paths)
        if not pids:
            return
        if poke:
            poke(pids)
        if time.monotonic() >= deadline:
            who = ", ".join(f"{p} ({_comm(p)})" for p in pids)
            where = ", ".join(p for p in paths if p)
            raise Pending(f"process(es) {who} of the interrupted operation are still at work on {where}; "
                          "run 'migrt recover' again once they end")
        time.sleep(0.3)


# -- per operation --------------------------------------------------------------------------------
def _state(runtime: LowerRuntime, root: str | None, cid: str | None) -> ContainerState | None:
    if not names.is_container_id(cid) or not root or not os.path.isfile(os.path.join(root, cid, "state.json")):
        return None
    try:
        return runtime.state(root, cid)
    except MigrtError:
        return None


def _committed(store: Store, name: str | None, entry_id: str) -> bool:
    if not name or not store.exists(name):
        return False
    try:
        return mf.load(os.path.join(store.root, name), name).op_id == entry_id
    except MigrtError:
        return False


def _resume_gpu(cfg: Config, pids: list[int], actions: list[str]) -> None:
    """Restore + unlock each process from wherever it stands; one that is gone is no one's concern."""
    if not pids:
        return
    backend = gpu_select.get_backend(getattr(cfg, "gpu_backend", "auto") or "auto")
    done = []
    for pid in pids:
        try:
            session.resume_if_needed([pid], backend)
            done.append(pid)
        except GpuError:
            if os.path.exists(f"/proc/{pid}"):
                raise
    if done:
        actions.append(f"resumed GPU processes {', '.join(map(str, done))}")
        from migrt.gpu import apphooks  # those the dead migrt had told "pre-checkpoint" rebuild now

        timeout_s = float(getattr(cfg, "gpu_hook_timeout_s", apphooks.DEFAULT_TIMEOUT_S))
        told, _ = apphooks.after_restore(done, what="recovered container", reason=apphooks.RESUMED,
                                         timeout_s=timeout_s)
        if told:
            actions.append(f"told {len(told)} application hook(s) 'post-restore'")


def _thaw(runtime: LowerRuntime, root: str | None, cid: str | None, st: ContainerState | None, was_paused: bool,
          actions: list[str]) -> None:
    if st and root and cid and st.status == "paused" and not was_paused:
        runtime.resume(root, cid)
        actions.append(f"thawed container {cid}")


def _rmtree(path: str | None, actions: list[str], what: str) -> None:
    if path and os.path.lexists(path):
        unmount_under(path)  # a killed CRIU's cgroup yard in its work directory: never delete through a mount
        shutil.rmtree(path, ignore_errors=True)
        actions.append(f"removed {what}")


def _listener_inode(port: int) -> str | None:
    """The socket inode listening on port `port` of 127.0.0.1 or of every address (CRIU 4.2's lazy page
    server binds 0.0.0.0 whatever address runc passes), this network namespace, from /proc/net/tcp."""
    want = {f"0100007F:{port:04X}", f"00000000:{port:04X}"}
    try:
        with open("/proc/net/tcp", encoding="ascii") as fh:
            next(fh, None)
            for line in fh:
                f = line.split()
                if len(f) > 9 and f[1] in want and f[3] == "0A":  # 0A: LISTEN
                    return f[9]
    except OSError:
        return None
    return None


def _owns_socket(pids: list[int], inode: str) -> bool:
    target = f"socket:[{inode}]"
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return True
    return False


def _end_lazy_dump(server: list, actions: list[str]):
    """A poke for wait_helpers: the dead migrt's lazy dump (ops/dump.py) waits on its page server for
    ever; end it, but only when the listener is one of the helpers (never someone else's CRIU)."""
    def poke(pids: list[int]) -> None:
        host, port = server[0], int(server[1])
        inode = _listener_inode(port)
        if inode is None or not _owns_socket(pids, inode):
            return
        from migrt.runtime import control  # here: recover is imported on the restore path, which needs no sockets

        try:
            control.end_page_server((host, port), 10)
        except OSError:
            return
        if "ended the interrupted lazy dump" not in actions:
            actions.append("ended the interrupted lazy dump")
    return poke


def _checkpoint(cfg: Config, store: Store, e: journal.Entry, wait_s: float) -> list[str]:
    d = e.data
    actions: list[str] = []
    server = d.get("page_server")
    wait_helpers([d.get("staging"), d.get("work")], wait_s, poke=_end_lazy_dump(server, actions) if server else None)
    runtime = LowerRuntime(cfg.runtime_path())
    cid, root = d.get("container"), d.get("root")
    st = _state(runtime, root, cid)
    gpu_pids = d.get("gpu_pids") or []
    if _committed(store, d.get("name"), e.id):
        if d.get("leave_running"):
            _thaw(runtime, root, cid, st, bool(d.get("was_paused")), actions)
            _resume_gpu(cfg, gpu_pids, actions)
        elif st and root and cid:  # (a state is read only for a root and a container id)
            runtime.stop(root, cid)  # frozen: killed before it is thawed
            actions.append(f"stopped container {cid} (its checkpoint {d.get('name')} is committed)")
        actions.append(f"checkpoint {d.get('name')} is complete")
    elif st:
        _thaw(runtime, root, cid, st, bool(d.get("was_paused")), actions)
        _resume_gpu(cfg, gpu_pids, actions)
        _rmtree(d.get("staging"), actions, "the uncommitted images (the container runs on)")
    else:
        staging = d.get("staging")
        if staging and os.path.isdir(staging) and any(os.scandir(os.path.join(staging, "images"))
                                                      if os.path.isdir(os.path.join(staging, "images")) else []):
            kept = store.keep_incomplete(staging,
                                         reason="checkpoint interrupted before its commit; the container is gone",
                                         container=cid, name=d.get("name"), phase=e.phase, journal=e.id)
            actions.append(f"container {cid} is gone: kept its uncommitted images in {kept}")
        else:
            _rmtree(staging, actions, "an empty staging directory")
    _rmtree(d.get("work"), actions, "the work directory")
    return actions


def _checkpoint_pod(cfg: Config, store: Store, e: journal.Entry, wait_s: float) -> list[str]:
    d = e.data
    actions: list[str] = []
    wait_helpers([d.get("staging")], wait_s)
    runtime = LowerRuntime(cfg.runtime_path())
    finish = _committed(store, d.get("name"), e.id) and not d.get("leave_running")
    for m in d.get("members") or []:
        root, cid = (m.get("root"), m.get("container")) if isinstance(m, dict) else (None, None)
        st = _state(runtime, root, cid)
        if finish and st and root and cid:
            runtime.stop(root, cid)  # frozen: killed before it is thawed
            actions.append(f"stopped container {cid} (its pod checkpoint {d.get('name')} is committed)")
        else:
            _thaw(runtime, root, cid, st, bool(m.get("was_paused")), actions)
    if not finish:  # the GPU containers' processes, locked before the freeze, once thawed
        _resume_gpu(cfg, d.get("gpu_pids") or [], actions)
    if not _committed(store, d.get("name"), e.id):
        _rmtree(d.get("staging"), actions, "the uncommitted parts (the pod's containers run on)")
    return actions


def _restore(cfg: Config, store: Store, e: journal.Entry, wait_s: float) -> list[str]:
    d = e.data
    actions: list[str] = []
    wait_helpers([d.get("view"), d.get("work")], wait_s)
    runtime = LowerRuntime(cfg.runtime_path())
    cid, root = d.get("container"), d.get("root")
    if e.phase in ("restoring", "gpu-restore") and cid and root and os.path.isdir(os.path.join(root, cid)) \
            and not is_restored(root, cid):
        clear_container(runtime.path, root, cid)  # unmounts what a killed runc left before deleting
        actions.append(f"deleted the half-restored container {cid} (checkpoint {d.get('name')} is intact)")
    _rmtree(d.get("view"), actions, "the restore view")
    _rmtree(d.get("work"), actions, "the work directory")
    return actions


def _gpu_checkpoint(cfg: Config, store: Store, e: journal.Entry, wait_s: float) -> list[str]:
    d = e.data
    actions: list[str] = []
    wait_helpers([d.get("image_dir"), d.get("work")], wait_s)
    st = _state(LowerRuntime(cfg.runtime_path()), d.get("root"), d.get("container"))
    if st:
        _resume_gpu(cfg, d.get("gpu_pids") or [], actions)
    return actions


def handle_runc_checkpoint(cfg: Config, e: journal.Entry, actions: list[str]) -> None:
    """Thaw a container that a cancelled or killed pass-through checkpoint left frozen (and that
    nobody else had paused). The images belong to the caller (containerd): left alone."""
    d = e.data
    runtime = LowerRuntime(cfg.runtime_path())
    cid, root = d.get("container"), d.get("root")
    _thaw(runtime, root, cid, _state(runtime, root, cid), bool(d.get("was_paused")), actions)


def _runc_checkpoint(cfg: Config, store: Store, e: journal.Entry, wait_s: float) -> list[str]:
    """migrt-runc's pass-through checkpoint whose watchdog did not finish (see ops/runc_checkpoint.py)."""
    actions: list[str] = []
    wait_helpers([e.data.get("image_dir"), e.data.get("work")], wait_s)
    handle_runc_checkpoint(cfg, e, actions)
    return actions


def _disposable(cfg: Config, store: Store, e: journal.Entry, wait_s: float) -> list[str]:
    actions: list[str] = []
    wait_helpers([e.data.get("staging")], wait_s)
    _rmtree(e.data.get("staging"), actions, "the partial copy (its source still has it)")
    return actions


HANDLERS = {"checkpoint": _checkpoint, "restore": _restore, "gpu-checkpoint": _gpu_checkpoint,
            "runc-checkpoint": _runc_checkpoint, "receive": _disposable, "import": _disposable,
            "checkpoint-pod": _checkpoint_pod}


def recover(cfg: Config, *, wait_s: float = AUTO_WAIT_S) -> list[Outcome]:
    """Recover every stale journal entry of the store; what was done, per entry."""
    store = Store(cfg.store)
    store.check()  # never act on (nor create lock files in) a store another user could change
    if not os.path.isdir(os.path.join(store.root, journal.DIR)):
        return []
    log = log_mod.get()
    out = []
    for e in journal.take_stale(store.root):
        o = Outcome(id=e.id, op=e.op, phase=e.phase, container=e.data.get("container"), status="recovered")
        handler = HANDLERS.get(e.op)
        try:
            if handler is None:
                raise MigrtError(f"unknown operation {e.op!r} (from a newer migrt?); left as it is")
            o.actions = handler(cfg, store, e, wait_s)
        except Pending as exc:
            o.status, o.error = "pending", str(exc)
            e.release()
        except (MigrtError, OSError) as exc:
            o.status, o.error = "failed", str(exc)
            e.release()
        else:
            e.end()
        log.info("recovered", **o.to_dict())
        out.append(o)
    return out


def pending_for(cfg: Config, container_id: str) -> list[dict]:
    """Stale entries still open for a container (recovery could not finish them)."""
    return [d for d in journal.entries(cfg.store) if d.get("stale") and d.get("container") == container_id]


def describe(cfg: Config) -> dict:
    """For `migrt recover --list` and doctor: the journal and what .incomplete/ keeps."""
    store = Store(cfg.store)
    store.check()
    return {"journal": journal.entries(store.root), "incomplete": store.incomplete()}
