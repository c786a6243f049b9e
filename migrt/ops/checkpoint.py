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
from migrt.pagefill.images import record_beside
from migrt.pods import rootfs
from migrt.progress import Progress, null_progress
from migrt.runtime import lazy_memory, markers
from migrt.runtime.runc import LowerRuntime, find_root
from migrt.store import Store
from migrt.store import manifest as mf


@dataclass
class CheckpointRequest:
    container_id: str
    root: str | None = None
    name: str | None = None
    leave_running: bool = False
    tcp_established: bool = False
    ext_unix_sk: bool = False
    file_locks: bool = False


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


def _checkpoint_locked(cfg: Config, req: CheckpointRequest, progress: Progress, runtime: LowerRuntime, root: str,
                       store: Store, t_start: float) -> dict:
    state = runtime.state(root, req.container_id)
    if state.status not in ("running", "paused"):
        raise Conflict(f"container {req.container_id} is {state.status}; only a running container can be "
                       "checkpointed")
    was_paused = state.status == "paused"
    name = names.validate(req.name) if req.name else default_name(req.container_id)
    # memory a lazy restore is still filling would be missing from the dump (and from the estimate)
    waited = lazy_memory.wait_filled(lambda: procs.runc_container_pids(root, req.container_id),
                                     f"checkpoint of container {req.container_id}")
    bundle_dir = state.bundle
    try:
        bundle = Bundle.load(bundle_dir)
    except MigrtError:
        bundle = Bundle(bundle_dir, {})
    opts = CriuOptions.from_dict(cfg.criu_options).merged(
        tcp_established=req.tcp_established, ext_unix_sk=req.ext_unix_sk, file_locks=req.file_locks,
        shell_job=bundle.terminal,
    )
    est = space.estimate(state.pid)
    dump_mode = dump.decide(cfg, est.memory + est.gpu)
    store.gc()
    created = time.time()
    timings: dict[str, float] = {"memory_wait_s": waited} if waited else {}
    upper = rootfs.overlay_upperdir(bundle.rootfs) if bundle_dir else None  # while still mounted
    root_mode = rootfs.root_mode(bundle.rootfs) if bundle_dir else None  # what CRIU records for "/"
    # held until the end (imports, pulls and other checkpoints see it); the config may turn the check off
    res = space.reserve(store.root, est, f"checkpoint of container {req.container_id}", check=cfg.store_space_check)
    work = _work_dir()
    stuck = None  # --leave-running: why the GPU processes stayed suspended after the dump
    kept = []  # the journal entry, when it must outlive us (then recovery removes `work`)
    try:
        with store.writer(name, op="checkpoint", container=req.container_id, root=root, was_paused=was_paused,
                          leave_running=req.leave_running, work=work, estimate=est.to_dict()) as staging:
            journal = staging.journal
            assert journal is not None  # a writer's staging has its journal entry
            kept.append(journal)
            with _Undo(cfg, runtime, root, req.container_id, journal) as undo:
                # GPU first: the driver's lock needs the processes running (it works through a thread of
                # theirs); then freeze, so that nothing changes between the dump and the stop.
                gpu = undo.gpu = gpu_steps.suspend(
                    cfg, req.container_id, state.pid, bundle.config, progress,
                    before_lock=lambda pids: journal.update("gpu-locking", gpu_pids=pids))
                if gpu:
                    records.write_image_file(staging.images, gpu.section)
                if not was_paused:
                    journal.update("freezing")
                    undo.frozen = True
                    runtime.pause(root, req.container_id)
                progress("phase", name="dump", container=req.container_id)
                t0 = time.monotonic()
                dumped = dump.dump(cfg, runtime, root, req.container_id, images=staging.images, work=work,
                                   options=opts, env=gpu_steps.runtime_env(gpu), journal=journal,
                                   decision=dump_mode, progress=progress)
                timings["dump_s"] = round(time.monotonic() - t0, 3)
                for key in ("lazy_dump_s", "pages_s"):
                    if key in dumped:
                        timings[key] = dumped.pop(key)
                known = dumped.pop("digests", None)  # the pages files, hashed as they were written
                known_chunks = dumped.pop("chunk_digests", None)  # their 64 MiB chunks' digests (manifest `chunks`)
                journal.update("dumped")
                res.settle()  # the images are on disk now
                record_beside(staging)  # the images' survey for the restore's choice, taken while the commit hashes
                progress("done", name="dump", seconds=timings["dump_s"])
                if req.leave_running:  # back to work at once; the commit does not need the container
                    stuck = _resume_after_dump(undo, req.container_id, root)
                    journal.update("resumed")
                dump_log = os.path.join(work, "dump.log")
                if os.path.isfile(dump_log):
                    os.makedirs(os.path.join(staging.path, "logs"), mode=0o700, exist_ok=True)
                    shutil.copyfile(dump_log, os.path.join(staging.path, "logs", "dump.log"))
                t0 = time.monotonic()
                layer = rootfs.capture(upper, staging.path, [m.get("destination", "") for m in bundle.mounts])
                timings["rootfs_diff_s"] = round(time.monotonic() - t0, 3)
                total = staging.payload_bytes()  # images, logs and the writable layer: what commit hashes
                fields = _fields(req, root, state, bundle, bundle_dir, opts, layer, timings, created, runtime, est)
                fields["op_id"] = journal.id  # recovery's proof that this commit is the interrupted one
                fields["root_mode"] = root_mode
                fields["dump_pages"] = dumped
                if gpu:
                    fields["gpu"] = gpu.section
                    timings.update(gpu.timings)
                journal.update("committing")
                progress("phase", name="commit", total_bytes=total)
                t0 = time.monotonic()
                data = staging.commit(fields, progress=lambda n: progress("bytes", name="commit", bytes=n),
                                      known=known, known_chunks=known_chunks)
                timings["commit_s"] = round(time.monotonic() - t0, 3)
                journal.update("committed")
                progress("done", name="commit", seconds=timings["commit_s"])
                undo.committed = True
            if not req.leave_running:
                journal.update("stopping")
                t0 = time.monotonic()
                try:  # killed while still frozen: nothing runs after the dump (runtime/stop.py)
                    runtime.stop(root, req.container_id)
                except RuntimeFailed as exc:
                    journal.keep = True
                    raise RuntimeFailed(f"checkpoint {name} is committed, but container {req.container_id} could not "
                                        f"be stopped: {exc.message}", details=exc.details) from exc
                timings["stop_s"] = round(time.monotonic() - t0, 3)  # the kill, the tasks' exit, runc delete
            timings["total_s"] = round(time.monotonic() - t_start, 3)
            # The last timings are known only after commit: record them (atomic rewrite, lock still held).
            data["timings"] = {**data.get("timings", {}), **timings}
            mf.write(store.get(name).path, data)
    finally:
        res.release()
        if not (kept and kept[0].keep):
            shutil.rmtree(work, ignore_errors=True)
    if req.leave_running and stuck:
        raise RuntimeFailed(f"checkpoint {name} is committed, but the CUDA processes of container {req.container_id} "
                            f"could not be resumed after the dump: {stuck}; or restore {name} into a new container")
    return data


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


def _fields(req, root, state, bundle, bundle_dir, opts, layer, timings, created, runtime, est) -> dict:
    return {
        "created": _utc(created),
        "source": {
            "container_id": req.container_id,
            "runtime_root": root,
            "bundle": bundle_dir,
            "pid": state.pid,
            "status": state.status,
            "cri": bundle.cri_metadata(),
            "annotations": bundle.annotations,
        },
        "versions": versions(runtime.path),
        "options": {**opts.to_dict(), "leave_running": req.leave_running},
        "mounts": [{"destination": m.get("destination"), "type": m.get("type"), "source": m.get("source")}
                   for m in bundle.mounts],
        "rootfs": layer,
        "timings": timings,
        "estimate": est.to_dict(),
    }
