"""CudaDriverBackend: the CUDA driver's process checkpoint API (r570+; remap needs r580) via ctypes.

Argument structures, as the CUDA 12.8+/13.0 `cuda.h` and the driver API reference (section 7,
"CUcheckpoint*Args") declare them; every one is 64 bytes on 64-bit Linux:

    CUcheckpointLockArgs       { unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7]; }
    CUcheckpointCheckpointArgs { cuuint64_t reserved[8]; }
    CUcheckpointGpuPair        { CUuuid oldUuid; CUuuid newUuid; }                  (32 bytes)
    CUcheckpointRestoreArgs    { CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;
                                 char reserved[52 - sizeof(CUcheckpointGpuPair *)]; cuuint64_t reserved1; }
                               (8 + 4 + 44 = 56, then reserved1 at offset 56: 64 bytes)
    CUcheckpointUnlockArgs     { cuuint64_t reserved[8]; }

Reserved fields must be zero; ctypes zero-fills. CUresult codes become migrt errors in one place,
`_check`, with the driver's own name and text (cuGetErrorName / cuGetErrorString), a hint chosen by
the code AND the operation that returned it (`_HINTS`), and, after a failed transition, the state the
driver now reports for the process.
"""

from __future__ import annotations

import ctypes
import threading

from migrt.gpu.backend import (
    CHECKPOINTED,
    FAILED,
    LOCKED,
    RUNNING,
    GpuBackend,
    GpuCannotRestore,
    GpuError,
    GpuUnavailable,
    Remap,
)

LIBCUDA = "libcuda.so.1"

# CUresult values the messages and the translation below care about (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_TIMEOUT = 909
CUDA_ERROR_NOT_READY = 600  # a lock whose timeout ran out (r570+ drivers)

# CUprocessState
_STATES = {0: RUNNING, 1: LOCKED, 2: CHECKPOINTED, 3: FAILED}

LOCK, CHECKPOINT, RESTORE, UNLOCK = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                                     "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_OPERATING_SYSTEM = 304

# What a CUresult means for the process, by the operation that returned it: (code, call) first, then
# (code, None). The same code says different things in different places: NOT_SUPPORTED from the
# restore of a process the driver has just checkpointed is no "driver too old".
_HINTS = {
    (CUDA_ERROR_INVALID_VALUE, RESTORE): "the GPU pairs must cover every GPU the process can see, each once",
    (CUDA_ERROR_OUT_OF_MEMORY, RESTORE): ("the target GPU lacks the free memory this process's state needs; it "
                                          "stays checkpointed (free memory there, then retry)"),
    (CUDA_ERROR_OPERATING_SYSTEM, RESTORE): ("an earlier restore of this process failed half-way and the driver "
                                             "cannot retry it (NVIDIA/cuda-checkpoint#44); restore a checkpoint "
                                             "of it into a new process instead"),
    (CUDA_ERROR_NOT_SUPPORTED, RESTORE): (
        "the driver checkpointed this process but cannot restore it: it held state the driver cannot bring "
        "back, most likely peer-to-peer or CUDA IPC mappings into another process's GPU memory (NCCL's P2P "
        "or SHM transports between processes, CUDA IPC, NVLS multicast); NVIDIA documents CUDA IPC restore "
        "from driver 610. Retrying will not help with this driver. Run such jobs with "
        "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, or with the application hook (docs/gpu.md, Multi-GPU jobs)"),
    (CUDA_ERROR_NOT_SUPPORTED, LOCK): ("the driver cannot checkpoint this process: it uses something process "
                                       "checkpoints do not support (UVM/managed memory, CUDA IPC, multicast "
                                       "objects), or its GPU does not support them"),
    (CUDA_ERROR_NOT_SUPPORTED, CHECKPOINT): ("the driver cannot checkpoint this process: it uses something "
                                             "process checkpoints do not support (UVM/managed memory, CUDA IPC, "
                                             "multicast objects), or its GPU does not support them"),
    (CUDA_ERROR_NOT_SUPPORTED, None): "the driver or GPU does not support process checkpoints (driver r570+ needed)",
    (CUDA_ERROR_ILLEGAL_STATE, LOCK): "the process is not running on the GPU (already locked or checkpointed)",
    (CUDA_ERROR_ILLEGAL_STATE, CHECKPOINT): "the process is not locked",
    (CUDA_ERROR_ILLEGAL_STATE, RESTORE): "the process is not checkpointed",
    (CUDA_ERROR_ILLEGAL_STATE, UNLOCK): "the process is not locked (it may still be checkpointed)",
    (CUDA_ERROR_ILLEGAL_STATE, None): "the process is not in the state this call needs",
    (CUDA_ERROR_NOT_FOUND, None): "no CUDA process with this pid (or it never initialised CUDA)",
    (CUDA_ERROR_NOT_PERMITTED, None): "run as root",
    (CUDA_ERROR_TIMEOUT, None): "the process did not reach a lockable point in time; raise the lock timeout",
    (CUDA_ERROR_NOT_READY, LOCK): ("the process did not reach a lockable point in time: work it submitted is still "
                                   "running (a long kernel, or a collective waiting for a peer process that was "
                                   "locked first); raise the lock timeout (gpu_lock_timeout_ms), or have the "
                                   "ranks stop at one step with the application hook"),
}


