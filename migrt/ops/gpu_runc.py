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
Errors go to runc's --log as runc-shaped JSON lines; stdout/stderr belong to the container.
"""

from __future__ import annotations

import os
import subprocess

from migrt.errors import MigrtError, UsageError
from migrt.gpu import procs, records
from migrt.oci.bundle import Bundle
from migrt.ops import gpu_steps
from migrt.runtime import lower as lower_mod
from migrt.runtime import runclog


def _setup(parsed):
    from migrt import config as config_mod
    from migrt import log as log_mod

    cfg = config_mod.load()
    return cfg, log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-runc")


def _fail(parsed, exc: MigrtError) -> int:
    runclog.append(parsed.log_path, "error", f"migrt: {exc}", log_format=parsed.log_format)
    return exc.exit_code


def _run(lower: str, parsed, env: dict | None) -> int:
    try:
        return subprocess.run([lower, *parsed.render()], env=env, check=False).returncode
    except OSError as exc:
        runclog.append(parsed.log_path, "error", f"migrt: cannot execute lower runtime {lower}: {exc}",
                       log_format=parsed.log_format)
        return 126


def _bundle_config(state: dict | None) -> dict | None:
    """The container's config.json, through the bundle path runc keeps in its state labels."""
    bundle = Bundle.of_state(state)
    return bundle.config if bundle else None


def checkpoint(parsed, lower: str, pids: list[int]) -> int:
    cmd = parsed.command_args()
    cid = cmd.container_id or ""
    root = parsed.root or lower_mod.default_root(lower)
    keeps_running = cmd.has("leave-running") or cmd.has("pre-dump")
    image_dir = cmd.value("image-path") or os.path.join(os.getcwd(), "checkpoint")
    try:
        cfg, log = _setup(parsed)
    except MigrtError as exc:  # fail closed: do not dump CUDA processes blindly
        return _fail(parsed, exc)
    state = procs.runc_state(root, cid)
    init_pid = (state or {}).get("init_process_pid")
    entry = _journal(cfg, log, cid, root, image_dir, pids)
    try:
        rc = _checkpoint(parsed, lower, cfg, log, cid, root, init_pid, state, pids, image_dir, keeps_running)
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


def _checkpoint(parsed, lower: str, cfg, log, cid: str, root: str, init_pid, state, pids: list[int], image_dir: str,
                keeps_running: bool) -> int:
    try:
        gpu = gpu_steps.suspend(cfg, cid, init_pid, _bundle_config(state), pids=pids)
    except MigrtError as exc:
        log.error("gpu_checkpoint_failed", container=cid, error=str(exc))
        return _fail(parsed, exc)
    if gpu is None:  # no CUDA process (the shim found some: never here): a plain checkpoint
        return _run(lower, parsed, None)
    try:
        os.makedirs(image_dir, mode=0o700, exist_ok=True)
        records.write_image_file(image_dir, gpu.section)
    except OSError as exc:
        err = MigrtError(f"cannot write the GPU record into {image_dir}: {exc}")
        try:
            gpu.resume()
        except MigrtError as undo:
            err.details.append(f"the GPU processes could not be resumed: {undo}")
        return _fail(parsed, err)
    rc = _run(lower, parsed, gpu_steps.runtime_env(gpu))
    if rc != 0 or keeps_running:
        try:
            gpu.resume()
        except MigrtError as exc:
            log.error("gpu_resume_failed", container=cid, error=str(exc))
            from migrt.ops import gpu_preempt  # the container runs on: 'migrt gpu resume' can retry

            kept = gpu_preempt.keep_suspended(cid, root, gpu.pids, gpu.section, by="migrt-runc checkpoint",
                                              error=str(exc))
            runclog.append(parsed.log_path, "error",
                           f"migrt: container {cid}: the GPU processes could not be resumed: {exc}{kept}",
                           log_format=parsed.log_format)
            return rc or exc.exit_code
    log.info("gpu_checkpoint", container=cid, rc=rc, pids=pids, timings=gpu.timings)
    return rc


def restore(parsed, lower: str, image_dir: str) -> int:
    cmd = parsed.command_args()
    cid = cmd.container_id or ""
    root = parsed.root or lower_mod.default_root(lower)
    try:
        cfg, log = _setup(parsed)
        if not (cmd.has("detach", "d")):
            raise UsageError("restoring a checkpoint with GPU state needs --detach (the GPU is restored after runc "
                             "returns)")
        bundle = Bundle.load(cmd.value("bundle", "b") or os.getcwd())
        try:
            section = records.read_image_file(image_dir)
        except ValueError as exc:
            raise MigrtError(str(exc)) from exc
        gpu = gpu_steps.plan_restore(cfg, section, bundle.config, f"checkpoint image {image_dir}")
    except MigrtError as exc:
        return _fail(parsed, exc)
    rc = _run(lower, parsed, gpu_steps.runtime_env(gpu))
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
        subprocess.run([lower, *[t for f in parsed.global_flags for t in f.tokens], "delete", "--force", cid],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        exc.message = (f"GPU restore of container {cid} failed; the container was removed, the checkpoint image "
                       f"{image_dir} is unchanged: {exc.message}")
        return _fail(parsed, exc)
    log.info("gpu_restore", container=cid, pid=pid, timings=timings)
    return 0
