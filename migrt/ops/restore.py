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
    from migrt.registry.client import Deadline


@dataclass
class RestoreSeams:
    """What a caller that did part of a restore's work already hands it (a migration's receiver; a
    create that pulled its checkpoint a moment ago): `verified` skips re-hashing a checkpoint just
    imported and verified on the fly; `before_restore(image_view, work_dir)` runs right before runc
    restore (lazy pages: the daemon); `supervise(proc)` waits for runc restore and may kill it (a
    migration's progress deadline); `fill` is a PageFill the caller started (lazy migration: pages
    from the source), and with `fill_first` (a direct migration) the restored tree is held at CRIU's
    post-restore until `fill` has every page (ops/pages.py FilledFirst), `fill_first` seconds without
    one being its stall deadline. `registry`: the pages come from the registry as the filler needs them
    (restore_pulling)."""

    verified: bool = False
    registry: object | None = None  # a lazy restore by reference: registry/lazy.py LazyImage
    before_restore: Callable[[str, str], None] | None = None
    supervise: Callable | None = None
    fill: object | None = None
    fill_first: float | None = None
    criu_env: Callable[[dict | None, str], dict] | None = None  # runc's env, given the work dir (a pod's hold)


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
    seams: RestoreSeams = field(default_factory=RestoreSeams)

    @classmethod
    def for_create(cls, flags: CreateFlags, bundle: Bundle, seams: RestoreSeams | None = None) -> RestoreTarget:
        """The restore that replaces a runc `create`: its container, root, global flags, pid file,
        console socket and log (runtime/argv.py Call.create_flags)."""
        return cls(container_id=flags.container_id, bundle=bundle, root=flags.root,
                   global_tokens=list(flags.global_tokens), pid_file=flags.pid_file,
                   console_socket=flags.console_socket, no_pivot=flags.no_pivot, log_path=flags.log_path,
                   log_format=flags.log_format, seams=seams or RestoreSeams())


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
        with store.reading(name) as ckpt, journal.recording(store.root, "restore", name=name,
                                                            container=target.container_id, root=target.root) as entry:
            if "pod" in ckpt.manifest:  # a pod's checkpoint: this container's part of it, held (issue 29)
                from migrt.ops.pod_restore import restore_part

                return restore_part(cfg, ckpt, target, lambda part, tgt: _Restore(cfg, store, part, tgt, entry,
                                                                                  progress).run())
            return _Restore(cfg, store, ckpt, target, entry, progress).run()
    except OSError as exc:
        raise MigrtError(f"restore of checkpoint {name} failed: {exc} (the checkpoint is unchanged)") from exc


def restore_pulling(cfg: Config, lazy, target: RestoreTarget, progress: Progress = null_progress) -> dict:
    """A lazy restore by reference (registry/lazy.py LazyImage): from the pull's partial directory, not a
    store checkpoint yet; the image lock, held since the pull began, keeps other pulls of the image out,
    and the page filler takes it over until it has committed the image. Journaled as any restore."""
    store = Store(cfg.store)
    store.check()
    name = lazy.ckpt.name
    try:
        with journal.recording(store.root, "restore", name=name, container=target.container_id,
                               root=target.root) as entry:
            return _Restore(cfg, store, lazy.ckpt, target, entry, progress).run()
    except OSError as exc:
        raise MigrtError(f"restore of {name} from the registry failed: {exc} (what arrived is kept; restore "
                         "again)") from exc
    finally:
        lazy.release()


