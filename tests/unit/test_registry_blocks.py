"""Block digests of the eager chunks (registry/blocks.py): the record push writes (deterministic, none
where the images cannot be planned), what a reader accepts of it, which blocks a create fetches, the
create fetching only those (verified, a corrupted one refused before it counts), images without the
record read as before, the Verifier not holding the gate on such a chunk, and the filler fetching only
the rest of it and hashing the whole chunk (a corrupted gap refused and zeroed). Against the fake
registry of tests/helpers/fake_registry.py; the whole path with CRIU: tests/integration/test_registry_lazy.py."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from migrt.errors import CheckpointInvalid
from migrt.pagefill import ImageError, verify
from migrt.pagefill import images as images_mod
from migrt.registry import blocks, image, lazy, pull
from migrt.registry import push as push_mod
from migrt.registry.blocks import BLOCK, Eager
from migrt.registry.fill import RegistrySource
from migrt.registry.reference import parse
from migrt.store import Store
from tests.helpers.fake_registry import migrt_image, send_range
from tests.unit.test_registry_lazy import _prepare, _source
from tests.unit.test_registry_pull import Log, cfg, reg, tls  # noqa: F401 - fixtures

MiB = 1 << 20
PAGES = os.urandom(4 * MiB)
FILES = {"images/inventory.img": b"inventory", "images/core-1.img": b"core" * 100, "images/pages-1.img": PAGES}
LAZY = [(2 * MiB, 3 * MiB)]  # block 2 lazy: blocks 0, 1 and 3 hold bytes CRIU reads


# -- the record -------------------------------------------------------------------------------------

def test_a_record_round_trips_and_a_reader_takes_its_block_size():
    rec = blocks.Blocks(BLOCK, tuple(hashlib.sha256(PAGES[a:a + BLOCK]).digest() for a in range(0, len(PAGES), BLOCK)))
    assert blocks.parse(rec.value(), len(PAGES), "r") == rec
    small = blocks.Blocks(4096, (b"\1" * 32,) * 3)
    assert blocks.parse(small.value(), 3 * 4096 - 5, "r").span(2, 3 * 4096 - 5) == (8192, 3 * 4096 - 5)


@pytest.mark.parametrize("value,why", [
    (7, "not '<block size>"),
    ("ab" * 32, "not '<block size>"),
    ("1000:" + "ab" * 32, "not a power of two"),
    ("2048:" + "ab" * 32, "not a power of two"),                          # below a page
    (f"{128 * MiB}:" + "ab" * 32, "not a power of two"),                   # above a chunk
    ("-4096:" + "ab" * 32, "not a power of two"),
    (f"{MiB}:" + "ab" * 32 * 3, "192 hex digits, 4 sha256 digests expected"),  # 4 blocks, 3 digests
    (f"{MiB}:" + "AB" * 32 * 4, "4 sha256 digests expected"),             # not lowercase hex
    (f"{MiB}:" + "zz" * 32 * 4, "4 sha256 digests expected"),
    (f"{MiB}:" + "ab" * 32 * 5, "4 sha256 digests expected"),
])
def test_a_malformed_record_is_refused_with_what_is_wrong(value, why):
    with pytest.raises(CheckpointInvalid, match=r"reg/x@sha256:1: the io.migrt.checkpoint.blocks annotation of a "
                                                rf"4194304-byte blob is malformed .*{why}.*push the checkpoint again"):
        blocks.parse(value, 4 * MiB, "reg/x@sha256:1")


def test_the_blocks_a_create_needs_are_those_holding_a_byte_outside_the_lazy_ranges():
    assert blocks.needed(0, 4 * MiB, MiB, LAZY) == [0, 1, 3]
    assert blocks.needed(0, 4 * MiB, MiB, [(0, 4 * MiB)]) == []
    assert blocks.needed(0, 4 * MiB, MiB, [(0, MiB), (MiB, 2 * MiB + 4096)]) == [2, 3]   # touching ranges merge
    assert blocks.needed(64 * MiB, 66 * MiB + 10, MiB, [(64 * MiB, 66 * MiB)]) == [2]      # a short last block
    assert blocks.needed(0, 2 * MiB, MiB, [(MiB + 4096, 9 * MiB)]) == [0, 1]               # one page not lazy
    assert blocks.runs([3, 0, 1, 5, 6, 9]) == [(0, 1), (3, 3), (5, 6), (9, 9)]
    assert blocks.gaps(0, 4 * MiB, [(0, 2 * MiB), (3 * MiB, 4 * MiB)]) == [(2 * MiB, 3 * MiB)]
    assert blocks.gaps(0, 40 * MiB, [(0, MiB)]) == [(MiB, 17 * MiB), (17 * MiB, 33 * MiB), (33 * MiB, 40 * MiB)]


# -- push -------------------------------------------------------------------------------------------

class _Client:
    """What _push_chunked asks of a client (the blobs' upload is patched out)."""

    def __init__(self) -> None:
        self.manifests: list[bytes] = []

    def put_blob_bytes(self, data: bytes) -> str:
        return "sha256:" + hashlib.sha256(data).hexdigest()

    def put_manifest(self, raw: bytes, media_type: str, tag: str) -> str:
        self.manifests.append(raw)
        return "sha256:" + hashlib.sha256(raw).hexdigest()


def _push_twice(cfg, monkeypatch, plan) -> tuple[list[dict], list[bytes], Log]:  # noqa: F811
    monkeypatch.setattr(push_mod, "_upload", lambda *a: 0)
    monkeypatch.setattr(blocks, "eager_plan", plan)
    log = Log()
    monkeypatch.setattr(push_mod.log_mod, "get", lambda: log)
    store = Store(cfg.store)
    with store.writer("ck") as w:
        for rel, data in FILES.items():
            os.makedirs(os.path.dirname(os.path.join(w.path, rel)), exist_ok=True)
            with open(os.path.join(w.path, rel), "wb") as fh:
                fh.write(data)
        w.commit({"created": "2026-01-02T03:04:05Z"})
    client = _Client()
    for _ in range(2):
        with store.reading("ck") as ckpt:
            push_mod._push_chunked(cfg, client, ckpt, parse("r.example/team/ckpt:v1"), lambda *a, **k: None)
    return json.loads(client.manifests[0])["layers"], client.manifests, log


def test_push_records_the_eager_chunks_blocks_the_same_each_time(cfg, monkeypatch):  # noqa: F811
    seen = []

    def plan(images, sizes):
        seen.append((os.path.basename(images), sizes))
        return {rel: Eager(LAZY, [0]) for rel in sizes}
    layers, manifests, _log = _push_twice(cfg, monkeypatch, plan)
    assert seen[0] == ("images", {"images/pages-1.img": len(PAGES)})       # only the pages images are planned
    assert manifests[0] == manifests[1]                                     # same checkpoint, same manifest
    marked = {d["annotations"][image.A_PATH]: d["annotations"].get(blocks.A_BLOCKS) for d in layers}
    digests = "".join(hashlib.sha256(PAGES[a:a + BLOCK]).hexdigest() for a in range(0, len(PAGES), BLOCK))
    assert marked == {"images/core-1.img": None, "images/inventory.img": None,
                      "images/pages-1.img": f"{BLOCK}:{digests}"}


def test_push_without_a_plan_records_nothing_and_says_so(cfg, monkeypatch):  # noqa: F811
    def plan(images, sizes):
        raise ImageError("pstree.img lists no process")
    layers, _manifests, log = _push_twice(cfg, monkeypatch, plan)
    assert not [d for d in layers if blocks.A_BLOCKS in d.get("annotations", {})]
    said = [e for e in log.events if e[1] == "push_no_blocks"]
    assert said and said[0][0] == "info" and "pstree.img lists no process" in said[0][2]["reason"]


def test_an_eager_chunk_every_block_of_which_is_needed_gets_no_record(cfg, monkeypatch):  # noqa: F811
    layers, _m, _log = _push_twice(cfg, monkeypatch, lambda images, sizes: {rel: Eager([], [0]) for rel in sizes})
    assert not [d for d in layers if blocks.A_BLOCKS in d.get("annotations", {})]


# -- the create -------------------------------------------------------------------------------------

def _image(registry, value: str | None = None) -> str:
    """migrt_image of FILES whose pages layer carries a blocks record (the real one unless `value`)."""
    migrt_image(registry, "v1", FILES)
    manifest = json.loads(registry.manifests["v1"])
    for d in manifest["layers"]:
        if d["annotations"][image.A_PATH] == "images/pages-1.img":
            d["annotations"][blocks.A_BLOCKS] = value or blocks.Blocks(BLOCK, tuple(
                hashlib.sha256(PAGES[a:a + BLOCK]).digest() for a in range(0, len(PAGES), BLOCK))).value()
    return registry.add_manifest("v1", manifest)


@pytest.fixture()
def eager(monkeypatch):
    """Chunk 0 of pages-1.img is eager; of it, only block 2 is lazy."""
    monkeypatch.setattr(lazy, "_eager_chunks", lambda images, pages: {rel: Eager(LAZY, [0]) for rel in pages})


def _ranges(registry) -> list[str]:
    """Serve the pages blob's byte ranges, recording the Range asked ("" for a whole GET)."""
    asked: list[str] = []
    blob = registry.add_blob(PAGES)

    def hook(h) -> None:
        asked.append(h.headers.get("Range") or "")
        data = registry.blobs[blob]
        if h.headers.get("Range"):
            return send_range(h, data)
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    registry.hooks[f"/v2/{registry.repo}/blobs/{blob}"] = hook
    return asked


def test_the_create_fetches_only_the_blocks_criu_reads_verified(cfg, reg, eager):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    _image(registry)
    asked = _ranges(registry)
    out = _prepare(cfg, host, Log())
    second = None
    try:
        assert asked[0] == "bytes=0-0"                                      # the range probe
        assert sorted(asked[1:]) == [f"bytes=0-{2 * MiB - 1}", f"bytes={3 * MiB}-{4 * MiB - 1}"]  # blocks 0-1, 3
        path = os.path.join(out.ckpt.path, "images", "pages-1.img")
        with open(path, "rb") as fh:
            got = fh.read()
        assert got[:2 * MiB] == PAGES[:2 * MiB] and got[3 * MiB:] == PAGES[3 * MiB:]
        assert got[2 * MiB:3 * MiB] == bytes(MiB)                           # the lazy block: the filler's
        f = out.handover["files"]["pages-1.img"]
        assert f["partly"] == {"0": [[0, 2 * MiB], [3 * MiB, 4 * MiB]]}
        assert out.handover["registry"]["present"] == {"pages-1.img": []}   # not a whole chunk: not journaled
        assert out.summary["partly"] == 1 and out.summary["bytes_received"] < len(PAGES)
        journal = pull.Journal(out.handover["registry"]["journal"])
        assert not [k for k in journal.done if k[2] == "images/pages-1.img"]
        second = _prepare(cfg, host, Log())                                 # a restore that joins the fill
        assert second.summary["joined"] and second.handover["files"]["pages-1.img"]["partly"] == f["partly"]
    finally:
        for o in (second, out):
            if o is not None:
                o.release()


def test_a_corrupted_block_is_refused_before_it_counts(cfg, reg, eager):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    _image(registry)
    asked = _ranges(registry)
    blob = registry.add_blob(PAGES)
    registry.blobs[blob] = PAGES[:3 * MiB + 5] + bytes([PAGES[3 * MiB + 5] ^ 1]) + PAGES[3 * MiB + 6:]
    with pytest.raises(CheckpointInvalid, match=rf"blob {blob} \(images/pages-1.img bytes {3 * MiB}-{4 * MiB - 1}, "
                                                r"block 3 of 4\): the data received has sha256 .*altered in the "
                                                r"registry or in transit \(nothing was committed\)"):
        _prepare(cfg, host, Log())
    assert f"bytes={3 * MiB}-{4 * MiB - 1}" in asked
    hexd = next(p for p in os.listdir(os.path.join(cfg.store, ".pulls")) if not p.endswith((".done", ".chunks")))
    with open(os.path.join(cfg.store, ".pulls", hexd, "images", "pages-1.img"), "rb") as fh:
        assert fh.read()[3 * MiB:] == bytes(MiB)                            # zeroed on disk
    assert Store(cfg.store).list() == [] and not os.path.exists(os.path.join(cfg.store, ".pulls", hexd + ".lazy.json"))


def test_an_image_without_records_has_its_eager_chunks_fetched_whole(cfg, reg, eager):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    asked = _ranges(registry)
    out = _prepare(cfg, host, Log())
    try:
        assert asked[1:] == [""]                                            # one whole GET, as before
        assert "partly" not in out.handover["files"]["pages-1.img"]
        assert out.handover["registry"]["present"] == {"pages-1.img": [0]} and out.summary["partly"] == 0
    finally:
        out.release()


def test_a_malformed_record_refuses_the_image_before_any_blob(cfg, reg, eager):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    _image(registry, f"{BLOCK}:" + "ab" * 32)
    with pytest.raises(CheckpointInvalid, match="io.migrt.checkpoint.blocks annotation .* is malformed"):
        _prepare(cfg, host, Log())
    assert not [p for p in registry.blob_paths() if registry.add_blob(PAGES) in p]


def test_pull_takes_an_image_with_records_as_any(cfg, reg):  # noqa: F811
    registry, host, _ca = reg
    _image(registry)
    name, pulled = pull.ensure_local(cfg, f"{host}/team/ckpt:v1")
    assert pulled
    Store(cfg.store).get(name).verify()


# -- the filler ------------------------------------------------------------------------------------

def _plan(images: str) -> images_mod.Plan:
    """The filler's plan that matches LAZY: one process whose lazy segment is block 2."""
    seg = images_mod.Segment(0x400000, 0x400000 + MiB, 2 * MiB)
    return images_mod.Plan(images=images, processes={1: images_mod.ProcessPlan(
        pid=1, pages_file=os.path.join(images, "pages-1.img"), segments=[seg])})


def test_the_gate_does_not_wait_for_a_chunk_whose_criu_bytes_are_verified(tmp_path):
    spec = {"files": {"pages-1.img": {"rel": "images/pages-1.img", "size": 4 * MiB, "chunks": "ab" * 32}}}
    plan = _plan(str(tmp_path))
    assert [i for _f, i in verify.build(plan, spec).eager] == [0]           # before: held for the whole chunk
    spec["files"]["pages-1.img"]["partly"] = {"0": [[0, 2 * MiB], [3 * MiB, 4 * MiB]]}
    v = verify.build(plan, spec)
    assert v.eager == [] and v.eager_done and [i for _f, i in v.order] == [0]
    spec["files"]["pages-1.img"]["partly"] = {"0": [[0, 2 * MiB]]}         # block 3 not in: still eager
    assert [i for _f, i in verify.build(plan, spec).eager] == [0]
    for bad in ({"1": [[0, 1]]}, {"x": [[0, 1]]}, {"0": [[5, 5]]}, {"0": [[0, 5 * MiB]]}, {"0": [[0, True]]},
                {"0": "0-1"}):
        spec["files"]["pages-1.img"]["partly"] = bad
        with pytest.raises(verify.VerifyError, match="bad verified ranges"):
            verify.build(plan, spec)


def _partly(cfg, reg, *, alter_gap: bool = False):  # noqa: F811
    """The image with block records, served in ranges, its create done (the eager chunk's blocks but
    block 2, the lazy one, in); alter_gap: the registry then serves block 2 with a byte altered.
    (registry, host, the ranges asked since the create, the create's LazyImage)."""
    registry, host, _ca = reg
    registry.ranges = True
    _image(registry)
    asked = _ranges(registry)
    out = _prepare(cfg, host, Log())
    del asked[:]
    if alter_gap:
        blob = registry.add_blob(PAGES)
        registry.blobs[blob] = PAGES[:2 * MiB + 7] + bytes([PAGES[2 * MiB + 7] ^ 1]) + PAGES[2 * MiB + 8:]
    return registry, host, asked, out


def _filler(cfg, host, out, tmp_path):  # noqa: F811
    src, _f = _source(out, tmp_path)
    v = verify.build(_plan(os.path.join(out.ckpt.path, "images")), json.loads(json.dumps(out.handover)))
    v.source = src
    return src, v, v.files[os.path.join(out.ckpt.path, "images", "pages-1.img")]


def test_the_filler_fetches_only_the_missing_blocks_then_hashes_the_whole_chunk(cfg, reg, eager, tmp_path):  # noqa: F811
    registry, host, asked, out = _partly(cfg, reg)
    src, v, f = _filler(cfg, host, out, tmp_path)
    assert v.eager == []
    v.sweep_one()                                                           # the chunk's fill
    assert asked == [f"bytes={2 * MiB}-{3 * MiB - 1}"]                      # the gap only
    with open(f.path, "rb") as fh:
        assert fh.read() == PAGES
    assert src.summary()["fetched_bytes"] == MiB and src.summary()["fetched_chunks"] == 1
    journal = pull.Journal(src.spec["journal"])
    assert (registry.add_blob(PAGES), 0, "images/pages-1.img") in journal.done
    src.commit()
    Store(cfg.store).get(out.ckpt.name).verify()


def test_a_fault_in_a_partly_chunk_takes_its_block_alone_and_the_chunk_is_hashed_whole_later(
        cfg, reg, eager, tmp_path):  # noqa: F811
    registry, host, asked, out = _partly(cfg, reg)
    src, v, f = _filler(cfg, host, out, tmp_path)
    v.ensure(f.path, 2 * MiB + 8192, 4096)                                  # a fault in the lazy block
    assert asked == [f"bytes={2 * MiB}-{3 * MiB - 1}"]                      # that block, nothing more
    with open(f.path, "rb") as fh:
        assert fh.read() == PAGES
    assert f.state[0] is not True and src.summary()["fetched_chunks"] == 0  # the chunk: not counted yet
    assert not [k for k in pull.Journal(src.spec["journal"]).done if k[2] == "images/pages-1.img"]
    v.ensure(f.path, 2 * MiB, 4096)                                         # in now: nothing fetched again
    assert len(asked) == 1
    other = RegistrySource.from_handover(json.loads(json.dumps({**out.handover, "registry": {
        **out.handover["registry"], "join": True}})), src.images, None)
    other.shared_ranges(f, 0)                                               # another filler of the image
    assert (2 * MiB, 3 * MiB) in other.partly[(f.path, 0)]                  # never rewrites that block
    v.sweep_one()                                                           # the whole chunk, from disk
    assert len(asked) == 1 and f.state[0] is True
    assert (registry.add_blob(PAGES), 0, "images/pages-1.img") in pull.Journal(src.spec["journal"]).done
    src.commit()
    Store(cfg.store).get(out.ckpt.name).verify()


def test_a_corrupted_block_taken_for_a_fault_is_refused_zeroed_and_final(cfg, reg, eager, tmp_path):  # noqa: F811
    registry, host, _asked, out = _partly(cfg, reg, alter_gap=True)
    blob = "sha256:" + hashlib.sha256(PAGES).hexdigest()
    src, v, f = _filler(cfg, host, out, tmp_path)
    with pytest.raises(verify.VerifyError, match=rf"images/pages-1.img bytes {2 * MiB}-{3 * MiB - 1} \(block 2 of blob "
                                                 rf"{blob}\) from registry {host} does not match its digest .*no "
                                                 "restored process ran on it"):
        v.ensure(f.path, 2 * MiB, 4096)
    with open(f.path, "rb") as fh:
        got = fh.read()
    assert got[2 * MiB:3 * MiB] == bytes(MiB)                               # the block: zeroed
    assert got[:2 * MiB] == PAGES[:2 * MiB] and got[3 * MiB:] == PAGES[3 * MiB:]   # the verified ones kept
    with pytest.raises(verify.VerifyError):                                 # final: any later ensure fails
        v.ensure(f.path, 0, 4096)
    src.close()


def test_a_corrupted_gap_is_refused_with_the_chunks_mismatch_and_zeroed(cfg, reg, eager, tmp_path):  # noqa: F811
    registry, host, _asked, out = _partly(cfg, reg, alter_gap=True)
    blob = "sha256:" + hashlib.sha256(PAGES).hexdigest()
    src, v, f = _filler(cfg, host, out, tmp_path)
    with pytest.raises(verify.VerifyError, match=rf"images/pages-1.img bytes 0-{4 * MiB - 1} \(blob {blob}\) from "
                                                 rf"registry {host} does not match its digest \(the data received "
                                                 r"has .*\); the container was stopped, no restored process ran on it"):
        v.sweep_one()
    with open(f.path, "rb") as fh:
        got = fh.read()
    assert got[2 * MiB:3 * MiB] == bytes(MiB)                               # what it fetched: zeroed
    assert got[:2 * MiB] == PAGES[:2 * MiB] and got[3 * MiB:] == PAGES[3 * MiB:]   # the verified blocks kept
    journal = pull.Journal(src.spec["journal"])
    assert not [k for k in journal.done if k[2] == "images/pages-1.img"]
    src.close()