def hint(code: int, call: str) -> str | None:
    return _HINTS.get((code, call)) or _HINTS.get((code, None))


REQUIRED = ("cuInit", "cuGetErrorName", "cuGetErrorString", "cuCheckpointProcessLock",
            "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
            "cuCheckpointProcessGetState", "cuCheckpointProcessGetRestoreThreadId")


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


class CUcheckpointUnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


for _s in (CUcheckpointLockArgs, CUcheckpointCheckpointArgs, CUcheckpointRestoreArgs, CUcheckpointUnlockArgs):
    assert ctypes.sizeof(_s) == 64, (_s.__name__, ctypes.sizeof(_s))
assert ctypes.sizeof(CUcheckpointGpuPair) == 32


def _gpu_pairs(remap: Remap) -> ctypes.Array[CUcheckpointGpuPair]:
    pairs = (CUcheckpointGpuPair * len(remap))()
    for i, (old, new) in enumerate(remap):
        if len(old) != 16 or len(new) != 16:
            raise ValueError(f"GPU pair {i}: UUIDs must be 16 bytes, got {len(old)} and {len(new)}")
        ctypes.memmove(pairs[i].oldUuid.bytes, old, 16)
        ctypes.memmove(pairs[i].newUuid.bytes, new, 16)
    return pairs