class _Restore:
    """One restore of a checkpoint read under the store's lock, its steps in the order they run: verify
    the checkpoint (its large files left to the background), refuse a target it cannot go into, decide
    how its memory comes in (PagesPlan), prepare the work directory and the checks the gate waits for,
    apply the rootfs layer, restore through the lower runtime in a view of the images, then the GPU and
    the memory. Whatever happens, the checks end, a filler of ours is let go and the work directory goes.

    The checks run while the restore prepares and CRIU restores; the restored tree waits at CRIU's
    post-restore for their verdict, and migrt checks it again before anything runs on a GPU
    (ops/restore_checks.py): the large image files hashed, and for a checkpoint with GPU state the GPU
    preflight (NVML: the new container's GPUs, their models, free memory, the remap) and the driver's
    load (cuInit), which start as runc is called (their Python work would compete for the GIL with
    the steps before it); their modules are imported there too, off the path to CRIU."""

    def __init__(self, cfg: Config, store: Store, ckpt, target: RestoreTarget, entry, progress: Progress) -> None:
        self.cfg, self.store, self.ckpt, self.target = cfg, store, ckpt, target
        self.entry, self.progress = entry, progress
        self.name: str = ckpt.name
        self.runtime = LowerRuntime(cfg.runtime_path())
        self.timings: dict = {}
        self.t_all = time.monotonic()
        self.state_dir = ""  # the container's state directory under the runtime root, once its id is checked
        self.work = os.path.join(target.bundle.path, f".migrt-work-{os.getpid()}")
        self.checks = restore_checks.RestoreChecks(self.work)
        section = ckpt.manifest.get("gpu")
        self.gpu_section: dict | None = section if section and section.get("processes") else None

    def run(self) -> dict:
        t = self.target
        background = self._verify()
        self.state_dir = os.path.join(t.root, names.container_id(t.container_id))
        if os.path.exists(self.state_dir):
            raise Conflict(f"container {t.container_id} already exists in {t.root}")
        self._gpu_checks()
        plan: pages.PagesPlan | None = None
        try:
            security = check_target(self.ckpt.manifest, t.bundle, self.name,
                                    allow_cross_namespace=self.cfg.allow_cross_namespace_restore,
                                    allow_unbound=self.cfg.allow_unbound_checkpoints, images=self.ckpt.images,
                                    rootfs_changes=lambda: restore_privileges.layer_changes(self.ckpt.path))
            options = CriuOptions.from_dict(self.ckpt.manifest.get("options"))
            plan = pages.PagesPlan.decide(self.cfg, self.ckpt, t.seams.fill, other_lazy="--lazy-pages" in t.extra)
            lazy = t.seams.registry
            if lazy is not None:
                plan.from_registry(lazy.handover, lazy.lock_fd, lazy.summary)  # type: ignore[attr-defined]
            self._prepare(plan, background)
            self._apply_rootfs()
            pid, hostname = self._restore(plan, options, security)
            write_marker(t.root, t.container_id,
                         {"checkpoint": self.name, "restored_at": time.time(), "pid": pid, "pages": plan.mode})
            self.entry.update("restored")
        finally:
            gate = self._end(plan)
        self.timings["total_s"] = round(time.monotonic() - self.t_all, 3)
        return {"checkpoint": self.name, "container_id": t.container_id, "pid": pid, "hostname": hostname,
                "timings": self.timings, "restore_gate": gate, "pages": plan.decision, "security": security.notes}

    def _verify(self) -> list[str]:
        """Up front: every file there with its size, the small ones hashed (skipped for a checkpoint the
        caller verified on arrival). Returns the large files left to hash while CRIU restores."""
        self.progress("phase", name="verify", checkpoint=self.name)
        self.entry.update("verifying")
        t0 = time.monotonic()
        self.store.check_images_dir(self.ckpt)
        background: list[str] = []
        if not self.target.seams.verified:
            front, background = restore_checks.split_for_background(self.ckpt.manifest.get("files") or {},
                                                                    self.ckpt.path)
            self.ckpt.verify_structure()
            self.ckpt.verify_hashes(front)
        _mark("verified")
        self.timings["verify_s"] = round(time.monotonic() - t0, 3)
        self.progress("done", name="verify", seconds=self.timings["verify_s"])
        return background

    def _gpu_checks(self) -> None:
        """A checkpoint with GPU state: the GPU preflight and the driver's load, started as runc is called."""
        section = self.gpu_section
        if section is None:
            return
        what = f"checkpoint {self.name}"
        config = self.target.bundle.config
        self.checks.add("gpu_preflight", lambda: _gpu_steps().restore_preflight(section, config, what), deferred=True)
        self.checks.add("gpu_driver", lambda: _gpu_steps().restore_driver(self.cfg, what), deferred=True)

    def _prepare(self, plan: pages.PagesPlan, background: list[str]) -> None:
        """The work directory; the background hashing (less the pages images a filler verifies as it
        fills them); the page checks; the filler, listening before CRIU starts; the checks started."""
        self.entry.update("preparing", work=self.work)
        os.makedirs(self.work, mode=0o700, exist_ok=True)
        ckpt, t = self.ckpt, self.target
        background = plan.verified_as_filled(ckpt.manifest, background)
        if background:
            self.checks.add("verify_background", lambda: ckpt.verify_hashes(background))
        plan.add_checks(self.checks, fill_first=t.seams.fill_first)
        late = plan.start_filler(self.checks, container_id=t.container_id, root=t.root,
                                 runc_log=t.log_path if t.global_tokens is not None else None,
                                 log_format=t.log_format, log_file=self.cfg.log_file)
        if late:  # the filler could not start (auto: eager): hashed before the tree runs
            self.checks.add("verify_background_pages", lambda: ckpt.verify_hashes(late))
        self.checks.start()

    def _apply_rootfs(self) -> None:
        """The checkpoint's rootfs changes and /dev/shm, into the new container's."""
        manifest = self.ckpt.manifest
        if (manifest.get("rootfs") or {}).get("captured"):
            t0 = time.monotonic()
            rootfs.apply_checkpoint(self.ckpt.path, manifest, self.target.bundle.rootfs)
            self.timings["rootfs_apply_s"] = round(time.monotonic() - t0, 3)
        if manifest.get("devshm"):
            from migrt.pods.engines import DEVSHM_TAR

            rootfs.apply_devshm(os.path.join(self.ckpt.path, DEVSHM_TAR), self.target.bundle.mounts)

    def _restore(self, plan: pages.PagesPlan, options: CriuOptions,
                 security: restore_privileges.Verdict) -> tuple[int, str | None]:
        """runc restore in a view of the images, then the GPU and the memory. (pid, hostname)."""
        t = self.target
        with self.store.restore_view(self.ckpt) as view, restore_privileges.shared_with_userns(view, security):
            _mark("view")
            hostname = namespaces.retarget_uts(view, t.bundle)
            rootfs.align_root_mode(view, t.bundle.rootfs, recorded=self.ckpt.manifest.get("root_mode"))
            spec = RestoreSpec(
                container_id=t.container_id, bundle=t.bundle.path, image_path=view, work_path=self.work,
                pid_file=t.pid_file or os.path.join(self.work, "init.pid"), console_socket=t.console_socket,
                no_pivot=t.no_pivot, options=options, extra=t.extra + security.runc_args + plan.runc_args())
            plan.link(self.work)
            if t.seams.before_restore:
                t.seams.before_restore(view, self.work)
            env = self._env()
            self.entry.update("restoring", view=view)
            self.progress("phase", name="restore", checkpoint=self.name)
            self.timings["criu_call_after_start_s"] = _mark("criu")  # the shim's own start, for bench/
            self.timings["start_marks"] = dict(_MARKS)
            t0 = time.monotonic()
            self.checks.release()
            try:
                return self._run(spec, env, plan, t0), hostname
            except (MigrtError, OSError) as exc:
                cause = self._undo(plan, exc)
                if cause is not None and cause is not exc:
                    raise cause from exc  # a failed check is the reason, whatever CRIU said
                raise

    def _env(self) -> dict | None:
        """runc's environment: CRIU's GPU hook stands aside where migrt drives the GPU; the gate armed."""
        env = None
        if self.gpu_section:  # migrt drives the GPU: CRIU's GPU hook (hooks/cuda-criu-action) stands aside
            from migrt.gpu.records import HANDLED_ENV

            env = {**os.environ, HANDLED_ENV: "1"}
        if self.checks.pending:
            env = self.checks.gate_env(env)
        if self.target.seams.criu_env:
            env = self.target.seams.criu_env(env, self.work)
        return env

    def _run(self, spec: RestoreSpec, env: dict | None, plan: pages.PagesPlan, t0: float) -> int:
        """The lower runtime's restore; the checks' verdict; the filler told; the GPU; the memory."""
        t = self.target
        global_tokens, log_path = self._runc_globals()
        pid = self.runtime.restore(spec, global_tokens=global_tokens, stdio=t.stdio, log_path=log_path, env=env,
                                   **({"supervise": t.seams.supervise} if t.seams.supervise else {}))
        self.timings["restore_s"] = round(time.monotonic() - t0, 3)
        self.checks.raise_failure()  # CRIU's gate already held the tree for it; this is the second lock
        self.progress("done", name="restore", seconds=self.timings["restore_s"])
        plan.after_restore(pid)
        if self.gpu_section:
            self._gpu_resume(pid, plan)
        if t.wait_pages:
            plan.wait_all(self.timings, self.progress)
        return pid

    def _runc_globals(self) -> tuple[list[str], str | None]:
        """runc's global flags and its --log: a create's own, else migrt's (a log in the work directory)."""
        t = self.target
        if t.global_tokens is not None:
            return t.global_tokens, t.log_path
        log_path = os.path.join(self.work, "runc.log")
        return ["--root", t.root, "--log", log_path, "--log-format", "json"], log_path

    def _gpu_resume(self, pid: int, plan: pages.PagesPlan) -> None:
        """GPU restore (remap) and unlock. The driver reads each process's memory: with the filler, a
        process's GPU restore starts once its own memory is in, the others' still arriving."""
        self.entry.update("gpu-restore", pid=pid)
        gpu = self.checks.value("gpu_preflight")
        gpu.backend = self.checks.value("gpu_driver")
        gpu.hook_timeout_s = _gpu_steps().hook_timeout_s(self.cfg)  # the application hook's post-restore
        early = os.environ.get("MIGRT_GPU_RESTORE_EARLY") == "1"  # experiment seam (pages.py)
        self.timings.update(gpu.resume(pid, self.progress, plan.memory_ready(early)))

    def _undo(self, plan: pages.PagesPlan, exc: BaseException) -> BaseException | None:
        """The restore failed: the half-restored container goes; the reason to report, if not `exc`."""
        if os.path.exists(self.state_dir):  # ours: it did not exist before
            from migrt.runtime.cleanup import unmount_under

            unmount_under(self.state_dir)  # a killed runc's criu-root bind mount: delete would walk into it
            self.runtime.delete_force(self.target.root, self.target.container_id)
        cause = self.checks.failure()  # first: a check may still read the filler's status (PlanCheck)
        return cause or plan.failed(exc)  # a chunk that did not verify

    def _end(self, plan: pages.PagesPlan | None) -> str | None:
        """Every check thread ended before the lock goes; their times; whether CRIU ran the gate (held
        the tree until the checks passed; migrt checked them too); our filler carries on alone."""
        self.checks.failure()
        self.timings.update({f"{k}_s": v for k, v in self.checks.seconds().items()})
        gate = ("held" if self.checks.gate_ran else "not run") if self.checks.pending else None
        if plan is not None:
            plan.let_go()  # its guard kills the container should it fail
        shutil.rmtree(self.work, ignore_errors=True)
        return gate


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
            f"(target: {dst_ns or 'not a pod'}); set 'allow_cross_namespace_restore: true' in the migrt config to "
            "allow it"
        )
    if dst_ns and not src_ns and not allow_unbound:
        raise PreconditionFailed(
            f"checkpoint {name} records no Kubernetes namespace (not taken from a pod, or made by hand) and may not "
            f"be restored into a pod (namespace {dst_ns!r}); set 'allow_unbound_checkpoints: true' in the migrt "
            "config to allow checkpoints without a namespace into pods"
        )


