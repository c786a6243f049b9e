"""Verify as filled (migrt/pagefill/verify.py): the chunk bookkeeping (each chunk hashed once, waiters
wait for that one hash, a mismatch is final), which chunks are eager (hold a byte that is not lazy),
the order of the sweep, the store's per-chunk record in the manifest, and the engine refusing to copy
from a chunk that does not verify (its pages never reach the task). Chunks are made 1 MiB here
(verify.TREE_CHUNK and fsutil.TREE_CHUNK patched) so that files of a few MiB have several."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
import time

import pytest

from migrt.pagefill import images, verify
from migrt.store import fsutil
from migrt.store import manifest as mf
from tests.unit.test_pagefill import MiB, Rig, rigs, uffd_ok  # noqa: F401 (fixtures)
from tests.unit.test_store import make, store  # noqa: F401 (fixture)

CH = 1 << 20


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(verify, "TREE_CHUNK", CH)
    monkeypatch.setattr(fsutil, "TREE_CHUNK", CH)


def _file(tmp_path, data: bytes, name="pages-1.img") -> verify.FileChunks:
    path = str(tmp_path / name)
    with open(path, "wb") as fh:
        fh.write(data)
    digests = [hashlib.sha256(data[o:o + CH]).digest() for o in range(0, max(1, len(data)), CH)]
    return verify.FileChunks(path=path, rel=f"images/{name}", size=len(data), digests=digests)


class SlowReader:
    """Counts the reads of each chunk; each read takes a while, so that callers overlap."""

    def __init__(self, path: str, delay: float = 0.05) -> None:
        self.path, self.delay = path, delay
        self.reads: dict[int, int] = {}
        self.lock = threading.Lock()

    def __call__(self, offset: int, n: int):
        with self.lock:
            self.reads[offset // CH] = self.reads.get(offset // CH, 0) + 1
        time.sleep(self.delay)
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            return fh.read(n)


def test_concurrent_callers_of_one_chunk_wait_for_one_hash(tmp_path, small_chunks):
    f = _file(tmp_path, os.urandom(4 * CH))
    v = verify.Verifier([f])
    reader = SlowReader(f.path, delay=0.2)
    v.reader(f.path, reader)
    errors = []

    def fault(off):
        try:
            v.ensure(f.path, off, 4096)
        except verify.VerifyError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fault, args=(CH + 4096 * k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert reader.reads == {1: 1}  # six callers, one hash
    snap = v.snapshot()
    assert snap["verified"] == 1 and snap["waits"] == 5 and snap["by_copy"] == 1
    v.ensure(f.path, 0, 4 * CH)  # the others now, chunk 1 not again
    assert reader.reads == {0: 1, 1: 1, 2: 1, 3: 1}
    v.ensure(f.path, 0, 4 * CH)
    assert sum(reader.reads.values()) == 4 and v.snapshot()["verified"] == 4


def test_sweep_and_copies_hash_each_chunk_once_and_eager_chunks_first(tmp_path, small_chunks):
    f = _file(tmp_path, os.urandom(8 * CH + 100))  # 9 chunks, the last one short
    done = threading.Event()
    v = verify.Verifier([f], eager=[(f, 8), (f, 0)], order=[(f, 5), (f, 4)])
    v.on_eager_done = done.set
    assert [i for _, i in v.order] == [8, 0, 5, 4, 1, 2, 3, 6, 7]
    reader = SlowReader(f.path, delay=0.01)
    v.reader(f.path, reader)
    copies = threading.Thread(target=lambda: [v.ensure(f.path, o, 3 * CH) for o in (CH, 4 * CH)])
    sweeps = [threading.Thread(target=v.sweep) for _ in range(3)]
    for t in [copies, *sweeps]:
        t.start()
    for t in [copies, *sweeps]:
        t.join(20)
    assert done.is_set() and v.eager_done
    assert reader.reads == {i: 1 for i in range(9)}
    snap = v.snapshot()
    assert snap["verified"] == 9 == snap["chunks"] and snap["bytes"] == f.size
    assert snap["by_sweep"] + snap["by_copy"] == 9 and snap["eager"] == 2


def test_a_mismatch_names_the_file_and_bytes_and_is_final(tmp_path, small_chunks):
    data = bytearray(os.urandom(3 * CH))
    f = _file(tmp_path, bytes(data))
    data[CH + 12345] ^= 1
    with open(f.path, "wb") as fh:
        fh.write(data)
    v = verify.Verifier([f], what="checkpoint ck")
    v.ensure(f.path, 0, 4096)  # chunk 0 is intact
    with pytest.raises(verify.VerifyError, match=rf"checkpoint ck: sha256 mismatch in images/pages-1.img at bytes "
                                                 rf"{CH}-{2 * CH - 1} \(64 MiB chunk 1 of 3\)"):
        v.ensure(f.path, CH + 8192, 4096)
    with pytest.raises(verify.VerifyError):  # even an intact chunk: the fill is over
        v.ensure(f.path, 2 * CH, 4096)
    with pytest.raises(verify.VerifyError):
        v.sweep()
    assert "error" in v.snapshot() and v.snapshot()["verified"] == 1


def test_waiters_on_a_chunk_that_fails_fail_too(tmp_path, small_chunks):
    f = _file(tmp_path, os.urandom(CH))
    f.digests[0] = b"\0" * 32
    v = verify.Verifier([f])
    v.reader(f.path, SlowReader(f.path, delay=0.2))
    errors = []

    def fault():
        try:
            v.ensure(f.path, 0, 4096)
        except verify.VerifyError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=fault) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 4 and all("mismatch" in e for e in errors)


def test_files_not_handed_over_pass(tmp_path, small_chunks):
    f = _file(tmp_path, os.urandom(CH))
    v = verify.Verifier([f])
    v.ensure(str(tmp_path / "pages-2.img"), 0, 4096)
    assert v.snapshot()["verified"] == 0


def test_eager_chunks_are_those_with_a_byte_outside_the_lazy_ranges(small_chunks):
    assert verify.eager_chunks(4 * CH, [(0, 4 * CH)]) == []
    assert verify.eager_chunks(4 * CH, []) == [0, 1, 2, 3]
    # a stack page at the end, a file-backed page at the start, lazy in between (two touching ranges)
    assert verify.eager_chunks(4 * CH, [(4096, 2 * CH), (2 * CH, 4 * CH - 4096)]) == [0, 3]
    assert verify.eager_chunks(4 * CH + 10, [(0, 4 * CH)]) == [4]  # a short last chunk, not lazy
    assert verify.eager_chunks(3 * CH, [(0, CH), (CH + 4096, 3 * CH)]) == [1]
    assert verify.eager_chunks(0, []) == [0]


def test_build_from_a_plan_eager_chunks_and_copy_order(tmp_path, small_chunks):
    size = 6 * CH
    seg = images.Segment
    procs = {
        1: images.ProcessPlan(pid=1, pages_file=str(tmp_path / "pages-1.img"),
                              segments=[seg(0x10000, 0x10000 + CH, 4096), seg(0x900000, 0x900000 + 3 * CH, 2 * CH)],
                              first=[(0x10000, 0x10000 + CH)]),
    }
    plan = images.Plan(images=str(tmp_path), processes=procs)
    spec = {"checkpoint": "ck", "files": {
        "pages-1.img": {"rel": "images/pages-1.img", "size": size, "chunks": "ab" * 32 * 6},
        "pages-9.img": {"rel": "images/pages-9.img", "size": 10, "chunks": "cd" * 32},  # no process: all eager
    }}
    v = verify.build(plan, spec)
    f1 = v.files[str(tmp_path / "pages-1.img")]
    f9 = v.files[str(tmp_path / "pages-9.img")]
    # lazy: [4096, CH + 4096) and [2 CH, 5 CH): chunks 0, 1 (partly) and 5 hold other bytes
    assert [(f.rel, i) for f, i in v.eager] == [("images/pages-1.img", 0), ("images/pages-1.img", 1),
                                                 ("images/pages-1.img", 5), ("images/pages-9.img", 0)]
    # then the first ranges' chunks (0, 1: already listed), then the biggest segment's (2, 3, 4)
    assert [(f is f1, i) for f, i in v.order] == [(True, 0), (True, 1), (True, 5), (False, 0), (True, 2), (True, 3),
                                                  (True, 4)]
    assert f9.size == 10 and v.what == "checkpoint ck"
    with pytest.raises(verify.VerifyError, match="chunk digests for"):
        verify.build(plan, {"files": {"pages-1.img": {"size": size, "chunks": "ab" * 32}}})
    with pytest.raises(verify.VerifyError, match="bad file name"):
        verify.build(plan, {"files": {"../pages-1.img": {"size": 1, "chunks": "ab" * 32}}})
    assert verify.build(plan, {"files": {}}) is None


# -- the store's record ----------------------------------------------------------------------------
def test_commit_records_the_chunk_digests_of_multi_chunk_files(store, small_chunks):  # noqa: F811
    data = make(store)  # pages-1.img is 70 000 bytes: one chunk, no record
    assert mf.CHUNKS not in data
    with store.writer("big") as w:
        big = os.urandom(3 * CH + 5)
        os.makedirs(w.images, exist_ok=True)
        with open(os.path.join(w.images, "pages-1.img"), "wb") as fh:
            fh.write(big)
        with open(os.path.join(w.images, "core-1.img"), "wb") as fh:
            fh.write(b"core")
        data = w.commit({"created": "2025-01-01T00:00:00Z"})
    want = [hashlib.sha256(big[o:o + CH]).digest() for o in range(0, len(big), CH)]
    assert data[mf.CHUNKS] == {"images/pages-1.img": "".join(c.hex() for c in want)}
    loaded = store.get("big").manifest
    assert mf.file_chunks(loaded, "images/pages-1.img") == want
    assert mf.file_chunks(loaded, "images/core-1.img") == [hashlib.sha256(b"core").digest()]
    # a record that does not fold into the file's digest (altered), or of another length, is not used
    bad = json.loads(json.dumps(loaded.raw))
    bad[mf.CHUNKS]["images/pages-1.img"] = "00" + bad[mf.CHUNKS]["images/pages-1.img"][2:]
    assert mf.file_chunks(bad, "images/pages-1.img") is None
    bad[mf.CHUNKS]["images/pages-1.img"] = bad[mf.CHUNKS]["images/pages-1.img"][:64]
    assert mf.file_chunks(bad, "images/pages-1.img") is None
    del bad[mf.CHUNKS]
    assert mf.file_chunks(bad, "images/pages-1.img") is None


def test_commit_takes_the_chunk_digests_of_known_files(store, small_chunks):  # noqa: F811
    big = os.urandom(2 * CH + 7)
    chunks = [hashlib.sha256(big[o:o + CH]).digest() for o in range(0, len(big), CH)]
    with store.writer("known") as w:
        with open(os.path.join(w.images, "pages-1.img"), "wb") as fh:
            fh.write(big)
        rel = "images/pages-1.img"
        data = w.commit({"created": "2025-01-01T00:00:00Z"},
                        known={rel: fsutil.make_entry(len(big), fsutil.fold_chunks(chunks))},
                        known_chunks={rel: chunks})
    assert mf.file_chunks(data, rel) == chunks


def test_verify_as_filled_hands_over_pages_images_with_usable_records(small_chunks, monkeypatch):
    from migrt.ops import pages

    monkeypatch.delenv(pages.VERIFY_ENV, raising=False)
    c = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    manifest = {"files": {
        "images/pages-1.img": {"size": 3 * CH, "sha256_tree": fsutil.fold_chunks(c)},
        "images/pages-2.img": {"size": 3 * CH, "sha256_tree": fsutil.fold_chunks(c)},  # no record
        "images/pages-3.img": {"size": CH, "sha256": c[0].hex()},
        "images/fs-1.img": {"size": 2 * CH, "sha256_tree": fsutil.fold_chunks(c[:2])},
    }, mf.CHUNKS: {"images/pages-1.img": fsutil.chunk_record(c), "images/fs-1.img": fsutil.chunk_record(c[:2])}}
    decision = {"mode": "lazy"}
    spec = pages.verify_as_filled(decision, manifest, sorted(manifest["files"]), "ck")
    assert sorted(spec["files"]) == ["pages-1.img", "pages-3.img"]
    assert spec["files"]["pages-1.img"] == {"rel": "images/pages-1.img", "size": 3 * CH,
                                            "chunks": fsutil.chunk_record(c)}
    assert decision["verify"] == {"as_filled": ["images/pages-1.img", "images/pages-3.img"],
                                  "before_run": ["images/fs-1.img", "images/pages-2.img"]}
    assert pages.verify_as_filled({"mode": "eager"}, manifest, sorted(manifest["files"]), "ck") is None
    monkeypatch.setenv(pages.VERIFY_ENV, "background")  # the old behaviour (bench/restore_fill.py)
    decision = {"mode": "lazy"}
    assert pages.verify_as_filled(decision, manifest, sorted(manifest["files"]), "ck") is None
    assert decision["verify"]["as_filled"] == []


# -- the engine --------------------------------------------------------------------------------------
def test_engine_verifies_every_chunk_before_copying_it(tmp_path, uffd_ok, rigs, small_chunks):  # noqa: F811
    rigs.append(rig := VRig(tmp_path, 8 * MiB))
    got = rig.read_faulting(5 * MiB + 7, 100)  # a fault: its chunk is verified first
    assert got == rig.data[5 * MiB + 7:5 * MiB + 107]
    assert rig.finish() == 0
    assert rig.read(0, rig.size) == rig.data
    snap = rig.filler.verifier.snapshot()
    assert snap["verified"] == 8 == snap["chunks"] and "error" not in snap
    st = json.loads((tmp_path / "status.json").read_text())
    assert st["verify"]["verified"] == 8 and st["verify"]["eager_done"]


def test_engine_never_copies_from_a_chunk_that_does_not_verify(tmp_path, uffd_ok, rigs, small_chunks):  # noqa: F811
    rigs.append(rig := VRig(tmp_path, 8 * MiB, corrupt_at=6 * MiB + 100))
    rig.guard.send(b"F")
    rig.thread.join(30)
    assert rig.rc == 1
    assert "sha256 mismatch in images/pages-1.img at bytes" in rig.filler.fatal
    assert f"{6 * MiB}-{7 * MiB - 1}" in rig.filler.fatal
    # not one page of the bad chunk reached the task (mincore: resident pages of our mapping)
    vec = (ctypes.c_ubyte * (MiB // 4096))()
    assert _mincore(rig.addr + 6 * MiB, MiB, vec) == 0
    assert not any(b & 1 for b in vec)
    st = json.loads((tmp_path / "status.json").read_text())
    assert st["state"] == "failed" and "mismatch" in st["verify"]["error"]
    assert any(m.startswith(b"E ") and b"mismatch" in m for m in rig.messages())


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _mincore(addr, n, vec):
    return _libc.mincore(ctypes.c_void_p(addr), n, vec)


class VRig(Rig):
    """A Rig whose filler verifies its pages file against per-chunk digests (optionally of other data:
    one byte at corrupt_at differs in the file)."""

    def __init__(self, tmp_path, size, corrupt_at=None):
        def on_disk(data: bytes) -> bytes:
            if corrupt_at is None:
                return data
            out = bytearray(data)
            out[corrupt_at] ^= 0xFF
            return bytes(out)

        self._memory(tmp_path, size, on_disk)
        digests = [hashlib.sha256(self.data[o:o + CH]).digest() for o in range(0, size, CH)]
        self._start(tmp_path, [images.Segment(self.addr, self.addr + size, 0)], 2, verifier_of=lambda plan: verify.build(
            plan, {"checkpoint": "ck", "files": {"pages-1.img": {
                "rel": "images/pages-1.img", "size": size, "chunks": "".join(d.hex() for d in digests)}}}))
