"""Live migration, source side: move a running container to another node's receiver.

    connect + authenticate + offer   (nothing touched yet: any refusal leaves the container as it was)
    [pre-dump rounds]                 only where the kernel tracks dirty pages (soft-dirty)
    pause                             the freeze starts here (downtime_s counts from this instant)
    dump --leave-running              the container stays frozen, resumable
      stop-and-copy: every image -> target (sha256 on the fly), target verifies and commits
      lazy:          memory stays in the frozen tasks; migrt's page server (pageserve.py) serves it to
                     the target's page filler over several streams, the rest -> target
    target restores                   (if the receiver was started with --restore)
    destroy the frozen source         only once the target holds the state

Who runs the container after a failure follows one rule (handover.py): before the target is asked
to restore, the source is resumed; after, the source stays frozen until it knows (from the target's
answer, or by asking again on a new connection) whether the target runs it. A guard process
(guard.py) applies the same rule if this process is killed. Every wait on the target ends after
`migration_stall_timeout` seconds without a byte or message from it (a busy target says it is alive).
The source's images live in a staging directory of the local store that is removed at the end; sent
ranges are released at once, so a tmpfs store does not double the memory footprint. That staging
directory is written under a name of its own (staging_name), never the offered one: the target
commits the offered name in ITS store, which is this very store when a pod pulls from its own
node's agent (a StatefulSet's second pull, docs/kubernetes.md), and the target's import takes that
name's lock for the whole transfer.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from migrt import names
from migrt.config import Config
from migrt.criu import lazy as lazy_mod
from migrt.criu.options import CriuOptions
from migrt.criu.version import versions
from migrt.errors import Conflict, MigrtError, PreconditionFailed, RuntimeFailed, UsageError
from migrt.gpu import procs
from migrt.migration import bulk, handover, pageserve
from migrt.migration.channel import RemoteError
from migrt.migration.gpu import GpuSource
from migrt.migration.guard import Guard
from migrt.migration.tls import TLSFiles
from migrt.migration.wire import Channel, TransferError, connect, load_key
from migrt.oci.bundle import Bundle
from migrt.ops.checkpoint import default_name
from migrt.pagefill import images as pagefill_images
from migrt.pods import rootfs
from migrt.progress import Progress, null_progress
from migrt.runtime import control, lazy_memory, markers
from migrt.runtime import moved as moved_marks
from migrt.runtime.runc import ContainerState, LowerRuntime, find_root
from migrt.store import Store
from migrt.store import manifest as mf

MODES = ("stop-and-copy", "lazy", "direct")
MAX_PRE_DUMPS = 8
LAZY_READY_TIMEOUT = 120.0


@dataclass
class MigrateRequest:
    container_id: str
    to: str
    root: str | None = None
    name: str | None = None
    pre_dump: str = "auto"  # "auto", "0" (off) or a number of rounds
    lazy: bool = False
    free_source_early: bool = False  # destroy the source before the target restores (one-machine tests)
    # a pod container pulled by another node (agent.py): the record left where it was, so that its
    # restart here is refused (runtime/moved.py); written before the source is destroyed
    moved: dict | None = None
    streams: int | None = None  # stop-and-copy: connections the files travel over (None: migration_streams)
    # stop-and-copy without images: the memory goes from the frozen source into the restored tasks over
    # the lazy path's page streams, the target's tree held until every page is in (docs/migration.md)
    direct: bool = False
    # one part of a pod-level pull (podpull.py): the pod's cut froze the container already, and hands
    # it to this migration (which then resumes it on a failure, like one it froze) once its own guard
    # is armed: on_frozen() is called then
    prefrozen: bool = False
    on_frozen: Callable[[], None] | None = None
    # with prefrozen: the container's lazy dump made at the pod's cut (migration/earlydump.py), taken
    # instead of dumping it here
    early: Any = None


class MigrationFailed(MigrtError):
    """Wraps the cause with what happened to the container; keeps the cause's exit code."""

    def __init__(self, message: str, cause: MigrtError) -> None:
        super().__init__(message, details=cause.details)
        self.exit_code = cause.exit_code


def parse_pre_dump(value: str | None) -> int | None:
    """None for auto, else the number of rounds (0 = off)."""
    if value in (None, "", "auto"):
        return None
    if not str(value).isdigit() or int(value) > MAX_PRE_DUMPS:
        raise UsageError(f"--pre-dump must be 'auto' or a number of rounds from 0 to {MAX_PRE_DUMPS}, got {value!r}")
    return int(value)


