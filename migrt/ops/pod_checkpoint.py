"""`migrt checkpoint --pod NS/POD`: every container of a pod on this node, cut at one instant, as ONE
checkpoint (issue 29).

The rule, in order:
  1. the pod's containers are found (pods/members.py) and checked before anything is touched: at least
     one running, none with an interrupted operation; each is locked against other checkpoints of it;
     the GPU containers' CUDA processes are locked and checkpointed by the driver (GPU preflight
     first), while they still run: the driver works through a thread of each process;
  2. every running container is frozen (PodFreeze) before any is dumped; what they share (a TCP
     connection over the pod's loopback, both ends; a file; a shared-memory segment) is seen by every
     dump in the same state;
  3. each is dumped while all stay frozen, by the ordinary checkpoint code (ops/checkpoint.py: CRIU
     options, parallel dump, writable layer, its own manifest and hashes), into parts/<container>/ of
     the pod checkpoint's staging directory (a store of its own there, nothing of it visible);
  4. the pod checkpoint is committed once, atomically, like any checkpoint: its manifest's `pod`
     section lists the parts {name, image, kind, container_id}, its `files` every file of every part
     (parts/<name>/manifest.json included), so verify, rm, push and pull treat it as one checkpoint;
  5. then all resume (--leave-running: thawed, then their GPU processes resumed) or all are destroyed
     (killed while still frozen).
A failure before the commit thaws every container it froze and leaves nothing in the store; the
error names the container. The journal entry (op checkpoint-pod) lets recovery thaw them after a
migrt that was killed (ops/recover.py).

A part is read back as an ordinary checkpoint, and restored, by ops/pod_restore.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from migrt import faults, names
from migrt.config import Config
from migrt.criu.version import versions
from migrt.errors import Conflict, MigrtError, PreconditionFailed, RuntimeFailed, UsageError
from migrt.oci.bundle import Bundle
from migrt.ops.pod_restore import PARTS
from migrt.pods.members import Member, PodFreeze, pod_members
from migrt.progress import Progress, null_progress
from migrt.runtime.runc import LowerRuntime
from migrt.store import Store
from migrt.store import manifest as mf
from migrt.store.store import HIDDEN, Staging

if TYPE_CHECKING:
    from migrt.ops.gpu_steps import GpuSuspension

OP = "checkpoint-pod"


@dataclass
class PodCheckpointRequest:
    namespace: str
    pod: str
    name: str | None = None
    leave_running: bool = False
    tcp_established: bool = False


def parse_pod(value: str) -> tuple[str, str]:
    """NS/POD -> (namespace, pod); UsageError otherwise."""
    ns, _, pod = value.partition("/")
    if not ns or not pod or "/" in pod or not all(c.isalnum() or c in "-." for c in ns + pod):
        raise UsageError(f"--pod {value!r}: give the pod as <namespace>/<name>, e.g. team-a/web-0")
    return ns, pod


def checkpoint_pod(cfg: Config, req: PodCheckpointRequest, progress: Progress = null_progress) -> dict:
    from migrt.ops import recover
    from migrt.ops.checkpoint import default_name

    t0 = time.monotonic()
    pod = f"{req.namespace}/{req.pod}"
    members = [m for m in pod_members(cfg, req.namespace, req.pod) if _alive(cfg, m)]
    if not members:
        raise PreconditionFailed(f"pod {pod}: none of its containers runs on this node; nothing to checkpoint")
    name = names.validate(req.name) if req.name else default_name(req.pod)
    store = Store(cfg.store)
    store.ensure()
    recover.recover(cfg)
    for m in members:
        if recover.pending_for(cfg, m.cid):
            raise Conflict(f"pod {pod}: {m.describe()} has an interrupted operation not recovered yet; run "
                           "'migrt recover'")
    with contextlib.ExitStack() as locks:
        for m in members:
            locks.enter_context(store.container_lock(m.root, m.cid))
        record = [{"container": m.cid, "root": m.root, "name": m.name, "was_paused": not m.running} for m in members]
        with store.writer(name, op=OP, pod=pod, members=record, leave_running=req.leave_running) as staging:
            gpus = _Gpus()
            try:
                gpus.suspend(cfg, members, staging.journal, progress)
                return _cut(cfg, req, store, staging, members, progress, t0, gpus)
            except BaseException as exc:  # the thaw has run (PodFreeze): now the GPU processes
                problems = gpus.resume()
                if problems and isinstance(exc, MigrtError):
                    exc.details.extend(problems)
                raise


def _alive(cfg: Config, m: Member) -> bool:
    if m.running:
        return True
    return LowerRuntime(cfg.runtime_path()).status(m.root, m.cid) == "paused"


class _Gpus:
    """The pod's GPU containers: suspended (the driver's lock and checkpoint, ops/gpu_steps.py, GPU
    preflight included) before the pod is frozen, since the driver works through a thread of each
    process; resumed after the thaw, or after any failure. Recorded in the pod's journal entry first."""

    def __init__(self) -> None:
        self.held: dict[str, GpuSuspension] = {}

    def suspend(self, cfg: Config, members: list[Member], journal, progress: Progress) -> None:
        from migrt.ops import gpu_steps

        runtime, pids_all = LowerRuntime(cfg.runtime_path()), []

        def record(pids: list[int]) -> None:
            pids_all.extend(pids)
            journal.update("gpu-locking", gpu_pids=list(pids_all))

        for m in members:
            if not m.running:  # paused by its user: dumped as a lone checkpoint of it would be
                continue
            state = runtime.state(m.root, m.cid)
            gpu = gpu_steps.suspend(cfg, m.cid, state.pid, Bundle.load(m.bundle).config, progress,
                                    before_lock=record)
            if gpu is not None:
                self.held[m.cid] = gpu

    def resume(self) -> list[str]:
        """Resume what is held; the problems, one line per container."""
        problems = []
        for cid, gpu in list(self.held.items()):
            try:
                gpu.resume()
            except MigrtError as exc:
                problems.append(f"the CUDA processes of container {cid[:12]} stay suspended: {exc.message}")
            del self.held[cid]
        return problems