def _admit(cfg: Config, request: RestoreRequest, bundle: Bundle) -> Callable[[str | None], None]:
    def admit(image_ns: str | None) -> None:
        check_namespace(image_ns, bundle, request.name, allow_cross_namespace=cfg.allow_cross_namespace_restore,
                        allow_unbound=cfg.allow_unbound_checkpoints)
    return admit


def _lazy_ok(cfg: Config, name: str) -> Callable[[str, dict, object], str | None]:
    """Whether a lazy restore by reference fills the memory lazily (the page mode's decision)."""
    def lazy_ok(images: str, files: dict, recorded: object) -> str | None:
        try:
            decision = pages.decide(cfg, images, name=name, other_lazy=False, manifest_files=files, recorded=recorded)
        except PreconditionFailed as exc:
            return str(exc)
        return None if decision["mode"] == "lazy" else f"the memory is copied eagerly ({decision.get('reason')})"
    return lazy_ok


def _lazy_refusal(cfg: Config) -> str | None:
    """Why this node restores by reference after a full pull whatever the image (None: it may be lazy):
    the page mode's own test of the node (pages.decide: userfaultfd usable; not `criu check`, a
    subprocess of 0.17 s on every create)."""
    from migrt.pagefill.uffd import usable

    if (os.environ.get(pages.ENV) or cfg.restore_pages) == "eager":
        return "restore_pages is eager"
    return usable()


