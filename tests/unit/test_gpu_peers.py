"""The peer-state rule (migrt/gpu/peers.py) over a proc tree laid out by hand: maps, descriptors,
environments, unix sockets and config files of processes as a torch.distributed job shows them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from migrt.gpu import peers, procview

NET_NS = "net:[4026531840]"
SHM_MAP = "7f0000000000-7f0000100000 rw-s 00000000 00:1a 77 /dev/shm/nccl-AbC123 (deleted)"
UNIX_HEAD = "Num       RefCount Protocol Flags    Type St Inode Path"


class ProcTree:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.unix: list[str] = []

    def add(self, pid: int, *, maps_gpus=(), open_gpus=(), shm=False, env=None, sockets=(), files=None,
            threads=("python3",), nccl_lib=False) -> int:
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "ns").mkdir()
        (d / "net").mkdir()
        os.symlink(NET_NS, d / "ns" / "net")
        for i, name in enumerate(threads):
            (d / "task" / str(pid + i)).mkdir(parents=True)
            (d / "task" / str(pid + i) / "comm").write_text(name + "\n")
        lines = ["55d000000000-55d000001000 r-xp 00000000 08:01 12 /usr/bin/python3.12",
                 "7f1000000000-7f1000200000 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
                 "7f1100000000-7f1100001000 rw-s 00000000 00:05 5 /dev/nvidiactl"]
        if nccl_lib:
            lines.append("7f1300000000-7f1300100000 r-xp 00000000 08:01 14 "
                         "/usr/lib/python3/site-packages/nvidia/nccl/lib/libnccl.so.2")
        lines += [f"7f12{m:08x}-7f12{m:08x}1000 rw-s 00000000 00:05 {600 + m} /dev/nvidia{m}" for m in maps_gpus]
        if shm:
            lines.append(SHM_MAP)
        (d / "maps").write_text("\n".join(lines) + "\n")
        targets = ["/dev/nvidiactl", "/dev/nvidia-uvm", *(f"/dev/nvidia{m}" for m in open_gpus),
                   *(f"socket:[{s}]" for s in sockets)]
        for i, t in enumerate(targets):
            os.symlink(t, d / "fd" / str(i + 3))
        environ = {"PATH": "/usr/bin", "HOME": "/root", **(env or {})}
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")
        root = d / "root"
        root.mkdir()
        for rel, text in (files or {}).items():
            p = root / rel.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        self.write_unix()
        return pid

    def socket(self, inode: int, path: str, *, dgram=True, listening=False) -> int:
        flags = "00010000" if listening else "00000000"
        self.unix.append(f"0000000000000000: 00000002 00000000 {flags} {'0002' if dgram else '0001'} "
                         f"{'01' if listening else '07'} {inode} {path}")
        self.write_unix()
        return inode

    def write_unix(self) -> None:
        for d in self.root.iterdir():
            if (d / "net").is_dir():
                (d / "net" / "unix").write_text("\n".join([UNIX_HEAD, *self.unix]) + "\n")


@pytest.fixture
def proc(tmp_path) -> ProcTree:
    return ProcTree(tmp_path / "proc")


def blocked(proc: ProcTree, pids, **kw) -> dict[int, list[str]]:
    v = peers.assess(list(pids), driver_version=kw.pop("driver", "580.95.05"), proc=str(proc.root), **kw)
    out: dict[int, list[str]] = {}
    for f in v.blocked:
        out.setdefault(f.pid, []).append(f.rule)
    return out


U0, U1 = "GPU-00000000-0000-0000-0000-0000000000a0", "GPU-00000000-0000-0000-0000-0000000000b1"
UUIDS = (U0, U1)
TORCH_THREADS = ("python3", "cuda-EvtHandlr", "pt_nccl_watchdg", "pt_nccl_heartbt")


def nccl_rank(proc: ProcTree, pid: int, gpu: int, *, via="socket", env=None, files=None, maps_gpus=None) -> int:
    """A torch.distributed rank on its own GPU, NCCL initialised: it opens every GPU of the container
    (cuInit); its communicator shows as NCCL's proxy socket, NCCL's shared memory (legacy), PyTorch's
    process-group threads only (what torch 2.11 with NCCL 2.28 showed on the 2x H200 machine), or not
    at all (via="lib": libnccl mapped, no communicator yet). Every rank maps libnccl (PyTorch)."""
    sockets = ()
    if via == "socket":
        sockets = (proc.socket(90000 + pid, f"@/tmp/nccl-socket-{gpu}-5f3a9c"),)
    threads = TORCH_THREADS if via == "threads" else ("python3",)
    return proc.add(pid, maps_gpus=(gpu,) if maps_gpus is None else maps_gpus, open_gpus=(0, 1), shm=via == "shm",
                    env=env, sockets=sockets, files=files, threads=threads, nccl_lib=True)


@pytest.mark.parametrize("via", ["socket", "shm", "threads", "lib"])
def test_two_nccl_ranks_with_the_defaults_are_refused(proc, via):
    a, b = nccl_rank(proc, 101, 0, via=via), nccl_rank(proc, 102, 1, via=via)
    assert blocked(proc, [a, b]) == {a: ["nccl-peers"], b: ["nccl-peers"]}
    v = peers.assess([a, b], driver_version="580.95.05", proc=str(proc.root))
    with pytest.raises(peers.PeerStateRefused) as info:
        peers.refuse(v, "container job-1", "580.95.05")
    msg = str(info.value)
    assert msg.startswith("container job-1: CUDA process(es) 101, 102 hold peer-to-peer or IPC state that NVIDIA "
                          "driver 580.95.05 cannot restore")
    assert "P2P and SHM transport on" in msg and "nothing was touched" in msg
    assert "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" in msg and "application hook" in msg and "610" in msg
    assert info.value.exit_code == 8


def test_p2p_and_shm_off_in_the_environment_pass(proc):
    off = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    a, b = nccl_rank(proc, 101, 0, env=off), nccl_rank(proc, 102, 1, env=off)
    assert blocked(proc, [a, b]) == {}


def test_one_transport_left_on_is_refused_and_named(proc):
    a = nccl_rank(proc, 101, 0, env={"NCCL_P2P_DISABLE": "1"})
    b = nccl_rank(proc, 102, 1, env={"NCCL_P2P_DISABLE": "1"})
    v = peers.assess([a, b], driver_version="580", proc=str(proc.root))
    assert [f.detail for f in v.blocked] == [
        "NCCL communicator (proxy socket) with intra-node peer(s) 102 on other GPUs, SHM transport on",
        "NCCL communicator (proxy socket) with intra-node peer(s) 101 on other GPUs, SHM transport on"]


def test_nccl_config_files_count_below_the_environment(proc):
    conf = {"/etc/nccl.conf": "# node defaults\nNCCL_P2P_LEVEL=LOC\nNCCL_SHM_DISABLE=1\n"}
    a, b = nccl_rank(proc, 101, 0, files=conf), nccl_rank(proc, 102, 1, files=conf)
    assert blocked(proc, [a, b]) == {}
    c = nccl_rank(proc, 103, 0, files=conf, env={"NCCL_SHM_DISABLE": "0"})  # the environment wins
    assert blocked(proc, [a, c]) == {c: ["nccl-peers"]}
    user = {"/home/u/.nccl.conf": "NCCL_P2P_DISABLE=1\nNCCL_SHM_DISABLE=1\n"}
    d = nccl_rank(proc, 104, 1, env={"HOME": "/home/u"}, files=user)
    assert blocked(proc, [a, d]) == {}


def test_a_config_file_that_is_a_symlink_is_not_followed(proc, tmp_path):
    host = tmp_path / "host-nccl.conf"
    host.write_text("NCCL_P2P_DISABLE=1\nNCCL_SHM_DISABLE=1\n")
    a, b = nccl_rank(proc, 101, 0), nccl_rank(proc, 102, 1)
    for pid in (a, b):
        (proc.root / str(pid) / "root" / "etc").mkdir()
        os.symlink(str(host), proc.root / str(pid) / "root" / "etc" / "nccl.conf")
    assert procview.read_in_root(a, "/etc/nccl.conf", proc=str(proc.root)) is None
    assert blocked(proc, [a, b]) == {a: ["nccl-peers"], b: ["nccl-peers"]}


def test_processes_without_nccl_peers_pass(proc):
    """One NCCL process alone (e.g. one rank per container), and two plain CUDA processes sharing a
    GPU (tests/gpu/test_gpu_containers.py's pair) hold no intra-node peer state that the rule sees."""
    alone = nccl_rank(proc, 101, 0)
    x = proc.add(201, maps_gpus=(0,), open_gpus=(0, 1))
    y = proc.add(202, maps_gpus=(0,), open_gpus=(0, 1))
    assert blocked(proc, [alone]) == {}
    assert blocked(proc, [x, y]) == {}
    assert blocked(proc, [alone, x]) == {}


def test_a_context_on_another_processes_gpu_is_refused(proc):
    """The driver lists a process on its own GPU and on a GPU another process of the container uses
    (CUDA peer access into that process's memory)."""
    a = proc.add(101, maps_gpus=(0, 1), open_gpus=(0, 1))
    b = proc.add(102, maps_gpus=(0, 1), open_gpus=(0, 1))
    ctx = {a: [U0, U1], b: [U1]}
    v = peers.assess([a, b], driver_version="580", contexts=ctx, proc=str(proc.root))
    assert [(f.pid, f.rule) for f in v.blocked] == [(101, "peer-context")]
    assert f"context on GPU {U1}, where another process of the container has one too" in v.blocked[0].detail
    single = proc.add(103, maps_gpus=(0, 1), open_gpus=(0, 1))  # one process on two GPUs, nobody else
    assert blocked(proc, [single], contexts={single: [U0, U1]}) == {}


def test_mapped_device_files_alone_refuse_nothing(proc):
    """What the 2x H200 machine showed: each rank of a torch.distributed job maps /dev/nvidia0 AND
    /dev/nvidia1 while the driver lists it on its own GPU only. With P2P and SHM off (case (b)) that
    job must go ahead: the mappings were read as 'a context on another process's GPU' and refused it."""
    off = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    a = nccl_rank(proc, 101, 0, via="threads", env=off, maps_gpus=(0, 1))
    b = nccl_rank(proc, 102, 1, via="threads", env=off, maps_gpus=(0, 1))
    ctx = {a: [U0], b: [U1]}
    v = peers.assess([a, b], driver_version="580", contexts=ctx, proc=str(proc.root))
    assert v.findings == []
    assert blocked(proc, [a, b]) == {}  # nor without the driver's list


def test_nccl_defaults_seen_by_torchs_threads_are_refused_as_nccl_peers(proc):
    """Case (a) as the 2x H200 machine showed it (NCCL 2.28: no /dev/shm/nccl-* mapping, no proxy
    socket seen; PyTorch's pt_nccl_* threads; both GPUs' files mapped; one GPU each per the driver)."""
    a = nccl_rank(proc, 101, 0, via="threads", maps_gpus=(0, 1))
    b = nccl_rank(proc, 102, 1, via="threads", maps_gpus=(0, 1))
    v = peers.assess([a, b], driver_version="580.159.04", contexts={a: [U0], b: [U1]}, proc=str(proc.root))
    assert [(f.pid, f.rule) for f in v.blocked] == [(101, "nccl-peers"), (102, "nccl-peers")]
    assert v.blocked[0].detail == ("NCCL communicator (threads pt_nccl_heartbt, pt_nccl_watchdg) with intra-node "
                                   "peer(s) 102 on other GPUs, P2P and SHM transport on")


def test_nccl_loaded_counts_only_between_processes_on_other_gpus(proc):
    """libnccl mapped (every PyTorch CUDA process) with no communicator seen: refused when another
    such process runs on another GPU, not when both share one GPU (NCCL refuses two ranks on one GPU),
    and a process the driver lists on no GPU (a DataLoader worker forked from a rank) is nobody's peer."""
    a = nccl_rank(proc, 101, 0, via="lib")
    b = nccl_rank(proc, 102, 1, via="lib")
    worker = nccl_rank(proc, 103, 0, via="lib")  # forked: inherits libnccl and the device files
    v = peers.assess([a, b], driver_version="580", contexts={a: [U0], b: [U1]}, proc=str(proc.root))
    assert [f.rule for f in v.blocked] == ["nccl-peers", "nccl-peers"]
    assert v.blocked[0].detail.startswith("NCCL loaded (libnccl.so.2; no communicator seen yet) with intra-node "
                                          "peer(s) 102 on other GPUs")
    assert blocked(proc, [a, b], contexts={a: [U0], b: [U0]}) == {}
    assert blocked(proc, [a, worker], contexts={a: [U0]}) == {}


def test_without_the_drivers_list_every_pair_counts_as_apart(proc):
    """No NVML, or a list naming none of the container's processes (another pid namespace): the rule
    cannot tell GPUs apart, so it assumes they are (a lost job costs more than a refusal)."""
    a = nccl_rank(proc, 101, 0, via="lib")
    b = nccl_rank(proc, 102, 0, via="lib")
    assert blocked(proc, [a, b]) == {a: ["nccl-peers"], b: ["nccl-peers"]}
    assert blocked(proc, [a, b], contexts={7: [U0], 8: [U0]}) == {a: ["nccl-peers"], b: ["nccl-peers"]}
    assert blocked(proc, [a, b], contexts={a: [U0], b: [U0]}) == {}


def test_the_hook_a_declaration_or_a_newer_driver_let_it_through(proc):
    a, b = nccl_rank(proc, 101, 0), nccl_rank(proc, 102, 1)
    v = peers.assess([a, b], driver_version="580", hooked={a, b}, registered={a, b}, proc=str(proc.root))
    assert not v.blocked and {f.allowed_by for f in v.findings} == {"hook"}
    v = peers.assess([a, b], driver_version="580", hooked={a}, registered={a}, proc=str(proc.root))
    assert [f.pid for f in v.blocked] == [b]  # a peer that did not answer keeps its mappings
    assert blocked(proc, [a, b], declared_off=True) == {}
    assert not peers.assess([a, b], driver_version="610.12", proc=str(proc.root)).blocked
    c = nccl_rank(proc, 103, 0, env={peers.OFF_ENV: "off"})
    assert blocked(proc, [c, b]) == {b: ["nccl-peers"]}
    assert peers.annotation_off({"annotations": {"migrt.io/gpu-peer-check": "off"}})
    assert not peers.annotation_off({"annotations": {}}) and not peers.annotation_off(None)


def test_a_registered_peer_without_visible_nccl_still_makes_a_peer(proc):
    """A rank that tore its communicator down (hook answered) shows no NCCL state any more; the rank
    that did not answer still maps its memory."""
    a = proc.add(101, maps_gpus=(0,), open_gpus=(0, 1))  # answered: nothing visible
    b = nccl_rank(proc, 102, 1)
    assert blocked(proc, [a, b]) == {}  # nobody registered: b looks alone
    assert blocked(proc, [a, b], registered={a}, hooked={a}) == {b: ["nccl-peers"]}


def test_evidence_is_what_the_rule_saw(proc):
    a = nccl_rank(proc, 101, 0, env={"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "INFO"})
    ev = peers.assess([a], driver_version="580", contexts={a: [U0]}, proc=str(proc.root)).to_dict()
    assert ev["processes"] == [{"pid": 101, "gpus_ctx": [U0], "gpus_mapped": [0], "gpus_open": [0, 1],
                                "nccl_threads": [], "nccl_lib": "libnccl.so.2", "nccl_shm": 0, "nccl_socket": True,
                                "nccl": {"NCCL_P2P_DISABLE": "1"}, "declared_off": False}]


@pytest.mark.parametrize("bad", ["run/x", "/run/../etc", "/run/./x", "/"])
def test_paths_inside_a_root_must_be_plain(bad):
    with pytest.raises(ValueError):
        procview.safe_path(bad)
