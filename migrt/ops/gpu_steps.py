"""The GPU steps of checkpoint and restore, called from a few lines of ops/checkpoint.py,
ops/restore.py and ops/gpu_runc.py (migrt-runc's own checkpoint/restore).

Checkpoint:  suspend(...) finds the container's live CUDA processes; if any, asks the gate (peer
             state the driver cannot restore, the application hook's pre-checkpoint: gpu/gate.py;
             a refusal touches nothing), then locks and checkpoints them all (undoing on failure;
             the checkpoint calls inside gpu/thp.py's window: config gpu_checkpoint_thp).
             The returned GpuSuspension resumes them (and tells the hook "post-restore") when the
             container must keep running (--leave-running) or the dump failed.
Restore:     plan_restore(...) is the preflight (before anything is touched); GpuRestore.resume(pid)
             after the lower runtime's restore: finds the restored CUDA processes, fixes the
             container's /dev/nvidia* nodes, restores (with the UUID remap) and unlocks them. After a
             lazy restore each process's GPU restore starts as soon as its own memory is in; then
             the restored processes that registered the application hook are told "post-restore".
Whenever migrt drives the GPU it sets MIGRT_GPU_HANDLED=1 in the lower runtime's environment, which
CRIU passes on to action scripts: the hooks/cuda-criu-action then stands aside.
A container without CUDA processes, or a checkpoint without GPU state, needs neither libcuda nor NVML.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeGuard

from migrt import log as log_mod
from migrt.errors import MigrtError, PreconditionFailed
from migrt.gpu import (
    apphooks,
    backing,
    devnodes,
    gate,
    inventory,
    preflight,
    procs,
    records,
    select,
    session,
    thp,
    visible,
)
from migrt.gpu.backend import CHECKPOINTED, GpuBackend, GpuError
from migrt.progress import Progress, null_progress

HANDLED_ENV = records.HANDLED_ENV


def backend_choice(cfg) -> str:
    return getattr(cfg, "gpu_backend", "auto") or "auto"


def lock_timeout_ms(cfg) -> int:
    return int(getattr(cfg, "gpu_lock_timeout_ms", session.DEFAULT_LOCK_TIMEOUT_MS))


def hook_timeout_s(cfg) -> float:
    return float(getattr(cfg, "gpu_hook_timeout_s", apphooks.DEFAULT_TIMEOUT_S))


def open_gate(cfg, what: str, pids: list[int], inv: inventory.Inventory, config: dict | None) -> gate.Gate:
    """Peer state and the application hook, before any lock (gpu/gate.py); PreconditionFailed refuses."""
    return gate.before_lock(pids, what=what, driver_version=inv.driver_version, config=config,
                            peer_check=getattr(cfg, "gpu_peer_check", "refuse"), timeout_s=hook_timeout_s(cfg),
                            contexts=inv.contexts())


def usable_backend(cfg, what: str) -> GpuBackend:
    """The configured GPU backend; PreconditionFailed naming `what` needs it when the CUDA checkpoint
    API is not usable on this node."""
    backend = select.get_backend(backend_choice(cfg))
    if not backend.available():
        raise PreconditionFailed(f"{what}, but the CUDA checkpoint API is not usable here: "
                                 f"{select.unavailable_reason(backend)}")
    return backend


def has_gpu_state(section: dict | None) -> TypeGuard[dict]:
    """Whether a checkpoint's GPU record holds CUDA processes (known before any preflight)."""
    return bool(section and section.get("processes"))


def runtime_env(active) -> dict[str, str] | None:
    """The lower runtime's environment: ours plus MIGRT_GPU_HANDLED=1 when migrt drives the GPU."""
    if not active:
        return None
    return {**os.environ, HANDLED_ENV: "1"}


