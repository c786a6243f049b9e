"""The interface every GPU backend implements, its process states, and the GPU error type.

State machine of one process (the CUDA driver's, r570+):

    running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running

`failed` is the driver's word for a process whose last transition broke half-way.
"""

from __future__ import annotations

import abc

from migrt.errors import PreconditionFailed, RuntimeFailed

RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
STATES = (RUNNING, LOCKED, CHECKPOINTED, FAILED)

# A remap is a list of (old GPU UUID, new GPU UUID) pairs, 16 raw bytes each.
Remap = list[tuple[bytes, bytes]]


class GpuError(RuntimeFailed):
    """A GPU call failed. `call`, `pid` and `code` (the CUresult, when the driver gave one) say which."""

    def __init__(self, message: str, *, call: str = "", pid: int | None = None, code: int | None = None,
                 details: list[str] | None = None) -> None:
        super().__init__(message, details=details)
        self.call = call
        self.pid = pid
        self.code = code
        self.pending: list[int] = []  # a timed-out lock: pids whose lock call had not returned yet


class GpuCannotRestore(GpuError):
    """The driver checkpointed the process but refuses to restore it (CUDA_ERROR_NOT_SUPPORTED at
    restore: state such as peer or IPC mappings that this driver cannot bring back). A retry with the
    same driver fails the same way; the process keeps its GPU state in its host memory."""


class GpuUnavailable(GpuError, PreconditionFailed):
    """No usable GPU checkpoint API on this node (no driver, too old, or the no-GPU backend)."""

    exit_code = PreconditionFailed.exit_code


class GpuBackend(abc.ABC):
    """Checkpoint calls on CUDA processes, addressed by pid (as seen from migrt's pid namespace)."""

    name = "abstract"

    @abc.abstractmethod
    def available(self) -> bool:
        """True when the calls below can work on this node."""

    @abc.abstractmethod
    def state(self, pid: int) -> str:
        """One of STATES."""

    @abc.abstractmethod
    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        """Block further CUDA calls and wait for submitted work (0: no timeout)."""

    @abc.abstractmethod
    def checkpoint(self, pid: int) -> None:
        """Move a locked process's GPU memory into its host memory; release its GPU."""

    @abc.abstractmethod
    def restore(self, pid: int, remap: Remap | None = None) -> None:
        """Bring a checkpointed process's GPU state back, onto other GPUs when remap is given."""

    @abc.abstractmethod
    def unlock(self, pid: int) -> None:
        """Let a locked process call CUDA again."""

    @abc.abstractmethod
    def restore_thread_id(self, pid: int) -> int:
        """The thread of the process that performs the restore (CRIU lets it run first)."""


def uuid_bytes(text: str) -> bytes:
    """'GPU-8c2d6a5e-...' (NVML's and nvidia-smi's form) or bare hex with dashes -> 16 raw bytes."""
    t = text.strip()
    if t[:4].upper() == "GPU-":
        t = t[4:]
    raw = t.replace("-", "")
    if len(raw) != 32:
        raise ValueError(f"not a GPU UUID: {text!r}")
    return bytes.fromhex(raw)


def uuid_text(raw: bytes) -> str:
    """16 raw bytes -> 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx'."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
