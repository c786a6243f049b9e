"""Restore a checkpoint as a container: verify, hard-link view of the images, runc restore --detach,
marker for the no-op start. A failed restore never deletes its checkpoint and cleans up after itself.

`restore_on_create` is the shim's path (create -> restore swap); `restore_checkpoint` is shared with
`migrt restore`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from migrt import names
from migrt.config import POLICIES, Config
from migrt.criu.options import CriuOptions
from migrt.errors import Conflict, MigrtError, PreconditionFailed, UsageError
from migrt.oci.bundle import Bundle, RestoreRequest
from migrt.ops import pages, restore_checks, restore_privileges
from migrt.pods import namespaces, rootfs
from migrt.progress import Progress, null_progress
from migrt.registry import reference
from migrt.runtime.argv import Call, CreateFlags
from migrt.runtime.markers import write_marker
from migrt.runtime.runc import LowerRuntime, RestoreSpec
from migrt.store import Store, journal

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import Any


@dataclass
class RestoreTarget:
    container_id: str
    bundle: Bundle
    root: str
    global_tokens: list[str] | None = None  # None: migrt builds --root/--log itself
    pid_file: str | None = None
    console_socket: str | None = None
    no_pivot: bool = False
    stdio: tuple | None = None
    log_path: str | None = None
    log_format: str = "json"
    extra: list[str] = field(default_factory=list)
    wait_pages: bool = False  # lazy restore: return only once every page is in (a GPU restore always waits)
    # Migration seams: `verified` skips re-hashing a checkpoint just imported and verified on the fly;
    # `before_restore(image_view, work_dir)` runs right before runc restore (lazy pages: the daemon);
    # `supervise(proc)` waits for runc restore and may kill it (a migration's progress deadline).
    verified: bool = False
    before_restore: Callable[[str, str], None] | None = None
    supervise: Callable | None = None
    fill: object | None = None  # a PageFill started by the caller (lazy migration: pages from the source)
    # a direct migration: the restored tree is held at CRIU's post-restore until `fill` has every page
    # (ops/pages.py FilledFirst); fill_first is then its stall deadline in seconds
    fill_first: float | None = None

    @classmethod
    def for_create(cls, flags: CreateFlags, bundle: Bundle, **seams: Any) -> RestoreTarget:
        """The restore that replaces a runc `create`: its container, root, global flags, pid file,
        console socket and log (runtime/argv.py Call.create_flags); `seams` as above."""
        return cls(container_id=flags.container_id, bundle=bundle, root=flags.root,
                   global_tokens=list(flags.global_tokens), pid_file=flags.pid_file,
                   console_socket=flags.console_socket, no_pivot=flags.no_pivot, log_path=flags.log_path,
                   log_format=flags.log_format, **seams)


def restore_checkpoint(cfg: Config, name: str, target: RestoreTarget, progress: Progress = null_progress) -> dict:
    """Restore under a shared lock (any number of restores of one checkpoint at once; `rm` waits),
    recorded in the journal so that a half-restored container of a killed migrt is cleaned up."""
    names.validate(name)
    store = Store(cfg.store)
    store.check()  # a store another user could change is never read (nor its journal acted on)
    try:
        _mark("restore")
        if any(e.get("stale") for e in journal.entries(store.root)):  # someone's interrupted operation
            from migrt.ops import recover

            recover.recover(cfg, wait_s=0)  # never delay a restore (containerd's create) for someone else's helpers
        _mark("recovered")
        with store.reading(name) as ckpt:
            with journal.recording(store.root, "restore", name=name, container=target.container_id,
                                   root=target.root) as entry:
                return _restore_read(cfg, store, ckpt, target, entry, progress)
    except OSError as exc:
        raise MigrtError(f"restore of checkpoint {name} failed: {exc} (the checkpoint is unchanged)") from exc


def _restore_read(cfg: Config, store: Store, ckpt, target: RestoreTarget, entry, progress: Progress) -> dict:
    name = ckpt.name
    runtime = LowerRuntime(cfg.runtime_path())
    timings: dict[str, float] = {}
    t_all = time.monotonic()
    progress("phase", name="verify", checkpoint=name)
    entry.update("verifying")
    t0 = time.monotonic()
    store.check_images_dir(ckpt)
    background: list[str] = []
    if not target.verified:  # up front: every file there with its size, the small ones hashed
        front, background = restore_checks.split_for_background(ckpt.manifest.get("files") or {}, ckpt.path)
        ckpt.verify_structure()
        ckpt.verify_hashes(front)
    _mark("verified")
    timings["verify_s"] = round(time.monotonic() - t0, 3)
    progress("done", name="verify", seconds=timings["verify_s"])
    state_dir = os.path.join(target.root, names.container_id(target.container_id))
    if os.path.exists(state_dir):
        raise Conflict(f"container {target.container_id} already exists in {target.root}")
    work = os.path.join(target.bundle.path, f".migrt-work-{os.getpid()}")
    # Checks that run while the restore prepares and CRIU restores; the restored tree waits at CRIU's
    # post-restore for their verdict, and migrt checks it again before anything runs on a GPU
    # (ops/restore_checks.py): the large image files hashed, and for a checkpoint with GPU state the
    # GPU preflight (NVML: the new container's GPUs, their models, free memory, the remap) and the
    # driver's load (cuInit), which start as runc is called (their Python work would compete for the
    # GIL with the steps before it); their modules are imported there too, off the path to CRIU.
    checks = restore_checks.RestoreChecks(work)
    section = ckpt.manifest.get("gpu")
    has_gpu = bool(section and section.get("processes"))  # gpu_steps.has_gpu_state, without importing it
    if has_gpu:
        what = f"checkpoint {name}"
        checks.add("gpu_preflight", lambda: _gpu_steps().restore_preflight(section, target.bundle.config, what),
                   deferred=True)
        checks.add("gpu_driver", lambda: _gpu_steps().restore_driver(cfg, what), deferred=True)
    fill = None
    gate = None
    try:
        security = check_target(ckpt.manifest, target.bundle, name, allow_cross_namespace=cfg.allow_cross_namespace_restore,
                                allow_unbound=cfg.allow_unbound_checkpoints, images=ckpt.images,
                                rootfs_changes=lambda: restore_privileges.layer_changes(ckpt.path))
        options = CriuOptions.from_dict(ckpt.manifest.get("options"))
        if target.fill is not None:  # a lazy migration's filler, already fetching from the source
            page_mode = pages.migration_mode(target.fill)
        else:
            page_mode = pages.decide(cfg, ckpt.images, name=name, manifest_files=ckpt.manifest.get("files"),
                                     recorded=ckpt.manifest.get("pagefill"),
                                     other_lazy="--lazy-pages" in target.extra)
        entry.update("preparing", work=work)
        os.makedirs(work, mode=0o700, exist_ok=True)
        global_tokens = target.global_tokens
        log_path = target.log_path
        if global_tokens is None:
            log_path = os.path.join(work, "runc.log")
            global_tokens = ["--root", target.root, "--log", log_path, "--log-format", "json"]
        # pages images the filler verifies chunk by chunk as it fills them (each chunk before any page
        # of it is copied, the chunks CRIU reads itself before the tree runs) instead of the whole file
        # being hashed before the tree may run (docs/restore-pages.md, "What is verified when")
        as_filled = pages.verify_as_filled(page_mode, ckpt.manifest, background, name) \
            if target.fill is None else None
        if as_filled:
            handed = {f["rel"] for f in as_filled["files"].values()}
            background = [r for r in background if r not in handed]
        if background:
            checks.add("verify_background", lambda: ckpt.verify_hashes(background))
        # a lazy restore's tree waits at the gate for the guard's own plan of the images (the choice
        # may rest on the manifest's record alone)
        plan_check = pages.PlanCheck(page_mode, name) if target.fill is None and page_mode["mode"] == "lazy" else None
        if plan_check is not None:
            checks.add("pages_plan", plan_check, deferred=True)
        eager_check = pages.EagerVerified(name) if as_filled else None
        if eager_check is not None:
            checks.add("pages_verify_eager", eager_check, deferred=True)
        if target.fill is not None and target.fill_first:  # nothing runs before all of its memory is in
            page_mode["fill_first"] = True
            checks.add("pages_in", pages.FilledFirst(target.fill, checks, stall=target.fill_first), deferred=True)
        # the page filler (lazy restore) must listen before CRIU starts
        fill = target.fill if target.fill is not None else pages.start(
            page_mode, ckpt.images, container_id=target.container_id, root=target.root,
            runc_log=target.log_path if target.global_tokens is not None else None,
            log_format=target.log_format, log_file=cfg.log_file, post_restore=checks.ran_path, verify=as_filled)
        if as_filled and fill is None:  # the filler could not start (auto: eager): hashed before the tree runs
            late = sorted(f["rel"] for f in as_filled["files"].values())
            checks.add("verify_background_pages", lambda: ckpt.verify_hashes(late))
            page_mode["verify"] = {"as_filled": [], "before_run": sorted(background + late)}
        checks.start()
        if plan_check is not None:
            plan_check.fill = fill
        if eager_check is not None:
            eager_check.fill = fill
        if (ckpt.manifest.get("rootfs") or {}).get("captured"):
            t0 = time.monotonic()
            rootfs.apply_checkpoint(ckpt.path, ckpt.manifest, target.bundle.rootfs)
            timings["rootfs_apply_s"] = round(time.monotonic() - t0, 3)
        if ckpt.manifest.get("devshm"):
            from migrt.pods.engines import DEVSHM_TAR

            rootfs.apply_devshm(os.path.join(ckpt.path, DEVSHM_TAR), target.bundle.mounts)
        with store.restore_view(ckpt) as view, restore_privileges.shared_with_userns(view, security):
            _mark("view")
            hostname = namespaces.retarget_uts(view, target.bundle)
            rootfs.align_root_mode(view, target.bundle.rootfs, recorded=ckpt.manifest.get("root_mode"))
            spec = RestoreSpec(
                container_id=target.container_id, bundle=target.bundle.path, image_path=view,
                work_path=work, pid_file=target.pid_file or os.path.join(work, "init.pid"), console_socket=target.console_socket,
                no_pivot=target.no_pivot, options=options,
                extra=target.extra + security.runc_args + (["--lazy-pages"] if fill else []),
            )
            if fill:
                fill.link(work)
            if target.before_restore:
                target.before_restore(view, work)
            env = None
            if has_gpu:  # migrt drives the GPU: CRIU's GPU hook (hooks/cuda-criu-action) stands aside
                from migrt.gpu.records import HANDLED_ENV

                env = {**os.environ, HANDLED_ENV: "1"}
            if checks.pending:
                env = checks.gate_env(env)
            entry.update("restoring", view=view)
            progress("phase", name="restore", checkpoint=name)
            timings["criu_call_after_start_s"] = _mark("criu")  # the shim's own start, for bench/
            timings["start_marks"] = dict(_MARKS)
            t0 = time.monotonic()
            checks.release()
            try:
                pid = runtime.restore(spec, global_tokens=global_tokens, stdio=target.stdio, log_path=log_path,
                                      env=env,
                                      **({"supervise": target.supervise} if target.supervise else {}))
                timings["restore_s"] = round(time.monotonic() - t0, 3)
                checks.raise_failure()  # CRIU's gate already held the tree for it; this is the second lock
                progress("done", name="restore", seconds=timings["restore_s"])
                if fill:
                    pages.after_restore(fill, pid, name)
                if has_gpu:
                    entry.update("gpu-restore", pid=pid)
                    gpu = checks.value("gpu_preflight")
                    gpu.backend = checks.value("gpu_driver")
                    gpu.hook_timeout_s = _gpu_steps().hook_timeout_s(cfg)  # the application hook's post-restore
                    # GPU restore (remap) + unlock. The driver reads each process's memory: with the filler,
                    # a process's GPU restore starts once its own memory is in, the others' still arriving
                    early = os.environ.get("MIGRT_GPU_RESTORE_EARLY") == "1"  # experiment seam (pages.py)
                    timings.update(gpu.resume(pid, progress, pages.MemoryReady(fill, early) if fill else None))
                if fill and target.wait_pages:
                    pages.wait_all(fill, page_mode, timings, name)
            except (MigrtError, OSError) as exc:
                if os.path.exists(state_dir):  # ours: it did not exist before
                    from migrt.runtime.cleanup import unmount_under

                    unmount_under(state_dir)  # a killed runc's criu-root bind mount: delete would walk into it
                    runtime.delete_force(target.root, target.container_id)
                cause = checks.failure()  # first: a check may still read the filler's status (PlanCheck)
                if fill:
                    cause = cause or pages.failed(fill, exc, name)  # a chunk that did not verify
                if cause is not None and cause is not exc:
                    raise cause from exc  # a failed check is the reason, whatever CRIU said
                raise
        write_marker(target.root, target.container_id,
                     {"checkpoint": name, "restored_at": time.time(), "pid": pid, "pages": page_mode["mode"]})
        entry.update("restored")
    finally:
        checks.failure()  # every check thread has ended before the lock goes
        timings.update({f"{k}_s": v for k, v in checks.seconds().items()})
        # whether CRIU ran the gate (held the tree until the checks passed); migrt checked them too
        gate = ("held" if checks.gate_ran else "not run") if checks.pending else None
        if fill and target.fill is None:  # (a caller's filler is the caller's to let go)
            fill.detach()  # the filler carries on alone; its guard kills the container should it fail
        shutil.rmtree(work, ignore_errors=True)
    timings["total_s"] = round(time.monotonic() - t_all, 3)
    return {"checkpoint": name, "container_id": target.container_id, "pid": pid, "hostname": hostname,
            "timings": timings, "restore_gate": gate, "pages": page_mode, "security": security.notes}


def _gpu_steps():
    """The GPU steps' modules (NVML, ctypes, threads: ~15 ms to import), loaded only for a checkpoint
    with GPU state, and then in the check threads that run while CRIU restores."""
    from migrt.ops import gpu_steps

    return gpu_steps


_MARKS: dict[str, float | None] = {}
_FIRST: list[float] = []  # (process age, time.monotonic()) at the first mark


def _mark(step: str) -> float | None:
    """The process's age when `step` was reached (the restore path's start, step by step, in the
    `restored` log event's timings.start_marks): the first from /proc (10 ms resolution), the
    others that plus time.monotonic()'s difference, so that the steps' own costs are exact."""
    if not _FIRST:
        age = _process_age_s()
        if age is None:
            _MARKS[step] = None
            return None
        _FIRST.extend((age, time.monotonic()))
    _MARKS[step] = age = round(_FIRST[0] + time.monotonic() - _FIRST[1], 4)
    return age


def _process_age_s() -> float | None:
    """Seconds since this process started (exec keeps the start: migrt-runc's sh fast path counts),
    at the kernel's clock-tick resolution (10 ms); None where /proc says nothing."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return round(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 3)
    except (OSError, ValueError, IndexError):
        return None


def check_target(manifest: dict, bundle: Bundle, name: str, *, allow_cross_namespace: bool,
                 allow_unbound: bool = False, images: str | None = None,
                 rootfs_changes: Callable[[], list[str]] | None = None) -> restore_privileges.Verdict:
    """Refuse, before anything is touched, a target the checkpoint cannot go into: another Kubernetes
    namespace, a pod for a checkpoint bound to none, missing mounts, and (given its `images`) a
    container that grants less than the checkpointed processes hold (ops/restore_privileges.py).
    Returns what runc must be told for the privileges to match (an --lsm-profile)."""
    src_ns = ((manifest.get("source") or {}).get("cri") or {}).get("pod_namespace")
    check_namespace(src_ns, bundle, name, allow_cross_namespace=allow_cross_namespace, allow_unbound=allow_unbound)
    old_binds = rootfs.bind_destinations(manifest.get("mounts") or [])
    new_dests = {m.get("destination") for m in bundle.mounts}
    missing = [d for d in old_binds if d not in new_dests]
    if missing:
        sources = {m.get("destination"): m.get("source") for m in manifest.get("mounts") or []}
        raise PreconditionFailed(
            f"the new container lacks the mount destination {missing[0]} (the checkpointed container had a bind "
            f"mount from {sources.get(missing[0])} there); give the new container a volume at {missing[0]}"
            + (f" (also missing: {', '.join(missing[1:])})" if missing[1:] else "")
        )
    if images is None:
        return restore_privileges.Verdict()
    captured = bool((manifest.get("rootfs") or {}).get("captured"))  # the layer a restore applies
    return restore_privileges.check(images, bundle, name, rootfs_changes=rootfs_changes if captured else None)


def check_namespace(src_ns: str | None, bundle: Bundle, name: str, *, allow_cross_namespace: bool,
                    allow_unbound: bool) -> None:
    """A checkpoint taken in Kubernetes namespace src_ns goes into a pod of that namespace only; one
    that records none (not taken from a pod, or made by hand) into no pod."""
    dst_ns = bundle.cri_metadata().get("pod_namespace")
    if src_ns and dst_ns != src_ns and not allow_cross_namespace:
        raise PreconditionFailed(
            f"checkpoint {name} was taken in Kubernetes namespace {src_ns!r} and may only be restored there "
            f"(target: {dst_ns or 'not a pod'}); set 'allow_cross_namespace_restore: true' in the migrt config to allow it"
        )
    if dst_ns and not src_ns and not allow_unbound:
        raise PreconditionFailed(
            f"checkpoint {name} records no Kubernetes namespace (not taken from a pod, or made by hand) and may not "
            f"be restored into a pod (namespace {dst_ns!r}); set 'allow_unbound_checkpoints: true' in the migrt "
            "config to allow checkpoints without a namespace into pods"
        )


def pull_for_create(cfg: Config, request: RestoreRequest, bundle: Bundle, log, cid: str) -> tuple[str, bool]:
    """(store name, pulled now) of a create's `oci:REF` request: pulled once per node, within the
    config's restore_registries and registry_timeout (registry/pull.py ensure_local). An image that says
    it belongs to another namespace than the pod's (or to none) is refused before any layer is
    fetched; one that says so only once pulled is removed again. A failed pull reaches the runc log, which containerd
    shows to the pod's author, as one generic line: the registry's answer (or its silence, a closed
    port, plain HTTP, TLS) would tell that author about the node's network; the detail goes to
    migrt's own log. Refusals of the request itself (reference, registry, namespace) say what they are."""
    from migrt.errors import RegistryError
    from migrt.registry import pull  # http.client, ssl: only for oci: references

    def admit(image_ns: str | None) -> None:
        check_namespace(image_ns, bundle, request.name, allow_cross_namespace=cfg.allow_cross_namespace_restore,
                        allow_unbound=cfg.allow_unbound_checkpoints)

    try:
        name, just_pulled = pull.ensure_local(cfg, request.name, admit=admit)
    except (UsageError, PreconditionFailed):
        raise
    except MigrtError as exc:
        log.error("restore_pull_failed", container=cid, reference=request.name, error=str(exc),
                  exit_code=exc.exit_code)
        raise RegistryError(f"cannot pull {request.name} (see the node's migrt log)") from exc
    if just_pulled:  # what the checkpoint itself records (an image may not have said it before the pull)
        store = Store(cfg.store)
        try:
            admit(((store.get(name).manifest.get("source") or {}).get("cri") or {}).get("pod_namespace"))
        except PreconditionFailed:
            try:
                store.remove(name, wait=0)
            except MigrtError as exc:  # in use by another restore meanwhile: it stays
                log.warning("refused_pull_kept", checkpoint=name, error=str(exc))
            raise
    return name, just_pulled


@dataclass(frozen=True)
class FreshStart:
    """A create's restore failed and its restore failure policy is 'fresh': the shim warns in runc's
    log and runs the original create."""

    warning: str


def restore_on_create(call: Call, bundle: Bundle, request: RestoreRequest) -> FreshStart | None:
    """The shim's create -> restore swap: None once restored; a FreshStart when the restore failed and
    the policy says so; else the failure, as a MigrtError."""
    from migrt import config as config_mod
    from migrt import log as log_mod

    _mark("imported")
    cfg = config_mod.load()  # fail closed: never guess a store or policy
    _mark("config")
    log = log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-runc")
    if call.lower_warning:
        log.warning("lower_runtime_fallback", detail=call.lower_warning)
    cid = call.container_id or None
    policy = request.fallback or cfg.restore_failure_policy
    log.info("restore_requested", container=cid, checkpoint=request.name, source=request.source, policy=policy)
    try:
        result = _restore_on_create(cfg, log, call, bundle, request, policy)
    except MigrtError as exc:
        log.error("restore_failed", container=cid, checkpoint=request.name, error=str(exc))
        if policy == "fresh":
            return FreshStart(f"restore of {request.name!r} failed ({exc}); starting the container fresh "
                              "(restore failure policy 'fresh')")
        raise
    log.info("restored", **result)
    return None


def _restore_on_create(cfg: Config, log, call: Call, bundle: Bundle, request: RestoreRequest, policy: str) -> dict:
    if policy not in POLICIES:
        raise UsageError(f"MIGRT_RESTORE_FALLBACK must be one of {POLICIES}, got {policy!r}")
    flags = call.create_flags()  # refused: no container id, a flag restore cannot honour
    name, just_pulled = request.name, False
    if reference.is_reference(name):  # oci:REF: pulled into the store once per node, then restored
        t0 = time.monotonic()
        name, just_pulled = pull_for_create(cfg, request, bundle, log, flags.container_id)
        log.info("restore_image_ready", container=flags.container_id, reference=request.name, checkpoint=name,
                 pulled=just_pulled, seconds=round(time.monotonic() - t0, 3))
    names.validate(name)
    for flag in flags.dropped:
        log.debug("create_flag_dropped", flag=flag)
    cfg.runtime = call.lower  # the shim already resolved it (same rules)
    # every byte of a checkpoint pulled a moment ago was checked against its digest on arrival
    target = RestoreTarget.for_create(flags, bundle, verified=just_pulled)
    try:
        return restore_checkpoint(cfg, name, target)
    except MigrtError:
        raise
    except Exception as exc:  # never leak a traceback to the container's stderr
        log.exception("restore_crashed", container=flags.container_id)
        raise MigrtError(f"internal error during restore of {request.name!r}: {exc!r}") from exc
