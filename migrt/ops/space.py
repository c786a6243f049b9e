"""How much a checkpoint of a container will take, and whether the store can hold it, decided
BEFORE the container is frozen (a dump that runs out of space costs the workload its downtime and
then fails anyway).

The estimate is what CRIU writes: each process's anonymous memory and swap (smaps_rollup Pss_Anon,
Pss_Shmem, SwapPss: proportional, so memory shared between the processes counts once), the content
of the container's own tmpfs mounts (CRIU dumps those whole; bind mounts are external), and the GPU
memory of its CUDA processes (the driver's checkpoint moves it into host memory, which CRIU dumps).
Page tables, file-backed mappings and CRIU's metadata are small next to that: a margin covers them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from migrt.errors import PreconditionFailed, StoreFull
from migrt.gpu import inventory, procs
from migrt.store import hugetmpfs
from migrt.store import reserve as reserve_mod

MARGIN = 0.10           # on top of the estimate
SLACK = 16 << 20        # metadata, logs, manifest, the rootfs diff of a small layer
# CRIU's image files (core-, mm-, pagemap-, fdinfo-... per process, a few dozen shared): on a store whose
# every file takes whole 2 MiB pages (store/hugetmpfs.py), each small one takes a page
FILES_FIXED, FILES_PER_PROCESS = 32, 12
_ROLLUP_KEYS = ("Pss_Anon", "Pss_Shmem", "SwapPss")


@dataclass
class Estimate:
    memory: int = 0
    tmpfs: int = 0
    gpu: int = 0
    processes: int = 0

    @property
    def total(self) -> int:
        return self.memory + self.tmpfs + self.gpu

    @property
    def needed(self) -> int:
        return int(self.total * (1 + MARGIN)) + SLACK

    def to_dict(self) -> dict:
        return {"memory_bytes": self.memory, "tmpfs_bytes": self.tmpfs, "gpu_bytes": self.gpu,
                "processes": self.processes, "needed_bytes": self.needed}


def _process_memory(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        text = ""
    found, total = False, 0
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _ROLLUP_KEYS:
            found = True
            total += int(rest.split()[0]) * 1024
    if found:
        return total
    try:  # kernels before 5.7 lack Pss_Anon: /proc/<pid>/status (counts shared memory per process)
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssShmem", "VmSwap"):
                    total += int(rest.split()[0]) * 1024
    except OSError:
        return 0
    return total


def _tmpfs_usage(init_pid: int) -> int:
    """Bytes used in the tmpfs mounts of the container's mount namespace (CRIU dumps them whole)."""
    try:
        with open(f"/proc/{init_pid}/mountinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return 0
    seen, total = set(), 0
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, fstype = left.split(), (right.split() or [""])[0]
        if fstype != "tmpfs" or len(fields) < 5 or fields[2] in seen:
            continue
        seen.add(fields[2])  # one superblock counted once
        try:
            st = os.statvfs(f"/proc/{init_pid}/root{fields[4]}")
        except OSError:
            continue
        total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total


def estimate(init_pid: int | None) -> Estimate:
    est = Estimate()
    if not init_pid:
        return est
    pids = procs.container_pids(init_pid)
    est.processes = len(pids)
    est.memory = sum(_process_memory(p) for p in pids)
    est.tmpfs = _tmpfs_usage(init_pid)
    cuda = procs.cuda_pids(pids)
    if cuda:
        inv = inventory.take()
        est.gpu = sum(b or 0 for p in cuda for _, b in (inv.processes.get(p) or []))  # None: not reported
    return est


def free_bytes(path: str) -> int:
    return reserve_mod.free_bytes(path)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def reserve(store_root: str, est: Estimate, what: str, *, check: bool = True) -> reserve_mod.Reservation:
    """The checkpoint's estimated size reserved in the store (store/reserve.py: imports, pulls and other
    checkpoints see it), decided before anything is frozen: PreconditionFailed when the store's file
    system cannot hold it beside what the other writers reserved (check=False: recorded, never refused).
    The caller releases it when the checkpoint ends."""
    res = reserve_mod.Reservation(store_root, what, margin=0)  # the estimate has its own margin
    unit = res.alloc.unit
    pages = (FILES_FIXED + FILES_PER_PROCESS * est.processes) * unit if unit >= hugetmpfs.HUGE_PAGE else 0
    try:
        res.reserve(est.needed + pages, check=check)
    except StoreFull as exc:
        parts = f"memory {_mib(est.memory)}, tmpfs {_mib(est.tmpfs)}" + (f", GPU {_mib(est.gpu)}" if est.gpu else "")
        held = reserve_mod.held_text(exc.others, _mib)
        files = f", {_mib(pages)} for its files in whole pages: {res.alloc.where}" if pages else ""
        raise PreconditionFailed(
            f"{what}: the store {store_root} has {_mib(exc.free)} free{held}, the checkpoint needs about "
            f"{_mib(est.needed + pages)} ({parts}, +{int(MARGIN * 100)}% and {_mib(SLACK)} margin{files}); nothing "
            "was frozen. Free "
            "space in the store or point 'store:' in the migrt config at a larger file system") from None
    return res


def check(store_root: str, est: Estimate, what: str) -> None:
    """PreconditionFailed (nothing touched yet) when the store's file system cannot hold it now."""
    reserve(store_root, est, what).release()
