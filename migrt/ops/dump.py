"""How `migrt checkpoint` dumps the frozen container, decided per checkpoint and recorded in the
manifest (`dump_pages`) and the journal:

  criu      `runc checkpoint --leave-running`: CRIU writes every page (one thread per process).
  parallel  migrt's parallel dump (migrt/pagedump): CRIU's lazy dump writes every image but the
            private anonymous memory, migrt then writes that memory into CRIU's own format with
            `dump_threads` threads, reading it from the frozen tasks. Fails with the reason when the
            node or the images do not allow it.
  auto      parallel when the container holds at least AUTO_MIN_BYTES of memory (the estimate taken
            before the freeze, GPU memory included), the node has at least AUTO_MIN_CPUS CPUs (one
            writer thread copies about as fast as CRIU's one thread: the gain is in the other cores;
            on the 2-core test VM the parallel dump was no faster, docs/benchmarks.md) and
            userfaultfd is usable here (runc asks CRIU whether it can do lazy pages); criu otherwise.
            A parallel dump that cannot be completed (a lazy dump CRIU refused, images with pre-dump
            parents or anything unexpected, a task whose memory cannot be read) falls back to CRIU's
            own dump of the still frozen container, the reason recorded.

The mode comes from MIGRT_DUMP_PAGES when set, else from the config's `dump_pages`; the threads from
MIGRT_DUMP_THREADS, else `dump_threads`.

Crash safety (docs/store.md): the journal records the lazy dump's page-server address before runc
starts. CRIU waits on that page server until someone ends it, so a migrt killed during the lazy dump
would leave CRIU holding the frozen container for ever; recovery ends it (PS_IOV_CLOSE, only when
the listener belongs to a process still at work on this checkpoint's directories), then thaws as
for any interrupted dump. The page writing is its own phase (`writing-pages`): killed there, nothing
is holding the container, and the uncommitted images are removed as usual.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

from migrt import faults
from migrt import log as log_mod
from migrt.config import DUMP_PAGES, Config
from migrt.criu.options import CriuOptions
from migrt.errors import PreconditionFailed, RuntimeFailed, UsageError
from migrt.gpu import procs
from migrt.progress import Progress, null_progress
from migrt.runtime import control
from migrt.runtime.runc import LowerRuntime
from migrt.store.fsutil import TREE_CHUNK, fold_chunks, make_entry

ENV = "MIGRT_DUMP_PAGES"
THREADS_ENV = "MIGRT_DUMP_THREADS"
AUTO_MIN_BYTES = 256 << 20
AUTO_MIN_CPUS = 4
MAX_AUTO_THREADS = 16  # the tasks are frozen meanwhile: every core may copy (16 GiB on 16 cores: 1.5 s vs 2.9 s with 8)
READY_TIMEOUT_S = 3600.0  # CRIU writes every image but the memory before it is ready: no size bound here
END_TIMEOUT_S = 120.0


def threads(cfg: Config) -> int:
    """dump_threads, or MIGRT_DUMP_THREADS when set (benchmarks); 0: min(16, CPUs)."""
    raw = os.environ.get(THREADS_ENV)
    if raw:
        if not raw.isdigit() or not 0 <= int(raw) <= 256:
            raise UsageError(f"{THREADS_ENV} must be an integer from 0 to 256, got {raw!r}")
        n = int(raw)
    else:
        n = cfg.dump_threads
    return n or max(1, min(MAX_AUTO_THREADS, os.cpu_count() or 1))


def decide(cfg: Config, estimate_bytes: int) -> dict:
    """{"mode": "parallel"|"criu", "requested", "reason"?, "threads"?}; PreconditionFailed when
    'parallel' was asked for and this node cannot do it."""
    requested = os.environ.get(ENV) or cfg.dump_pages
    if requested not in DUMP_PAGES:
        raise UsageError(f"{ENV} must be one of {DUMP_PAGES}, got {requested!r}")
    out = {"mode": "criu", "requested": requested}
    if requested == "criu":
        return {**out, "reason": "dump_pages is criu"}
    if requested == "auto" and estimate_bytes < AUTO_MIN_BYTES:
        return {**out, "reason": f"about {estimate_bytes >> 20} MiB of memory is below {AUTO_MIN_BYTES >> 20} MiB"}
    cpus = os.cpu_count() or 1
    if requested == "auto" and cpus < AUTO_MIN_CPUS:
        return {**out, "reason": f"{cpus} CPUs: below {AUTO_MIN_CPUS} the parallel dump is no faster than CRIU's"}
    from migrt.criu.lazy import lazy_dump_problem
    from migrt.pagefill.uffd import usable

    why = usable()
    if why:
        if requested == "parallel":
            raise PreconditionFailed(f"dump_pages is parallel, but runc's lazy checkpoint needs userfaultfd here: "
                                     f"{why}; set dump_pages to auto or criu")
        return {**out, "reason": why}
    why = lazy_dump_problem(estimate_bytes)
    if why:
        if requested == "parallel":
            raise PreconditionFailed(f"dump_pages is parallel, but {why}; or set dump_pages to auto or criu")
        return {**out, "reason": why}
    return {"mode": "parallel", "requested": requested, "threads": threads(cfg)}


class _Fallback(Exception):
    """The parallel dump could not be completed; auto dumps with CRIU instead."""


def dump(cfg: Config, runtime: LowerRuntime, root: str, cid: str, *, images: str, work: str, options: CriuOptions,
         env: dict | None, journal, decision: dict, progress: Progress = null_progress) -> dict:
    """Dump the frozen container into `images` (--leave-running: it stays frozen); returns the
    decision with what happened (`bytes`, `lazy_bytes`, `seconds`, `fallback`...) and timings; after
    a parallel dump `digests` holds the manifest entries of the pages files it wrote (relative to the
    checkpoint: images/pages-N.img), hashed as they were written, for Staging.commit(known=...), and
    `chunk_digests` their 64 MiB chunks' sha256 (bytes), for a migration's sender (migration/bulk.py);
    callers pop both before recording the rest."""
    # Files the tasks hold open but that are deleted (NCCL's and PyTorch's /dev/shm segments, 34 MB
    # each under NCCL's socket transport) are dumped whole up to CRIU's ghost limit (1 MiB by default).
    # The config file lives outside the checkpoint (the work directory travels with it).
    conf_dir = tempfile.mkdtemp(prefix="migrt-criu-dump.")
    try:
        env = control.criu_config_env(env, conf_dir, [f"ghost-limit {cfg.criu_ghost_limit_mib}M"], "criu-dump.conf")
        return _dump(cfg, runtime, root, cid, images=images, work=work, options=options, env=env, journal=journal,
                     decision=decision, progress=progress)
    finally:
        shutil.rmtree(conf_dir, ignore_errors=True)


def _dump(cfg: Config, runtime: LowerRuntime, root: str, cid: str, *, images: str, work: str, options: CriuOptions,
          env: dict | None, journal, decision: dict, progress: Progress) -> dict:
    record = dict(decision)
    if decision["mode"] == "parallel":
        before = set(os.listdir(images))
        try:
            record.update(_parallel(runtime, root, cid, images=images, work=work, options=options, env=env,
                                    journal=journal, threads=decision["threads"], progress=progress,
                                    fallback=decision["requested"] == "auto"))
            return record
        except _Fallback as exc:
            if decision["requested"] != "auto":
                raise RuntimeFailed(f"parallel dump of container {cid} failed: {exc}; the container was left as it "
                                    "was; set dump_pages to auto or criu") from exc
            _clean(images, before, work)
            log_mod.get().warning("dump_pages_fallback", container=cid, reason=str(exc))
            record.update(mode="criu", fallback=str(exc))
    journal.update("dumping", dump_pages="criu", page_server=None)
    runtime.checkpoint(root, cid, image_path=images, work_path=work, options=options, leave_running=True, env=env)
    return record


def _parallel(runtime: LowerRuntime, root: str, cid: str, *, images: str, work: str, options: CriuOptions,
              env: dict | None, journal, threads: int, progress: Progress, fallback: bool) -> dict:
    from migrt import pagedump

    server = control.loopback_page_server()  # CRIU's page server: only ended, never asked for a page
    journal.update("dumping", dump_pages="parallel", page_server=list(server))
    t0 = time.monotonic()
    lazy = control.LazyCheckpoint(runtime.path, root, cid, image_path=images, work_path=work, options=options,
                                  page_server=server, env=env)
    try:
        lazy.wait_ready(READY_TIMEOUT_S)
        faults.point("checkpoint:lazy-ready")  # test seam: CRIU serves, nobody will end it
        lazy.finish(END_TIMEOUT_S)
    except RuntimeFailed as exc:
        if not fallback:
            raise  # CRIU's own error, with its log lines
        raise _Fallback(f"CRIU's lazy dump: {exc}") from exc
    except BaseException:
        lazy.abort()
        raise
    lazy_s = time.monotonic() - t0
    journal.update("writing-pages", page_server=None)
    try:
        dump_plan = pagedump.plan(images)
        pids = container_pids(root, cid)
        progress("phase", name="pages", total_bytes=dump_plan.total_bytes)
        t1 = time.monotonic()
        stats = pagedump.write(dump_plan, pids, threads, progress=lambda n: progress("bytes", name="pages", bytes=n),
                               chunk=TREE_CHUNK)  # hashed in the store's digest chunks
        pagedump.install(dump_plan)
    except (pagedump.PlanError, pagedump.ReadError) as exc:
        raise _Fallback(str(exc)) from exc
    pages_s = time.monotonic() - t1
    progress("done", name="pages", seconds=round(pages_s, 3))
    # hashed as they were written: the commit takes these instead of reading the memory again
    digests = {f"{os.path.basename(images)}/{name}": make_entry(os.path.getsize(os.path.join(images, name)),
                                                                  fold_chunks(chunks))
               for name, chunks in stats["digests"].items()}
    chunks = {f"{os.path.basename(images)}/{name}": list(c) for name, c in stats["digests"].items()}
    return {"digests": digests, "chunk_digests": chunks, "lazy_dump_s": round(lazy_s, 3), "pages_s": round(pages_s, 3),
            "bytes": stats["bytes"],
            "lazy_bytes": dump_plan.lazy_bytes, "criu_bytes": dump_plan.criu_bytes, "threads": stats["threads"],
            "processes": len(dump_plan.files), "via_proc_mem_bytes": stats["via_proc_mem_bytes"],
            "gbps": round(dump_plan.lazy_bytes / pages_s / 1e9, 2) if pages_s > 0 else None}


def container_pids(root: str, cid: str) -> dict[int, int]:
    """pid inside the container's pid namespace (CRIU's key) -> host pid, for every process of it."""
    return procs.runc_vpid_map(root, cid)


def _clean(images: str, keep: set[str], work: str) -> None:
    """Remove what the lazy dump (and the page writing) left, before CRIU dumps again; its log is kept."""
    for name in os.listdir(images):
        if name not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(images, name))
    with contextlib.suppress(OSError):
        os.replace(os.path.join(work, "dump.log"), os.path.join(work, "lazy-dump.log"))
