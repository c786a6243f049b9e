"""Suspend and resume every CUDA process of a container, in parallel, with undo.

suspend_all: lock all (so that no process submits work to a peer that is already frozen), then
checkpoint all (inside `checkpoint_window` when given: the caller's context for the driver's
writing of its host copy, e.g. gpu/thp.py's huge pages; the undo runs outside it). On any failure
every process already touched is brought back (restore, unlock) so the workload goes on, and the
first error is raised with what the undo could not do. Locks that time out while others succeeded
are tried once more after the undo: processes that talk to each other (NCCL collectives without
the application hook) can have work in flight that waits for a peer locked a moment earlier, which
never completes while that peer stays locked; unlocked, it does.
A lock call is given its timeout plus LOCK_GRACE_S to return (in a daemon thread: a driver call
cannot be interrupted, and migrt must be able to exit): one that does not is stuck in the driver
(NVIDIA/cuda-checkpoint#30: while one process of an NCCL job is locked, every call on its peer can
block). The processes locked are unlocked, which lets such a call through; it is then undone too
and the whole lock tried again. One still stuck after that is named in the error (`pending`), and
nobody asks the driver about it again in this call.
resume_all: restore all (onto other GPUs with a remap), then unlock all; every process is tried,
and one error names every process that did not come back.
resume_as_ready: the same, but each process's restore starts as soon as its host memory is in (a
lazy restore fills it while the processes run; the driver reads it), several at once; the first
failure stops it (see there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

from migrt import log as log_mod
from migrt.errors import MigrtError
from migrt.gpu.backend import CHECKPOINTED, LOCKED, RUNNING, GpuBackend, GpuCannotRestore, GpuError, Remap

DEFAULT_LOCK_TIMEOUT_MS = 30_000
LOCK_TIMED_OUT = (600, 909)  # CUDA_ERROR_NOT_READY (what r570+ drivers return), CUDA_ERROR_TIMEOUT
LOCK_RETRIES = 1
LOCK_GRACE_S = 10.0  # beyond the lock's own timeout, before a lock call counts as stuck


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
        err = fut.exception()
        if err is not None:
            errors[pid] = err
    return errors


def _first(errors: dict[int, BaseException], pids: list[int]) -> BaseException:
    return next(errors[p] for p in pids if p in errors)


def _kind(cause: BaseException) -> type[GpuError]:
    """The error class a wrapped failure keeps: a restore the driver refuses for good stays one."""
    return GpuCannotRestore if isinstance(cause, GpuCannotRestore) else GpuError


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
                parallel: bool = True, retries: int = LOCK_RETRIES,
                checkpoint_window: AbstractContextManager | None = None) -> None:
    pids = list(dict.fromkeys(pids))
    window = checkpoint_window or nullcontext()
    for attempt in range(retries + 1):
        try:
            return _suspend_once(pids, backend, timeout_ms, parallel, window)
        except _LockTimedOut as exc:
            if attempt == retries:
                raise exc.error from exc.error.__cause__
            log_mod.get().warning("gpu_lock_retry", pids=pids, timed_out=exc.pids, attempt=attempt + 1,
                                  error=str(exc.error))
            time.sleep(0.2)


class _LockTimedOut(Exception):
    """Some locks timed out, the others were undone: worth one more try."""

    def __init__(self, error: GpuError, pids: list[int]) -> None:
        super().__init__(str(error))
        self.error, self.pids = error, pids


class _Calls:
    """One driver call per pid, each in a daemon thread, waited for up to a deadline."""

    def __init__(self, pids: list[int], fn: Callable[[int], None], seconds: float, parallel: bool) -> None:
        self.results: dict[int, BaseException | None] = {}
        self.threads: dict[int, threading.Thread] = {}
        end = time.monotonic() + seconds
        for pid in pids:
            t = threading.Thread(target=self._run, args=(fn, pid), name=f"migrt-gpu-{pid}", daemon=True)
            self.threads[pid] = t
            t.start()
            if not parallel:
                t.join(seconds)  # one at a time, each with its own deadline
                if t.is_alive():
                    break  # the next ones are not tried: they stay running
        for t in self.threads.values():
            t.join(max(0.0, end - time.monotonic()))

    def _run(self, fn: Callable[[int], None], pid: int) -> None:
        try:
            fn(pid)
            self.results[pid] = None
        except Exception as exc:  # noqa: BLE001 - collected and re-raised by the caller
            self.results[pid] = exc

    def stuck(self) -> list[int]:
        return [p for p, t in self.threads.items() if t.is_alive()]

    def done(self) -> list[int]:
        """Those whose call returned without error."""
        return [p for p, t in self.threads.items() if not t.is_alive() and self.results.get(p, 0) is None]

    def errors(self) -> dict[int, BaseException]:
        return {p: e for p, e in self.results.items() if e is not None and not self.threads[p].is_alive()}


def _lock_all(pids: list[int], backend: GpuBackend, timeout_ms: int, parallel: bool) -> dict[int, BaseException]:
    """Lock every pid; pid -> error. A lock call stuck beyond its deadline: see the module docstring."""
    if timeout_ms <= 0:  # no timeout asked for: no deadline either
        return _each(pids, lambda p: backend.lock(p, timeout_ms), parallel)
    seconds = timeout_ms / 1000 + LOCK_GRACE_S
    calls = _Calls(pids, lambda p: backend.lock(p, timeout_ms), seconds, parallel)
    stuck = calls.stuck()
    if not stuck:
        return calls.errors()
    undo = _each(calls.done(), backend.unlock, parallel)  # a peer unlocked lets a stuck call through
    end = time.monotonic() + LOCK_GRACE_S
    for p in stuck:
        calls.threads[p].join(max(0.0, end - time.monotonic()))
    pending = calls.stuck()
    undo.update(_each([p for p in stuck if p in calls.done()], backend.unlock, parallel))  # went through: undone
    waited = f"{seconds:g} s"
    msg = (f"GPU lock of {len(pids)} process(es) failed: cuCheckpointProcessLock of pid(s) "
           f"{', '.join(map(str, stuck))} did not return within {waited} (work it submitted may wait for a peer "
           "process that was locked first, as in NVIDIA/cuda-checkpoint#30; the application hook stops the "
           "ranks at one step)")
    if pending:
        msg += (f"; pid(s) {', '.join(map(str, pending))} still had not returned {LOCK_GRACE_S:g} s after the others "
                "were unlocked and may end up locked: 'migrt gpu resume' brings them back")
    elif undo:
        msg += f"; {len(undo)} process(es) could NOT be unlocked"
    else:
        msg += "; every process was resumed"
    error = GpuError(msg, call="cuCheckpointProcessLock", pid=stuck[0],
                     details=[f"undo pid {p}: {e}" for p, e in undo.items()])
    error.pending = pending
    if not pending and not undo:
        raise _LockTimedOut(error, stuck)
    raise error


def _suspend_once(pids: list[int], backend: GpuBackend, timeout_ms: int, parallel: bool,
                  window: AbstractContextManager) -> None:
    phase = "lock"
    errors = _lock_all(pids, backend, timeout_ms, parallel)
    if errors:
        known = {p: (RUNNING if p in errors else LOCKED) for p in pids}
    else:
        phase = "checkpoint"
        with window:
            errors = _each(pids, backend.checkpoint, parallel)
        if not errors:
            return
        known = {p: (LOCKED if p in errors else CHECKPOINTED) for p in pids}
    cause = _first(errors, pids)
    undo = _each(pids, lambda p: _bring_back(backend, p, known[p]), parallel)
    details = [f"pid {p}: {e}" for p, e in errors.items() if e is not cause]
    details += [f"undo pid {p}: {e}" for p, e in undo.items()]
    left = "; every process was resumed" if not undo else f"; {len(undo)} process(es) could NOT be resumed"
    error = GpuError(f"GPU {phase} of {len(pids)} process(es) failed: {cause}{left}",
                     call=getattr(cause, "call", ""), pid=getattr(cause, "pid", None),
                     code=getattr(cause, "code", None), details=details)
    error.__cause__ = cause
    if phase == "lock" and not undo and all(getattr(e, "code", None) in LOCK_TIMED_OUT for e in errors.values()):
        raise _LockTimedOut(error, sorted(errors))
    raise error


def resume_all(pids: list[int], backend: GpuBackend, remap: Remap | None = None, *, parallel: bool = True) -> None:
    pids = list(dict.fromkeys(pids))
    failed = _each(pids, lambda p: backend.restore(p, remap), parallel)
    failed.update(_each([p for p in pids if p not in failed], backend.unlock, parallel))
    if failed:
        cause = _first(failed, pids)
        raise _kind(cause)(
            f"GPU restore of {len(failed)} of {len(pids)} process(es) failed "
            f"(pids {', '.join(str(p) for p in pids if p in failed)}): {cause}",
            call=getattr(cause, "call", ""), pid=getattr(cause, "pid", None), code=getattr(cause, "code", None),
            details=[f"pid {p}: {e}" for p, e in failed.items() if e is not cause],
        ) from cause


def resume_as_ready(pids: list[int], backend: GpuBackend, remap: Remap | None,
                    ready: Callable[[list[int]], Iterable[int]], *, poll_s: float = 0.01,
                    clock: Callable[[], float] = time.monotonic) -> dict[int, tuple[float, float]]:
    """Restore each process once ready(waiting pids) names it, in parallel with the restores already
    running, then unlock all (as resume_all: no process runs CUDA work before every one is restored).
    ready() must not block; it raises when the memory can never come (the page filler failed).
    Returns pid -> (clock() at its restore's start, seconds it took).

    The first failure (a restore, or ready()) stops it: no further restore starts, those running
    end, the processes restored so far are unlocked (as resume_all does with those that came back)
    and one error is raised: the restore's GpuError, or ready()'s own error, with what happened to
    each process in its details. The caller removes the container."""
    pids = list(dict.fromkeys(pids))
    waiting = list(pids)
    spans: dict[int, tuple[float, float]] = {}
    futures: dict[int, Future] = {}
    memory_error: BaseException | None = None

    def restore(pid: int) -> None:
        t0 = clock()
        try:
            backend.restore(pid, remap)
        finally:
            spans[pid] = (t0, clock() - t0)

    with ThreadPoolExecutor(max_workers=max(1, min(len(pids), 32)), thread_name_prefix="migrt-gpu") as pool:
        while waiting and not any(f.done() and f.exception() is not None for f in futures.values()):
            try:
                go = set(ready(list(waiting)))
            except Exception as exc:  # noqa: BLE001 - re-raised below, once the restores in flight ended
                memory_error = exc
                break
            for pid in [p for p in waiting if p in go]:
                waiting.remove(pid)
                futures[pid] = pool.submit(restore, pid)
            if waiting:
                time.sleep(poll_s)
    failed = {pid: err for pid, f in futures.items() if (err := f.exception()) is not None}
    restored = [p for p in pids if p in futures and p not in failed]
    if memory_error is None and not failed:
        failed = _each(restored, backend.unlock, True)
        if not failed:
            return spans
        restored = []
    undo = _each(restored, backend.unlock, True)
    cause_pid = next((p for p in pids if p in failed), None)
    details = [f"pid {p}: {e}" for p, e in failed.items() if p != cause_pid or memory_error is not None]
    details += [f"pid {p}: restored, then unlocked" for p in restored if p not in undo]
    details += [f"pid {p}: restored, unlock failed: {e}" for p, e in undo.items()]
    details += [f"pid {p}: not restored (still checkpointed)" for p in waiting]
    if memory_error is not None:
        if isinstance(memory_error, MigrtError):
            memory_error.details.extend(f"GPU restore: {d}" for d in details)
            raise memory_error
        raise GpuError(f"GPU restore of {len(pids)} process(es) stopped: {memory_error!r}",
                       details=details) from memory_error
    assert cause_pid is not None  # failed is not empty, and every pid in it is one of pids
    cause = failed[cause_pid]
    raise _kind(cause)(
        f"GPU restore of {len(failed)} of {len(pids)} process(es) failed "
        f"(pids {', '.join(str(p) for p in pids if p in failed)}): {cause}",
        call=getattr(cause, "call", ""), pid=getattr(cause, "pid", None), code=getattr(cause, "code", None),
        details=details,
    ) from cause


def resume_if_needed(pids: list[int], backend: GpuBackend, *, parallel: bool = True) -> None:
    """Bring every process back to running from whatever state it is in (undo paths, the hook's
    watchdog). Raises one GpuError naming those that could not be."""
    pids = list(dict.fromkeys(pids))
    failed = _each(pids, lambda p: _bring_back(backend, p, CHECKPOINTED), parallel)
    if failed:
        cause = _first(failed, pids)
        raise _kind(cause)(f"could not resume GPU processes {', '.join(map(str, failed))}: {cause}",
                           details=[f"pid {p}: {e}" for p, e in failed.items()])
