"""FakeGpuBackend: the driver's per-process state machine, for tests. Illegal transitions raise
(as the driver's CUDA_ERROR_ILLEGAL_STATE would); `fail(call, pid)` makes a chosen call fail."""

from __future__ import annotations

import threading

from migrt.gpu.backend import CHECKPOINTED, FAILED, LOCKED, RUNNING, GpuBackend, GpuError, Remap

# call -> (state required, state after)
TRANSITIONS = {
    "lock": (RUNNING, LOCKED),
    "checkpoint": (LOCKED, CHECKPOINTED),
    "restore": (CHECKPOINTED, LOCKED),
    "unlock": (LOCKED, RUNNING),
}


class IllegalTransition(GpuError):
    pass


class FakeGpuBackend(GpuBackend):
    name = "fake"

    def __init__(self, pids: dict[int, str] | list[int] | None = None, *, gpus: list[bytes] | None = None) -> None:
        """pids: the CUDA processes it knows (state running unless given); others are 'not found'.
        gpus: UUIDs a remap may name as targets (None: any)."""
        if isinstance(pids, dict):
            self.states = dict(pids)
        else:
            self.states = {p: RUNNING for p in pids or []}
        self.gpus = gpus
        self.calls: list[tuple] = []  # (call, pid, extra) in the order made
        self.remaps: dict[int, Remap | None] = {}
        self._failures: dict[tuple[str, int | None], list[tuple[str, bool]]] = {}
        self._mu = threading.Lock()

    def add(self, pid: int, state: str = RUNNING) -> None:
        with self._mu:
            self.states[pid] = state

    def fail(self, call: str, pid: int | None = None, *, message: str = "injected failure", to_failed: bool = False,
             times: int = 1) -> None:
        """Make `call` (on `pid`, or on any pid) raise GpuError `times` times; to_failed also moves
        the process to the driver's 'failed' state, as a transition that broke half-way does."""
        with self._mu:
            self._failures.setdefault((call, pid), []).extend([(message, to_failed)] * times)

    def _maybe_fail(self, call: str, pid: int) -> None:
        for key in ((call, pid), (call, None)):
            queue = self._failures.get(key)
            if queue:
                message, to_failed = queue.pop(0)
                if to_failed:
                    self.states[pid] = FAILED
                raise GpuError(f"{call} (pid {pid}) failed: {message}", call=call, pid=pid, code=999)

    def _known(self, call: str, pid: int) -> str:
        if pid not in self.states:
            raise GpuError(f"{call} (pid {pid}) failed: CUDA_ERROR_NOT_FOUND (fake)", call=call, pid=pid, code=500)
        return self.states[pid]

    def _transition(self, call: str, pid: int, extra=None) -> None:
        with self._mu:
            self.calls.append((call, pid, extra))
            state = self._known(call, pid)
            self._maybe_fail(call, pid)
            need, after = TRANSITIONS[call]
            if state != need:
                raise IllegalTransition(f"{call} (pid {pid}): process is {state}, needs {need}",
                                        call=call, pid=pid, code=401)
            self.states[pid] = after

    def available(self) -> bool:
        return True

    def state(self, pid: int) -> str:
        with self._mu:
            self.calls.append(("state", pid, None))
            state = self._known("state", pid)
            self._maybe_fail("state", pid)
            return state

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        self._transition("lock", pid, timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._transition("checkpoint", pid)

    def restore(self, pid: int, remap: Remap | None = None) -> None:
        if remap and self.gpus is not None:
            unknown = [new for _, new in remap if new not in self.gpus]
            if unknown:
                raise GpuError(f"restore (pid {pid}): unknown target GPU {unknown[0].hex()}", call="restore",
                               pid=pid, code=1)
        self._transition("restore", pid, list(remap) if remap else None)
        with self._mu:
            self.remaps[pid] = list(remap) if remap else None

    def unlock(self, pid: int) -> None:
        self._transition("unlock", pid)

    def restore_thread_id(self, pid: int) -> int:
        with self._mu:
            self.calls.append(("restore_thread_id", pid, None))
            self._known("restore_thread_id", pid)
            return pid

    def calls_of(self, call: str) -> list[int]:
        return [p for c, p, _ in self.calls if c == call]
