"""Checkpoint a running container into the store: journal, GPU suspend, freeze, dump (runc checkpoint
--leave-running, or migrt's parallel dump: ops/dump.py), atomic commit, then stop (docs/store.md
"Crash safety")."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from migrt import log as log_mod
from migrt import names
from migrt.config import Config
from migrt.criu.options import CriuOptions
from migrt.criu.version import versions
from migrt.errors import Conflict, MigrtError, RuntimeFailed
from migrt.gpu import procs, records
from migrt.gpu.backend import GpuError
from migrt.oci.bundle import Bundle
from migrt.ops import dump, gpu_steps, recover, space
from migrt.ops.space import Estimate
from migrt.pagefill.images import record_beside
from migrt.pods import rootfs
from migrt.progress import Progress, null_progress
from migrt.runtime import lazy_memory, markers
from migrt.runtime.messages import ContainerState
from migrt.runtime.runc import LowerRuntime, find_root
from migrt.store import Store
from migrt.store import manifest as mf
from migrt.store.journal import Entry
from migrt.store.reserve import Reservation
from migrt.store.store import Staging


@dataclass
class CheckpointRequest:
    container_id: str
    root: str | None = None
    name: str | None = None
    leave_running: bool = False
    tcp_established: bool = False
    ext_unix_sk: bool = False
    file_locks: bool = False
    # GPU state the caller suspended already and owns (a pod's cut: every GPU container locked before the
    # pod is frozen, ops/pod_checkpoint.py): recorded as this checkpoint's, never resumed here
    gpu: gpu_steps.GpuSuspension | None = None


def default_name(container_id: str, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now or time.time()))
    return names.validate(f"{names.sanitize(container_id)[:100]}-{stamp}")


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _work_dir() -> str:
    """runc's --work-path (its log, CRIU's dump.log) outside the store: a full store must not cost
    the error message. /run is tmpfs on every node; the logs are small."""
    base = "/run/migrt" if os.access("/run", os.W_OK) else None
    if base:
        os.makedirs(base, mode=0o700, exist_ok=True)
    return tempfile.mkdtemp(prefix="ckpt-", dir=base)


def checkpoint(cfg: Config, req: CheckpointRequest, progress: Progress = null_progress) -> dict:
    """Crash-safe at every instant (docs/store.md "Crash safety"): the journal records each step
    before it is taken; the container is frozen (not stopped) for the dump, which leaves it in
    place; only once the checkpoint is committed (fsync'd and renamed) is the container stopped.
    Any failure thaws it and resumes its GPU processes; a migrt killed anywhere leaves a journal
    entry from which the next migrt command (or `migrt recover`) brings the workload back."""
    t_start = time.monotonic()
    runtime = LowerRuntime(cfg.runtime_path())
    root = req.root or find_root(req.container_id, cfg.runtime_roots)
    if markers.gpu_suspended(root, req.container_id):
        raise Conflict(markers.gpu_suspended_message(req.container_id))
    store = Store(cfg.store)
    store.ensure()
    try:
        recover.recover(cfg)  # a container frozen by a migrt that died must not look "paused by the user"
        if recover.pending_for(cfg, req.container_id):
            raise Conflict(f"container {req.container_id}: an interrupted operation on it is not recovered yet; "
                           "run 'migrt recover'")
        with store.container_lock(root, req.container_id):
            return _checkpoint_locked(cfg, req, progress, runtime, root, store, t_start)
    except OSError as exc:  # the store (full, read-only, gone): the undo has run by now
        raise MigrtError(f"checkpoint of container {req.container_id} failed: {exc}; the container was left "
                         "running (or as it was)") from exc


@dataclass
class _Job:
    """One checkpoint's inputs, read before anything is frozen, and the timings it collects."""
    cfg: Config
    req: CheckpointRequest
    progress: Progress
    runtime: LowerRuntime
    root: str
    store: Store
    name: str
    state: ContainerState
    bundle: Bundle
    opts: CriuOptions
    est: Estimate
    dump_mode: dict
    created: float
    timings: dict[str, float]
    upper: str | None  # the writable layer, found while the rootfs is still mounted
    root_mode: int | None  # what CRIU records for "/"
    work: str = ""

    @property
    def cid(self) -> str:
        return self.req.container_id


def _checkpoint_locked(cfg: Config, req: CheckpointRequest, progress: Progress, runtime: LowerRuntime, root: str,
                       store: Store, t_start: float) -> dict:
    job = _prepare(cfg, req, progress, runtime, root, store)
    # held until the end (imports, pulls and other checkpoints see it); the config may turn the check off
    res = space.reserve(store.root, job.est, f"checkpoint of container {job.cid}", check=cfg.store_space_check)
    job.work = _work_dir()
    kept = []  # the journal entry, when it must outlive us (then recovery removes `work`)
    try:
        with store.writer(job.name, op="checkpoint", container=job.cid, root=root,
                          was_paused=job.state.status == "paused", leave_running=req.leave_running, work=job.work,
                          estimate=job.est.to_dict()) as staging:
            journal = staging.journal
            assert journal is not None  # a writer's staging has its journal entry
            kept.append(journal)
            with _Undo(cfg, runtime, root, job.cid, journal) as undo:
                dumped, gpu, stuck = _freeze_and_dump(job, staging, journal, undo, res)
                data = _commit(job, staging, journal, dumped, gpu)
                undo.committed = True
            if not req.leave_running:
                _stop(job, journal)
            job.timings["total_s"] = round(time.monotonic() - t_start, 3)
            # The last timings are known only after commit: record them (atomic rewrite, lock still held).
            data["timings"] = {**data.get("timings", {}), **job.timings}
            mf.write(store.get(job.name).path, data)
    finally:
        res.release()
        if not (kept and kept[0].keep):
            shutil.rmtree(job.work, ignore_errors=True)
    if req.leave_running and stuck:
        raise RuntimeFailed(f"checkpoint {job.name} is committed, but the CUDA processes of container {job.cid} "
                            f"could not be resumed after the dump: {stuck}; or restore {job.name} into a new container")
    return data


def _prepare(cfg: Config, req: CheckpointRequest, progress: Progress, runtime: LowerRuntime, root: str,
             store: Store) -> _Job:
    """Everything read before the freeze: the container's state and bundle, CRIU's options, the estimate
    and the dump's mode; waits first for memory a lazy restore is still filling (it would be missing from
    the dump and from the estimate)."""
    state = runtime.state(root, req.container_id)
    if state.status not in ("running", "paused"):
        raise Conflict(f"container {req.container_id} is {state.status}; only a running container can be "
                       "checkpointed")
    name = names.validate(req.name) if req.name else default_name(req.container_id)
    waited = lazy_memory.wait_filled(lambda: procs.runc_container_pids(root, req.container_id),
                                     f"checkpoint of container {req.container_id}")
    try:
        bundle = Bundle.load(state.bundle)
    except MigrtError:
        bundle = Bundle(state.bundle, {})
    opts = CriuOptions.from_dict(cfg.criu_options).merged(
        tcp_established=req.tcp_established, ext_unix_sk=req.ext_unix_sk, file_locks=req.file_locks,
        shell_job=bundle.terminal,
    )
    est = space.estimate(state.pid)
    dump_mode = dump.decide(cfg, est.memory + est.gpu)
    store.gc()
    created = time.time()
    return _Job(cfg, req, progress, runtime, root, store, name, state, bundle, opts, est, dump_mode, created,
                {"memory_wait_s": waited} if waited else {},
                rootfs.overlay_upperdir(bundle.rootfs) if state.bundle else None,
                rootfs.root_mode(bundle.rootfs) if state.bundle else None)


def _freeze_and_dump(job: _Job, staging: Staging, journal: Entry, undo: _Undo,
                     res: Reservation) -> tuple[dict, gpu_steps.GpuSuspension | None, str | None]:
    """GPU first: the driver's lock needs the processes running (it works through a thread of theirs);
    then freeze, so that nothing changes between the dump and the stop; then the dump. Returns what the
    dump reported, the GPU suspension (None: no CUDA process) and, under --leave-running, why the GPU
    processes stayed suspended."""
    gpu = job.req.gpu or gpu_steps.suspend(
        job.cfg, job.cid, job.state.pid, job.bundle.config, job.progress,
        before_lock=lambda pids: journal.update("gpu-locking", gpu_pids=pids))
    undo.gpu = None if job.req.gpu else gpu
    if gpu:
        records.write_image_file(staging.images, gpu.section)
    if job.state.status != "paused":
        journal.update("freezing")
        undo.frozen = True
        job.runtime.pause(job.root, job.cid)
    job.progress("phase", name="dump", container=job.cid)
    t0 = time.monotonic()
    dumped = dump.dump(job.cfg, job.runtime, job.root, job.cid, images=staging.images, work=job.work,
                       options=job.opts, env=gpu_steps.runtime_env(gpu), journal=journal,
                       decision=job.dump_mode, progress=job.progress)
    job.timings["dump_s"] = round(time.monotonic() - t0, 3)
    for key in ("lazy_dump_s", "pages_s"):
        if key in dumped:
            job.timings[key] = dumped.pop(key)
    journal.update("dumped")
    res.settle()  # the images are on disk now
    record_beside(staging)  # the images' survey for the restore's choice, taken while the commit hashes
    job.progress("done", name="dump", seconds=job.timings["dump_s"])
    stuck = None
    if job.req.leave_running:  # back to work at once; the commit does not need the container
        stuck = _resume_after_dump(undo, job.cid, job.root)
        journal.update("resumed")
    return dumped, gpu, stuck


def _commit(job: _Job, staging: Staging, journal: Entry, dumped: dict, gpu: gpu_steps.GpuSuspension | None) -> dict:
    """CRIU's log and the writable layer into the staging directory, then the atomic commit with the
    manifest's fields; the pages files hashed as they were written are not read again."""
    known = dumped.pop("digests", None)  # the pages files, hashed as they were written
    known_chunks = dumped.pop("chunk_digests", None)  # their 64 MiB chunks' digests (manifest `chunks`)
    dump_log = os.path.join(job.work, "dump.log")
    if os.path.isfile(dump_log):
        os.makedirs(os.path.join(staging.path, "logs"), mode=0o700, exist_ok=True)
        shutil.copyfile(dump_log, os.path.join(staging.path, "logs", "dump.log"))
    t0 = time.monotonic()
    layer = rootfs.capture(job.upper, staging.path, [m.get("destination", "") for m in job.bundle.mounts])
    job.timings["rootfs_diff_s"] = round(time.monotonic() - t0, 3)
    total = staging.payload_bytes()  # images, logs and the writable layer: what commit hashes
    fields = _fields(job, layer)
    fields["op_id"] = journal.id  # recovery's proof that this commit is the interrupted one
    fields["root_mode"] = job.root_mode
    fields["dump_pages"] = dumped
    if gpu:
        fields["gpu"] = gpu.section
        job.timings.update(gpu.timings)
    journal.update("committing")
    job.progress("phase", name="commit", total_bytes=total)
    t0 = time.monotonic()
    data = staging.commit(fields, progress=lambda n: job.progress("bytes", name="commit", bytes=n),
                          known=known, known_chunks=known_chunks)
    job.timings["commit_s"] = round(time.monotonic() - t0, 3)
    journal.update("committed")
    job.progress("done", name="commit", seconds=job.timings["commit_s"])
    return data


def _stop(job: _Job, journal: Entry) -> None:
    """The container killed while still frozen: nothing runs after the dump (runtime/stop.py)."""
    journal.update("stopping")
    t0 = time.monotonic()
    try:
        job.runtime.stop(job.root, job.cid)
    except RuntimeFailed as exc:
        journal.keep = True
        raise RuntimeFailed(f"checkpoint {job.name} is committed, but container {job.cid} could not "
                            f"be stopped: {exc.message}", details=exc.details) from exc
    job.timings["stop_s"] = round(time.monotonic() - t0, 3)  # the kill, the tasks' exit, runc delete


def _resume_after_dump(undo: _Undo, cid: str, root: str) -> str | None:
    """--leave-running, after a complete dump: thaw, then resume the GPU processes. If the GPU resume
    fails the dump is kept (it is committed next: it may be the only copy the driver can restore)
    and the processes are recorded as suspended for 'migrt gpu resume' (ops/gpu_preempt.py); the
    sentence returned is raised once the checkpoint is committed. A failed thaw is the undo's."""
    gpu = undo.gpu
    try:
        undo.run()
    except GpuError as exc:
        if gpu is None or undo.frozen:
            raise
        undo.gpu = None  # nothing more the undo can do for them
        from migrt.ops import gpu_preempt

        return str(exc) + gpu_preempt.keep_suspended(cid, root, gpu.pids, gpu.section,
                                                     by="migrt checkpoint --leave-running", error=str(exc))
    return None


class _Undo:
    """What a failed checkpoint must put back, in order: thaw the container (if migrt froze it),
    then resume its GPU processes (the driver needs them running). Waits first for any runc/CRIU
    still at work on the staging directory (a Ctrl-C reaches them too, CRIU finishes its dump).
    If the undo itself fails, the journal entry is kept for recovery."""

    def __init__(self, cfg: Config, runtime: LowerRuntime, root: str, cid: str, journal) -> None:
        self.cfg, self.runtime, self.root, self.cid, self.journal = cfg, runtime, root, cid, journal
        self.gpu: gpu_steps.GpuSuspension | None = None
        self.frozen = False
        self.committed = False

    def __enter__(self) -> _Undo:
        return self

    def run(self) -> None:
        if self.frozen:
            if self.runtime.state(self.root, self.cid).status == "paused":  # pause may not have happened
                self.runtime.resume(self.root, self.cid)
            self.frozen = False
        if self.gpu:
            self.gpu.resume()
            self.gpu = None

    def __exit__(self, exc_type, exc, tb) -> None:  # never swallows: the failure goes on up
        if exc is None or self.committed:
            return
        problems = []
        try:
            recover.wait_helpers([self.journal.data.get("staging"), self.journal.data.get("work")],
                                 recover.COMMAND_WAIT_S)
            self.run()
        except (MigrtError, OSError) as undo_exc:
            problems.append(str(undo_exc))
        if problems:
            self.journal.keep = True
            log_mod.get().error("checkpoint_undo_failed", container=self.cid, error=problems[0])
            if isinstance(exc, MigrtError):
                exc.details.append(f"the container could not be brought back ({problems[0]}); run 'migrt recover'")


def _fields(job: _Job, layer: dict) -> dict:
    return {
        "created": _utc(job.created),
        "source": {
            "container_id": job.cid,
            "runtime_root": job.root,
            "bundle": job.state.bundle,
            "pid": job.state.pid,
            "status": job.state.status,
            "cri": job.bundle.cri_metadata(),
            "annotations": job.bundle.annotations,
        },
        "versions": versions(job.runtime.path),
        "options": {**job.opts.to_dict(), "leave_running": job.req.leave_running},
        "mounts": [{"destination": m.get("destination"), "type": m.get("type"), "source": m.get("source")}
                   for m in job.bundle.mounts],
        "rootfs": layer,
        "timings": job.timings,
        "estimate": job.est.to_dict(),
    }
