"""The parallel dump's image rewrite (migrt/pagedump), on images written with pycriu and on the memory of
this test process: the pagemap a lazy dump wrote becomes the one a normal dump writes (byte for byte, as
pycriu encodes it), the pages file holds every PE_PRESENT entry's pages in pagemap order (CRIU's own and
the ones read from the process, PROT_NONE memory included), and images it does not handle are refused
before anything is changed."""

from __future__ import annotations

import ctypes
import io
import mmap
import os

import pytest

from migrt import pagedump
from migrt.config import Config
from migrt.errors import PreconditionFailed, UsageError
from migrt.ops import dump as dump_ops
from migrt.pagedump import images as pd_images
from migrt.pagedump import memory as pd_memory
from migrt.store import fsutil

pycriu = pytest.importorskip("pycriu")  # Debian's python3-pycriu, copied into the venv by setup-host.sh
PAGE = 4096
LAZY, PRESENT, PARENT = 2, 4, 1


def _dump(path: str, magic: str, entries: list[dict]) -> None:
    buf = io.BytesIO()
    pycriu.images.dump({"magic": magic, "entries": entries}, buf)
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())


def _load(path: str) -> list[dict]:
    with open(path, "rb") as fh:
        return pycriu.images.load(fh)["entries"]


def _entry(vaddr: int, nr: int, flags: int) -> dict:
    return {"vaddr": vaddr, "compat_nr_pages": 0, "flags": flags, "nr_pages": nr}


class Memory:
    """Anonymous memory of this process with known random content."""

    def __init__(self, pages: int) -> None:
        self.map = mmap.mmap(-1, pages * PAGE)
        self.data = os.urandom(pages * PAGE)
        self.map.write(self.data)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def at(self, page: int, nr: int) -> bytes:
        return self.data[page * PAGE:(page + nr) * PAGE]


def _images(tmp_path, procs: dict[int, tuple[int, list[dict], bytes]]) -> str:
    """procs: pid -> (pages_id, pagemap entries, CRIU's pages file content)."""
    d = tmp_path / "images"
    d.mkdir(exist_ok=True)
    _dump(str(d / "pstree.img"), "PSTREE", [{"pid": pid, "ppid": 0, "pgid": pid, "sid": pid, "threads": [pid]}
                                             for pid in procs])
    for pid, (pages_id, entries, pages) in procs.items():
        _dump(str(d / f"pagemap-{pid}.img"), "PAGEMAP", [{"pages_id": pages_id}] + entries)
        (d / f"pages-{pages_id}.img").write_bytes(pages)
    return str(d)


def test_varint_encoding_round_trips():
    for v in (0, 1, 2, 6, 127, 128, 300, 1 << 31, (1 << 47) - 4096, (1 << 64) - 1):
        enc = pd_images.encode_varint(v)
        assert pd_images._varint(enc, 0) == (v, len(enc))


def test_lazy_pagemap_becomes_the_normal_dumps_byte_for_byte(tmp_path):
    """Only the flags of lazy entries change (PE_LAZY -> PE_PRESENT|PE_LAZY); CRIU's own entries stay."""
    lazy = [_entry(0x400000, 1, PRESENT), _entry(0x7F0000000000, 1024, LAZY), _entry(0x7F0000400000, 3, LAZY),
            _entry(0x7FFF00000000, 2, PRESENT), _entry(0x7FFF00002000, 1, LAZY)]
    criu_pages = os.urandom(3 * PAGE)
    images = _images(tmp_path, {1: (1, lazy, criu_pages)})
    plan = pd_images.plan(images)
    [f] = plan.files
    normal = [{"pages_id": 1}] + [{**e, "flags": e["flags"] | PRESENT} for e in lazy]
    buf = io.BytesIO()
    pycriu.images.dump({"magic": "PAGEMAP", "entries": normal}, buf)
    assert f.pagemap == buf.getvalue()
    assert f.lazy_bytes == 1028 * PAGE and f.criu_bytes == 3 * PAGE and f.size == 1031 * PAGE
    # in pagemap order: CRIU's page, the lazy 1024+3, CRIU's 2, the lazy 1 (adjacent lazy entries merged)
    assert [(c.dst, c.length, c.src, c.vpid) for c in f.copies] == [
        (0, PAGE, 0, None), (PAGE, 1027 * PAGE, 0x7F0000000000, 1), (1028 * PAGE, 2 * PAGE, PAGE, None),
        (1030 * PAGE, PAGE, 0x7FFF00002000, 1)]


