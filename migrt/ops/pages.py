"""How a restore fills the restored memory, decided per restore and recorded in its result:

  eager  CRIU copies every page before the tree resumes (one thread per process).
  lazy   `runc restore --lazy-pages` and migrt's page filler (migrt/pagefill): the tree resumes at
         once; several threads copy the memory, page faults first. Fails when the node or the
         images cannot do it.
  auto   lazy when userfaultfd is usable here, the images allow it and their lazy memory reaches
         `fill_min_mib`; eager otherwise (the reason is recorded). Whether the images allow it and
         how much lazy memory they hold come from the manifest (recorded at commit), else from
         planning the images here.

The mode comes from MIGRT_RESTORE_PAGES when set, else from the config's `restore_pages`. A restore
that another mechanism already makes lazy (lazy migration's page server) is left alone.
"""

from __future__ import annotations

import os
import time

from migrt.config import RESTORE_PAGES, Config
from migrt.errors import CheckpointInvalid, PreconditionFailed, RuntimeFailed, UsageError

ENV = "MIGRT_RESTORE_PAGES"
GUARD = "migrt.pagefill.guard"
GUARD_REGISTRY = "migrt.registry.fill"  # the guard with the registry's chunks (a lazy restore by reference)
# H100 host, 16 CPUs: 32 GB GPU restore's memory wait 3.2 s vs 3.8 s with 8; lazy 16 GiB migration's 2.1 vs 2.5 s
MAX_AUTO_THREADS = 16
MIN_STREAMS = 4


def threads(cfg: Config) -> int:
    return cfg.fill_threads or max(2, min(MAX_AUTO_THREADS, os.cpu_count() or 2))


def streams(cfg: Config) -> int:
    """Copy threads of a lazy migration's filler, each with its own stream to the source: at least
    MIN_STREAMS, so that requests stay in flight while others wait on the network."""
    return cfg.fill_threads or max(MIN_STREAMS, threads(cfg))


def migration_mode(fill, lazy_bytes: int | None = None) -> dict:
    """The recorded decision of a restore whose filler a lazy migration started (pages from the source)."""
    return {"mode": "lazy", "requested": "migration", "reason": "lazy migration: pages from the source node",
            "threads": fill.threads, "lazy_bytes": lazy_bytes}