# -- checkpoint --------------------------------------------------------------------------------------
@dataclass
class GpuSuspension:
    pids: list[int]
    backend: GpuBackend
    section: dict
    timings: dict[str, float] = field(default_factory=dict)
    gate: gate.Gate | None = None
    what: str = ""

    def resume(self) -> None:
        """Back to running from wherever each process stands (a dump that failed, --leave-running),
        then "post-restore" (resumed) to the processes told "pre-checkpoint" (a missing answer is logged)."""
        t0 = time.monotonic()
        session.resume_if_needed(self.pids, self.backend)
        self.timings["gpu_resume_s"] = round(time.monotonic() - t0, 3)
        if self.gate:
            problems = self.gate.after(apphooks.RESUMED, self.what)
            if problems:
                log_mod.get().warning("app_hook_unanswered", container=self.what, hook_event=apphooks.POST,
                                      problems=problems)
            self.gate = None


def _config_gpus(config: dict | None, inv, what: str) -> list[str] | None:
    if not config:
        return None
    try:
        return visible.from_config(config, inv)
    except visible.VisibleError as exc:
        log_mod.get().warning("gpu_visible_unclear", container=what, error=str(exc))
        return None


def suspend(cfg, container_id: str, init_pid: int | None, config: dict | None,
            progress: Progress = null_progress, *, pids: list[int] | None = None,
            before_lock: Callable[[list[int]], None] | None = None) -> GpuSuspension | None:
    """Suspend the container's CUDA processes; None when it has none (nothing GPU-related happens).
    before_lock(pids) runs before the gate and the first driver call (the journal records them there)."""
    if pids is None:
        pids = procs.cuda_pids(procs.container_pids(init_pid)) if init_pid else []
    if not pids:
        return None
    what = f"container {container_id} has {len(pids)} CUDA process(es) (pids {', '.join(map(str, pids))})"
    backend = usable_backend(cfg, what)
    inv = inventory.take()
    vis = records.visible_at_checkpoint(_config_gpus(config, inv, container_id),
                                        visible.from_devnodes(init_pid, inv) if init_pid else None, pids, inv)
    section = records.describe(pids, inv, vis)
    if before_lock:  # journaled before the hook is asked: a migrt killed from here on is recovered, and
        before_lock(pids)  # the recovery tells the hook's processes "post-restore" (ops/recover.py)
    opened = open_gate(cfg, f"container {container_id}", pids, inv, config)
    section.update(opened.record())
    progress("phase", name="gpu-checkpoint", processes=len(pids))
    before = backing.snapshot(pids)  # the driver's host copy of the GPU memory is what appears (gpu/backing.py)
    window = thp.window(cfg)  # huge pages while the driver writes its host copy
    try:
        t0 = time.monotonic()
        session.suspend_all(pids, backend, lock_timeout_ms(cfg), checkpoint_window=window)
    except BaseException:  # every process was brought back by suspend_all: the hook's processes may rebuild
        opened.after(apphooks.ABORTED, f"container {container_id}")
        raise
    seconds = round(time.monotonic() - t0, 3)
    copies = backing.found(before)
    for proc in section.get("processes") or []:
        if copies.get(proc.get("pid")):
            proc["gpu_backing"] = copies[proc["pid"]]  # a lazy restore fills these first (pagefill/images.py)
    section["timings"]["gpu_checkpoint_s"] = seconds
    section["thp"] = window.applied  # always | kept | failed: benchmarks tell the runs apart by it
    progress("done", name="gpu-checkpoint", seconds=seconds)
    log_mod.get().info("gpu_suspended", container=container_id, pids=pids, seconds=seconds, thp=window.applied,
                       **opened.record())
    return GpuSuspension(pids=pids, backend=backend, section=section, timings={"gpu_checkpoint_s": seconds},
                         gate=opened, what=f"container {container_id}")


