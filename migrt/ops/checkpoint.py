"""Checkpoint a running container into the store (runc checkpoint -> manifest -> atomic commit)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from migrt import names
from migrt.config import Config
from migrt.criu.options import CriuOptions
from migrt.criu.version import versions
from migrt.errors import Conflict, MigrtError
from migrt.oci.bundle import Bundle
from migrt.ops import gpu_steps
from migrt.pods import rootfs
from migrt.progress import Progress, null_progress
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


def checkpoint(cfg: Config, req: CheckpointRequest, progress: Progress = null_progress) -> dict:
    t_start = time.monotonic()
    runtime = LowerRuntime(cfg.runtime_path())
    root = req.root or find_root(req.container_id, cfg.runtime_roots)
    state = runtime.state(root, req.container_id)
    if state.get("status") not in ("running", "paused"):
        raise Conflict(f"container {req.container_id} is {state.get('status')}; only a running container can be checkpointed")
    name = names.validate(req.name) if req.name else default_name(req.container_id)
    bundle_dir = state.get("bundle") or ""
    try:
        bundle = Bundle.load(bundle_dir)
    except MigrtError:
        bundle = Bundle(bundle_dir, {})
    opts = CriuOptions.from_dict(cfg.criu_options).merged(
        tcp_established=req.tcp_established, ext_unix_sk=req.ext_unix_sk, file_locks=req.file_locks,
        shell_job=bundle.terminal,
    )
    store = Store(cfg.store)
    store.ensure()
    store.gc()
    created = time.time()
    timings: dict[str, float] = {}
    upper = rootfs.overlay_upperdir(bundle.rootfs) if bundle_dir else None  # while still mounted
    with store.writer(name) as staging:
        # GPU: suspend the CUDA processes (if any) before the dump; resume them after it when the
        # container keeps running, and on any failure.
        with gpu_steps.suspended(cfg, req.container_id, state.get("pid"), bundle.config, image_dir=staging.images,
                                 leave_running=req.leave_running, progress=progress) as gpu:
            progress("phase", name="dump", container=req.container_id)
            t0 = time.monotonic()
            runtime.checkpoint(root, req.container_id, image_path=staging.images, work_path=staging.work,
                               options=opts, leave_running=req.leave_running, env=gpu_steps.runtime_env(gpu))
            timings["dump_s"] = round(time.monotonic() - t0, 3)
        dump_log = os.path.join(staging.work, "dump.log")
        if os.path.isfile(dump_log):
            os.makedirs(os.path.join(staging.path, "logs"), mode=0o700, exist_ok=True)
            os.replace(dump_log, os.path.join(staging.path, "logs", "dump.log"))
        progress("done", name="dump", seconds=timings["dump_s"])
        t0 = time.monotonic()
        layer = rootfs.capture(upper, staging.path, [m.get("destination", "") for m in bundle.mounts])
        timings["rootfs_diff_s"] = round(time.monotonic() - t0, 3)
        total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(staging.images) for f in fs)
        progress("phase", name="commit", total_bytes=total)
        fields = {
            "created": _utc(created),
            "source": {
                "container_id": req.container_id,
                "runtime_root": root,
                "bundle": bundle_dir,
                "pid": state.get("pid"),
                "status": state.get("status"),
                "cri": bundle.cri_metadata(),
                "annotations": bundle.annotations,
            },
            "versions": versions(runtime.path),
            "options": {**opts.to_dict(), "leave_running": req.leave_running},
            "mounts": [{"destination": m.get("destination"), "type": m.get("type"), "source": m.get("source")}
                       for m in bundle.mounts],
            "rootfs": layer,
            "timings": timings,
        }
        if gpu:
            fields["gpu"] = gpu.section
            timings.update(gpu.timings)
        t0 = time.monotonic()
        data = staging.commit(fields, progress=lambda n: progress("bytes", name="commit", bytes=n))
        timings["commit_s"] = round(time.monotonic() - t0, 3)
        progress("done", name="commit", seconds=timings["commit_s"])
        timings["total_s"] = round(time.monotonic() - t_start, 3)
        # The last timings are known only after commit: record them (atomic rewrite, lock still held).
        data["timings"] = {**data.get("timings", {}), **timings}
        mf.write(store.get(name).path, data)
    return data
