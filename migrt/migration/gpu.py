"""The GPU side of a migration (stop-and-copy), kept apart from the wire and the freeze logic.

Source, before anything is touched: `GpuSource.probe` finds the container's CUDA processes and
describes them (GPU models, memory per process, driver) for the offer; the receiver answers with
its preflight (`target_preflight`: the GPUs the target container will get, their free memory, the
pairing, the driver) or refuses, and nothing has been frozen yet. Then, with the source's tasks
still running, `suspend` locks and checkpoints them (the driver needs running tasks), the freeze
and the dump follow (MIGRT_GPU_HANDLED=1 keeps a CRIU action script out of it), and the section goes
into the images (migrt-gpu.json) and the manifest, so that the receiver's ordinary restore path
(ops/restore.py) does the GPU restore with the UUID remap onto the target's GPUs and the unlock.
On a failure before the target runs, the source is thawed first and `resume` then restores and
unlocks the processes on their own GPU; once the target runs, the source is destroyed, which frees
its GPU.

Lazy mode takes the same GPU steps: the GPU checkpoint before the freeze, the GPU restore on the
target once `runc restore --lazy-pages` has returned. The driver's restore reads each process's GPU
memory from the host copy its checkpoint made in the process (still on the source, frozen): the GPU
record says where (`gpu_backing`, gpu/backing.py), the target's page filler fetches those ranges
before any other memory over every stream, and each process's GPU restore starts as soon as its own
are in (ops/pages.py MemoryReady); the rest of the memory follows, faults first.
"""

from __future__ import annotations

import time

from migrt.errors import Conflict, MigrtError, PreconditionFailed
from migrt.gpu import gate, inventory, procs, records, visible
from migrt.ops import gpu_steps
from migrt.progress import Progress, null_progress


class GpuSource:
    """The CUDA processes of the container being migrated, and what was done to them."""

    def __init__(self, cfg, cid: str, init_pid: int | None, config: dict | None) -> None:
        self.cfg, self.cid, self.init_pid, self.config = cfg, cid, init_pid, config
        self.pids: list[int] = []
        self.section: dict | None = None
        self.suspension: gpu_steps.GpuSuspension | None = None

    def probe(self, *, paused: bool) -> dict | None:
        """The offer's GPU section (None: no CUDA process, nothing GPU-related happens)."""
        self.pids = procs.cuda_pids(procs.container_pids(self.init_pid)) if self.init_pid else []
        if not self.pids:
            return None
        if paused:
            raise Conflict(f"container {self.cid} is paused and has CUDA processes: the GPU checkpoint needs "
                           "running tasks; resume it first")
        gpu_steps.usable_backend(self.cfg, f"container {self.cid} has {len(self.pids)} CUDA process(es)")
        inv = inventory.take()
        try:
            config_gpus = visible.from_config(self.config, inv) if self.config else None
        except visible.VisibleError:
            config_gpus = None
        on_nodes = visible.from_devnodes(self.init_pid, inv) if self.init_pid else None
        vis = records.visible_at_checkpoint(config_gpus, on_nodes, self.pids, inv)
        # peer state the driver cannot restore is refused before the offer (the application hook is
        # asked later, in suspend(), right before the lock)
        gate.check_peers(self.pids, what=f"container {self.cid}", driver_version=inv.driver_version,
                         config=self.config, peer_check=getattr(self.cfg, "gpu_peer_check", "refuse"),
                         contexts=inv.contexts())
        self.section = records.describe(self.pids, inv, vis)
        return self.section

    def check_answer(self, ready: dict, to: str) -> dict | None:
        if self.section is None:
            return None
        answer = ready.get("gpu")
        if not isinstance(answer, dict):
            raise PreconditionFailed(f"the receiver at {to} did not check the container's GPU state (an older "
                                     "migrt, or started without GPU support); nothing was frozen")
        return answer

    def suspend(self, progress: Progress = null_progress) -> None:
        if self.section is None or self.suspension is not None:  # a pod's cut suspended it already
            return
        self.suspension = gpu_steps.suspend(self.cfg, self.cid, self.init_pid, self.config, progress, pids=self.pids)

    def write(self, image_dir: str, fields: dict, phases: dict) -> None:
        if self.suspension is None:
            return
        records.write_image_file(image_dir, self.suspension.section)
        fields["gpu"] = self.suspension.section
        phases.update(self.suspension.timings)

    def env(self):
        return gpu_steps.runtime_env(self.suspension)

    def resume(self) -> str:
        """After the source was thawed (or never frozen): back onto its own GPU. A sentence for errors."""
        if self.suspension is None:
            return ""
        try:
            self.suspension.resume()
        except MigrtError as exc:
            from migrt.ops import gpu_preempt

            try:
                root = gpu_preempt.find_root(self.cid, getattr(self.cfg, "runtime_roots", None))
            except MigrtError:
                return (f"; its {len(self.pids)} CUDA process(es) could NOT be resumed on the GPU ({exc}): they "
                        "stay suspended, and its runc state was not found to record them for 'migrt gpu resume'")
            kept = gpu_preempt.keep_suspended(self.cid, root, self.pids, self.suspension.section,
                                              by="migrt migrate", error=str(exc))
            return f"; its {len(self.pids)} CUDA process(es) could NOT be resumed on the GPU ({exc}){kept}"
        self.suspension = None
        return f"; its {len(self.pids)} CUDA process(es) were resumed on their GPU"


