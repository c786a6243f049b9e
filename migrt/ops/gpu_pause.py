"""migrt-runc's `pause` and `resume` of containers that release their GPU while paused (annotation
migrt.io/gpu-release-on-pause=true or env MIGRT_GPU_RELEASE_ON_PAUSE=1 in config.json), so that
containerd (`ctr task pause`, CRI) preempts a GPU job in place without knowing about GPUs.

  create: the lower runtime's create as a child, then the marker `<root>/<id>/migrt-gpu-release-on-pause`
          (runc's own state directory: `runc delete` removes it). The shim's fast path tests only that
          marker at pause/resume, so every other container's pause and resume pass straight through.
  pause:  GPU suspend of every CUDA process (gpu_preempt.suspend, while the tasks still run) -> the
          lower runtime's pause (cgroup freeze); if the freeze fails, the GPU is resumed.
  resume: the lower runtime's resume (the driver's restore needs running tasks) -> GPU resume onto
          the same GPUs; if that fails the container is paused again: it stays paused with its GPU
          state in host memory (never half-resumed), and the error goes to runc's --log.
A container with no CUDA process when paused is simply paused. A GPU suspend made by
`migrt gpu suspend` is left alone by pause/resume (the person who made it resumes it).
"""

from __future__ import annotations

import os

from migrt import names
from migrt.errors import LowerRuntimeFailed, MigrtError, RuntimeFailed
from migrt.gpu import procs
from migrt.ops import gpu_preempt
from migrt.runtime.argv import Call
from migrt.runtime.runc import LowerRuntime


def _setup():
    from migrt import config as config_mod
    from migrt import log as log_mod

    cfg = config_mod.load()
    return cfg, log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-runc")


def _lower(call: Call, args: list[str] | None = None) -> int:
    """The lower runtime as a child: the call's own command line, or its global flags and `args`; its
    exit status. LowerRuntimeFailed (126) when it cannot be executed."""
    argv = call.render() if args is None else [*call.global_tokens, *args]
    try:
        return LowerRuntime(call.lower).call(argv)
    except RuntimeFailed as exc:
        raise LowerRuntimeFailed(exc.message) from exc


def _status(call: Call, args: list[str]) -> int:
    """The exit status of a follow-up call (the undo of a failed step, whose error is the one told)."""
    try:
        return _lower(call, args)
    except LowerRuntimeFailed as exc:
        return exc.exit_code


def mark(root: str, cid: str) -> None:
    path = os.path.join(root, names.container_id(cid), gpu_preempt.RELEASE_MARKER)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.close(fd)


def create(call: Call) -> int:
    """The lower runtime's create, then the marker (a failed marker fails the create: the user asked)."""
    rc = _lower(call)
    if rc != 0:
        return rc
    cid, root = call.container_id, call.root
    try:
        mark(root, cid)
    except OSError as exc:
        _status(call, ["delete", "--force", cid])
        raise MigrtError(f"container {cid}: cannot write {gpu_preempt.RELEASE_MARKER} under {root}: {exc}") from exc
    return 0


def pause(call: Call) -> int:
    cid, root = call.container_id, call.root
    if gpu_preempt.read_record(root, cid) is not None or not procs.container_cuda_pids(root, cid):
        return _lower(call)  # already suspended by someone, or nothing on a GPU
    try:
        cfg, log = _setup()
        rec = gpu_preempt.suspend(cfg, cid, root, by="pause")
    except MigrtError as exc:
        exc.message = f"container {cid} was not paused (it keeps running): {exc.message}"
        raise
    try:
        rc = _lower(call)
    except LowerRuntimeFailed as exc:
        _unsuspend(cfg, call, exc.exit_code)
        raise
    if rc != 0:
        _unsuspend(cfg, call, rc)
        return rc
    log.info("gpu_released_on_pause", container=cid, timings=rec.get("timings"))
    return 0


def _unsuspend(cfg, call: Call, rc: int) -> None:
    """The freeze failed (the lower runtime's status `rc`): the GPU state goes back; if it cannot, that
    is the call's error, with that status."""
    cid = call.container_id
    try:
        gpu_preempt.resume(cfg, cid, call.root)
    except MigrtError as exc:
        raise LowerRuntimeFailed(f"container {cid}: the pause failed and its GPU state could not be resumed: {exc}; "
                                 f"run 'migrt gpu resume {cid}'", exit_code=rc) from exc


def resume(call: Call) -> int:
    cid, root = call.container_id, call.root
    try:
        rec = gpu_preempt.read_record(root, cid)
    except MigrtError:
        rec = None
    if rec is None or rec.get("by") != "pause":
        return _lower(call)
    rc = _lower(call)
    if rc != 0:
        return rc
    try:
        cfg, log = _setup()
        done = gpu_preempt.resume(cfg, cid, root)
    except MigrtError as exc:
        again = _status(call, ["pause", cid])
        state = ("it was paused again with its GPU state in host memory" if again == 0 else
                 "it could NOT be paused again: its tasks run but block on their first CUDA call")
        exc.message = f"container {cid}: GPU resume failed, {state}: {exc.message}"
        raise
    log.info("gpu_restored_on_resume", container=cid, timings=done.get("timings"))
    return 0