class CudaDriverBackend(GpuBackend):
    """libcuda.so.1 (or `library`, a path: the tests' stand-in) loaded once, cuInit(0) on first use."""

    name = "cuda"

    def __init__(self, library: str = LIBCUDA) -> None:
        self.library = library
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None
        self._init_lock = threading.Lock()

    # -- loading ---------------------------------------------------------------------------------
    def _load(self) -> ctypes.CDLL:
        with self._init_lock:
            if self._lib is not None:
                return self._lib
            if self._error is not None:
                raise GpuUnavailable(self._error)
            try:
                lib = ctypes.CDLL(self.library)
            except OSError as exc:
                self._error = f"cannot load {self.library}: {exc} (no NVIDIA driver on this node?)"
                raise GpuUnavailable(self._error) from exc
            missing = [s for s in REQUIRED if not hasattr(lib, s)]
            if missing:
                self._error = (f"{self.library} lacks {', '.join(missing)}: the driver is too old for process "
                               "checkpoints (r570+ needed, r580+ for restore onto other GPUs)")
                raise GpuUnavailable(self._error)
            for fn in REQUIRED:
                getattr(lib, fn).restype = ctypes.c_int
            lib.cuInit.argtypes = [ctypes.c_uint]
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuCheckpointProcessLock.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)]
            lib.cuCheckpointProcessCheckpoint.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointCheckpointArgs)]
            lib.cuCheckpointProcessRestore.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointRestoreArgs)]
            lib.cuCheckpointProcessUnlock.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointUnlockArgs)]
            lib.cuCheckpointProcessGetState.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            lib.cuCheckpointProcessGetRestoreThreadId.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            self._lib = lib  # set before cuInit so that _check can name its errors
            try:
                self._check("cuInit", None, lib.cuInit(0))
            except GpuError as exc:
                self._lib = None
                self._error = str(exc)
                raise GpuUnavailable(self._error, call="cuInit", code=exc.code) from exc
            return lib

    def available(self) -> bool:
        try:
            self._load()
        except GpuError:
            return False
        return True

    def unavailable_reason(self) -> str | None:
        return None if self.available() else self._error

    # -- the one place where CUresult becomes a migrt error ----------------------------------------
    def _describe(self, rc: int) -> tuple[str, str]:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        lib = self._lib
        if lib is None or lib.cuGetErrorName(rc, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {rc}", "unknown error"
        if lib.cuGetErrorString(rc, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return name.value.decode(errors="replace"), "no description"
        return name.value.decode(errors="replace"), text.value.decode(errors="replace")

    def _check(self, call: str, pid: int | None, rc: int) -> None:
        if rc == CUDA_SUCCESS:
            return
        name, text = self._describe(rc)
        where = f" (pid {pid})" if pid is not None else ""
        tip = hint(rc, call)
        msg = f"{call}{where} failed: {name}: {text}" + (f"; {tip}" if tip else "")
        if pid is not None and call in (CHECKPOINT, RESTORE, UNLOCK):
            now = self._state_after(pid)
            if now:
                msg += f" (the driver now reports the process {now})"
        cls: type[GpuError]
        if rc == CUDA_ERROR_NOT_SUPPORTED and call == RESTORE:
            cls = GpuCannotRestore  # checkpointed, and this driver will not bring it back
        elif rc == CUDA_ERROR_NOT_SUPPORTED:
            cls = GpuUnavailable  # nothing changed: a precondition of the node or of this process
        else:
            cls = GpuError
        raise cls(msg, call=call, pid=pid, code=rc)

    def _state_after(self, pid: int) -> str | None:
        """The process's state after a failed transition, for the message (None if the driver won't say)."""
        lib = self._lib
        out = ctypes.c_int(-1)
        try:
            if lib is None or lib.cuCheckpointProcessGetState(pid, ctypes.byref(out)) != CUDA_SUCCESS:
                return None
        except OSError:
            return None
        return _STATES.get(out.value)

    # -- the calls -----------------------------------------------------------------------------------
    def state(self, pid: int) -> str:
        lib = self._load()
        out = ctypes.c_int(-1)
        self._check("cuCheckpointProcessGetState", pid, lib.cuCheckpointProcessGetState(pid, ctypes.byref(out)))
        try:
            return _STATES[out.value]
        except KeyError:
            raise GpuError(f"cuCheckpointProcessGetState (pid {pid}) returned unknown state {out.value}",
                           call="cuCheckpointProcessGetState", pid=pid) from None

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        lib = self._load()
        args = CUcheckpointLockArgs(timeoutMs=int(timeout_ms))
        self._check("cuCheckpointProcessLock", pid, lib.cuCheckpointProcessLock(pid, ctypes.byref(args)))

    def checkpoint(self, pid: int) -> None:
        lib = self._load()
        args = CUcheckpointCheckpointArgs()
        self._check("cuCheckpointProcessCheckpoint", pid, lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)))

    def restore(self, pid: int, remap: Remap | None = None) -> None:
        lib = self._load()
        args = CUcheckpointRestoreArgs()
        pairs = None
        if remap:
            pairs = _gpu_pairs(remap)  # kept alive until the call returns
            args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(CUcheckpointGpuPair))
            args.gpuPairsCount = len(remap)
        rc = lib.cuCheckpointProcessRestore(pid, ctypes.byref(args))
        del pairs
        self._check("cuCheckpointProcessRestore", pid, rc)

    def unlock(self, pid: int) -> None:
        lib = self._load()
        args = CUcheckpointUnlockArgs()
        self._check("cuCheckpointProcessUnlock", pid, lib.cuCheckpointProcessUnlock(pid, ctypes.byref(args)))

    def restore_thread_id(self, pid: int) -> int:
        lib = self._load()
        tid = ctypes.c_int(0)
        self._check("cuCheckpointProcessGetRestoreThreadId", pid,
                    lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid)))
        return tid.value

    def driver_api_version(self) -> int | None:
        """cuDriverGetVersion (e.g. 13000 for CUDA 13.0), or None."""
        try:
            lib = self._load()
        except GpuError:
            return None
        fn = getattr(lib, "cuDriverGetVersion", None)
        if fn is None:
            return None
        v = ctypes.c_int(0)
        return v.value if fn(ctypes.byref(v)) == CUDA_SUCCESS else None
