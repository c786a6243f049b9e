"""Suspend and resume every CUDA process of a container, in parallel, with undo.

suspend_all: lock all (so that no process submits work to a peer that is already frozen), then
checkpoint all. On any failure every process already touched is brought back (restore, unlock)
so the workload goes on, and the first error is raised with what the undo could not do.
resume_all: restore all (onto other GPUs with a remap), then unlock all; every process is tried,
and one error names every process that did not come back.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from migrt.gpu.backend import CHECKPOINTED, LOCKED, RUNNING, GpuBackend, GpuError, Remap

DEFAULT_LOCK_TIMEOUT_MS = 30_000


def _each(pids: list[int], fn: Callable[[int], None], parallel: bool) -> dict[int, BaseException]:
    """Run fn(pid) for every pid (threads: ctypes drops the GIL in driver calls); pid -> error."""
    errors: dict[int, BaseException] = {}
    if not parallel or len(pids) < 2:
        for pid in pids:
            try:
                fn(pid)
            except Exception as exc:  # noqa: BLE001 - collected and re-raised by the caller
                errors[pid] = exc
        return errors
    with ThreadPoolExecutor(max_workers=min(len(pids), 32), thread_name_prefix="migrt-gpu") as pool:
        futures = {pid: pool.submit(fn, pid) for pid in pids}
    for pid, fut in futures.items():
        exc = fut.exception()
        if exc is not None:
            errors[pid] = exc
    return errors


def _first(errors: dict[int, BaseException], pids: list[int]) -> BaseException:
    return next(errors[p] for p in pids if p in errors)


def _bring_back(backend: GpuBackend, pid: int, known: str) -> None:
    """From wherever pid stands (the driver's word, else what we know) back to running."""
    try:
        state = backend.state(pid)
    except GpuError:
        state = known
    if state == CHECKPOINTED:
        backend.restore(pid)
        state = LOCKED
    if state == LOCKED:
        backend.unlock(pid)
        state = RUNNING
    if state != RUNNING:
        raise GpuError(f"process {pid} is {state}; it cannot be brought back to running", pid=pid)


def suspend_all(pids: list[int], backend: GpuBackend, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS, *,
                parallel: bool = True) -> None:
    pids = list(dict.fromkeys(pids))
    phase = "lock"
    errors = _each(pids, lambda p: backend.lock(p, timeout_ms), parallel)
    if errors:
        known = {p: (RUNNING if p in errors else LOCKED) for p in pids}
    else:
        phase = "checkpoint"
        errors = _each(pids, backend.checkpoint, parallel)
        if not errors:
            return
        known = {p: (LOCKED if p in errors else CHECKPOINTED) for p in pids}
    cause = _first(errors, pids)
    undo = _each(pids, lambda p: _bring_back(backend, p, known[p]), parallel)
    details = [f"pid {p}: {e}" for p, e in errors.items() if e is not cause]
    details += [f"undo pid {p}: {e}" for p, e in undo.items()]
    left = "; every process was resumed" if not undo else f"; {len(undo)} process(es) could NOT be resumed"
    raise GpuError(f"GPU {phase} of {len(pids)} process(es) failed: {cause}{left}",
                   call=getattr(cause, "call", ""), pid=getattr(cause, "pid", None),
                   code=getattr(cause, "code", None), details=details) from cause


def resume_all(pids: list[int], backend: GpuBackend, remap: Remap | None = None, *, parallel: bool = True) -> None:
    pids = list(dict.fromkeys(pids))
    failed = _each(pids, lambda p: backend.restore(p, remap), parallel)
    failed.update(_each([p for p in pids if p not in failed], backend.unlock, parallel))
    if failed:
        cause = _first(failed, pids)
        raise GpuError(
            f"GPU restore of {len(failed)} of {len(pids)} process(es) failed "
            f"(pids {', '.join(str(p) for p in pids if p in failed)}): {cause}",
            call=getattr(cause, "call", ""), pid=getattr(cause, "pid", None), code=getattr(cause, "code", None),
            details=[f"pid {p}: {e}" for p, e in failed.items() if e is not cause],
        ) from cause


def resume_if_needed(pids: list[int], backend: GpuBackend, *, parallel: bool = True) -> None:
    """Bring every process back to running from whatever state it is in (undo paths, the hook's
    watchdog). Raises one GpuError naming those that could not be."""
    pids = list(dict.fromkeys(pids))
    failed = _each(pids, lambda p: _bring_back(backend, p, CHECKPOINTED), parallel)
    if failed:
        raise GpuError(f"could not resume GPU processes {', '.join(map(str, failed))}: {_first(failed, pids)}",
                       details=[f"pid {p}: {e}" for p, e in failed.items()])