def decide(cfg: Config, images: str, *, name: str, other_lazy: bool, manifest_files: dict | None = None,
           recorded: object = None) -> dict:
    """{"mode": "lazy"|"eager", "requested", "reason", "lazy_bytes", "threads"}; PreconditionFailed
    when 'lazy' was asked for and cannot be done. manifest_files (the checkpoint's file list with
    sizes): under auto, page images smaller than fill_min_mib in all decide eager at once, without
    reading the images (their lazy memory can only be less). recorded: the manifest's survey of the
    images (`pagefill`, taken beside the commit's hashing: pagefill/images.py survey); when it is
    usable the images are not read here ("lazy_bytes_from": "manifest"), else they are planned
    ("images"; checkpoints written before the record existed). The record only chooses: a lazy
    restore's guard plans the images again, and PlanCheck holds the tree until it has."""
    requested = os.environ.get(ENV) or cfg.restore_pages
    if requested not in RESTORE_PAGES:
        raise UsageError(f"{ENV} must be one of {RESTORE_PAGES}, got {requested!r}")
    out = {"mode": "eager", "requested": requested}
    if requested == "eager":
        return {**out, "reason": "restore_pages is eager"}
    if other_lazy:
        return {**out, "reason": "pages come lazily from elsewhere (lazy migration)"}
    pages_bytes = None
    if manifest_files is not None:
        pages_bytes = sum(meta.get("size") or 0 for rel, meta in manifest_files.items()
                          if rel.startswith("images/pages-") and rel.endswith(".img"))
    if requested == "auto" and pages_bytes is not None and pages_bytes < cfg.fill_min_mib << 20:
        return {**out, "pages_bytes": pages_bytes,
                "reason": f"{pages_bytes >> 20} MiB of page images is below fill_min_mib ({cfg.fill_min_mib})"}
    from migrt import pagefill
    from migrt.pagefill.uffd import usable

    why = usable()
    lazy_bytes = 0
    source = None
    if why is None:
        survey = _usable_survey(recorded, pages_bytes)
        if survey is not None and not survey["fillable"] and requested == "lazy":
            survey = None  # a record alone never refuses a restore: the images say why
        if survey is not None:
            source = "manifest"
            lazy_bytes = survey.get("lazy_bytes", 0)
            if not survey["fillable"]:
                why = f"checkpoint {name}: {survey['reason']}"
        else:
            source = "images"
            try:
                lazy_bytes = pagefill.plan(images).lazy_bytes
            except pagefill.ImageError as exc:
                why = f"checkpoint {name}: {exc}"
    if source:
        out["lazy_bytes_from"] = source
    if why is None and requested == "auto" and lazy_bytes < cfg.fill_min_mib << 20:
        return {**out, "lazy_bytes": lazy_bytes,
                "reason": f"{lazy_bytes >> 20} MiB of lazy memory is below fill_min_mib ({cfg.fill_min_mib})"}
    if why is not None:
        if requested == "lazy":
            raise PreconditionFailed(f"restore_pages is lazy, but the page filler cannot restore checkpoint {name}: "
                                     f"{why}; set restore_pages to auto or eager")
        return {**out, "reason": why}
    return {**out, "mode": "lazy", "lazy_bytes": lazy_bytes, "threads": threads(cfg),
            "reason": "page filler" if requested == "lazy" else
            f"{lazy_bytes >> 20} MiB of lazy memory >= fill_min_mib ({cfg.fill_min_mib})"}


MAX_REASON = 300


def _usable_survey(recorded: object, pages_bytes: int | None) -> dict | None:
    """The manifest's survey if it can be used here: written under this migrt's planning rules, well
    formed, and not claiming more lazy memory than the page images hold (lazy pages are a part of
    them; the sizes were checked against the files). None: plan the images instead."""
    from migrt.pagefill.images import RULES

    if not isinstance(recorded, dict) or recorded.get("rules") != RULES or isinstance(recorded.get("rules"), bool):
        return None
    fillable = recorded.get("fillable")
    if fillable is True:
        lazy = recorded.get("lazy_bytes")
        if not isinstance(lazy, int) or isinstance(lazy, bool) or lazy < 0:
            return None
        if pages_bytes is not None and lazy > pages_bytes:
            return None
        return {"fillable": True, "lazy_bytes": lazy}
    if fillable is False:
        reason = recorded.get("reason")
        if not isinstance(reason, str) or not reason:
            return None
        return {"fillable": False, "reason": reason[:MAX_REASON]}
    return None


VERIFY_ENV = "MIGRT_RESTORE_VERIFY"  # "background": hash whole pages images before the tree runs (bench/)


def verify_as_filled(decision: dict, manifest: dict, unhashed: list[str], name: str) -> dict | None:
    """What a lazy restore's filler verifies chunk by chunk instead of the restore hashing it before
    the tree may run (docs/restore-pages.md, "What is verified when"): the pages images among
    `unhashed` (the large files left for the background) whose 64 MiB chunk digests the manifest gives
    (store/manifest.py file_chunks). Returns the filler's hand-over ({"checkpoint", "files": {basename:
    {"rel", "size", "chunks"}}}) or None; the decision records the split (`verify`)."""
    from migrt.store import manifest as mf

    if decision["mode"] != "lazy":
        return None
    files = {}
    if os.environ.get(VERIFY_ENV) != "background":
        for rel in unhashed:
            base = rel.rsplit("/", 1)[-1]
            if not (rel == f"images/{base}" and base.startswith("pages-") and base.endswith(".img")):
                continue
            chunks = mf.file_chunks(manifest, rel)
            if chunks is not None:
                files[base] = {"rel": rel, "size": manifest["files"][rel]["size"],
                               "chunks": "".join(c.hex() for c in chunks)}
    rest = [r for r in unhashed if r.rsplit("/", 1)[-1] not in files]
    decision["verify"] = {"as_filled": sorted(f["rel"] for f in files.values()), "before_run": rest}
    return {"checkpoint": name, "files": files} if files else None