def pre_dump_plan(value: str | None) -> dict:
    """What pre-dumping will do here, and why. Pre-dump rounds only help when the kernel tracks dirty
    pages: without soft-dirty each round would copy all memory again, so they are skipped (never an
    error)."""
    rounds = parse_pre_dump(value)
    plan = {"requested": "auto" if rounds is None else rounds, "available": False, "rounds": 0, "note": ""}
    if rounds == 0:
        plan["note"] = "off"
        return plan
    if not lazy_mod.soft_dirty():
        plan["note"] = ("skipped: the kernel does not track dirty pages (criu check --feature mem_dirty_track "
                        "fails; CONFIG_MEM_SOFT_DIRTY unset), so rounds could not be incremental")
        return plan
    plan["available"] = True
    plan["note"] = ("available; rounds are not run yet: a final dump on top of pre-dump images needs the parent "
                    "images on the target (see docs/migration.md)")
    return plan


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _payload(path: str) -> list[tuple[str, str]]:
    """(relpath, full path) of every file to send, small ones first, the pages last."""
    rels = mf.list_payload(path)
    rels.sort(key=lambda r: (os.path.getsize(os.path.join(path, r)), r))
    return [(r, os.path.join(path, r)) for r in rels]


class _Source:
    """The container on this node and what may be done to it; keeps the guard's instruction in step."""

    def __init__(self, runtime: str, root: str, cid: str, was_paused: bool, guard: Guard,
                 gpu: GpuSource, moved: dict | None = None, prefrozen: bool = False,
                 on_frozen: Callable[[], None] | None = None) -> None:
        self.runtime, self.root, self.cid = runtime, root, cid
        self.prefrozen, self.on_frozen = prefrozen, on_frozen
        self.was_paused = was_paused
        self.frozen = False
        self.guard = guard
        self.page_server: tuple[str, int] | None = None  # CRIU's, while the lazy dump runs
        self.pages_pid: int | None = None                 # migrt's page server (pageserve.py), after it
        self.staging: str | None = None
        self.gpu = gpu  # its CUDA processes (migration/gpu.py), if any (its pids)
        self.moved = moved

    def _where(self) -> dict:
        return {"runtime": self.runtime, "root": self.root, "cid": self.cid, "page_server": self.page_server,
                "pages_pid": self.pages_pid, "moved": self.moved,
                "remove": [self.staging] if self.staging else [],
                "gpu_pids": self.gpu.pids if self.gpu and self.gpu.section is not None else []}

    def freeze(self, staging: str) -> None:
        self.staging = staging
        # armed before the pause: a kill between the two leaves a container that resumes harmlessly
        self.guard.arm({"do": "settle" if self.was_paused else "resume", **self._where()})
        if not self.was_paused and not self.prefrozen:
            control.pause(self.runtime, self.root, self.cid)
        self.frozen = True
        if self.on_frozen:  # a pod's cut hands the container over: our guard has it now
            self.on_frozen()

    def serving(self, page_server: tuple[str, int] | None) -> None:
        self.page_server = page_server
        self.guard.arm({**self.guard.current, "page_server": page_server})

    def serving_pages(self, pid: int | None) -> None:
        self.pages_pid = pid
        self.guard.arm({**self.guard.current, "pages_pid": pid})

    def handing_over(self, cfg: Config, to: str, name: str, target_cid: str | None) -> None:
        """From here on, only the target's answer decides (see handover.py)."""
        self.guard.arm({"do": "resolve", **self._where(), "config": cfg.path, "to": to, "name": name,
                        "target_cid": target_cid, "was_paused": self.was_paused})

    def rollback(self, target_kept: bool = False) -> str:
        """Resume after a failure (thaw, then the GPU state back onto its own GPU); returns a sentence."""
        said = self._thaw(target_kept)
        if self.gpu and not self.frozen:  # the driver's restore needs running tasks
            said += self.gpu.resume()
        return said

    def _thaw(self, target_kept: bool) -> str:
        kept = "" if target_kept else "; the target kept nothing"
        if not self.frozen:
            return f"container {self.cid} was not touched and keeps running{kept}"
        if self.was_paused:
            self.guard.arm({"do": "remove", "remove": [self.staging] if self.staging else []})
            return f"container {self.cid} was left paused, as it was{kept}"
        try:
            control.resume(self.runtime, self.root, self.cid)
        except MigrtError as exc:
            return (f"container {self.cid} could NOT be resumed ({exc}); it is frozen with its state intact: "
                    f"run 'runc --root {self.root} resume {self.cid}'")
        self.guard.arm({"do": "remove", "remove": [self.staging] if self.staging else []})
        self.frozen = False
        return f"container {self.cid} was resumed on this node{kept}"

    def destroy(self) -> None:
        self.guard.arm({"do": "destroy", **self._where()})
        moved_marks.leave(self.root, self.moved)  # before it dies: its restart here is refused from the first
        control.destroy(self.runtime, self.root, self.cid)
        self.guard.arm({"do": "remove", "remove": [self.staging] if self.staging else []})
        self.frozen = False