def lazy_for_create(cfg: Config, request: RestoreRequest, bundle: Bundle, log, cid: str,
                    deadline: Deadline | None = None, *, operator: bool = False):
    """A create's `oci:REF` request ready to be restored lazily (registry/lazy.py LazyImage), or None:
    restore after the full pull (pull_for_create). Failures read as pull_for_create's do."""
    from migrt.errors import RegistryError
    from migrt.registry import lazy

    try:
        return lazy.prepare(cfg, request.name, admit=_admit(cfg, request, bundle),
                            lazy_ok=_lazy_ok(cfg, request.name), container_id=cid, log=log,
                            refusal=_lazy_refusal(cfg), deadline=deadline, any_registry=operator)
    except (UsageError, PreconditionFailed):
        raise
    except MigrtError as exc:
        if operator:  # the node's operator sees the registry's own error, with its exit code (as `migrt pull`)
            raise
        log.error("restore_pull_failed", container=cid, reference=request.name, error=str(exc),
                  exit_code=exc.exit_code)
        raise RegistryError(f"cannot pull {request.name} (see the node's migrt log)") from exc


def pull_for_create(cfg: Config, request: RestoreRequest, bundle: Bundle, log, cid: str,
                    deadline: Deadline | None = None, *, operator: bool = False,
                    progress: Progress = null_progress) -> tuple[str, bool]:
    """(store name, pulled now) of a create's `oci:REF` request: pulled once per node, within the
    config's restore_registries and registry_timeout (registry/pull.py ensure_local). An image that says
    it belongs to another namespace than the pod's (or to none) is refused before any layer is
    fetched; one that says so only once pulled is removed again. A failed pull reaches the runc log, which containerd
    shows to the pod's author, as one generic line: the registry's answer (or its silence, a closed
    port, plain HTTP, TLS) would tell that author about the node's network; the detail goes to
    migrt's own log. Refusals of the request itself (reference, registry, namespace) say what they are.
    operator: `migrt restore oci:REF` (image_for_restore), any registry and the pull's own errors."""
    from migrt.errors import RegistryError
    from migrt.registry import pull  # http.client, ssl: only for oci: references

    admit = _admit(cfg, request, bundle)
    try:
        name, just_pulled = pull.ensure_local(cfg, request.name, progress, admit=admit, deadline=deadline,
                                              any_registry=operator)
    except (UsageError, PreconditionFailed):
        raise
    except MigrtError as exc:
        if operator:
            raise
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