def start(decision: dict, images: str, *, container_id: str, root: str, runc_log: str | None, log_format: str,
          log_file: str | None, post_restore: str | None = None, verify: dict | None = None,
          keep_fd: int | None = None, entry: str | None = None):
    """The page filler for a restore decided lazy (None otherwise); it must be running before CRIU.
    post_restore: a file that appears when CRIU reaches post-restore (the restore gate holds the tree
    there while the checkpoint's pages are still being hashed): the filler starts copying then.
    verify: the pages images it verifies chunk by chunk as it fills (verify_as_filled)."""
    if decision["mode"] != "lazy":
        return None
    from migrt.pagefill import PageFill

    try:
        return PageFill.start(images, threads=decision["threads"], container_id=container_id, root=root,
                              runc_log=runc_log, log_format=log_format, log_file=log_file, post_restore=post_restore,
                              verify=verify, keep_fd=keep_fd, entry=entry or GUARD)
    except RuntimeFailed as exc:
        if decision["requested"] == "lazy":
            raise
        decision.update(mode="eager", reason=f"the page filler could not start ({exc}); copied eagerly")
        return None


class PlanCheck:
    """A restore check (ops/restore_checks.py) of a lazy restore whose filler the restore started: the
    guard plans the images itself before it serves CRIU (the plan the filler copies from), and the
    gate holds the restored tree at post-restore until it has. decide() may have chosen the filler
    from the manifest's record alone; images the guard refuses then fail the restore before any of
    its tasks ran, with the guard's reason, the checkpoint untouched. It runs while CRIU restores
    (deferred until the runc call), and the guard's plan is done long before CRIU's tree (0.5 s
    against 2.7 s at 32 GiB), so it costs nothing on the way to CRIU. `fill` is set once started."""

    def __init__(self, decision: dict, name: str) -> None:
        self.decision = decision
        self.name = name
        self.fill = None

    def __call__(self) -> None:
        if self.fill is None:  # the filler could not start: the restore went eager after all
            return
        try:
            st = self.fill.planned()
        except RuntimeFailed as exc:
            why = self.fill.status().get("plan_error")
            if not why:
                raise RuntimeFailed(f"restore failed: {exc.message}") from exc
            recorded = self.decision.get("lazy_bytes_from") == "manifest"
            raise CheckpointInvalid(
                f"checkpoint {self.name}: the page filler cannot fill its images ({why})"
                + (", though its manifest records them as fillable" if recorded else "")
                + "; the restore stopped before the container ran and the checkpoint is unchanged; restore it "
                f"with {ENV}=eager, and check it with 'migrt inspect --verify {self.name}'") from exc
        planned = st.get("lazy_bytes")
        if isinstance(planned, int) and planned != self.decision.get("lazy_bytes"):
            # what the filler copies, not what chose it (a record from other images, or altered)
            self.decision["decided_on_lazy_bytes"] = self.decision.get("lazy_bytes")
            self.decision["lazy_bytes"] = planned