@pytest.mark.parametrize("threads, how", [(1, "mmap"), (3, "mmap"), (3, "pwrite")])
def test_complete_writes_every_page_in_pagemap_order(tmp_path, monkeypatch, threads, how):
    monkeypatch.setattr(pd_memory, "PIECE", 5 * PAGE)  # many pieces (digest chunks), several threads at once
    monkeypatch.setattr(fsutil, "TREE_CHUNK", 5 * PAGE)  # the store's digest of the same chunks
    monkeypatch.setattr(pd_memory, "BUF", 2 * PAGE)
    monkeypatch.setattr(pd_memory, "WRITE", how)
    mem = Memory(64)
    a = mem.addr
    criu = os.urandom(4 * PAGE)
    lazy = [_entry(0x400000, 2, PRESENT), _entry(a, 20, LAZY), _entry(a + 24 * PAGE, 30, LAZY),
            _entry(0x7FFF00000000, 2, PRESENT), _entry(a + 60 * PAGE, 4, LAZY)]
    images = _images(tmp_path, {7: (3, lazy, criu)})
    stats = pagedump.complete(images, {7: os.getpid()}, threads)
    want = criu[:2 * PAGE] + mem.at(0, 20) + mem.at(24, 30) + criu[2 * PAGE:] + mem.at(60, 4)
    with open(os.path.join(images, "pages-3.img"), "rb") as fh:
        assert fh.read() == want
    assert [e["flags"] for e in _load(os.path.join(images, "pagemap-7.img"))[1:]] == [4, 6, 6, 4, 6]
    assert stats["lazy_bytes"] == 54 * PAGE and stats["criu_bytes"] == 4 * PAGE and stats["bytes"] == len(want)
    assert stats["threads"] == threads and stats["via_proc_mem_bytes"] == 0
    assert not [n for n in os.listdir(images) if n.endswith(pd_images.NEW_SUFFIX)]
    # hashed while written: the store's own chunk digests of the file (the commit takes them)
    chunks = fsutil.hash_chunks(images, ["pages-3.img"])["pages-3.img"]
    assert len(chunks) == 12 and stats["digests"] == {"pages-3.img": [c[2] for c in chunks]}