@dataclass
class ImageReady:
    """A restore by reference's image, ready: `lazy` (registry/lazy.py LazyImage: the memory comes from
    the registry while the container runs) or the store checkpoint `name`, there already or pulled whole
    now (`pulled`); `fallback`: why not lazily, as the node's log said it; what it took (seconds, bytes)."""

    name: str
    lazy: object | None = None
    pulled: bool = False
    fallback: str | None = None
    seconds: float = 0.0
    bytes_received: int = 0

    @property
    def path(self) -> str:
        return "lazy" if self.lazy is not None else ("pull" if self.pulled else "store")

    def seams(self) -> RestoreSeams:
        # every byte of a checkpoint pulled a moment ago was checked against its digest on arrival (and a
        # lazy one's files are, its pages images as the filler fetches them)
        return RestoreSeams(verified=self.pulled or self.lazy is not None, registry=self.lazy)


class _Heard:
    """The log and progress of a restore by reference's image steps, noting for the caller's report the
    fallback's reason (said once, in the log) and the bytes a full pull received."""

    def __init__(self, log, progress: Progress) -> None:
        self.log, self.told = log, progress
        self.fallback: str | None = None
        self.received = 0

    def __getattr__(self, attr: str):
        return getattr(self.log, attr)

    def info(self, event: str, **fields) -> None:
        from migrt.registry.lazy import EVENT_FALLBACK

        if event == EVENT_FALLBACK:
            self.fallback = fields.get("reason")
        self.log.info(event, **fields)

    def progress(self, event: str, **fields) -> None:
        if event == "bytes" and fields.get("name") == "download":
            self.received += int(fields.get("bytes") or 0)
        self.told(event, **fields)