def suspend_together(sources: list[GpuSource], progress: Progress = null_progress) -> None:
    """A pod's cut (podpull.py): each GPU container's CUDA processes locked and checkpointed, one
    container after the other, before the pod is frozen (the driver works through a thread of each
    process). On a failure those already suspended are resumed on their GPU, and the error says so."""
    done: list[GpuSource] = []
    try:
        for source in sources:
            source.suspend(progress)
            done.append(source)
    except BaseException as exc:
        said = "".join(source.resume() for source in done)
        if said and isinstance(exc, MigrtError):
            exc.details.append(f"the pod's other GPU containers:{said[1:]}")
        raise


def target_preflight(cfg, section: dict | None, bundle_config: dict | None, what: str) -> dict | None:
    """The receiver's answer to a GPU offer, or PreconditionFailed (before the source freezes)."""
    if not section or not section.get("processes"):
        return None
    t0 = time.monotonic()
    if bundle_config is None:  # stored only: restorable later on a GPU node; say what this node has
        inv = inventory.take()
        return {"restore_here": False, "driver": inv.driver_version, "gpus": [],
                "node_gpus": [{"uuid": g.uuid, "name": g.name, "memory_free": g.memory_free} for g in inv.gpus],
                "preflight_s": round(time.monotonic() - t0, 3)}
    plan = gpu_steps.plan_restore(cfg, section, bundle_config, what)
    if plan is None:  # no GPU state (checked above)
        return None
    gpus = [plan.inv.by_uuid(n) for _, n in plan.placement.pairs]
    return {"restore_here": True, "driver": plan.inv.driver_version, "pairs": plan.placement.to_dict(),
            "gpus": [{"uuid": g.uuid, "name": g.name, "memory_free": g.memory_free, "memory_total": g.memory_total}
                     for g in gpus if g is not None],
            "preflight_s": round(time.monotonic() - t0, 3)}


def resume_pids(pids: list[int]) -> str:
    """The guard's GPU step (migrate was killed): every process back to running from wherever it
    stands, once the container is thawed. A sentence for its log."""
    from migrt import config as config_mod
    from migrt.gpu import select, session

    live = [p for p in pids if procs.alive(p)]
    if not live:
        return ""
    try:
        backend = select.get_backend(getattr(config_mod.load(), "gpu_backend", "auto") or "auto")
        session.resume_if_needed(live, backend)
    except MigrtError as exc:
        return f"; its CUDA processes could NOT be resumed on the GPU: {exc}"
    from migrt.gpu import apphooks

    apphooks.after_restore(live, what="migrated container (recovered)", reason=apphooks.RESUMED)
    return f"; its {len(live)} CUDA process(es) were resumed on their GPU"
