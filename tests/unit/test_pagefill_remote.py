"""Lazy migration's page path without CRIU: migrt's page server (a real `python -m
migrt.migration.pageserve` process) serving this test process's memory with process_vm_readv, and
the filler fetching it over several streams into a userfaultfd-registered area of ours (faults
first, then the background copy; mremap during the fill), the handshake (wrong key, TLS), a source
that cannot read what is asked, and the plan of a lazy dump's images."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from dataclasses import asdict

import pytest

from migrt.migration import pageserve
from migrt.pagefill import engine, images, remote, uffd
from tests.unit.test_pagefill import (MREMAP_FIXED, MREMAP_MAYMOVE, Rig, _libc, _pm, _vma, make_images, rigs,  # noqa: F401
                                     uffd_ok)
from tests.unit.test_transfer_tls import pki  # noqa: F401

MiB = 1 << 20
KEY = os.urandom(32)


@pytest.fixture
def served():
    """Random data in our memory and a page server (its own process) serving it as vpid 7."""
    size = 24 * MiB
    data = os.urandom(size)
    buf = ctypes.create_string_buffer(data, size)
    servers = []

    def start(key=KEY, tls=None, pids=None):
        h = pageserve.Handle.start(host="127.0.0.1", key=key, peer=None, tls=tls, idle_s=30)
        h.serve(pids if pids is not None else {7: os.getpid()})
        servers.append(h)
        return h

    yield {"data": data, "addr": ctypes.addressof(buf), "size": size, "buf": buf, "start": start}
    for h in servers:
        h.stop()


def _spec(h, key=KEY, tls=None) -> dict:
    return {"address": "127.0.0.1", "port": h.port, "key": key.hex(), "tls": tls, "timeout": 10}


class RemoteRig(Rig):
    """Rig's registered memory, filled by a Filler whose pages come from the page server (vpid 7)."""

    def __init__(self, tmp_path, served, spec, threads=3) -> None:  # noqa: D107 - Rig's methods, another source
        self.size = served["size"]
        self.addr = _libc.mmap(None, self.size, 3, 0x22, -1, 0)
        self.fd, _ = uffd.open_uffd(uffd.NONCOOP_FEATURES)
        uffd.register(self.fd, self.addr, self.size)
        plan = images.Plan(images=str(tmp_path), processes={7: images.ProcessPlan(
            pid=7, pages_file="", segments=[images.Segment(self.addr, self.addr + self.size, served["addr"])])})
        self.guard, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.remote = remote.RemotePages(spec, engine.REMOTE_CHUNK)
        self.filler = engine.Filler(plan, threads=threads, guard=theirs, status_path=str(tmp_path / "status.json"),
                                    remote=self.remote)
        self.rc = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        dup = os.dup(self.fd)
        try:
            self.guard.sendmsg([b"T 1 7"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, dup.to_bytes(4, "little"))])
        finally:
            os.close(dup)


def test_filler_fetches_from_the_page_server_faults_first_then_everything(tmp_path, uffd_ok, rigs, served):
    h = served["start"]()
    rigs.append(rig := RemoteRig(tmp_path, served, _spec(h)))
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", rig.read_faulting(9 * MiB + 5, 300)), daemon=True)
    t.start()
    t.join(10)
    assert got.get("v") == served["data"][9 * MiB + 5:9 * MiB + 305]  # served before the restore finished
    assert rig.filler.copied < rig.size
    # an mremap while the memory arrives: the data must follow to the new place
    dst = _libc.mmap(None, 2 * MiB, 3, 0x22, -1, 0)
    assert _libc.mremap(rig.addr + 16 * MiB, 2 * MiB, 2 * MiB, MREMAP_MAYMOVE | MREMAP_FIXED, dst) == dst
    assert rig.finish() == 0
    assert ctypes.string_at(rig.addr, 16 * MiB) == served["data"][:16 * MiB]
    assert ctypes.string_at(dst, 2 * MiB) == served["data"][16 * MiB:18 * MiB]
    assert ctypes.string_at(rig.addr + 18 * MiB, 6 * MiB) == served["data"][18 * MiB:]
    assert rig.filler.counts["faults"] >= 1 and rig.filler.counts["remaps"] == 1
    # the filler told the server every page is in: it ends by itself, having served it all
    st = h.wait(10)
    assert st["exit"] == "done" and st["bytes"] >= 22 * MiB and st["streams"] >= 3