class EagerVerified:
    """A restore check of a lazy restore whose filler verifies the pages images as it fills them
    (verify_as_filled): the parts of those images that CRIU reads itself while it restores (every
    64 MiB chunk holding a byte that is not lazy) are verified by the filler first, and the gate holds
    the restored tree until they all are (the filler's status `verify.eager_done`). A mismatch there,
    or anywhere the filler looked before, fails the restore with the file and the bytes."""

    def __init__(self, name: str, timeout: float = 1800.0) -> None:
        self.name = name
        self.fill = None
        self.timeout = timeout

    def __call__(self) -> dict | None:
        if self.fill is None:
            return None
        deadline = time.monotonic() + self.timeout
        while True:
            st = self.fill.status()
            ver = st.get("verify") or {}
            if ver.get("error"):
                raise verify_failed(self.name, ver["error"])
            if st.get("state") in ("failed", "aborted", "done") or ver.get("eager_done"):
                if st.get("state") == "failed":
                    raise RuntimeFailed(f"restore failed: the page filler failed: {st.get('error') or 'unknown error'}")
                if st.get("state") == "aborted":
                    raise RuntimeFailed("restore failed: the page filler stopped before it verified the images")
                return {k: ver.get(k) for k in ("eager", "chunks", "eager_s") if k in ver}
            if time.monotonic() > deadline:
                raise RuntimeFailed(f"restore failed: the page filler has not verified the images after "
                                    f"{self.timeout:.0f} s")
            time.sleep(0.005)


def verify_failed(name: str, error: str) -> CheckpointInvalid:
    return CheckpointInvalid(f"{error}; the restore stopped, the container was removed and checkpoint {name} is "
                             f"unchanged; run 'migrt inspect --verify {name}'")


class FilledFirst:
    """A restore check (ops/restore_checks.py) of a direct migration (docs/migration.md): the restored
    tree stays at CRIU's post-restore, where every task is restored, every lazy range registered and
    none resumed, until the filler has copied every page from the source; so nothing runs on the
    target without all of its memory, and a transfer that breaks leaves nothing that ran. The filler
    was started with a post_restore file of its own (PageFill.start(post_restore=True)): this check
    creates it once the gate has run, the filler then copies with all its threads, and the check
    returns when the fill is over. It fails when the restore ended without reaching the gate, the
    filler failed, or no page arrived for `stall` seconds (the verdict then makes CRIU kill the tree)."""

    def __init__(self, fill, checks, *, stall: float) -> None:
        self.fill, self.checks, self.stall = fill, checks, stall

    def __call__(self) -> dict:
        ran = self.checks.ran_path
        while not os.path.exists(ran):
            if self.checks.ended.is_set():
                raise RuntimeFailed("restore failed before its tree was restored (the memory never went in)")
            check(self.fill)
            time.sleep(0.005)
        with open(self.fill.post_restore, "w"):
            pass
        last, t_last = -1, time.monotonic()
        while True:
            st = self.fill.status()
            if st.get("state") == "done" or _all_in(st):
                return {k: st.get(k) for k in ("copied_bytes", "lazy_bytes", "fill_s") if k in st}
            check(self.fill)
            if st.get("state") == "aborted" or self.checks.ended.is_set():
                raise RuntimeFailed("restore failed: its memory did not all arrive (the filler stopped)")
            now = time.monotonic()
            copied = st.get("copied_bytes") or 0
            if copied != last:
                last, t_last = copied, now
            elif now - t_last > self.stall:
                raise RuntimeFailed(f"restore failed: no memory page arrived for {self.stall:.0f} s "
                                    f"({copied >> 20} of {(st.get('lazy_bytes') or 0) >> 20} MiB in); the "
                                    "restored tree never ran")
            time.sleep(0.01)


def _all_in(st: dict) -> bool:
    """Every process with lazy memory has handed the filler its userfaultfd (their lazy bytes add up to
    the plan's) and nothing is left to copy: the filler's status (pagefill/engine.py snapshot)."""
    procs = st.get("pids") or {}
    planned = st.get("lazy_bytes")
    return (isinstance(planned, int) and sum(p.get("lazy_bytes") or 0 for p in procs.values()) == planned
            and st.get("left_bytes") == 0 and all(p.get("left_bytes") == 0 for p in procs.values()))


def after_restore(fill, pid: int, name: str | None = None) -> None:
    """runc restore returned: fail now if the filler already failed, hand it the init pid. The
    restore then waits for every page only when asked to (`--wait-pages`: wait_all); a GPU restore
    waits for each CUDA process's own memory (MemoryReady)."""
    check(fill, name)
    fill.restored(pid)


