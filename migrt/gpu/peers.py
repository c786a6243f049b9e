"""Before the GPU lock: does a CUDA process hold peer state that the node's driver cannot restore?

The driver's process checkpoint (r570, r580) takes a process that has peer-to-peer or CUDA IPC
mappings into another process's GPU memory, but its restore then fails (CUDA_ERROR_NOT_SUPPORTED)
and the process cannot run on the GPU again: measured on 2x H200, driver 580, with a plain
torch.distributed job (NCCL defaults). Such a job must be refused BEFORE the lock, while nothing
has been touched. No driver call says it without touching the process, so the rule reads what the
kernel shows of each process (migrt/gpu/procview.py) and the NCCL settings it runs with.

The rule. A CUDA process is BLOCKED when all of these hold:
  1. the node's driver is older than 610 (NVIDIA documents CUDA IPC restore from 610; on a newer
     driver a finding is only logged);
  2. it did not acknowledge the application hook's "pre-checkpoint" (an application that did has
     torn its peer state down: migrt/gpu/apphooks.py);
  3. nobody declared it free of such state: MIGRT_GPU_PEER_CHECK=off in its environment, the
     container's annotation migrt.io/gpu-peer-check=off, or the node's config gpu_peer_check: warn;
  4. one of:
     a. NCCL peers. It uses NCCL: a live communicator (PyTorch's NCCL process-group threads
        pt_nccl_*, NCCL's own named threads "NCCL ..." when NCCL_SET_THREAD_NAME=1, NCCL's shared
        memory /dev/shm/nccl-*, NCCL's proxy socket @/tmp/nccl-socket-*), or at least NCCL's library
        (it maps libnccl.so: every PyTorch CUDA process does, and a communicator can be made at any
        moment); another CUDA process of the container uses NCCL too (or registered the application
        hook) and runs on other GPUs (an intra-node peer); and its NCCL settings leave a transport
        that shares GPU or pinned memory between processes on: P2P (off with NCCL_P2P_DISABLE=1, or
        NCCL_P2P_LEVEL=LOC or 0) or SHM (off with NCCL_SHM_DISABLE=1). Settings as NCCL reads them:
        the process's environment, then NCCL_CONF_FILE (else $HOME/.nccl.conf), then /etc/nccl.conf
        inside its root.
     b. A context on another process's GPU. The driver lists it among the compute processes of more
        than one GPU, and another CUDA process of the container on one of those (CUDA peer access
        into another process's GPU memory).
Which GPUs a process runs on is the driver's own per-GPU list of compute processes (NVML,
nvmlDeviceGetComputeRunningProcesses; `contexts`): a process with no context anywhere holds no GPU
state (e.g. a DataLoader worker forked from a CUDA process, which inherits its mappings) and is
nobody's peer. Without that list (no NVML, a GPU whose list could not be read, or a list that names
none of the container's processes: another pid namespace) every pair counts as on other GPUs and
rule (b) is not applied. The device files a process maps or holds open are NOT used: on the 2x H200 machine both
ranks of a torch.distributed job (one GPU each) mapped /dev/nvidia0 and /dev/nvidia1, and CUDA opens
every visible GPU at cuInit; they are kept in `evidence()` only, with the contexts, so that a GPU
run shows what each signal said.
Not seen, hence never refused here: CUDA IPC between processes on one GPU (torch.multiprocessing),
shareable-handle imports outside NCCL, NVLS multicast (NVSwitch systems: NCCL_NVLS_ENABLE=0), and
NCCL settings a process sets in its own code after it started (its initial environment is what
/proc shows: such a job is refused with defaults it does not run with, and says so with the
declaration). What a failed restore of such a process leaves, and what can be retried, is in
docs/gpu.md, "Multi-GPU jobs". `evidence()` is what the rule saw, for the log and the GPU tests.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from migrt.errors import PreconditionFailed
from migrt.gpu import procview

RESTORES_PEERS_FROM = 610  # NVIDIA driver major with CUDA IPC restore (processes under `cuda-checkpoint --launch-job`)
OFF_ENV = "MIGRT_GPU_PEER_CHECK"
OFF_ANNOTATION = "migrt.io/gpu-peer-check"
NCCL_THREADS = ("pt_nccl", "NCCL ")  # PyTorch's ProcessGroupNCCL threads; NCCL's own with NCCL_SET_THREAD_NAME=1
NCCL_KEYS = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE")
_GPU_NODE = re.compile(r"/dev/nvidia(\d+)")
REMEDIES = ("start the job with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (collectives then go through "
            "sockets; also NCCL_NVLS_ENABLE=0 on NVSwitch systems); or have each process answer the "
            "application hook (migrt/apphook.py: tear the NCCL communicators down before the checkpoint, "
            "rebuild them after); or use NVIDIA driver 610 or newer. If these processes hold no such "
            f"state, set {OFF_ENV}=off in their environment")


class PeerStateRefused(PreconditionFailed):
    """The container was not touched: some of its CUDA processes hold peer state the driver cannot restore."""


@dataclass
class Process:
    """What one CUDA process shows (see the module docstring)."""

    pid: int
    gpus_mapped: list[int]  # minors of the /dev/nvidiaN it maps (evidence only: not used by the rule)
    gpus_open: list[int]  # minors of the /dev/nvidiaN it holds open (every visible GPU, usually: evidence only)
    nccl_shm: int  # /dev/shm/nccl-* mappings
    nccl_socket: bool  # holds NCCL's proxy socket
    nccl: dict[str, str]  # NCCL settings (environment, then config files)
    declared_off: bool
    gpus_ctx: list[str] | None = None  # UUIDs of the GPUs the driver lists it on (NVML); None: not known
    nccl_threads: list[str] = field(default_factory=list)  # names of its NCCL threads (pt_nccl_*, "NCCL ...")
    nccl_lib: str = ""  # the libnccl.so it maps ("": none)

    @property
    def nccl_comm(self) -> bool:
        """A live NCCL communicator is seen."""
        return self.nccl_shm > 0 or self.nccl_socket or bool(self.nccl_threads)

    @property
    def nccl_loaded(self) -> bool:
        """It can make NCCL communicators (one is live, or the library is loaded)."""
        return self.nccl_comm or bool(self.nccl_lib)

    @property
    def on_gpu(self) -> bool:
        """It holds GPU state (a context the driver lists), or that is not known."""
        return self.gpus_ctx is None or bool(self.gpus_ctx)

    @property
    def p2p_off(self) -> bool:
        return _true(self.nccl.get("NCCL_P2P_DISABLE")) or self.nccl.get("NCCL_P2P_LEVEL", "").upper() in ("LOC", "0")

    @property
    def shm_off(self) -> bool:
        return _true(self.nccl.get("NCCL_SHM_DISABLE"))

    def to_dict(self) -> dict:
        return {"pid": self.pid, "gpus_ctx": self.gpus_ctx, "gpus_mapped": self.gpus_mapped,
                "gpus_open": self.gpus_open, "nccl_threads": self.nccl_threads, "nccl_lib": self.nccl_lib,
                "nccl_shm": self.nccl_shm, "nccl_socket": self.nccl_socket, "nccl": self.nccl,
                "declared_off": self.declared_off}

    def nccl_seen(self) -> str:
        """What shows its NCCL, in words."""
        seen = []
        if self.nccl_threads:
            seen.append(f"threads {', '.join(self.nccl_threads)}")
        if self.nccl_shm:
            seen.append("shared memory /dev/shm/nccl-*")
        if self.nccl_socket:
            seen.append("proxy socket")
        if seen:
            return f"NCCL communicator ({'; '.join(seen)})"
        return f"NCCL loaded ({self.nccl_lib}; no communicator seen yet)"



@dataclass
class Finding:
    pid: int
    rule: str  # "nccl-peers" | "peer-context"
    detail: str
    allowed_by: str | None = None  # why it was let through: "hook", "declared", "driver"

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Verdict:
    processes: list[Process]
    findings: list[Finding] = field(default_factory=list)

    @property
    def blocked(self) -> list[Finding]:
        return [f for f in self.findings if f.allowed_by is None]

    def to_dict(self) -> dict:
        return {"findings": [f.to_dict() for f in self.findings],
                "processes": [p.to_dict() for p in self.processes]}


def _true(value: str | None) -> bool:
    try:
        return value is not None and int(value.strip()) != 0
    except ValueError:
        return False


def _conf(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        line = line.split("#", 1)[0].strip()
        key, sep, value = line.partition("=")
        if sep and key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def nccl_settings(pid: int, env: dict[str, str], proc: str | None = None) -> dict[str, str]:
    """The NCCL_* settings pid runs with, in NCCL's own order: its environment wins, then the user's
    file (NCCL_CONF_FILE, else $HOME/.nccl.conf), then /etc/nccl.conf (read inside its root)."""
    out = {k: v for k, v in env.items() if k.startswith("NCCL_")}
    files = [env.get("NCCL_CONF_FILE") or (env["HOME"].rstrip("/") + "/.nccl.conf" if env.get("HOME") else None),
             "/etc/nccl.conf"]
    for path in files:
        if not path:
            continue
        for key, value in _conf(procview.read_in_root(pid, path, proc=proc)).items():
            if key.startswith("NCCL_"):
                out.setdefault(key, value)
    return {k: v for k, v in sorted(out.items()) if k in NCCL_KEYS}


def _minors(paths: list[str]) -> list[int]:
    return sorted({int(m.group(1)) for p in paths if (m := _GPU_NODE.fullmatch(p))})


def look(pid: int, nccl_sockets: set[int], proc: str | None = None,
         contexts: dict[int, list[str]] | None = None) -> Process:
    env = procview.environ(pid, proc)
    maps = procview.mapped_files(pid, proc)
    libs = [os.path.basename(p) for p in maps if os.path.basename(p).startswith("libnccl.so")]
    return Process(
        pid=pid, gpus_mapped=_minors(maps), gpus_open=_minors(procview.fd_targets(pid, proc)),
        nccl_shm=sum(1 for p in maps if p.startswith("/dev/shm/nccl-")),
        nccl_socket=bool(procview.socket_inodes(pid, proc) & nccl_sockets),
        nccl=nccl_settings(pid, env, proc), declared_off=env.get(OFF_ENV, "").strip().lower() == "off",
        gpus_ctx=None if contexts is None else sorted(set(contexts.get(pid) or [])),
        nccl_threads=sorted({t for t in procview.thread_names(pid, proc) if t.startswith(NCCL_THREADS)}),
        nccl_lib=libs[0] if libs else "")


def _nccl_socket_inodes(pids: list[int], proc: str | None) -> set[int]:
    """Inodes of NCCL's proxy sockets (abstract '@/tmp/nccl-socket-<rank>-<hash>') in the pids' network namespaces."""
    out: set[int] = set()
    seen_ns: set[str] = set()
    for pid in pids:
        try:
            ns = os.readlink(f"{procview.at(proc)}/{pid}/ns/net")
        except OSError:
            ns = f"pid {pid}"
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        out |= {inode for inode, path, _, _ in procview.unix_sockets(pid, proc)
                if path.startswith("@/tmp/nccl-socket-")}
    return out


def driver_major(version: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", version or "")
    return int(m.group(1)) if m else None


def _apart(p: Process, q: Process) -> bool:
    """Whether p and q run on other GPUs (NCCL refuses two ranks on one GPU); unknown counts as apart."""
    if p.gpus_ctx is None or q.gpus_ctx is None:
        return True
    return bool(p.gpus_ctx) and bool(q.gpus_ctx) and set(p.gpus_ctx) != set(q.gpus_ctx)


def assess(pids: list[int], *, driver_version: str | None, hooked: set[int] | frozenset = frozenset(),
           registered: set[int] | frozenset = frozenset(), declared_off: bool = False,
           contexts: dict[int, list[str]] | None = None, proc: str | None = None) -> Verdict:
    """The rule above over the CUDA processes of one container. hooked: the pids that acknowledged
    the application hook's pre-checkpoint; registered: those that listen for it (peers, too);
    declared_off: the container's annotation or the node's config turn the refusal off; contexts:
    host pid -> UUIDs of the GPUs the driver lists it on (inventory.contexts()), None if unknown."""
    if contexts is not None and not any(p in contexts for p in pids):
        contexts = None  # the driver's list names none of them (another pid namespace?): not known
    sockets = _nccl_socket_inodes(pids, proc)
    procs = [look(p, sockets, proc, contexts) for p in pids]
    verdict = Verdict(processes=procs)
    major = driver_major(driver_version)
    for p in procs:
        if not p.on_gpu:
            continue
        others = [q for q in procs if q.pid != p.pid]
        found = []
        peers = [q.pid for q in others if (q.nccl_loaded or q.pid in registered) and _apart(p, q)]
        if p.nccl_loaded and peers and not (p.p2p_off and p.shm_off):
            on = [t for t, off in (("P2P", p.p2p_off), ("SHM", p.shm_off)) if not off]
            found.append(Finding(p.pid, "nccl-peers", f"{p.nccl_seen()} with intra-node peer(s) "
                                                      f"{', '.join(map(str, peers))} on other GPUs, "
                                                      f"{' and '.join(on)} transport on"))
        if p.gpus_ctx and len(p.gpus_ctx) > 1:
            shared = sorted({g for q in others for g in q.gpus_ctx or [] if g in p.gpus_ctx})
            if shared:
                found.append(Finding(p.pid, "peer-context",
                                     f"context on GPU {', '.join(shared)}, where another process of the container "
                                     f"has one too (CUDA peer access/IPC)"))
        for f in found:
            if p.pid in hooked:
                f.allowed_by = "hook"
            elif p.declared_off or declared_off:
                f.allowed_by = "declared"
            elif major is not None and major >= RESTORES_PEERS_FROM:
                f.allowed_by = "driver"
        verdict.findings += found
    return verdict


def refuse(verdict: Verdict, what: str, driver_version: str | None) -> None:
    """PeerStateRefused naming each blocked process, what was seen and the remedies; nothing if none."""
    blocked = verdict.blocked
    if not blocked:
        return
    pids = sorted({f.pid for f in blocked})
    detail = "; ".join(f"pid {f.pid}: {f.detail}" for f in blocked)
    raise PeerStateRefused(
        f"{what}: CUDA process(es) {', '.join(map(str, pids))} hold peer-to-peer or IPC state that NVIDIA driver "
        f"{driver_version or '(version unknown)'} cannot restore after a checkpoint ({detail}); nothing was "
        f"touched, the container keeps running. Remedies: {REMEDIES}")


def annotation_off(config: dict | None) -> bool:
    ann = (config or {}).get("annotations") or {}
    return isinstance(ann, dict) and str(ann.get(OFF_ANNOTATION, "")).strip().lower() == "off"