def image_for_restore(cfg: Config, request: RestoreRequest, bundle: Bundle, log, cid: str, deadline: Deadline, *,
                      operator: bool = False, progress: Progress = null_progress) -> ImageReady:
    """The image of an `oci:REF` restore, lazily from the registry or pulled once per node, within
    `deadline`: the create's path and `migrt restore oci:REF`'s (operator: any registry, as `migrt pull`,
    and the registry's own errors rather than the create's one generic line)."""
    t0 = time.monotonic()
    heard = _Heard(log, progress)
    lazy = lazy_for_create(cfg, request, bundle, heard, cid, deadline, operator=operator)
    if lazy is not None:
        out = ImageReady(lazy.ckpt.name, lazy=lazy, bytes_received=int(lazy.summary.get("bytes_received") or 0))
    else:
        name, pulled = pull_for_create(cfg, request, bundle, log, cid, deadline, operator=operator,
                                       progress=heard.progress)
        out = ImageReady(name, pulled=pulled, fallback=heard.fallback, bytes_received=heard.received)
    out.seconds = round(time.monotonic() - t0, 3)
    log.info("restore_image_ready", container=cid, reference=request.name, checkpoint=out.name, pulled=out.pulled,
             lazy=lazy is not None, seconds=out.seconds, **({"chunks": lazy.summary} if lazy is not None else {}))
    return out


def restore_image(cfg: Config, image: ImageReady, target: RestoreTarget, progress: Progress = null_progress) -> dict:
    """Restore what image_for_restore made ready (target.seams from image.seams())."""
    if image.lazy is not None:
        return restore_pulling(cfg, image.lazy, target, progress)
    return restore_checkpoint(cfg, image.name, target, progress)


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
    image = ImageReady(request.name)
    if reference.is_reference(request.name):  # oci:REF: lazily from the registry, or pulled once per node
        from migrt.registry.pull import create_deadline  # (http.client, ssl: only for oci: references)

        # the create's whole pull, whichever way it goes
        image = image_for_restore(cfg, request, bundle, log, flags.container_id, create_deadline(cfg))
    names.validate(image.name)
    for flag in flags.dropped:
        log.debug("create_flag_dropped", flag=flag)
    cfg.runtime = call.lower  # the shim already resolved it (same rules)
    target = RestoreTarget.for_create(flags, bundle, image.seams())
    try:
        return restore_image(cfg, image, target)
    except MigrtError:
        raise
    except Exception as exc:  # never leak a traceback to the container's stderr
        log.exception("restore_crashed", container=flags.container_id)
        raise MigrtError(f"internal error during restore of {request.name!r}: {exc!r}") from exc
