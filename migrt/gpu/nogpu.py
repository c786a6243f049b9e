"""NoGpuBackend: for nodes without the CUDA checkpoint API. available() is False; every call raises."""

from __future__ import annotations

from typing import NoReturn

from migrt.gpu.backend import GpuBackend, GpuUnavailable, Remap


class NoGpuBackend(GpuBackend):
    name = "none"

    def __init__(self, reason: str = "no GPU backend on this node (libcuda.so.1 not loadable)") -> None:
        self.reason = reason

    def available(self) -> bool:
        return False

    def unavailable_reason(self) -> str:
        return self.reason

    def _raise(self, call: str, pid: int) -> NoReturn:
        raise GpuUnavailable(f"{call} (pid {pid}): {self.reason}", call=call, pid=pid)

    def state(self, pid: int) -> str:
        self._raise("state", pid)

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        self._raise("lock", pid)

    def checkpoint(self, pid: int) -> None:
        self._raise("checkpoint", pid)

    def restore(self, pid: int, remap: Remap | None = None) -> None:
        self._raise("restore", pid)

    def unlock(self, pid: int) -> None:
        self._raise("unlock", pid)

    def restore_thread_id(self, pid: int) -> int:
        self._raise("restore_thread_id", pid)