def test_memory_without_read_permission_is_read_through_proc_mem(tmp_path):
    """CRIU's parasite dumps PROT_NONE memory too; process_vm_readv cannot read it, /proc/PID/mem can."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mem = Memory(8)
    assert libc.mprotect(mem.addr + 2 * PAGE, 3 * PAGE, 0) == 0  # pages 2-4: PROT_NONE
    try:
        images = _images(tmp_path, {1: (1, [_entry(mem.addr, 8, LAZY)], b"")})
        stats = pagedump.complete(images, {1: os.getpid()}, 2)
    finally:
        libc.mprotect(mem.addr + 2 * PAGE, 3 * PAGE, 3)
    with open(os.path.join(images, "pages-1.img"), "rb") as fh:
        assert fh.read() == mem.at(0, 8)
    assert stats["via_proc_mem_bytes"] == 3 * PAGE


def test_processes_get_their_own_pages_files(tmp_path):
    m1, m2 = Memory(4), Memory(6)
    images = _images(tmp_path, {1: (1, [_entry(m1.addr, 4, LAZY)], b""),
                                5: (2, [_entry(0x400000, 1, PRESENT), _entry(m2.addr, 6, LAZY)], b"x" * PAGE)})
    stats = pagedump.complete(images, {1: os.getpid(), 5: os.getpid()}, 4)
    assert open(os.path.join(images, "pages-1.img"), "rb").read() == m1.at(0, 4)
    assert open(os.path.join(images, "pages-2.img"), "rb").read() == b"x" * PAGE + m2.at(0, 6)
    assert stats["processes"] == 2


@pytest.mark.parametrize("entries, pages, why", [
    ([_entry(0x1000, 1, PARENT)], b"", "parent image"),
    ([_entry(0x1000, 1, LAZY | PARENT)], b"", "parent image"),
    ([_entry(0x1000, 1, 8)], b"", "unexpected flags"),
    ([_entry(0x1000, 1, PRESENT)], b"", "has 0 bytes, its pagemap says CRIU wrote 4096"),
    ([_entry(0x1000, 1, LAZY)], b"\0" * PAGE, "has 4096 bytes, its pagemap says CRIU wrote 0"),
])
def test_images_it_does_not_handle_are_refused_untouched(tmp_path, entries, pages, why):
    images = _images(tmp_path, {1: (1, entries, pages)})
    before = {n: open(os.path.join(images, n), "rb").read() for n in os.listdir(images)}
    with pytest.raises(pagedump.PlanError, match=why):
        pagedump.complete(images, {1: os.getpid()}, 2)
    assert {n: open(os.path.join(images, n), "rb").read() for n in os.listdir(images)} == before


def test_two_processes_naming_one_pages_file_are_refused(tmp_path):
    images = _images(tmp_path, {1: (1, [_entry(0x1000, 1, LAZY)], b""), 2: (1, [_entry(0x1000, 1, LAZY)], b"")})
    with pytest.raises(pagedump.PlanError, match="share pages-1.img"):
        pagedump.plan(images)


def test_unreadable_memory_fails_and_leaves_criu_files_as_they_were(tmp_path):
    mem = Memory(4)
    bad = mmap.mmap(-1, PAGE)
    hole = ctypes.addressof(ctypes.c_char.from_buffer(bad))
    bad.close()  # unmapped: neither process_vm_readv nor /proc/PID/mem can read it
    images = _images(tmp_path, {1: (1, [_entry(0x400000, 1, PRESENT), _entry(mem.addr, 4, LAZY),
                                        _entry(hole, 1, LAZY)], b"c" * PAGE)})
    before = {n: open(os.path.join(images, n), "rb").read() for n in os.listdir(images)}
    with pytest.raises(pagedump.ReadError, match="cannot read the memory of process 1"):
        pagedump.complete(images, {1: os.getpid()}, 2)
    assert {n: open(os.path.join(images, n), "rb").read() for n in os.listdir(images)} == before


def test_a_dumped_process_missing_from_the_container_is_an_error(tmp_path):
    mem = Memory(1)
    images = _images(tmp_path, {3: (1, [_entry(mem.addr, 1, LAZY)], b"")})
    with pytest.raises(pagedump.ReadError, match=r"processes \[3\] are not in the container"):
        pagedump.complete(images, {1: os.getpid()}, 1)


def test_a_process_without_pagemap_is_skipped(tmp_path):
    images = _images(tmp_path, {1: (1, [], b"")})
    os.unlink(os.path.join(images, "pagemap-1.img"))  # a zombie has no memory images
    assert pagedump.plan(images).files == []


# -- the decision (ops/dump.py) -------------------------------------------------------------------------
def test_decision_follows_config_and_env(monkeypatch):
    monkeypatch.delenv(dump_ops.ENV, raising=False)
    monkeypatch.setattr("migrt.pagefill.uffd.usable", lambda: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    cfg = Config(path="x")
    big = dump_ops.AUTO_MIN_BYTES
    assert dump_ops.decide(cfg, big)["mode"] == "parallel"
    small = dump_ops.decide(cfg, big - 1)
    assert small["mode"] == "criu" and "below" in small["reason"]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    few = dump_ops.decide(cfg, big)
    assert few["mode"] == "criu" and "2 CPUs" in few["reason"]
    cfg.dump_pages = "criu"
    assert dump_ops.decide(cfg, big)["mode"] == "criu"
    monkeypatch.setenv(dump_ops.ENV, "parallel")  # the environment wins, whatever the size
    d = dump_ops.decide(cfg, 0)
    assert d["mode"] == "parallel" and d["requested"] == "parallel" and d["threads"] >= 1
    cfg.dump_threads = 3
    assert dump_ops.decide(cfg, 0)["threads"] == 3
    monkeypatch.setenv(dump_ops.ENV, "fast")
    with pytest.raises(UsageError, match="MIGRT_DUMP_PAGES must be one of"):
        dump_ops.decide(cfg, 0)


def test_parallel_without_userfaultfd_is_refused_and_auto_uses_criu(monkeypatch):
    monkeypatch.setattr("migrt.pagefill.uffd.usable", lambda: "userfaultfd is not usable (EPERM)")
    cfg = Config(path="x", dump_pages="parallel")
    monkeypatch.delenv(dump_ops.ENV, raising=False)
    with pytest.raises(PreconditionFailed, match="set dump_pages to auto or criu"):
        dump_ops.decide(cfg, 1 << 30)
    cfg.dump_pages = "auto"
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    d = dump_ops.decide(cfg, 1 << 30)
    assert d["mode"] == "criu" and "userfaultfd" in d["reason"]


# -- the dump (ops/dump.py) with a fake lower runtime and a fake lazy dump --------------------------------
class FakeJournal:
    def __init__(self) -> None:
        self.updates: list[tuple[str, dict]] = []

    def update(self, phase=None, **fields) -> None:
        self.updates.append((phase, fields))


class FakeRuntime:
    path = "/usr/bin/runc"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def checkpoint(self, root, cid, *, image_path, work_path, options, leave_running, env=None):
        self.calls.append(image_path)
        (open(os.path.join(image_path, "pages-1.img"), "wb")).close()


def _fake_lazy(monkeypatch, write_images=None, fail: str | None = None):
    from migrt.errors import RuntimeFailed

    class FakeLazy:
        def __init__(self, runtime, root, cid, *, image_path, work_path, options, page_server, env=None):
            self.images = image_path

        def wait_ready(self, timeout):
            if fail:
                raise RuntimeFailed(fail)
            write_images(self.images)

        def finish(self, timeout):
            pass

        def abort(self):
            pass

    monkeypatch.setattr(dump_ops.control, "LazyCheckpoint", FakeLazy)
    monkeypatch.setattr(dump_ops, "container_pids", lambda root, cid: {1: os.getpid()})


def _run_dump(tmp_path, requested: str):
    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    (images / "gpu-state.json").write_text("{}")  # written before the dump: must survive a fallback
    rt, journal = FakeRuntime(), FakeJournal()
    decision = {"mode": "parallel", "requested": requested, "threads": 2}
    from migrt.criu.options import CriuOptions

    rec = dump_ops.dump(Config(path="x"), rt, "/run/runc", "c", images=str(images), work=str(work),
                        options=CriuOptions(), env=None, journal=journal, decision=decision)
    return rec, rt, journal, images


def test_dump_writes_the_memory_and_records_the_phases(tmp_path, monkeypatch):
    mem = Memory(16)

    def lazy_images(d):
        _images(tmp_path, {1: (1, [_entry(0x400000, 1, PRESENT), _entry(mem.addr, 16, LAZY)], b"p" * PAGE)})

    _fake_lazy(monkeypatch, lazy_images)
    rec, rt, journal, images = _run_dump(tmp_path, "parallel")
    assert rec["mode"] == "parallel" and rec["lazy_bytes"] == 16 * PAGE and rec["criu_bytes"] == PAGE
    assert rec["lazy_dump_s"] >= 0 and rec["pages_s"] >= 0 and rt.calls == []
    assert (images / "pages-1.img").read_bytes() == b"p" * PAGE + mem.at(0, 16)
    # the manifest entries of the pages files, for the commit (relative to the checkpoint, like its files)
    assert rec["digests"] == {"images/pages-1.img": fsutil.hash_tree(str(images), ["pages-1.img"])["pages-1.img"]}
    assert [p for p, _ in journal.updates] == ["dumping", "writing-pages"]
    assert journal.updates[0][1]["page_server"][0] == "127.0.0.1" and journal.updates[1][1]["page_server"] is None


def test_auto_falls_back_to_criu_when_the_lazy_dump_fails(tmp_path, monkeypatch):
    _fake_lazy(monkeypatch, fail="lazy checkpoint of c failed: criu failed: type DUMP")
    rec, rt, journal, images = _run_dump(tmp_path, "auto")
    assert rec["mode"] == "criu" and "CRIU's lazy dump" in rec["fallback"] and rt.calls == [str(images)]
    assert [(p, f.get("dump_pages")) for p, f in journal.updates] == [("dumping", "parallel"), ("dumping", "criu")]
    assert (images / "gpu-state.json").exists()


def test_auto_falls_back_on_images_it_does_not_handle_and_cleans_them(tmp_path, monkeypatch):
    def parent_images(d):
        _images(tmp_path, {1: (1, [_entry(0x1000, 1, PARENT)], b"")})

    _fake_lazy(monkeypatch, parent_images)
    images = tmp_path / "images"
    rec, rt, journal, images = _run_dump(tmp_path, "auto")
    assert rec["mode"] == "criu" and "parent image" in rec["fallback"] and len(rt.calls) == 1
    assert sorted(os.listdir(images)) == ["gpu-state.json", "pages-1.img"]  # the lazy dump's files went first


def test_parallel_fails_clearly_instead_of_falling_back(tmp_path, monkeypatch):
    from migrt.errors import RuntimeFailed

    def parent_images(d):
        _images(tmp_path, {1: (1, [_entry(0x1000, 1, PARENT)], b"")})

    _fake_lazy(monkeypatch, parent_images)
    with pytest.raises(RuntimeFailed, match="parallel dump of container c failed: .*parent image.*set dump_pages"):
        _run_dump(tmp_path, "parallel")
    _fake_lazy(monkeypatch, fail="lazy checkpoint of c failed: criu failed")
    with pytest.raises(RuntimeFailed, match="^lazy checkpoint of c failed: criu failed$"):
        _run_dump(tmp_path, "parallel")


def test_a_store_without_room_for_the_memory_fails_before_any_copy(tmp_path, monkeypatch):
    mem = Memory(4)
    images = _images(tmp_path, {1: (1, [_entry(mem.addr, 4, LAZY)], b"")})
    real = os.statvfs

    class Small:
        f_bavail, f_frsize = 3, PAGE  # three pages free, four needed

    monkeypatch.setattr(os, "statvfs", lambda p: Small() if p == images else real(p))
    with pytest.raises(OSError, match="has 0 MiB free, the memory needs 0 MiB") as exc:
        pagedump.complete(images, {1: os.getpid()}, 2)
    assert exc.value.errno == 28
    assert sorted(os.listdir(images)) == ["pagemap-1.img", "pages-1.img", "pstree.img"]