def check(fill, name: str | None = None) -> None:
    """Fail now if the filler already failed (a chunk that did not verify: CheckpointInvalid)."""
    try:
        fill.check()
    except RuntimeFailed as exc:
        _raise_verify(fill, name, exc)
        raise RuntimeFailed(f"restore failed: {exc.message}") from exc


def _raise_verify(fill, name: str | None, exc: Exception) -> None:
    error = (fill.status().get("verify") or {}).get("error")
    if error and name:
        raise verify_failed(name, error) from exc


def wait_all(fill, decision: dict, timings: dict, name: str | None = None, progress=None) -> None:
    """Until every page is in (the fill's figures go into the decision). progress: told of the bytes
    copied as the fill goes (`migrt restore --wait-pages` on a terminal)."""
    t0 = time.monotonic()
    stop = _report_fill(fill, progress) if progress is not None else None
    try:
        st = fill.wait()
    except RuntimeFailed as exc:
        _raise_verify(fill, name, exc)
        raise
    finally:
        if stop is not None:
            stop()
    if progress is not None:
        progress("done", name="pages", seconds=round(time.monotonic() - t0, 3))
    timings["pages_wait_s"] = round(time.monotonic() - t0, 3)
    decision["fill"] = {k: st.get(k) for k in ("copied_bytes", "fill_s", "counts", "verify") if k in st}


