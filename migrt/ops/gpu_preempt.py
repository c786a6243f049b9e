"""GPU preemption in place: take a running container's GPU memory away and give it back later, while
its processes stay alive (`migrt gpu suspend|resume|status`, and migrt-runc's `pause`/`resume` of
containers that ask for it).

    suspend: the gate (peer state the driver cannot restore, the application hook's
             pre-checkpoint: gpu/gate.py; a refusal touches nothing) -> record "suspending" -> lock +
             checkpoint every CUDA process (the driver copies its GPU memory into the process's host
             memory and releases the GPU) -> record "suspended"
    resume:  preflight (the GPUs exist, are as many and of the same model, have the free memory)
             -> record "resuming" -> restore (with the UUID remap when other GPUs are named) +
             unlock -> record removed -> "post-restore" (resumed) to the hook's processes

The state itself is the driver's; migrt records what it did in `<runc root>/<id>/migrt-gpu-suspended.json`
(written atomically before every step), so that `resume` works from a new process and after a crash
of migrt in the middle of either step: resume brings every recorded process back from wherever the
driver says it stands. The record lives in runc's state directory, which `runc delete` removes with
the container. A failure never leaves a container half-resumed: a suspend that fails brings every
process back to running; a resume that fails puts every process back to checkpointed (suspended).
Other operations that could not bring a container's GPU processes back after a complete dump
(`migrt checkpoint --leave-running`, migrt-runc's checkpoint of a container that keeps running, a
migration's source) leave the same record (`keep_suspended`), so `migrt gpu resume` retries there too.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass

from migrt import jsonsafe, names
from migrt import log as log_mod
from migrt.errors import Conflict, MigrtError, NotFound, PreconditionFailed
from migrt.gpu import apphooks, gate, inventory, preflight, procs, records, select, thp, visible
from migrt.gpu.backend import CHECKPOINTED, LOCKED, RUNNING, GpuBackend, GpuCannotRestore, GpuError
from migrt.gpu.session import DEFAULT_LOCK_TIMEOUT_MS, suspend_all
from migrt.oci.bundle import Bundle
from migrt.progress import Progress, null_progress
from migrt.runtime import markers
from migrt.runtime.runc import candidate_roots
from migrt.store.fsutil import write_json_atomic
from migrt.text import printable

RECORD = markers.GPU_SUSPENDED_RECORD
RELEASE_MARKER = markers.GPU_RELEASE_MARKER  # in runc's state dir: the shim's pause/resume test
SUSPENDING, SUSPENDED, RESUMING = "suspending", "suspended", "resuming"


def record_path(root: str, cid: str) -> str:
    return os.path.join(root, names.container_id(cid), RECORD)


def read_record(root: str, cid: str) -> dict | None:
    path = record_path(root, cid)
    try:
        with open(path, "rb") as fh:
            data = jsonsafe.load(fh, max_bytes=16 << 20)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise MigrtError(f"container {cid}: GPU suspend record {path} is unreadable: {printable(exc, 200)}") from exc
    if not isinstance(data, dict) or data.get("container_id") != cid or data.get("status") not in (
            SUSPENDING, SUSPENDED, RESUMING) or not isinstance(data.get("section"), dict):
        raise MigrtError(f"container {cid}: GPU suspend record {path} is not one migrt wrote for it (its container "
                         "id, status or GPU section is missing or other); if the container is not GPU-suspended, "
                         "remove the file")
    return data


def _write(rec: dict) -> None:
    write_json_atomic(record_path(rec["root"], rec["container_id"]), rec)


def _remove(rec: dict) -> None:
    try:
        os.unlink(record_path(rec["root"], rec["container_id"]))
    except FileNotFoundError:
        pass


def _rss(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def _backend(cfg, what: str) -> GpuBackend:
    backend = select.get_backend(getattr(cfg, "gpu_backend", "auto") or "auto")
    if not backend.available():
        raise PreconditionFailed(f"{what}, but the CUDA checkpoint API is not usable here: "
                                 f"{select.unavailable_reason(backend)}")
    return backend


def _hook_timeout(cfg) -> float:
    return float(getattr(cfg, "gpu_hook_timeout_s", apphooks.DEFAULT_TIMEOUT_S))


def _container(root: str, cid: str) -> tuple[dict, int]:
    state = procs.runc_state(root, cid)
    pid = (state or {}).get("init_process_pid")
    if not state or not isinstance(pid, int) or pid <= 0 or not procs.alive(pid):
        raise NotFound(f"container {cid} is not running under {root}")
    return state, pid


def find_root(cid: str, extra: list[str] | None = None) -> str:
    names.container_id(cid)  # before it becomes a path
    for root in candidate_roots(extra):
        if os.path.isfile(os.path.join(root, cid, "state.json")):
            return root
    raise NotFound(f"container {cid} not found under {', '.join(candidate_roots(extra))}; give --root")


# -- suspend -----------------------------------------------------------------------------------------
def suspend(cfg, cid: str, root: str, *, by: str = "migrt gpu suspend", progress: Progress = null_progress) -> dict:
    """Lock and checkpoint every CUDA process of a running container; the record says what was done."""
    old = read_record(root, cid)
    if old is not None:
        if old.get("status") == SUSPENDED:
            raise Conflict(f"container {cid} is already GPU-suspended (since {old.get('suspended_at')}); "
                           f"'migrt gpu resume {cid}' brings it back")
        raise Conflict(f"container {cid}: a GPU {old.get('status', '?')[:-3]} was interrupted; run "
                       f"'migrt gpu resume {cid}' to bring its processes back first")
    state, init = _container(root, cid)
    if state.get("status") == "paused" or _frozen(state):
        raise Conflict(f"container {cid} is paused; a frozen process cannot be locked: resume it first")
    pids = procs.cuda_pids(procs.container_pids(init))
    if not pids:
        raise PreconditionFailed(f"container {cid} has no CUDA process holding a GPU: nothing to suspend "
                                 "(it keeps running)")
    what = f"container {cid} has {len(pids)} CUDA process(es) (pids {', '.join(map(str, pids))})"
    backend = _backend(cfg, what)
    inv = inventory.take()
    bundle = Bundle.of_state(state)
    config = bundle.config if bundle else None
    try:
        config_gpus = visible.from_config(config, inv) if config else None
    except visible.VisibleError:
        config_gpus = None
    section = records.describe(pids, inv, records.visible_at_checkpoint(
        config_gpus, visible.from_devnodes(init, inv), pids, inv))
    rss_before = sum(_rss(p) or 0 for p in pids)
    rec: dict = {"schema": 1, "container_id": cid, "root": root, "status": SUSPENDING, "by": by,
           "processes": [{"pid": p, "start": procs.start_time(p), "comm": procs.comm(p)} for p in pids],
           "gpus": [g["uuid"] for g in section["gpus"]], "section": section,
           "gpu_memory_bytes": sum(preflight.memory_per_gpu(section).values()) or None,
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "timings": {}}
    _write(rec)  # before the hook is asked: a migrt killed from here on leaves what `resume` finishes
    try:
        opened = gate.before_lock(pids, what=f"container {cid}", driver_version=inv.driver_version, config=config,
                                  peer_check=getattr(cfg, "gpu_peer_check", "refuse"), timeout_s=_hook_timeout(cfg),
                                  contexts=inv.contexts())
    except BaseException:
        _remove(rec)
        raise
    section.update(opened.record())
    progress("phase", name="gpu-suspend", processes=len(pids))
    window = thp.window(cfg)  # huge pages while the driver writes its host copy
    t0 = time.monotonic()
    try:
        suspend_all(pids, backend, int(getattr(cfg, "gpu_lock_timeout_ms", DEFAULT_LOCK_TIMEOUT_MS)),
                    checkpoint_window=window)
    except GpuError as exc:
        pending = list(getattr(exc, "pending", None) or [])  # a lock call still in the driver: ask it nothing
        stuck = pending or [p for p in pids if _state_or_none(backend, p) not in (RUNNING, None)]
        if stuck:  # the undo left some suspended: keep the record, so that resume can finish it
            rec["status"] = SUSPENDING
            _write(rec)
            hint = f"; 'migrt gpu resume {cid}' retries bringing pids {', '.join(map(str, stuck))} back"
        else:
            _remove(rec)
            hint = ""
        opened.after(apphooks.ABORTED, f"container {cid}")
        raise GpuError(f"GPU suspend of container {cid} failed: {exc}{hint}", call=exc.call, pid=exc.pid,
                       code=exc.code) from exc
    seconds = round(time.monotonic() - t0, 3)
    rec.update(status=SUSPENDED, suspended_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               host_rss_bytes={"before": rss_before, "after": sum(_rss(p) or 0 for p in pids)})
    rec["timings"]["suspend_s"] = seconds
    rec["thp"] = window.applied
    _write(rec)
    progress("done", name="gpu-suspend", seconds=seconds)
    log_mod.get().info("gpu_suspended_in_place", container=cid, pids=pids, seconds=seconds, by=by, thp=window.applied)
    return rec


def _state_or_none(backend: GpuBackend, pid: int) -> str | None:
    try:
        return backend.state(pid)
    except GpuError:
        return None


def _frozen(state: dict) -> bool:
    """runc keeps no 'paused' in its state file: ask the freezer (v1 'freezer' or v2 unified, whichever
    the container has; on a hybrid host runc freezes through v1)."""
    given = state.get("cgroup_paths")
    paths = given if isinstance(given, dict) else {}
    for d, name in ((paths.get("freezer"), "freezer.state"), (paths.get(""), "cgroup.freeze")):
        if not d:
            continue
        try:
            with open(os.path.join(d, name), encoding="utf-8") as fh:
                if fh.read().strip() in ("1", "FROZEN", "FREEZING"):
                    return True
        except OSError:
            continue
    return False


# -- resume ------------------------------------------------------------------------------------------
@dataclass
class _Proc:
    pid: int
    state: str


def _live_pids(rec: dict) -> tuple[list[int], list[int]]:
    """(the recorded processes still alive as the same process (pid and start time), those gone).
    A process that exited while suspended took its GPU state with it; none left is an error."""
    live: list[int] = []
    gone: list[int] = []
    for p in rec.get("processes") or []:
        pid = int(p["pid"])
        same = procs.alive(pid) and (p.get("start") is None or procs.start_time(pid) == p["start"])
        (live if same else gone).append(pid)
    if not live:
        raise NotFound(f"container {rec['container_id']}: every suspended process ({', '.join(map(str, gone))}) is "
                       f"gone; nothing to resume (remove {record_path(rec['root'], rec['container_id'])})")
    return live, gone


def _resuspend(backend: GpuBackend, pids: list[int]) -> list[str]:
    """Undo of a failed resume: every process back to checkpointed. Returns what could not be."""
    left = []
    for pid in pids:
        try:
            state = backend.state(pid)
            if state == RUNNING:
                backend.lock(pid, DEFAULT_LOCK_TIMEOUT_MS)
                state = LOCKED
            if state == LOCKED:
                backend.checkpoint(pid)
        except GpuError as exc:
            left.append(f"pid {pid}: {exc}")
    return left


def plan(cfg, rec: dict, gpus: list[str] | None) -> preflight.Placement:
    """The preflight of a resume: nothing touched when it raises."""
    inv = inventory.take()
    targets = gpus if gpus else (rec.get("gpus") or None)
    return preflight.check(rec["section"], inv, targets, what=f"GPU-suspended container {rec['container_id']}",
                           keep_order=bool(gpus))


def resume(cfg, cid: str, root: str, *, gpus: list[str] | None = None, progress: Progress = null_progress) -> dict:
    rec = read_record(root, cid)
    if rec is None:
        raise NotFound(f"container {cid} is not GPU-suspended by migrt (no {record_path(root, cid)})")
    pids, gone = _live_pids(rec)
    if gone:
        log_mod.get().warning("gpu_suspended_process_gone", container=cid, pids=gone)
        rec["section"]["processes"] = [p for p in rec["section"].get("processes") or [] if p.get("pid") not in gone]
    backend = _backend(cfg, f"container {cid} is GPU-suspended")
    states = {pid: _state_or_none(backend, pid) for pid in pids}
    if CHECKPOINTED in states.values():
        placement = plan(cfg, rec, gpus)
    else:  # an interrupted suspend: nothing left the GPU, nothing to place
        placement = preflight.Placement(pairs=[(u, u) for u in rec.get("gpus") or []])
    prior = rec["status"]
    rec["status"] = RESUMING
    _write(rec)
    progress("phase", name="gpu-resume", processes=len(pids))
    t0 = time.monotonic()
    remap = placement.remap()
    errors: dict[int, GpuError] = {}
    for pid in pids:  # restore all, then unlock all (as resume_all), from wherever each stands
        try:
            if backend.state(pid) == CHECKPOINTED:
                backend.restore(pid, remap)
        except GpuError as exc:
            errors[pid] = exc
    if not errors:
        for pid in pids:
            try:
                if backend.state(pid) == LOCKED:
                    backend.unlock(pid)
            except GpuError as exc:
                errors[pid] = exc
    if errors:
        cause = next(iter(errors.values()))
        left = _resuspend(backend, pids)
        rec["status"] = SUSPENDED if not left else prior
        _write(rec)
        if isinstance(cause, GpuCannotRestore):
            again = ("; every process stays suspended with its GPU state in host memory, but this driver will not "
                     "restore it: 'migrt gpu resume' cannot succeed here (see docs/gpu.md, Multi-GPU jobs)")
        else:
            again = "; every process stays suspended (run 'migrt gpu resume' again once the cause is fixed)"
        tail = again if not left else f"; and {len(left)} process(es) could not be put back: {'; '.join(left)}"
        raise GpuError(f"GPU resume of container {cid} failed: {cause}{tail}", call=cause.call, pid=cause.pid,
                       code=cause.code, details=[f"pid {p}: {e}" for p, e in errors.items() if e is not cause])
    seconds = round(time.monotonic() - t0, 3)
    _remove(rec)
    progress("done", name="gpu-resume", seconds=seconds)
    told, problems = apphooks.after_restore(pids, what=f"container {cid}", reason=apphooks.RESUMED,
                                            timeout_s=_hook_timeout(cfg))
    if problems:
        log_mod.get().warning("app_hook_unanswered", container=cid, hook_event=apphooks.POST, problems=problems)
    log_mod.get().info("gpu_resumed_in_place", container=cid, pids=pids, pairs=placement.to_dict(), seconds=seconds)
    return {"container_id": cid, "root": root, "processes": pids, "exited": gone,
            "gpus": [n for _, n in placement.pairs],
            "pairs": placement.to_dict(), "moved": placement.moved,
            "timings": {**rec.get("timings", {}), "resume_s": seconds},
            **({"app_hook": {"processes": sorted({p for ep in told for p in ep.holders}), "unanswered": problems}}
               if told else {})}


def keep_suspended(cid: str, root: str, pids: list[int], section: dict, *, by: str, error: str) -> str:
    """After a complete dump whose container keeps running, its GPU processes could not be brought
    back (the restore failed): record them as suspended, as `migrt gpu suspend` would, so that
    `migrt gpu resume` retries from wherever each stands and `migrt gpu status` shows them. Returns
    the sentence for the caller's error."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rec = {"schema": 1, "container_id": cid, "root": root, "status": SUSPENDED, "by": by,
           "processes": [{"pid": p, "start": procs.start_time(p), "comm": procs.comm(p)} for p in pids],
           "gpus": [g["uuid"] for g in section.get("gpus") or []], "section": section,
           "gpu_memory_bytes": sum(preflight.memory_per_gpu(section).values()) or None,
           "started_at": now, "suspended_at": now, "timings": {}, "error": error}
    try:
        _write(rec)
    except OSError as exc:
        return f"; its GPU processes stay suspended, and the record for 'migrt gpu resume' could not be written ({exc})"
    return (f"; its {len(pids)} CUDA process(es) stay suspended with their GPU state in host memory: "
            f"'migrt gpu resume {cid}' retries, 'migrt gpu status {cid}' shows them")


