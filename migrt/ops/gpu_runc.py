"""migrt-runc's `checkpoint` and `restore` of containers with GPU state (containerd's own checkpoint
and restore paths, kubelet's checkpoint API, people calling runc by hand).

The shim decides with the standard library alone (migrt.gpu.procs, the image's migrt-gpu.json)
and comes here only when there is GPU work; otherwise it execs the lower runtime untouched.
Here the lower runtime runs as a child, with MIGRT_GPU_HANDLED=1 so that a CRIU action script
stands aside, between the GPU steps:

  checkpoint: suspend all CUDA processes (after the gate: peer state, the application hook) ->
              `<runtime> checkpoint ...` -> resume them if the container keeps running
              (--leave-running, --pre-dump) or the dump failed; a resume that fails leaves them
              recorded as suspended for `migrt gpu resume`.
  restore:    preflight (nothing touched on a mismatch) -> `<runtime> restore ...` -> GPU restore
              with the UUID remap and unlock; on failure `delete --force` of the half-restored
              container (the image is left as it was).
Handlers take the shim's typed call (runtime/argv.py) and return the lower runtime's exit status;
migrt's own failures are raised as MigrtErrors, which the shim writes to runc's --log.
"""

from __future__ import annotations

import os

from migrt.errors import LowerRuntimeFailed, MigrtError, RuntimeFailed, UsageError
from migrt.gpu import procs, records
from migrt.oci.bundle import Bundle
from migrt.ops import gpu_steps
from migrt.runtime.argv import Call
from migrt.runtime.runc import LowerRuntime


def _setup():
    from migrt import config as config_mod
    from migrt import log as log_mod

    cfg = config_mod.load()
    return cfg, log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-runc")


def _run(call: Call, env: dict | None) -> int:
    """The call's own command line, run by the lower runtime as a child: its exit status;
    LowerRuntimeFailed (126) when it cannot be executed."""
    try:
        return LowerRuntime(call.lower).call(call.render(), env=env)
    except RuntimeFailed as exc:
        raise LowerRuntimeFailed(exc.message) from exc


def _bundle_config(state: dict | None) -> dict | None:
    """The container's config.json, through the bundle path runc keeps in its state labels."""
    bundle = Bundle.of_state(state)
    return bundle.config if bundle else None


def checkpoint(call: Call, pids: list[int]) -> int:
    """The lower runtime's exit status; a MigrtError when migrt's GPU steps failed."""
    cid, root, image_dir = call.container_id, call.root, call.image_path
    keeps_running = call.cmd.has("leave-running") or call.cmd.has("pre-dump")
    cfg, log = _setup()  # fail closed: do not dump CUDA processes blindly
    state = procs.runc_state(root, cid)
    init_pid = (state or {}).get("init_process_pid")
    entry = _journal(cfg, log, cid, root, image_dir, pids)
    try:
        rc = _checkpoint(call, cfg, log, init_pid, state, pids, keeps_running)
    except MigrtError:
        if entry:
            entry.end()  # a failure migrt reports: nothing is left for recovery
        raise
    except BaseException:
        if entry:
            entry.release()  # an exception we did not expect: leave the record for recovery
        raise
    if entry:
        entry.end()
    return rc


def _journal(cfg, log, cid: str, root: str, image_dir: str, pids: list[int]):
    """Record the GPU suspension in the store's journal, so that a migrt-runc killed by containerd
    (a cancelled CRI call) leaves processes that the next migrt command resumes (ops/recover.py)."""
    from migrt.store import Store, journal

    try:
        store = Store(cfg.store)
        store.ensure()
        return journal.begin(store.root, "gpu-checkpoint", phase="gpu-locking", container=cid, root=root,
                             image_dir=os.path.abspath(image_dir), gpu_pids=pids)
    except OSError as exc:  # the checkpoint itself does not need the store
        log.warning("journal_unavailable", container=cid, error=str(exc))
        return None


