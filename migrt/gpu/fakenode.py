"""A simulated GPU node for tests that span processes and machines without a GPU: migrt-runc's
`pause` in one process and `migrt gpu resume` in another, the sender and the receiver of a
migration. Never used unless MIGRT_FAKE_GPU names its state file. Standard library only (the shim
finds CUDA processes through it).

When it is set, three things come from the file instead of the driver: which processes are CUDA
processes (those whose environment holds the `marker`, FAKE_CUDA=1 by default: the marker travels
with the process through CRIU as a real process's GPU state does), the driver's per-process state
(FileFakeGpuBackend in migrt/gpu/fake.py) and the inventory (GPUs, and their free memory: a process
that is not checkpointed holds `process_bytes` on its GPU: the first, or GPU <FAKE_CUDA_GPU> of its
environment). The file:

    {"driver_version": "580.159", "gpus": [{"uuid", "name", "memory_total", "pci_bus_id", "minor"}],
     "marker": "FAKE_CUDA=1", "new_state": "running", "process_bytes": 1073741824,
     "ns_init_only": false,     # true: only a container's init (pid 1 in its pid namespace) counts
     "processes": {"<pid>": {"state", "gpu", "bytes", "start"}},       # kept by the fake itself
     "fail": [{"call": "restore", "pid": null, "message": "...", "code": 801}],  # each entry fails one call
                                                  # (code 801 at restore: the driver's "cannot restore")
                                                  # ("crash": true: SIGKILLs the calling process instead)
     "checkpoint_signal": 10, "checkpoint_ack": "/tmp/gpu-copy",  # optional: see host_copy()
     "calls": [["lock", pid], ...]}                                     # every driver call, in order

`new_state` is the driver state of a marked process the file has not seen yet: "running" on a
source node, "checkpointed" on a target node (whatever arrives through a restore was checkpointed).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator

from migrt.kernel.files import atomic_file

ENV = "MIGRT_FAKE_GPU"
DEFAULT_MARKER = "FAKE_CUDA=1"


def path() -> str | None:
    return os.environ.get(ENV) or None


def _read_environ(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        raw = b""
    if not raw:  # a lazily restored process whose environment page is not in yet: see _environ_by_vm
        raw = _environ_by_vm(pid)
    return [e.decode(errors="replace") for e in raw.split(b"\0") if e]


def _environ_by_vm(pid: int) -> bytes:
    """The process's environment block read with process_vm_readv. /proc/PID/environ reads through a
    remote access that cannot wait for a userfaultfd (the kernel answers it with an error), so a
    process restored with lazy pages shows no environment until its page is copied in; process_vm_readv
    faults the page in through its userfaultfd like the process's own access, served by the filler."""
    import ctypes

    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            fields = fh.read().rpartition(")")[2].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (stat fields 50 and 51)
    except (OSError, IndexError, ValueError):
        return b""
    if not 0 < start < end or end - start > 1 << 20:
        return b""

    from migrt.kernel.libc import Iovec, libc

    buf = ctypes.create_string_buffer(end - start)
    local, remote = Iovec(ctypes.addressof(buf), end - start), Iovec(start, end - start)
    got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return buf.raw[:got] if got > 0 else b""


def _start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            return int(fh.read().rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _ns_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextlib.contextmanager
def locked(file: str | None = None) -> Iterator[dict]:
    """The file's data under an exclusive lock; written back (atomically) when the block ends, however."""
    file = file or path()
    if not file:
        raise RuntimeError(f"{ENV} is not set")
    with open(file + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
        data.setdefault("processes", {})
        data.setdefault("calls", [])
        data.setdefault("fail", [])
        try:
            yield data
        finally:  # a failing call changes the driver's state too (and consumes its injected failure)
            save(file, data)


def save(file: str, data: dict) -> None:
    with atomic_file(file, 0o644, text=True, durable=False) as fh:
        json.dump(data, fh, indent=1)


def read(file: str | None = None) -> dict:
    with locked(file) as data:
        return json.loads(json.dumps(data))


def entry(data: dict, pid: int) -> dict | None:
    """The process's record (created for a marked process seen for the first time), None when pid
    is not a CUDA process of this fake node."""
    key = str(pid)
    start = _start(pid)
    known = data["processes"].get(key)
    if known is not None and (start is None or known.get("start") in (None, start)):
        return known
    if start is None or data.get("marker", DEFAULT_MARKER) not in _read_environ(pid):
        return None
    if data.get("ns_init_only") and _ns_pid(pid) != 1:  # a container's init only, not what it forks
        return None
    gpus = data.get("gpus") or []
    state = data.get("new_state", "running")
    gpu = _own_gpu(pid, gpus)
    known = {"state": state, "gpu": gpu if state != "checkpointed" else None,
             "bytes": int(data.get("process_bytes", 1 << 30)), "start": start}
    data["processes"][key] = known
    return known


def _own_gpu(pid: int, gpus: list[dict]) -> str | None:
    """The GPU a new process holds: GPU <FAKE_CUDA_GPU> of the file (its index) if its environment
    says, else the first (one process per GPU, as a multi-GPU job runs)."""
    if not gpus:
        return None
    for item in _read_environ(pid):
        key, _, value = item.partition("=")
        if key == "FAKE_CUDA_GPU" and value.isdigit() and int(value) < len(gpus):
            return gpus[int(value)]["uuid"]
    return gpus[0]["uuid"]


def cuda_pids(pids: list[int], *, live: bool = True) -> list[int]:
    """procs.cuda_pids on the fake node: marked processes; live ones are those not checkpointed."""
    out = []
    with locked() as data:
        for pid in pids:
            e = entry(data, pid)
            if e is not None and (not live or e["state"] != "checkpointed"):
                out.append(pid)
    return out


def discover(data: dict) -> None:
    """Register every marked process of the machine, as the driver knows every CUDA process."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            entry(data, int(name))


def holds_gpu(state: str) -> bool:
    return state in ("running", "locked")


def lives(key: str, proc: dict) -> bool:
    """The recorded process still exists (an exited process's GPU memory is the driver's again)."""
    return _start(int(key)) == proc.get("start")


HOST_COPY_WAIT_S = 10.0


def host_copy(file: str, pid: int) -> None:
    """The real driver's checkpoint writes the process's GPU memory into fresh host memory of the
    process (one big private anonymous mapping: gpu/backing.py). The fake cannot allocate in another
    process, so a workload that wants it does it itself: with `checkpoint_signal` set, the checkpoint
    sends that signal to the process and waits until the file `checkpoint_ack` (a path inside the
    process's root) exists, which the workload creates once it has mapped and filled that memory."""
    import signal as signal_mod
    import time

    from migrt.gpu.backend import GpuError

    with locked(file) as data:
        sig, ack = data.get("checkpoint_signal"), data.get("checkpoint_ack")
    if not sig or not ack:
        return
    path = f"/proc/{pid}/root/{str(ack).lstrip('/')}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.kill(pid, signal_mod.Signals(int(sig)))
    deadline = time.monotonic() + HOST_COPY_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise GpuError(f"checkpoint (pid {pid}) failed: the workload did not map its host copy within "
                           f"{HOST_COPY_WAIT_S:.0f} s (no {ack}; fake)", call="checkpoint", pid=pid, code=999)
        time.sleep(0.01)
