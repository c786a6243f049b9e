"""What GPUs this node has: NVML through pynvml when importable (memory, processes, persistence
mode), else /proc/driver/nvidia (model, UUID, PCI bus id, minor number, driver version: enough to
pair and check GPUs without any Python package). Never raises: an Inventory says what it lacks.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from dataclasses import asdict, dataclass, field

PROC_NVIDIA = "/proc/driver/nvidia"


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str = ""
    minor: int | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    persistence_mode: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Inventory:
    source: str  # "nvml" | "procfs" | "none"
    driver_version: str | None = None
    cuda_driver_version: int | None = None  # e.g. 13000 (NVML only)
    gpus: list[Gpu] = field(default_factory=list)
    processes: dict[int, list[tuple[str, int | None]]] = field(default_factory=dict)  # pid -> [(uuid, bytes)]
    error: str | None = None
    processes_seen: bool = False  # `processes` is the driver's list (NVML asked, or the simulated node)

    @property
    def available(self) -> bool:
        return self.source != "none"

    def contexts(self) -> dict[int, list[str]] | None:
        """host pid -> UUIDs of the GPUs the driver lists it on as a compute process; None when the
        driver was not asked (no NVML): the peer rule (gpu/peers.py) then cannot tell GPUs apart."""
        if not self.processes_seen:
            return None
        return {pid: [u for u, _ in used] for pid, used in self.processes.items()}

    def by_uuid(self, uuid: str) -> Gpu | None:
        u = uuid.lower()
        return next((g for g in self.gpus if g.uuid.lower() == u), None)

    def by_minor(self, minor: int) -> Gpu | None:
        return next((g for g in self.gpus if g.minor == minor), None)

    def by_index(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _nvml(pynvml, with_processes: bool) -> Inventory:
    def opt(fn, *a):
        try:
            return fn(*a)
        except pynvml.NVMLError:
            return None

    pynvml.nvmlInit()
    try:
        inv = Inventory(source="nvml", driver_version=_text(pynvml.nvmlSystemGetDriverVersion()))
        inv.cuda_driver_version = opt(pynvml.nvmlSystemGetCudaDriverVersion)
        inv.processes_seen = with_processes
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = opt(pynvml.nvmlDeviceGetMemoryInfo, h)
            pci = opt(pynvml.nvmlDeviceGetPciInfo, h)
            pm = opt(pynvml.nvmlDeviceGetPersistenceMode, h)
            gpu = Gpu(
                index=i, uuid=_text(pynvml.nvmlDeviceGetUUID(h)), name=_text(pynvml.nvmlDeviceGetName(h)),
                pci_bus_id=_text(pci.busId) if pci is not None else "",
                minor=opt(pynvml.nvmlDeviceGetMinorNumber, h),
                memory_total=mem.total if mem else None, memory_used=mem.used if mem else None,
                memory_free=mem.free if mem else None,
                persistence_mode=None if pm is None else pm == pynvml.NVML_FEATURE_ENABLED,
            )
            inv.gpus.append(gpu)
            if with_processes:
                running = opt(pynvml.nvmlDeviceGetComputeRunningProcesses, h)
                if running is None:  # a list we could not read is not an empty one
                    inv.processes_seen = False
                for p in running or []:
                    used = getattr(p, "usedGpuMemory", None)
                    inv.processes.setdefault(int(p.pid), []).append((gpu.uuid, int(used) if used else None))
        return inv
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _info_file(path: str) -> dict[str, str]:
    out = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep:
                    out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def procfs_driver_version(root: str = PROC_NVIDIA) -> str | None:
    """'NVRM version: NVIDIA UNIX ... Kernel Module  580.159  Release Build ...' -> '580.159'."""
    try:
        with open(os.path.join(root, "version"), encoding="utf-8", errors="replace") as fh:
            first = fh.readline()
    except OSError:
        return None
    m = re.search(r"Module\b.*?\s(\d+\.\d+(?:\.\d+)*)(?:\s|$)", first)
    return m.group(1) if m else None


def _procfs(root: str = PROC_NVIDIA) -> Inventory:
    version = procfs_driver_version(root)
    gpus: list[Gpu] = []
    for d in sorted(glob.glob(os.path.join(root, "gpus", "*"))):
        info = _info_file(os.path.join(d, "information"))
        uuid = info.get("GPU UUID", "")
        if not uuid:
            continue
        minor = info.get("Device Minor", "")
        gpus.append(Gpu(index=len(gpus), uuid=uuid, name=info.get("Model", "?"),
                        pci_bus_id=info.get("Bus Location", os.path.basename(d)),
                        minor=int(minor) if minor.isdigit() else None))
    if version is None and not gpus:
        return Inventory(source="none")
    return Inventory(source="procfs", driver_version=version, gpus=gpus)


def take(with_processes: bool = True, *, procfs_root: str = PROC_NVIDIA) -> Inventory:
    """The node's GPUs, from NVML if pynvml imports and initialises, else from procfs (or from a
    simulated node's file when MIGRT_FAKE_GPU is set: migrt/gpu/fakenode.py)."""
    if os.environ.get("MIGRT_FAKE_GPU"):
        return _fake(os.environ["MIGRT_FAKE_GPU"])
    reason = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated 'pynvml' wrapper package warns on import
            import pynvml
    except ImportError as exc:
        reason = f"pynvml not importable ({exc})"
    else:
        try:
            return _nvml(pynvml, with_processes)
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            reason = f"NVML: {exc}"
    inv = _procfs(procfs_root)
    if inv.source == "none":
        inv.error = f"{reason}; {procfs_root} absent: no NVIDIA driver on this node"
    return inv


def _fake(path: str) -> Inventory:
    from migrt.gpu import fakenode
    from migrt.gpu.fake import free_bytes

    with fakenode.locked(path) as data:
        fakenode.discover(data)
        inv = Inventory(source="fake", driver_version=data.get("driver_version", "580.159"),
                        cuda_driver_version=data.get("cuda_driver_version", 13000), processes_seen=True)
        for i, g in enumerate(data.get("gpus") or []):
            total = g.get("memory_total")
            free = free_bytes(data, g["uuid"])
            inv.gpus.append(Gpu(index=i, uuid=g["uuid"], name=g.get("name", "Fake GPU"),
                                pci_bus_id=g.get("pci_bus_id", f"00000000:{i + 0x10:02X}:00.0"),
                                minor=g.get("minor", i), memory_total=total, memory_free=free,
                                memory_used=None if free is None or total is None else total - free))
        for pid, p in data["processes"].items():
            if fakenode.holds_gpu(p.get("state", "")) and p.get("gpu") and fakenode.lives(pid, p):
                inv.processes[int(pid)] = [(p["gpu"], p.get("bytes"))]
    return inv


def parse_version(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    return tuple(int(x) for x in re.findall(r"\d+", text))
