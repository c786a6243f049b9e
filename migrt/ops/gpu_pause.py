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
import subprocess

from migrt import names
from migrt.errors import MigrtError
from migrt.gpu import procs
from migrt.ops import gpu_preempt
from migrt.runtime import lower as lower_mod
from migrt.runtime import runclog


def _setup():
    from migrt import config as config_mod
    from migrt import log as log_mod

    cfg = config_mod.load()
    return cfg, log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-runc")


def _lower(lower: str, parsed, args: list[str] | None = None) -> int:
    argv = [lower, *parsed.render()] if args is None else [lower, *[t for f in parsed.global_flags for t in f.tokens],
                                                            *args]
    try:
        return subprocess.run(argv, check=False).returncode
    except OSError as exc:
        runclog.append(parsed.log_path, "error", f"migrt: cannot execute lower runtime {lower}: {exc}",
                       log_format=parsed.log_format)
        return 126


def _fail(parsed, msg: str, code: int) -> int:
    runclog.append(parsed.log_path, "error", f"migrt: {msg}", log_format=parsed.log_format)
    return code


def mark(root: str, cid: str) -> None:
    path = os.path.join(root, names.container_id(cid), gpu_preempt.RELEASE_MARKER)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.close(fd)


def create(parsed, lower: str) -> int:
    """The lower runtime's create, then the marker (a failed marker fails the create: the user asked)."""
    rc = _lower(lower, parsed)
    if rc != 0:
        return rc
    cid = parsed.command_args().container_id or ""
    root = parsed.root or lower_mod.default_root(lower)
    try:
        mark(root, cid)
    except OSError as exc:
        _lower(lower, parsed, ["delete", "--force", cid])
        return _fail(parsed, f"container {cid}: cannot write {gpu_preempt.RELEASE_MARKER} under {root}: {exc}", 1)
    return 0


def pause(parsed, lower: str) -> int:
    cid = parsed.command_args().container_id or ""
    root = parsed.root or lower_mod.default_root(lower)
    if gpu_preempt.read_record(root, cid) is not None or not procs.container_cuda_pids(root, cid):
        return _lower(lower, parsed)  # already suspended by someone, or nothing on a GPU
    try:
        cfg, log = _setup()
        rec = gpu_preempt.suspend(cfg, cid, root, by="pause")
    except MigrtError as exc:
        return _fail(parsed, f"container {cid} was not paused (it keeps running): {exc}", exc.exit_code)
    rc = _lower(lower, parsed)
    if rc != 0:
        try:
            gpu_preempt.resume(cfg, cid, root)
        except MigrtError as exc:
            return _fail(parsed, f"container {cid}: the pause failed and its GPU state could not be resumed: {exc}; "
                                 f"run 'migrt gpu resume {cid}'", rc)
        return rc
    log.info("gpu_released_on_pause", container=cid, timings=rec.get("timings"))
    return 0


def resume(parsed, lower: str) -> int:
    cid = parsed.command_args().container_id or ""
    root = parsed.root or lower_mod.default_root(lower)
    try:
        rec = gpu_preempt.read_record(root, cid)
    except MigrtError:
        rec = None
    if rec is None or rec.get("by") != "pause":
        return _lower(lower, parsed)
    rc = _lower(lower, parsed)
    if rc != 0:
        return rc
    try:
        cfg, log = _setup()
        done = gpu_preempt.resume(cfg, cid, root)
    except MigrtError as exc:
        again = _lower(lower, parsed, ["pause", cid])
        state = ("it was paused again with its GPU state in host memory" if again == 0 else
                 "it could NOT be paused again: its tasks run but block on their first CUDA call")
        return _fail(parsed, f"container {cid}: GPU resume failed, {state}: {exc}", exc.exit_code)
    log.info("gpu_restored_on_resume", container=cid, timings=done.get("timings"))
    return 0