def test_a_wrong_key_is_refused_and_the_filler_fails_cleanly(tmp_path, uffd_ok, rigs, served):
    h = served["start"]()
    with pytest.raises(remote.FetchError, match="refused|closed"):
        remote.RemotePages(_spec(h, key=os.urandom(32)), MiB).connect()
    rigs.append(rig := RemoteRig(tmp_path, served, _spec(h, key=os.urandom(32))))
    rig.thread.join(20)
    assert rig.rc == 1 and rig.filler.fatal and "page server" in rig.filler.fatal
    assert h.stop()["refused"] >= 1


def test_a_range_the_source_cannot_read_fails_the_fill_with_the_reason(tmp_path, uffd_ok, rigs, served):
    h = served["start"](pids={8: os.getpid()})  # vpid 7 is not a process of this "container"
    rigs.append(rig := RemoteRig(tmp_path, served, _spec(h)))
    rig.guard.send(b"F")
    rig.thread.join(20)
    assert rig.rc == 1 and "No such process" in rig.filler.fatal, rig.filler.fatal


def test_page_streams_over_mutual_tls(served, pki):
    tls = {k: v for k, v in asdict(pki["a"]).items()}
    h = served["start"](tls=tls)
    client = remote.RemotePages(_spec(h, tls={k: v for k, v in asdict(pki["b"]).items()}), 4 * MiB)
    addr = client.address(7, served["addr"] + MiB, 4 * MiB)
    assert ctypes.string_at(addr, 4 * MiB) == served["data"][MiB:5 * MiB]
    client.close(done=True)
    # a certificate from another CA gets nothing
    with pytest.raises(remote.FetchError):
        remote.RemotePages(_spec(h, tls={k: v for k, v in asdict(pki["stranger"]).items()}), MiB).connect()


def test_page_server_ends_when_its_owner_is_gone_and_nobody_asks(served):
    """A killed `migrt migrate` (its owner) must not leave the server forever: idle_s after the owner
    died and the last request, it exits."""
    code = ("import os, sys, time\nsys.path.insert(0, %r)\nfrom migrt.migration import pageserve\n"
            "h = pageserve.Handle.start(host='127.0.0.1', key=bytes(32), peer=None, tls=None, idle_s=0.5)\n"
            "h.serve({1: os.getpid()})\nprint(h.proc.pid, flush=True)\n") % os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import subprocess
    import sys

    owner = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    pid = int(owner.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and "pageserve" in open(f"/proc/{pid}/cmdline").read():
        assert time.monotonic() < deadline, "the page server outlived its owner by 10 s"
        time.sleep(0.1)


def test_plan_of_a_lazy_dump_fetches_each_range_from_its_own_address(tmp_path):
    # a lazy dump: lazy entries have no pages in pages-*.img (PE_LAZY without PE_PRESENT)
    d = make_images(tmp_path, [_vma(0x10000, 0x30000), _vma(0x30000, 0x40000)],
                    [_pm(0x10000, 1, "PE_PRESENT"), _pm(0x11000, 0x2f, "PE_LAZY")], pages_bytes=4096)
    with pytest.raises(images.ImageError, match="without pages"):
        images.plan(d)  # a local restore cannot use it
    p = images.plan(d, remote=True).processes[1]
    assert [(s.start, s.end, s.offset) for s in p.segments] == [(0x11000, 0x30000, 0x11000),
                                                                (0x30000, 0x40000, 0x30000)]