# -- status ------------------------------------------------------------------------------------------
def status(cfg, cid: str | None = None, root: str | None = None) -> list[dict]:
    """The containers of this node with a GPU suspend record, with the driver's view of each process."""
    if cid is not None:
        names.container_id(cid)
    roots = [root] if root else candidate_roots(getattr(cfg, "runtime_roots", None))
    found = []
    for r in roots:
        pattern = os.path.join(r, glob.escape(cid) if cid else "*", RECORD)
        for path in sorted(glob.glob(pattern)):
            rec = read_record(r, os.path.basename(os.path.dirname(path)))
            if rec:
                found.append(rec)
    if cid and not found:
        raise NotFound(f"container {cid} is not GPU-suspended by migrt")
    backend = None
    for rec in found:
        rec.pop("section", None)
        for p in rec.get("processes") or []:
            p["alive"] = procs.alive(int(p["pid"])) and procs.start_time(int(p["pid"])) == p.get("start")
            p["rss_bytes"] = _rss(int(p["pid"])) if p["alive"] else None
            if p["alive"]:
                try:
                    backend = backend or select.get_backend(getattr(cfg, "gpu_backend", "auto") or "auto")
                    p["driver_state"] = backend.state(int(p["pid"]))
                except GpuError as exc:
                    p["driver_state"] = f"unknown ({exc})"
        rec["host_memory_bytes"] = sum(p.get("rss_bytes") or 0 for p in rec.get("processes") or [])
    return found