def _checkpoint(call: Call, cfg, log, init_pid, state, pids: list[int], keeps_running: bool) -> int:
    cid, image_dir = call.container_id, call.image_path
    try:
        gpu = gpu_steps.suspend(cfg, cid, init_pid, _bundle_config(state), pids=pids)
    except MigrtError as exc:
        log.error("gpu_checkpoint_failed", container=cid, error=str(exc))
        raise
    if gpu is None:  # no CUDA process (the shim found some: never here): a plain checkpoint
        return _run(call, None)
    try:
        os.makedirs(image_dir, mode=0o700, exist_ok=True)
        records.write_image_file(image_dir, gpu.section)
    except OSError as exc:
        err = MigrtError(f"cannot write the GPU record into {image_dir}: {exc}")
        try:
            gpu.resume()
        except MigrtError as undo:
            err.details.append(f"the GPU processes could not be resumed: {undo}")
        raise err from exc
    try:
        rc = _run(call, gpu_steps.runtime_env(gpu))
    except LowerRuntimeFailed as exc:  # no dump: the processes resume as after a failed one
        _resume(call, log, gpu, exc.exit_code)
        raise
    if rc != 0 or keeps_running:
        _resume(call, log, gpu, rc)
    log.info("gpu_checkpoint", container=cid, rc=rc, pids=pids, timings=gpu.timings)
    return rc


def _resume(call: Call, log, gpu, rc: int) -> None:
    """GPU resume after the lower runtime's checkpoint (`rc`: its exit status) when the container goes
    on. A resume that fails leaves the processes recorded as suspended for 'migrt gpu resume', and is
    the call's error, with the lower runtime's exit status when that failed too."""
    cid = call.container_id
    try:
        gpu.resume()
    except MigrtError as exc:
        log.error("gpu_resume_failed", container=cid, error=str(exc))
        from migrt.ops import gpu_preempt  # the container runs on: 'migrt gpu resume' can retry

        kept = gpu_preempt.keep_suspended(cid, call.root, gpu.pids, gpu.section, by="migrt-runc checkpoint",
                                          error=str(exc))
        message = f"container {cid}: the GPU processes could not be resumed: {exc}{kept}"
        if rc:
            raise LowerRuntimeFailed(message, exit_code=rc) from exc
        exc.message, exc.details = message, []
        raise


def restore(call: Call, image_dir: str) -> int:
    """The lower runtime's exit status; a MigrtError when migrt's GPU steps failed (nothing touched
    before the lower runtime's restore; the container removed after it)."""
    cid, root = call.container_id, call.root
    cfg, log = _setup()
    if not call.cmd.has("detach", "d"):
        raise UsageError("restoring a checkpoint with GPU state needs --detach (the GPU is restored after runc "
                         "returns)")
    bundle = Bundle.load(call.bundle_dir)
    try:
        section = records.read_image_file(image_dir)
    except ValueError as exc:
        raise MigrtError(str(exc)) from exc
    gpu = gpu_steps.plan_restore(cfg, section, bundle.config, f"checkpoint image {image_dir}")
    rc = _run(call, gpu_steps.runtime_env(gpu))
    if rc != 0 or gpu is None:
        return rc
    try:
        state = procs.runc_state(root, cid) or {}
        pid = state.get("init_process_pid")
        if not isinstance(pid, int) or pid <= 0:
            raise MigrtError(f"container {cid}: restored, but runc's state under {root} names no init pid")
        timings: dict[str, float] = {}
        gpu_steps.resume_restored(gpu, pid, timings)
    except MigrtError as exc:
        log.error("gpu_restore_failed", container=cid, error=str(exc))
        LowerRuntime(call.lower, call.global_tokens).delete_force(None, cid)
        exc.message = (f"GPU restore of container {cid} failed; the container was removed, the checkpoint image "
                       f"{image_dir} is unchanged: {exc.message}")
        raise
    log.info("gpu_restore", container=cid, pid=pid, timings=timings)
    return 0
