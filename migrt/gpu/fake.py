"""FakeGpuBackend: the driver's per-process state machine, for tests. Illegal transitions raise
(as the driver's CUDA_ERROR_ILLEGAL_STATE would); `fail(call, pid)` makes a chosen call fail."""

from __future__ import annotations

import os
import signal
import threading

from migrt.gpu import fakenode
from migrt.gpu.backend import (
    CHECKPOINTED,
    FAILED,
    LOCKED,
    RUNNING,
    GpuBackend,
    GpuCannotRestore,
    GpuError,
    Remap,
    uuid_text,
)

NOT_SUPPORTED = 801

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
            self.states = dict.fromkeys(pids or [], RUNNING)
        self.gpus = gpus
        self.calls: list[tuple] = []  # (call, pid, extra) in the order made
        self.remaps: dict[int, Remap | None] = {}
        self._failures: dict[tuple[str, int | None], list[tuple[str, bool, int]]] = {}
        self._mu = threading.Lock()

    def add(self, pid: int, state: str = RUNNING) -> None:
        with self._mu:
            self.states[pid] = state

    def fail(self, call: str, pid: int | None = None, *, message: str = "injected failure", to_failed: bool = False,
             times: int = 1, code: int = 999) -> None:
        """Make `call` (on `pid`, or on any pid) raise GpuError `times` times; to_failed also moves
        the process to the driver's 'failed' state, as a transition that broke half-way does.
        code 801 at restore raises GpuCannotRestore, as the CUDA backend does."""
        with self._mu:
            self._failures.setdefault((call, pid), []).extend([(message, to_failed, code)] * times)

    def _maybe_fail(self, call: str, pid: int) -> None:
        for key in ((call, pid), (call, None)):
            queue = self._failures.get(key)
            if queue:
                message, to_failed, code = queue.pop(0)
                if to_failed:
                    self.states[pid] = FAILED
                raise _error(call, pid, message, code)

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


class FileFakeGpuBackend(GpuBackend):
    """The same state machine over migrt.gpu.fakenode's file (MIGRT_FAKE_GPU), so that every migrt
    process of a test (migrt-runc, the CLI, sender and receiver) sees one simulated driver."""

    name = "fake-file"

    def __init__(self, path: str) -> None:
        self.path = path

    def _call(self, call: str, pid: int, remap: Remap | None = None) -> str:
        with fakenode.locked(self.path) as data:
            data["calls"].append([call, pid])
            e = fakenode.entry(data, pid)
            if e is None:
                raise GpuError(f"{call} (pid {pid}) failed: CUDA_ERROR_NOT_FOUND (fake)", call=call, pid=pid, code=500)
            for i, f in enumerate(data["fail"]):
                if f.get("call") == call and f.get("pid") in (None, pid):
                    del data["fail"][i]
                    if f.get("crash"):  # the caller dies here, as a killed migrt would
                        fakenode.save(self.path, data)
                        os.kill(os.getpid(), signal.SIGKILL)
                    if f.get("to_failed"):
                        e["state"] = FAILED
                    raise _error(call, pid, f.get("message", "injected failure"), int(f.get("code", 999)))
            if call == "state":
                return e["state"]
            need, after = TRANSITIONS[call]
            if e["state"] != need:
                raise IllegalTransition(f"{call} (pid {pid}): process is {e['state']}, needs {need}",
                                        call=call, pid=pid, code=401)
            if call == "restore":
                uuids = [g["uuid"] for g in data.get("gpus") or []]
                target = e.get("gpu") or (uuids[0] if uuids else None)
                if remap:
                    pairs = {uuid_text(o).lower(): uuid_text(n) for o, n in remap}
                    target = pairs.get((e.get("gpu") or "").lower(), uuid_text(remap[0][1]))
                if target is not None and target.lower() not in [u.lower() for u in uuids]:
                    raise GpuError(f"restore (pid {pid}): unknown target GPU {target}", call=call, pid=pid, code=1)
                free = free_bytes(data, target)
                if free is not None and free < e.get("bytes", 0):
                    raise GpuError(f"restore (pid {pid}) failed: CUDA_ERROR_OUT_OF_MEMORY on {target} (fake)",
                                   call=call, pid=pid, code=2)
                e["gpu"] = target
                e["remap"] = [[uuid_text(o), uuid_text(n)] for o, n in remap] if remap else None
            e["state"] = after
            return after

    def available(self) -> bool:
        return True

    def state(self, pid: int) -> str:
        return self._call("state", pid)

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        self._call("lock", pid)

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", pid)
        fakenode.host_copy(self.path, pid)

    def restore(self, pid: int, remap: Remap | None = None) -> None:
        self._call("restore", pid, remap)

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid)

    def restore_thread_id(self, pid: int) -> int:
        return pid


def _error(call: str, pid: int, message: str, code: int) -> GpuError:
    cls = GpuCannotRestore if (call, code) == ("restore", NOT_SUPPORTED) else GpuError
    return cls(f"{call} (pid {pid}) failed: {message}", call=call, pid=pid, code=code)


def free_bytes(data: dict, uuid: str | None) -> int | None:
    """A fake GPU's free memory: its total less what the processes holding it use."""
    if not uuid:
        return None
    gpu = next((g for g in data.get("gpus") or [] if g["uuid"].lower() == uuid.lower()), None)
    if gpu is None or gpu.get("memory_total") is None:
        return None
    used = sum(p.get("bytes", 0) for k, p in data["processes"].items()
               if fakenode.holds_gpu(p.get("state", "")) and (p.get("gpu") or "").lower() == uuid.lower()
               and fakenode.lives(k, p))
    return int(gpu["memory_total"]) - used - int(gpu.get("reserved", 0))