@contextlib.contextmanager
def suspended(cfg, container_id: str, init_pid: int | None, config: dict | None, *, leave_running: bool,
              image_dir: str | None = None, progress: Progress = null_progress) -> Iterator[GpuSuspension | None]:
    """Around the lower runtime's dump: suspend before, resume after when the container keeps
    running, and on any failure inside (the failure is re-raised, with a failed resume noted)."""
    gpu = suspend(cfg, container_id, init_pid, config, progress)
    try:
        if gpu and image_dir:
            try:
                records.write_image_file(image_dir, gpu.section)
            except OSError as exc:
                raise MigrtError(f"cannot write the GPU record into {image_dir}: {exc}") from exc
        yield gpu
    except BaseException as exc:
        if gpu:
            try:
                gpu.resume()
            except GpuError as undo:
                log_mod.get().error("gpu_resume_failed", container=container_id, error=str(undo))
                if isinstance(exc, MigrtError):
                    exc.details.append(f"the GPU processes could not be resumed: {undo}")
        raise
    if gpu and leave_running:
        gpu.resume()


# -- restore -----------------------------------------------------------------------------------------
@dataclass
class GpuRestore:
    section: dict
    backend: GpuBackend | None  # None until restore_driver() gave one (see plan_restore)
    placement: preflight.Placement
    inv: inventory.Inventory
    what: str
    hook_timeout_s: float = apphooks.DEFAULT_TIMEOUT_S

    def _driver(self) -> GpuBackend:
        if self.backend is None:  # plan_restore(load_driver=False) leaves it to restore_driver()
            raise GpuError(f"{self.what}: GPU restore before the GPU driver was loaded (restore_driver)")
        return self.backend

    def resume(self, init_pid: int, progress: Progress = null_progress, memory=None) -> dict:
        """After the lower runtime restored the container (init_pid): GPU restore + unlock.
        memory: a lazy restore's fill as the GPU restore sees it (ops/pages.MemoryReady: `ready(pids)`,
        `t0`, `about(pid)`); each process's GPU restore then starts once its own memory is in."""
        want = len(self.section.get("processes") or [])
        t0 = time.monotonic()
        backend = self._driver()
        pids = []
        for pid in procs.cuda_pids(procs.container_pids(init_pid), live=False):
            try:
                if backend.state(pid) == CHECKPOINTED:
                    pids.append(pid)
            except GpuError:
                continue  # maps libcuda but never used it: not the driver's business
        if len(pids) != want:
            raise GpuError(f"{self.what}: found {len(pids)} checkpointed CUDA process(es) in the restored container "
                           f"(init pid {init_pid}), the checkpoint has {want}")
        minors = [g.minor for g in (self.inv.by_uuid(n) for _, n in self.placement.pairs) if g and g.minor is not None]
        try:
            changes = devnodes.sync(init_pid, minors)
        except OSError as exc:
            raise GpuError(f"{self.what}: cannot set up /dev/nvidia* in the restored container: {exc}") from exc
        progress("phase", name="gpu-restore", processes=len(pids))
        timings: dict = {}
        if memory is None:
            session.resume_all(pids, backend, self.placement.remap())
        else:
            spans = session.resume_as_ready(pids, backend, self.placement.remap(), memory.ready)
            first = min(start for start, _ in spans.values())
            timings["gpu_memory_wait_s"] = round(first - t0, 3)  # the first GPU restore waited for its memory
            timings["gpu_restores"] = [
                {"pid": p, **memory.about(p), "gpu_restore_start_s": round(spans[p][0] - memory.t0, 3),
                 "gpu_restore_s": round(spans[p][1], 3)} for p in pids]
            t0 = first
        seconds = round(time.monotonic() - t0, 3)
        progress("done", name="gpu-restore", seconds=seconds)
        log_mod.get().info("gpu_restored", pids=pids, pairs=self.placement.to_dict(), devnodes=changes, seconds=seconds)
        timings.update(self.tell_restored(procs.container_pids(init_pid)))
        return {"gpu_restore_s": seconds, **timings}

    def tell_restored(self, pids: list[int]) -> dict:
        """post-restore (restored) to the restored processes that registered the application hook."""
        t0 = time.monotonic()
        endpoints, problems = apphooks.after_restore(pids, what=self.what, reason=apphooks.RESTORED,
                                                     timeout_s=self.hook_timeout_s)
        if not endpoints:
            return {}
        if problems:
            log_mod.get().warning("app_hook_unanswered", container=self.what, hook_event=apphooks.POST,
                                  problems=problems)
        return {"app_hook_s": round(time.monotonic() - t0, 3), "app_hook_processes": len(endpoints)}