@dataclass
class Prepared:
    """What migrate() found out before connecting: nothing of the container is touched yet."""
    runtime: LowerRuntime
    root: str
    state: ContainerState
    name: str
    mode: str
    plan: dict
    bundle_dir: str
    bundle: Bundle
    opts: CriuOptions
    gpu: GpuSource
    gpu_offer: dict | None
    store: Store
    dump_mode: dict | None = None  # stop-and-copy: CRIU's dump or migrt's parallel dump (ops/dump.py decide)


def staging_name(name: str) -> str:
    """The name the source's images are staged under in the local store while checkpoint `name` goes
    to the target: never `name` itself, which the target locks and commits in its store (this one, on
    a pull from this node's own agent). The digest keeps two long names that share a prefix apart."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return names.validate(f"{name[:110].rstrip('._-')}.out-{digest}")


def prepare(cfg: Config, req: MigrateRequest) -> Prepared:
    """Every check that needs no peer, before the container is touched: its state, the lazy dump's
    limits, a lazy restore still filling it, its CUDA processes; the store made ready."""
    runtime = LowerRuntime(cfg.runtime_path())
    root = req.root or find_root(req.container_id, cfg.runtime_roots)
    if markers.gpu_suspended(root, req.container_id):
        raise Conflict(markers.gpu_suspended_message(req.container_id))
    state = runtime.state(root, req.container_id)
    if state.status not in ("running", "paused"):
        raise Conflict(f"container {req.container_id} is {state.status}; only a running container can be "
                       "migrated")
    name = names.validate(req.name) if req.name else default_name(req.container_id)
    mode = "lazy" if req.lazy else "direct" if req.direct else "stop-and-copy"
    plan = pre_dump_plan(req.pre_dump)
    from migrt.ops import dump as dump_ops
    from migrt.ops import space

    est = space.estimate(state.pid)
    # stop-and-copy dumps like `migrt checkpoint`: with migrt's parallel dump where it pays, whose threads
    # hash the pages as they write them (the transfer then sends those digests: bulk.py known=)
    dump_mode = dump_ops.decide(cfg, est.memory + est.gpu) if mode == "stop-and-copy" else None
    if mode in ("lazy", "direct"):  # CRIU's lazy dump, the pages from the frozen source
        lazy_mod.lazy_preflight("source")
        problem = lazy_mod.lazy_dump_problem(est.memory + est.gpu)  # GPU memory ends in the tasks' memory
        if problem:  # before anything is frozen (CRIU would fail half-way through the dump)
            raise PreconditionFailed(f"{mode} migration of {req.container_id} is not possible on this node: {problem}")
    bundle_dir = state.bundle
    try:
        bundle = Bundle.load(bundle_dir)
    except MigrtError:
        bundle = Bundle(bundle_dir, {})
    opts = CriuOptions.from_dict(cfg.criu_options).merged(shell_job=bundle.terminal)
    gpu = GpuSource(cfg, req.container_id, state.pid, bundle.config)
    # a container still being filled by a lazy restore (or migration) of its own: CRIU would dump only
    # the pages already in (runtime/lazy_memory.py); wait before the channel's stall timeout runs
    lazy_memory.wait_filled(lambda: procs.runc_container_pids(root, req.container_id),
                            f"migration of container {req.container_id}")
    gpu_offer = gpu.probe(paused=state.status == "paused")  # before anything is touched
    store = Store(cfg.store)
    store.ensure()
    store.gc()
    return Prepared(runtime, root, state, name, mode, plan, bundle_dir, bundle, opts, gpu, gpu_offer, store,
                     dump_mode)


def migrate(cfg: Config, req: MigrateRequest, progress: Progress = null_progress) -> dict:
    t_start = time.monotonic()
    key = load_key(cfg.migration_key_file)
    prep = prepare(cfg, req)
    progress("phase", name="connect", to=req.to)
    t0 = time.monotonic()
    ch = connect(req.to, key, tls=TLSFiles(**cfg.migration_tls) if cfg.migration_tls else None,
                 stall=cfg.migration_stall_timeout)
    return send(cfg, req, prep, ch, progress, t_start=t_start, t_connect=t0)


def send(cfg: Config, req: MigrateRequest, prep: Prepared, ch: Channel, progress: Progress = null_progress, *,
         t_start: float, t_connect: float) -> dict:
    """The migration over an authenticated channel to the target's receiving side: `migrt migrate`'s
    own connection, or the one a target's pull opened to this node's agent (agent.py). Closes it."""
    root, state, name, bundle, bundle_dir = prep.root, prep.state, prep.name, prep.bundle, prep.bundle_dir
    result: dict[str, Any] = {"name": name, "container_id": req.container_id, "to": req.to, "mode": prep.mode,
              "pre_dump": prep.plan,
              "phases": {}, "bytes": 0, "files": 0, "restored": False, "target": None,
              "downtime_s": None, "frozen_s": None, "total_s": None}
    guard: Guard | None = None
    try:
        # the source's Kubernetes namespace and bind mounts: the target refuses a pod it may not go
        # into now, before anything is frozen (its restore would refuse it later)
        ch.send({"type": "offer", "name": name, "mode": prep.mode, "container_id": req.container_id,
                 "schema": mf.SCHEMA, "cri": bundle.cri_metadata(), "mounts": _mounts(bundle),
                 **({"gpu": prep.gpu_offer} if prep.gpu_offer else {})})
        ready = ch.recv("ready")
        result["gpu"] = prep.gpu.check_answer(ready, req.to)  # the receiver's GPU preflight (None: no GPU)
        result["phases"]["connect_s"] = round(time.monotonic() - t_connect, 3)
        progress("done", name="connect", seconds=result["phases"]["connect_s"], peer=ch.peer)
        guard = Guard(f"source:{req.container_id}", cfg.log_file)  # starts while we prepare, before the freeze
        with prep.store.writer(staging_name(name), migration=name) as staging:
            fields = {
                "created": _utc(time.time()),
                "source": {"container_id": req.container_id, "runtime_root": root, "bundle": bundle_dir,
                           "pid": state.pid, "status": state.status, "cri": bundle.cri_metadata(),
                           "annotations": bundle.annotations, "node": socket.gethostname()},
                "versions": versions(prep.runtime.path),
                "options": {**prep.opts.to_dict(), "leave_running": False},
                "mounts": _mounts(bundle),
                "timings": result["phases"],
            }
            guard.arm({"do": "remove", "remove": [staging.path]})  # killed before the freeze: nothing else to undo
            source = _Source(prep.runtime.path, root, req.container_id, state.status == "paused" and not req.prefrozen,
                             guard, prep.gpu, moved=req.moved, prefrozen=req.prefrozen, on_frozen=req.on_frozen)
            source.staging = staging.path
            run = _Run(ch, ready, source, staging, prep.opts, fields, bundle, req, result, progress, cfg)
            run.dump_mode = prep.dump_mode
            run.lazy() if prep.mode in ("lazy", "direct") else run.stop_and_copy()
        guard.arm({"do": "nothing"})  # the staging directory is gone with the writer
    finally:
        ch.close()
        if guard:  # it acts on its last instruction: "nothing" unless we leave the source in doubt
            guard.release(wait=cfg.migration_stall_timeout * 3)
    result["total_s"] = round(time.monotonic() - t_start, 3)
    return result


def _mounts(bundle: Bundle) -> list[dict]:
    return [{"destination": m.get("destination"), "type": m.get("type"), "source": m.get("source")}
            for m in bundle.mounts]


class _Run:
    """One migration after the target said ready: the source container, its staging directory, the
    channel, and the result being filled in."""

    def __init__(self, ch: Channel, ready: dict, source: _Source, staging, opts: CriuOptions, fields: dict,
                 bundle: Bundle, req: MigrateRequest, result: dict, progress: Progress, cfg: Config) -> None:
        self.ch, self.ready, self.source, self.staging = ch, ready, source, staging
        self.opts, self.fields, self.bundle, self.req = opts, fields, bundle, req
        self.result, self.phases, self.progress = result, result["phases"], progress
        self.cfg = cfg
        self.upper = rootfs.overlay_upperdir(bundle.rootfs) if bundle.path else None
        self.t_freeze = 0.0
        self.dump_mode: dict | None = None

    def _timed(self, phase: str, t0: float, **extra) -> None:
        self.phases[f"{phase}_s"] = round(time.monotonic() - t0, 3)
        self.progress("done", name=phase, seconds=self.phases[f"{phase}_s"], **extra)

    def _dump_extras(self) -> None:
        """CRIU's dump log and the rootfs diff go along with the images."""
        dump_log = os.path.join(self.staging.work, "dump.log")
        if os.path.isfile(dump_log):
            os.makedirs(os.path.join(self.staging.path, "logs"), mode=0o700, exist_ok=True)
            os.replace(dump_log, os.path.join(self.staging.path, "logs", "dump.log"))
        t0 = time.monotonic()
        self.fields["rootfs"] = rootfs.capture(self.upper, self.staging.path,
                                               [m.get("destination", "") for m in self.bundle.mounts])
        self.phases["rootfs_diff_s"] = round(time.monotonic() - t0, 3)

    def _dump(self) -> dict | None:
        """The frozen container's images: CRIU's dump, or migrt's parallel dump where it pays (decided
        before the freeze, recorded as `dump_pages` as for `migrt checkpoint`); returns the 64 MiB chunk
        digests of the pages files the parallel dump hashed as it wrote them (None after CRIU's)."""
        from migrt.ops import dump as dump_ops

        source = self.source
        decision = self.dump_mode or {"mode": "criu", "requested": "criu", "reason": "decided by the caller"}
        rec = dump_ops.dump(self.cfg, LowerRuntime(source.runtime), source.root, self.req.container_id,
                            images=self.staging.images, work=self.staging.work, options=self.opts,
                            env=source.gpu.env(), journal=_GuardJournal(source), decision=decision,
                            progress=self.progress)
        known = rec.pop("chunk_digests", None)
        rec.pop("digests", None)
        for key in ("lazy_dump_s", "pages_s"):
            if key in rec:
                self.phases[key] = rec.pop(key)
        self.fields["dump_pages"] = rec
        return known

    def _send_all(self, *, release: bool, streams: int | None = None, known: dict | None = None) -> dict:
        files = _payload(self.staging.path)
        total = sum(os.path.getsize(full) for _, full in files)
        self.progress("phase", name="transfer", total_bytes=total)
        t0 = time.monotonic()
        sent = lambda n: self.progress("bytes", name="transfer", bytes=n)  # noqa: E731
        offer = self.ready.get("bulk")
        if isinstance(offer, dict) and offer.get("protocol") == bulk.PROTOCOL:
            meta = self._send_bulk(files, offer, release, streams, sent, known)
        else:  # a receiver without it (an older migrt): one file after the other on this connection
            meta = {rel: self.ch.send_file(full, rel, release=release, progress=sent) for rel, full in files}
        self.result.update(bytes=total, files=len(files))
        self._timed("transfer", t0, bytes=total)
        return meta

    def _send_bulk(self, files: list[tuple[str, str]], offer: dict, release: bool, streams: int | None,
                   sent, known: dict | None = None) -> dict:
        """Every file over `streams` connections at once, each chunk checked on arrival (bulk.py)."""
        want = streams or self.req.streams or self.cfg.migration_streams or bulk.auto_streams()
        offered = offer.get("streams")
        n = max(1, min(want, offered if isinstance(offered, int) else 1))
        tls = TLSFiles(**self.cfg.migration_tls) if self.cfg.migration_tls else None
        extra = bulk.open_streams(self.ch, offer, n - 1, tls=tls, stall=self.cfg.migration_stall_timeout)
        self.result["streams"] = n
        try:
            return bulk.send([self.ch, *extra], files, release=release, progress=sent, known=known)
        finally:
            for c in extra:
                c.close()

    def _failed(self, exc: MigrtError, what: str, *, target_kept: bool = False) -> MigrationFailed:
        return MigrationFailed(f"{what}: {exc}; {self.source.rollback(target_kept)}", exc)

    def _running(self, restored: dict, t_running: float) -> None:
        self.result.update(restored=True,
                           target={"container_id": restored.get("container_id"), "pid": restored.get("pid")},
                           downtime_s=round(t_running - self.t_freeze, 3), frozen_s=round(t_running - self.t_freeze, 3))

    def _hand_over(self) -> None:
        self.source.handing_over(self.cfg, self.req.to, self.result["name"], self.ready.get("container_id"))

    def _lost_target(self, exc: BaseException, what: str) -> None:
        """The connection broke (or stalled) after the target was asked to restore: ask it again on a
        new connection whether it runs the container, and apply the answer (handover.py). Returns
        when the target runs it (the migration happened); raises otherwise."""
        source = self.source
        state, outcome = handover.resolve_source(
            self.cfg, runtime=source.runtime, root=source.root, cid=source.cid, to=self.req.to,
            name=self.result["name"], target_cid=self.ready.get("container_id"), page_server=source.page_server,
            was_paused=source.was_paused, pages_pid=source.pages_pid, moved=source.moved)
        self.result["handover"] = {"lost": str(exc), "target": state, "outcome": outcome}
        # decided here (unknown included: the source stays frozen for a person to decide, as the error says)
        source.guard.arm({"do": "remove", "remove": [source.staging] if source.staging else []})
        if state == handover.RUNNING:
            source.frozen = False
            self.result.update(restored=True, target={"container_id": self.ready.get("container_id"), "pid": None})
            return
        if state == handover.ABSENT:
            source.frozen = False
            if source.gpu:  # thawed by the handover: now its GPU state, onto its own GPU
                outcome += source.gpu.resume()
        cause = exc if isinstance(exc, MigrtError) else TransferError(f"interrupted ({exc!r})")
        raise MigrationFailed(f"{what}: {exc}; {outcome}", cause) from exc

    def stop_and_copy(self) -> None:
        req, ch, source = self.req, self.ch, self.source
        failed = f"migration of {req.container_id} to {req.to} failed"
        self.progress("phase", name="dump", container=req.container_id)
        self.t_freeze = time.monotonic()
        try:
            if source.gpu.section is not None:  # a kill from here on: the guard also brings the GPU state back
                source.guard.arm({"do": "remove", "remove": [self.staging.path], "gpu_pids": source.gpu.pids})
            with ch.busy("gpu-checkpoint"):  # GPU first: the driver's lock needs running tasks
                source.gpu.suspend(self.progress)
            source.freeze(self.staging.path)
            with ch.busy("dump"):
                known = self._dump()
                self._timed("dump", self.t_freeze)
                source.gpu.write(self.staging.images, self.fields, self.phases)
                self._dump_extras()
            files = self._send_all(release=True, known=known)
            self.progress("phase", name="commit")
            t0 = time.monotonic()
            ch.send({"type": "commit", "manifest": {**self.fields, "files": files}})
            committed = ch.recv("committed")
            self._timed("commit", t0)
        except MigrtError as exc:
            ch.error(f"source aborted: {exc}", exc.exit_code)
            raise self._failed(exc, failed) from exc
        except BaseException:
            ch.error("source aborted")
            source.rollback()
            raise
        self.result["committed"] = committed.get("name")
        # The target holds a verified, durable copy from here on: the source may go.
        if not self.ready.get("restore") or req.free_source_early:
            source.destroy()
        if not self.ready.get("restore"):
            self.result["frozen_s"] = round(time.monotonic() - self.t_freeze, 3)
            ch.send({"type": "bye"})
            return
        self.progress("phase", name="restore", target=self.ready.get("container_id"))
        t0 = time.monotonic()
        name = self.result["name"]
        where = (f"the checkpoint {name} is committed in the target's store; restore it there "
                 f"('migrt restore {name} ...' or MIGRT_RESTORE={name})")
        if source.gpu.section is not None:  # a GPU migration: the target removes it (see receive.py)
            where = "the target removed what it received"
        if source.frozen:
            self._hand_over()
        try:
            ch.send({"type": "restore"})
            restored = ch.recv("restored")
        except RemoteError as exc:  # the target says its restore failed: it runs nothing
            if source.frozen:
                where += "; " + source.rollback(target_kept=True)
            raise MigrationFailed(f"restore on the target failed: {exc}; {where}", exc) from exc
        except (MigrtError, KeyboardInterrupt) as exc:
            if not source.frozen:  # --free-source-early: nothing here to decide about
                raise MigrationFailed(f"restore on the target failed: {exc}; {where}",
                                      exc if isinstance(exc, MigrtError) else TransferError(str(exc))) from exc
            self._lost_target(exc, f"lost the target while it restored {req.container_id}")
            self._timed("restore", t0)
            return
        t_running = time.monotonic()
        self._timed("restore", t0)
        if source.frozen:
            source.destroy()
        self._running(restored, t_running)
        ch.send({"type": "bye"})

    def lazy(self) -> None:
        """Post-copy: CRIU dumps everything but the memory (its lazy dump), which stays in the frozen
        source; migrt's page server (pageserve.py) then serves it to the target's page filler over
        several streams while the target already runs."""
        mode = self.result["mode"]  # lazy, or direct: the target runs only once every page is in
        failed = f"{mode} migration of {self.req.container_id} to {self.req.to} failed"
        self._check_lazy_target(mode)
        files, server = self._lazy_dump(failed)
        self._lazy_restore(mode, failed, files, server)

    def _check_lazy_target(self, mode: str) -> None:
        """The target restores at once and fetches pages from migrt's page server."""
        if not self.ready.get("restore"):
            raise UsageError(f"{mode} migration needs a target that restores at once; start 'migrt receive' on "
                             f"{self.req.to} with --restore BUNDLE")
        if "migrt-pages/1" not in (self.ready.get("pages") or []):
            raise UsageError(f"the receiver on {self.req.to} fetches lazy pages with CRIU's daemon (an older migrt): "
                             "upgrade migrt there, or migrate without --lazy")

    def _lazy_dump(self, failed: str) -> tuple[dict, pageserve.Handle]:
        """The page server started, the GPU suspended, the container frozen, CRIU's lazy dump, the
        images (all but the memory) sent; on a failure the target is told and the source rolled back."""
        req, ch, source = self.req, self.ch, self.source
        self.progress("phase", name="dump", container=req.container_id)
        self.t_freeze = time.monotonic()
        dump = server = None
        try:
            if source.gpu.section is not None and not source.prefrozen:  # as in stop_and_copy: GPU first, the
                # guard knows (a pod's cut locked it before its freeze, and its guard knows until the hand-over)
                source.guard.arm({"do": "remove", "remove": [self.staging.path], "gpu_pids": source.gpu.pids})
            server = self._start_page_server()  # before the freeze: its start is no downtime
            source.serving_pages(server.proc.pid)
            if req.early is not None:  # dumped at the pod's cut: its images, taken while the cut has it
                with ch.busy("dump"):
                    early_s = req.early.take(self.staging.images, self.staging.work)
                    source.freeze(self.staging.path)
                    self._lazy_dump_done(None, server, {"early_dump_s": time.monotonic()})
                    self.result["lazy_dump"]["early_dump_criu_s"] = early_s
            else:
                with ch.busy("gpu-checkpoint"):
                    source.gpu.suspend(self.progress)
                source.freeze(self.staging.path)
                marks = {"pause_s": time.monotonic()}
                crit = control.loopback_page_server()  # CRIU's page server: only ended, never used
                source.serving(crit)
                with ch.busy("dump"):
                    dump = control.LazyCheckpoint(source.runtime, source.root, req.container_id,
                                                  image_path=self.staging.images, work_path=self.staging.work,
                                                  options=self.opts, page_server=crit, env=source.gpu.env())
                    self._lazy_dump_done(dump, server, marks)
            files = self._send_all(release=False, streams=1)  # a few hundred KB: no more connections
        except MigrtError as exc:
            ch.error(f"source aborted: {exc}", exc.exit_code)
            _stop(dump, server)
            raise self._failed(exc, failed) from exc
        except BaseException:
            ch.error("source aborted")
            _stop(dump, server)
            source.rollback()
            raise
        return files, server

    def _lazy_dump_done(self, dump: control.LazyCheckpoint | None, server: pageserve.Handle,
                        marks: dict[str, float]) -> None:
        """CRIU's lazy dump to its end (None: made at the pod's cut), the memory then served by migrt's
        page server; where the downtime went, step by step; the GPU record and the dump's extras into
        the staging directory."""
        if dump is not None:
            dump.wait_ready(LAZY_READY_TIMEOUT)
            marks["criu_dump_s"] = time.monotonic()
            dump.finish(LAZY_READY_TIMEOUT)
            marks["criu_end_s"] = time.monotonic()
        self.source.serving(None)
        self._serve_pages(server)
        marks["page_server_s"] = time.monotonic()
        self._timed("dump", self.t_freeze)
        prev, detail = self.t_freeze, {}
        for k, t in marks.items():  # where the dump's downtime goes, step by step
            detail[k], prev = round(t - prev, 3), t
        self.result["lazy_dump"] = detail
        self.source.gpu.write(self.staging.images, self.fields, self.phases)
        self._dump_extras()

    def _lazy_restore(self, mode: str, failed: str, files: dict, server: pageserve.Handle) -> None:
        """The commit sent with the page server's port; the target restores and runs (direct: once every
        page is in), its pages keep coming until it says done; then the source is destroyed."""
        req, ch, source = self.req, self.ch, self.source
        self.progress("phase", name="restore", target=self.ready.get("container_id"))
        t0 = time.monotonic()
        self._hand_over()
        running = False
        if mode == "direct":  # the pages arrive during the restore: the target's heartbeats tell how far
            ch.on_alive = self._pages_progress()
        try:
            ch.send({"type": "commit", "manifest": {**self.fields, "files": files},
                     "pages": {"protocol": "migrt-pages/1", "port": server.port}})
            restored = ch.recv("restored")
            t_running = time.monotonic()
            running = True
            self._timed("restore", t0)
            self._running(restored, t_running)
            # The target runs; its memory still arrives from here. Wait until every page is across.
            self.progress("phase", name="pages")
            t0 = time.monotonic()
            ch.on_alive = self._pages_progress()
            done = ch.recv("done")
            ch.on_alive = None
        except RemoteError as exc:  # the target failed, and removed its copy before saying so
            _stop(None, server)
            lost = (" (it had run there since the restore: what it did there is lost; it continues from the freeze)"
                    if running else "")
            raise MigrationFailed(f"{failed}: {exc}; {source.rollback(target_kept=True)}{lost}", exc) from exc
        except (MigrtError, KeyboardInterrupt) as exc:
            self._lost_target(exc, f"lost the target during the {mode} migration of {req.container_id}")
            return
        served = server.wait(self.cfg.migration_stall_timeout * 3)  # it ends on the target's last word
        self._timed("pages", t0)
        self.result["lazy_pages_s"] = done.get("pages_s")
        self.result["pages"] = {"bytes": served.get("bytes"), "requests": served.get("requests"),
                                "streams": served.get("streams"), "fill": done.get("fill")}
        source.serving_pages(None)
        source.destroy()
        ch.send({"type": "bye"})

    def _pages_progress(self):
        """The target's heartbeats while the pages flow say how far its filler is: progress events."""
        seen = {"done": 0, "total": 0}

        def on_alive(msg: dict) -> None:
            total, done = msg.get("total_bytes"), msg.get("done_bytes")
            if not isinstance(total, int) or not isinstance(done, int):
                return
            if total and not seen["total"]:
                seen["total"] = total
                self.progress("phase", name="pages", total_bytes=total)
            if done > seen["done"]:
                self.progress("bytes", name="pages", bytes=done - seen["done"])
                seen["done"] = done
        return on_alive

    def _start_page_server(self) -> pageserve.Handle:
        try:
            return pageserve.Handle.start(host=self.ch.local_host, key=self.ch.pages_key, peer=None,
                                          tls=self.cfg.migration_tls or None,
                                          idle_s=self.cfg.migration_stall_timeout * 3)
        except pageserve.FetchError as exc:
            raise RuntimeFailed(str(exc)) from exc

    def _serve_pages(self, server: pageserve.Handle) -> None:
        """The dump is done: the page server may read the dumped processes (frozen, left in place)."""
        try:
            pids = procs.runc_vpid_map(self.source.root, self.req.container_id)
            wanted = set(pagefill_images.read_pids(self.staging.images))
        except (pagefill_images.ImageError, OSError) as exc:
            raise RuntimeFailed(f"cannot map the dumped processes to this node's pids: {exc}") from exc
        missing = sorted(wanted - set(pids))
        if missing:
            raise RuntimeFailed(f"the dumped processes {missing} are not in container {self.req.container_id} any more")
        try:
            server.serve({v: pids[v] for v in wanted})
        except pageserve.FetchError as exc:
            raise RuntimeFailed(str(exc)) from exc


class _GuardJournal:
    """ops/dump.py records its steps in a checkpoint's journal; in a migration the source's guard holds
    what must be undone: CRIU's page server of a parallel dump's lazy dump, which the guard ends (and
    waits for the dump) should `migrt migrate` be killed meanwhile."""

    def __init__(self, source: _Source) -> None:
        self.source = source

    def update(self, phase: str, **fields) -> None:
        if "page_server" in fields:
            ps = fields["page_server"]
            self.source.serving(tuple(ps) if ps else None)


def _stop(dump: control.LazyCheckpoint | None, server: pageserve.Handle | None) -> None:
    if dump:
        dump.abort()
    if server:
        server.stop()