def _report_fill(fill, progress, every: float = 0.5):
    """A thread telling `progress` of the bytes the filler copied, from its status file; returns its stop."""
    import threading

    st = fill.status()
    progress("phase", name="pages", total_bytes=st.get("lazy_bytes") or 0)
    done = threading.Event()

    def report() -> None:
        sent = 0
        while not done.wait(every):
            copied = fill.status().get("copied_bytes") or 0
            if copied > sent:
                progress("bytes", name="pages", bytes=copied - sent)
                sent = copied

    thread = threading.Thread(target=report, name="fill-progress", daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join()
    return stop


class MemoryReady:
    """The fill as a GPU restore sees it (ops/gpu_steps): which CUDA processes, by host pid, may have
    their GPU state restored: those whose GPU backing memory is in (the driver's host copy of their
    GPU memory, which the filler copies before anything else when the checkpoint's GPU record says
    where it is: pagefill/images.py), else those whose memory is all in. The rest of a process's
    memory keeps arriving meanwhile (the driver's restore reads little else; a page it touches that
    is not in yet is served as a fault). The filler knows processes by their pid inside the
    container (CRIU's images); a process it does not list is ready once the whole fill is over."""

    def __init__(self, fill, early: bool = False) -> None:
        from migrt.pagefill.session import container_vpid

        self.fill = fill
        # Experiment seam (MIGRT_GPU_RESTORE_EARLY=1, benchmarks only): every process counts as ready at
        # once, so the driver's restore reads memory still arriving, its faults served by the filler.
        self.early = early
        self.t0 = fill.started
        self._vpid = container_vpid
        self._vpids: dict[int, int | None] = {}
        self._ready_at: dict[int, float] = {}
        self._waited: dict[int, str] = {}

    def ready(self, pids: list[int]) -> set[int]:
        """Without waiting: those of pids whose GPU restore may start. Raises RuntimeFailed when the
        filler failed (they never will be)."""
        try:
            done = self.fill.gpu_ready()
        except RuntimeFailed as exc:
            raise RuntimeFailed(f"restore failed: {exc.message}") from exc
        now = round(time.monotonic() - self.t0, 3)
        out = set()
        for pid in pids:
            if pid not in self._vpids:
                self._vpids[pid] = self._vpid(pid)
            vpid = self._vpids[pid]
            if done is None or self.early or vpid in done:
                out.add(pid)
                if pid not in self._ready_at:
                    self._ready_at[pid] = now
                    self._waited[pid] = ("nothing (early)" if self.early and (done is None or vpid not in done)
                                         else "memory" if done is None else done[vpid])
        return out

    def about(self, pid: int) -> dict:
        """For the restore's timings: the pid inside the container, when what its GPU restore waits
        for was seen in (seconds after the filler was started, as the GPU restore's start), and what
        that was ("gpu_backing": the driver's host copy of its GPU memory; "memory": all of it)."""
        return {"vpid": self._vpids.get(pid), "memory_in_s": self._ready_at.get(pid),
                "waited_for": self._waited.get(pid)}


def failed(fill, exc, name: str | None = None) -> CheckpointInvalid | None:
    """The restore failed (the container is gone): stop the filler, quote why it failed if it did.
    Returns the reason to report when the filler found a chunk that does not verify: its guard kills
    CRIU's tasks only after that verdict is in its status, so whether runc restore returned first (the
    verdict comes through check/wait_all) or CRIU was killed mid-restore, the restore fails as
    CheckpointInvalid naming the file and bytes (name: the checkpoint)."""
    st = fill.status()
    details = getattr(exc, "details", None)
    if st.get("state") == "failed" and st.get("error") and st["error"] not in str(exc) and details is not None:
        details.append(f"page filler: {st['error']}")
    fill.abort()
    error = (st.get("verify") or {}).get("error")
    return verify_failed(name, error) if error and name and not isinstance(exc, CheckpointInvalid) else None


class PagesPlan:
    """The page mode of one restore, from its decision to its filler's end, in the order a restore
    meets them: decided (or a migration's filler taken as it is) -> the pages images the filler will
    verify as it fills them taken out of the background hashing -> its checks added -> the filler
    started before CRIU (a filler that cannot start leaves the restore eager, its images hashed before
    the tree runs) -> runc's flag -> after runc: the init pid handed over, the memory waited for ->
    on failure, the filler stopped and its reason; at the end, a filler of ours left to carry on alone.
    `decision` is what the restore records (its result's `pages`)."""

    def __init__(self, decision: dict, name: str, fill=None, images: str | None = None) -> None:
        self.decision = decision
        self.name = name
        self.images = images  # the checkpoint's image directory (our filler reads it)
        self.fill = fill
        self.own = fill is None  # a filler the caller started (lazy migration) is the caller's to let go
        self.as_filled: dict | None = None  # what the filler verifies chunk by chunk (verify_as_filled)
        self._plan_check: PlanCheck | None = None
        self._eager_check: EagerVerified | None = None
        self.registry: dict | None = None  # a lazy restore by reference's hand-over (from_registry)
        self.keep_fd: int | None = None

    def from_registry(self, handover: dict, keep_fd: int, summary: dict) -> None:
        """The pages images come from the registry as the filler needs them (registry/lazy.py): the
        filler must run (no eager fallback: the bytes are not here), verifies every chunk as it fetches
        it, and holds the image lock (`keep_fd`) until it has committed the pulled checkpoint."""
        if self.mode != "lazy" or not self.own:
            raise PreconditionFailed(f"checkpoint {self.name}: a lazy restore from the registry was decided "
                                     f"{self.mode} here ({self.decision.get('reason')}); restore it again")
        self.registry, self.keep_fd = handover, (keep_fd if keep_fd >= 0 else None)  # (-1: joined another's fill)
        self.decision.update(requested="lazy", source="registry", registry=summary)

    @classmethod
    def decide(cls, cfg: Config, ckpt, fill=None, *, other_lazy: bool) -> PagesPlan:
        """A migration's filler (pages from the source), else the mode decide() chooses for checkpoint
        `ckpt` (a store.Checkpoint)."""
        if fill is not None:
            return cls(migration_mode(fill), ckpt.name, fill)
        decision = decide(cfg, ckpt.images, name=ckpt.name, manifest_files=ckpt.manifest.get("files"),
                          recorded=ckpt.manifest.get("pagefill"), other_lazy=other_lazy)
        return cls(decision, ckpt.name, images=ckpt.images)

    @property
    def mode(self) -> str:
        return self.decision["mode"]

    def verified_as_filled(self, manifest: dict, background: list[str]) -> list[str]:
        """`background` (the large files hashed while CRIU restores) less the pages images our filler
        verifies chunk by chunk as it fills them (docs/restore-pages.md, "What is verified when")."""
        if self.registry is not None:
            self.as_filled = self.registry
            self.decision["verify"] = {"as_filled": sorted(f["rel"] for f in self.registry["files"].values()),
                                       "before_run": []}
        elif self.own:
            self.as_filled = verify_as_filled(self.decision, manifest, background, self.name)
        if not self.as_filled:
            return background
        handed = {f["rel"] for f in self.as_filled["files"].values()}
        return [r for r in background if r not in handed]

    def add_checks(self, checks, *, fill_first: float | None) -> None:
        """The checks the gate waits for: our lazy restore's plan by the guard (PlanCheck), the chunks
        CRIU reads itself verified (EagerVerified), and a direct migration's whole memory in before
        anything runs (FilledFirst, `fill_first`: its stall deadline)."""
        if self.own and self.mode == "lazy":
            self._plan_check = PlanCheck(self.decision, self.name)
            checks.add("pages_plan", self._plan_check, deferred=True)
        if self.as_filled:
            self._eager_check = EagerVerified(self.name)
            checks.add("pages_verify_eager", self._eager_check, deferred=True)
        if not self.own and fill_first:
            self.decision["fill_first"] = True
            checks.add("pages_in", FilledFirst(self.fill, checks, stall=fill_first), deferred=True)

    def start_filler(self, checks, *, container_id: str, root: str, runc_log: str | None, log_format: str,
                     log_file: str | None) -> list[str]:
        """Our filler, listening before CRIU starts (lazy restore). Returns the pages images it was to
        verify when it could not start (auto: eager after all): the caller hashes them before the tree runs."""
        if not self.own:
            return []
        self.fill = start(self.decision, self.images or "", container_id=container_id, root=root, runc_log=runc_log,
                          log_format=log_format, log_file=log_file, post_restore=checks.ran_path, verify=self.as_filled,
                          keep_fd=self.keep_fd, entry=GUARD_REGISTRY if self.registry is not None else GUARD)
        for check in (self._plan_check, self._eager_check):
            if check is not None:
                check.fill = self.fill
        if not self.as_filled or self.fill is not None:
            return []
        late = sorted(f["rel"] for f in self.as_filled["files"].values())
        before_run = self.decision["verify"]["before_run"]  # the rest of the background (verify_as_filled)
        self.decision["verify"] = {"as_filled": [], "before_run": sorted(before_run + late)}
        return late

    def runc_args(self) -> list[str]:
        return ["--lazy-pages"] if self.fill else []

    def link(self, work: str) -> None:
        """The filler's socket where CRIU's lazy-pages client looks for it (the restore's work dir)."""
        if self.fill:
            self.fill.link(work)

    def after_restore(self, pid: int) -> None:
        """runc restore returned: fail now if the filler already failed, else hand it the init pid."""
        if self.fill:
            after_restore(self.fill, pid, self.name)

    def memory_ready(self, early: bool = False) -> MemoryReady | None:
        """The fill as a GPU restore waits on it (None: every page is in already)."""
        return MemoryReady(self.fill, early) if self.fill else None

    def wait_all(self, timings: dict, progress=None) -> None:
        """Until every page is in (a lazy restore asked to wait: --wait-pages, a migration)."""
        if self.fill:
            wait_all(self.fill, self.decision, timings, self.name, progress)

    def failed(self, exc: BaseException) -> CheckpointInvalid | None:
        """The restore failed: the filler stopped; a chunk that did not verify is the reason to report."""
        return failed(self.fill, exc, self.name) if self.fill else None

    def let_go(self) -> None:
        """The restore is over: our filler carries on alone (its guard kills the container should it fail)."""
        if self.fill and self.own:
            self.fill.detach()