def plan_restore(cfg, section: dict | None, config: dict, what: str, *,
                 load_driver: bool = True) -> GpuRestore | None:
    """Preflight: None for a checkpoint without GPU state; PreconditionFailed on any mismatch.
    load_driver=False leaves loading libcuda (cuInit, the slow part) to restore_driver(); the
    restore runs both while CRIU restores (ops/restore.py)."""
    if not has_gpu_state(section):
        return None
    gpu = restore_preflight(section, config, what)
    gpu.backend = restore_driver(cfg, what) if load_driver else _restore_backend(cfg)
    gpu.hook_timeout_s = hook_timeout_s(cfg)
    return gpu


def restore_preflight(section: dict, config: dict, what: str) -> GpuRestore:
    """The NVML part of the preflight: the new container's GPUs, their models and free memory, and
    how the checkpoint's GPUs map onto them. The backend is left to restore_driver()."""
    inv = inventory.take(with_processes=False)
    try:
        targets = visible.from_config(config, inv) if inv.available else None
    except visible.VisibleError as exc:
        raise PreconditionFailed(f"{what}: {exc}") from exc
    chosen = restore_gpus(config, targets, what)
    if chosen:  # the person chose the pairing (e.g. two GPUs swapped): keep their order
        placement = preflight.check(section, inv, chosen, what=what, keep_order=True)
    else:
        placement = preflight.check(section, inv, targets, what=what)
    return GpuRestore(section=section, backend=None, placement=placement, inv=inv, what=what)


RESTORE_GPUS_ANNOTATION = "migrt.io/restore-gpus"


def restore_gpus(config: dict | None, given: list[str] | None, what: str) -> list[str] | None:
    """The annotation migrt.io/restore-gpus="GPU-a,GPU-b" of the new container: its GPUs, paired in
    this order with the checkpoint's GPUs in their recorded order ('migrt inspect'), as `migrt gpu
    resume --gpus` pairs them; None without it. They must be the GPUs the container is given."""
    raw = ((config or {}).get("annotations") or {}).get(RESTORE_GPUS_ANNOTATION)
    if not raw:
        return None
    chosen = [t.strip() for t in str(raw).split(",") if t.strip()]
    if len({c.lower() for c in chosen}) != len(chosen):
        raise PreconditionFailed(f"{what}: {RESTORE_GPUS_ANNOTATION} names a GPU twice: {raw}")
    if given is not None and sorted(c.lower() for c in chosen) != sorted(g.lower() for g in given):
        raise PreconditionFailed(f"{what}: {RESTORE_GPUS_ANNOTATION} names {', '.join(chosen)}, but the new "
                                 f"container is given {', '.join(given) or 'no GPU'}; name exactly its GPUs")
    return chosen


def _restore_backend(cfg) -> GpuBackend:
    if select.override is not None or backend_choice(cfg) == "none":
        return select.get_backend(backend_choice(cfg))
    return select.get_backend("cuda")  # "cuda" does not load the library yet; "auto" would


def restore_driver(cfg, what: str) -> GpuBackend:
    """The driver part of the preflight: libcuda loads (cuInit) with the checkpoint API."""
    backend = _restore_backend(cfg)
    if not backend.available():
        raise PreconditionFailed(f"{what} holds GPU state, but the CUDA checkpoint API is not usable here: "
                                 f"{select.unavailable_reason(backend)}")
    return backend


def resume_restored(gpu: GpuRestore | None, init_pid: int, timings: dict, progress: Progress = null_progress,
                    memory=None) -> None:
    """The restore paths' one line: nothing without GPU state."""
    if gpu is not None:
        timings.update(gpu.resume(init_pid, progress, memory))