def _cut(cfg: Config, req: PodCheckpointRequest, store: Store, staging: Staging, members: list[Member],
         progress: Progress, t0: float, gpus: _Gpus) -> dict:
    journal = staging.journal
    assert journal is not None
    runtime = LowerRuntime(cfg.runtime_path())
    timings: dict[str, float] = {}
    journal.update("freezing")
    with PodFreeze(runtime, members, f"{req.namespace}/{req.pod}") as freeze:
        timings["freeze_s"] = round(freeze.freeze_s, 3)
        t_frozen = time.monotonic()
        journal.update("frozen")  # (fault point checkpoint-pod:frozen, as every journaled phase)
        parts = _dump_parts(cfg, req, staging, members, progress, timings, gpus)
        timings["dump_s"] = round(time.monotonic() - t_frozen, 3)
        data = _commit(req, staging, members, parts, timings, journal.id, runtime.path)
        if req.leave_running:
            freeze.thaw()
            timings["frozen_s"] = round(time.monotonic() - t_frozen, 3)
            stuck = gpus.resume()
            if stuck:
                raise RuntimeFailed(f"pod checkpoint {data['name']} is committed, but " + "; ".join(stuck))
        else:
            freeze.keep()  # killed while still frozen: nothing runs after the cut
            gpus.held.clear()  # their processes go with them
            _stop(runtime, data["name"], members, journal)
    timings["total_s"] = round(time.monotonic() - t0, 3)
    data["timings"] = {**data.get("timings", {}), **timings}
    mf.write(store.get(data["name"]).path, data)
    return data


def _dump_parts(cfg: Config, req: PodCheckpointRequest, staging: Staging, members: list[Member],
                progress: Progress, timings: dict[str, float], gpus: _Gpus) -> list[dict]:
    """Each member dumped by ops/checkpoint.py into a store of its own inside the staging directory; the
    members stay frozen (a paused container is dumped as it is and left paused)."""
    from migrt.ops.checkpoint import CheckpointRequest, checkpoint

    sub = dataclasses.replace(cfg, store=os.path.join(staging.path, PARTS))
    parts = []
    for m in members:
        names.validate(m.name)
        progress("phase", name="dump", container=m.name)
        try:
            faults.point(f"checkpoint-pod:dump:{m.name}")
            data = checkpoint(sub, CheckpointRequest(container_id=m.cid, root=m.root, name=m.name, leave_running=True,
                                                     tcp_established=req.tcp_established,
                                                     gpu=gpus.held.get(m.cid)), progress=progress)
        except MigrtError as exc:  # its own exit code, the pod's words
            exc.message = (f"pod {req.namespace}/{req.pod}: checkpoint of container {m.name} ({m.cid[:12]}) failed: "
                           f"{exc.message}; every container of the pod was left running (or as it was)")
            exc.args = (exc.message,)
            raise
        timings[f"dump_{m.name}_s"] = (data.get("timings") or {}).get("dump_s", 0.0)
        parts.append({"name": m.name, "image": m.image, "kind": "gpu" if m.cid in gpus.held else "container",
                      "container_id": m.cid,
                      "size_bytes": data.get("size_bytes")})
    for d in HIDDEN:  # the parts' store's own bookkeeping: empty once each part is committed
        shutil.rmtree(os.path.join(sub.store, d), ignore_errors=True)
    return parts


def _commit(req: PodCheckpointRequest, staging: Staging, members: list[Member], parts: list[dict],
            timings: dict[str, float], op_id: str, runtime_path: str) -> dict:
    """One commit for the pod: the parts' files, hashed when each part was committed, are taken as
    they are (their manifests hold their digests); each part's manifest.json is hashed here."""
    known = {}
    for p in parts:
        base = os.path.join(staging.path, PARTS, p["name"])
        files = mf.load(base, p["name"]).files
        known.update({f"{PARTS}/{p['name']}/{rel}": e for rel, e in files.items()})
    src = members[0]
    fields = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {"cri": {"pod_namespace": req.namespace, "pod_name": req.pod}, "runtime_root": src.root},
        "pod": {"namespace": req.namespace, "name": req.pod, "parts": parts},
        "versions": versions(runtime_path),
        "options": {"tcp_established": req.tcp_established, "leave_running": req.leave_running},
        "timings": dict(timings),
        "op_id": op_id,
    }
    if staging.journal:
        staging.journal.update("committing")
    data = staging.commit(fields, known=known)
    if staging.journal:
        staging.journal.update("committed")
    return data


def _stop(runtime: LowerRuntime, name: str, members: list[Member], journal) -> None:
    journal.update("stopping")
    failed = []
    for m in members:
        try:
            runtime.stop(m.root, m.cid)
        except RuntimeFailed as exc:
            failed.append(f"{m.describe()}: {exc.message}")
    if failed:
        journal.keep = True
        raise RuntimeFailed(f"pod checkpoint {name} is committed, but not every container could be stopped: "
                            + "; ".join(failed))

