"""Blobs in parallel byte ranges (migrt/registry/transfer.py) against the fake registry: a blob cut
into ranges lands verified; a registry without ranges gets one stream per blob, said once in the log;
a corrupted range is refused before anything is journaled or committed; a registry that stops
serving ranges midway has the blob fetched whole; a range answered at the wrong place is refused."""

from __future__ import annotations

import json
import os

import pytest

from migrt import log as log_mod
from migrt.errors import CheckpointInvalid
from migrt.registry import pull, transfer
from migrt.store import Store
from tests.helpers.fake_registry import migrt_image, send, send_range
from tests.unit.test_registry_pull import Log, _pulls_left, cfg, reg, tls  # noqa: F401 - fixtures

PIECE = 64 << 10
BIG = os.urandom(5 * PIECE + 123)           # six ranges of the blob
FILES = {"images/inventory.img": b"inventory", "images/pages-1.img": BIG}


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(transfer, "PIECE", PIECE)


@pytest.fixture()
def log(monkeypatch):
    rec = Log()
    monkeypatch.setattr(log_mod, "get", lambda: rec)
    return rec


def _big_path(registry) -> str:
    return f"/v2/team/ckpt/blobs/{registry.add_blob(BIG)}"


def _pull(cfg, host: str) -> str:  # noqa: F811
    name = pull.pull(cfg, f"{host}/team/ckpt:v1")["name"]
    Store(cfg.store).get(name).verify()                       # every file against the checkpoint's manifest
    assert _pulls_left(cfg.store) == []
    return name


def test_a_blob_is_fetched_in_ranges_and_verified(cfg, reg, log):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    _pull(cfg, host)
    # the probe (bytes=0-0) and six ranges; the small blob whole
    assert registry.blob_paths().count(_big_path(registry)) == 1 + 6
    assert [e for e in log.events if e[1] == "registry_no_ranges"] == []


def test_a_registry_without_ranges_gets_one_stream_per_blob(cfg, reg, log):  # noqa: F811
    registry, host, _ca = reg
    other = os.urandom(3 * PIECE)
    migrt_image(registry, "v1", {**FILES, "images/pages-2.img": other})
    _pull(cfg, host)
    assert registry.blob_paths().count(_big_path(registry)) == 1 + 1     # the probe, then the blob whole
    assert registry.blob_paths().count(f"/v2/team/ckpt/blobs/{registry.add_blob(other)}") == 1
    said = [e for e in log.events if e[1] == "registry_no_ranges"]
    assert len(said) == 1 and "one stream per blob" in said[0][2]["detail"]


def test_a_corrupted_range_is_refused_before_anything_is_kept(cfg, reg, log):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    digest = registry.add_blob(BIG)
    bad = bytearray(BIG)
    bad[3 * PIECE + 7] ^= 0xFF                                 # one byte of the fourth range
    registry.blobs[digest] = bytes(bad)
    with pytest.raises(CheckpointInvalid, match=f"blob {digest}: the data received has sha256 .*altered"):
        pull.pull(cfg, f"{host}/team/ckpt:v1")
    assert Store(cfg.store).list() == [] and _pulls_left(cfg.store) == []


def test_a_registry_that_stops_serving_ranges_has_the_blob_fetched_whole(cfg, reg, log):  # noqa: F811
    registry, host, _ca = reg
    migrt_image(registry, "v1", FILES)
    path = _big_path(registry)
    calls = {"n": 0}

    def first_only(h):
        calls["n"] += 1
        if calls["n"] == 1:
            return send_range(h, BIG)                           # the probe says yes
        return send(h, 200, BIG, {"Content-Type": "application/octet-stream"})
    registry.hooks[path] = first_only
    _pull(cfg, host)
    assert calls["n"] >= 3                                      # the probe, a range answered whole, the blob


def test_a_range_answered_at_another_place_is_refused(cfg, reg, log):  # noqa: F811
    registry, host, _ca = reg
    migrt_image(registry, "v1", FILES)
    path = _big_path(registry)

    def shifted(h):
        first = int(h.headers["Range"].removeprefix("bytes=").partition("-")[0])
        if first == 0:
            return send_range(h, BIG)
        send(h, 206, BIG[:PIECE], {"Content-Range": f"bytes 0-{PIECE - 1}/{len(BIG)}"})
    registry.hooks[path] = shifted
    with pytest.raises(CheckpointInvalid, match="the registry answered range 'bytes 0-65535/"):
        pull.pull(cfg, f"{host}/team/ckpt:v1")
    assert Store(cfg.store).list() == [] and _pulls_left(cfg.store) == []


def test_an_archive_layer_is_fetched_in_ranges(cfg, reg, log):  # noqa: F811
    from tests.helpers.fake_registry import archive_image
    from tests.unit.test_import_cri import base_entries, diff_tar

    registry, host, _ca = reg
    registry.ranges = True
    archive = diff_tar(base_entries()) + b"\0" * (4 * PIECE)    # (tar readers stop at the end-of-archive)
    archive_image(registry, "v1", archive)
    name = pull.pull(cfg, f"{host}/team/ckpt:v1", admit=None)["name"]
    layer = f"/v2/team/ckpt/blobs/{registry.add_blob(archive)}"
    assert registry.blob_paths().count(layer) == 1 + -(-len(archive) // PIECE)
    assert json.dumps(Store(cfg.store).get(name).manifest["pulled"])


def test_identical_chunks_are_fetched_once(cfg, reg, log):  # noqa: F811
    """Two files of the same bytes (zero pages, say): one blob, fetched once, copied to both places."""
    registry, host, _ca = reg
    same = os.urandom(3000)
    migrt_image(registry, "v1", {"images/pages-1.img": same, "images/pages-2.img": same, "images/x.img": b"x"})
    name = _pull(cfg, host)
    assert registry.blob_paths().count(f"/v2/team/ckpt/blobs/{registry.add_blob(same)}") == 1
    ckpt = Store(cfg.store).get(name)
    for rel in ("images/pages-1.img", "images/pages-2.img"):
        with open(os.path.join(ckpt.path, rel), "rb") as fh:
            assert fh.read() == same


def test_a_cut_range_is_fetched_again_alone(cfg, reg, log):  # noqa: F811
    """A connection cut in the middle of one range: that range is asked again, not the blob."""
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    path = _big_path(registry)
    asked: list[str] = []

    def cut_once(h):
        asked.append(h.headers["Range"])
        if h.headers["Range"] == f"bytes={2 * PIECE}-{3 * PIECE - 1}" and asked.count(h.headers["Range"]) == 1:
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {2 * PIECE}-{3 * PIECE - 1}/{len(BIG)}")
            h.send_header("Content-Length", str(PIECE))
            h.end_headers()
            h.wfile.write(BIG[2 * PIECE:2 * PIECE + 1000])
            h.close_connection = True
            return None
        return send_range(h, BIG)
    registry.hooks[path] = cut_once
    _pull(cfg, host)
    assert len(asked) == 1 + 6 + 1 and asked.count(f"bytes={2 * PIECE}-{3 * PIECE - 1}") == 2, asked


def test_a_blob_cut_short_of_its_length_is_fetched_again(cfg, reg, log):  # noqa: F811
    """A connection cut before the Content-Length the registry announced is a network error, tried
    again; it is not taken for other content (that is only a body that ends where it said it ends)."""
    registry, host, _ca = reg
    small = os.urandom(100_000)
    migrt_image(registry, "v1", {"images/pages-1.img": small})
    path = f"/v2/team/ckpt/blobs/{registry.add_blob(small)}"
    asked = []

    def cut_once(h):
        asked.append(1)
        if len(asked) == 1:
            h.send_response(200)
            h.send_header("Content-Length", str(len(small)))
            h.end_headers()
            h.wfile.write(small[:1000])
            h.close_connection = True
            return None
        return send(h, 200, small)
    registry.hooks[path] = cut_once
    _pull(cfg, host)
    assert len(asked) == 2


def test_a_pull_starts_each_verified_blob_on_its_way_to_disk_and_no_other(cfg, reg, log, monkeypatch):  # noqa: F811
    """A pull's commit fsyncs every file: each blob that arrived and matched is handed to writeback at
    once (on a host with much memory the kernel would otherwise write nothing before that fsync); a
    blob that did not match is not."""
    from migrt.kernel import files

    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    started: list[tuple[int, int, bool]] = []

    def record(fd: int, offset: int, length: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        started.append((offset, length, path.endswith("pages-1.img")))
        real(fd, offset, length)
    real = files.start_writeback
    monkeypatch.setattr(files, "start_writeback", record)
    _pull(cfg, host)
    assert (0, len(BIG), True) in started and len(started) == len(FILES)
    started.clear()
    bad = bytearray(BIG)
    bad[7] ^= 0xFF
    registry.blobs[registry.add_blob(BIG)] = bytes(bad)
    with pytest.raises(CheckpointInvalid):
        pull.pull(cfg, f"{host}/team/ckpt:v1", name="again")
    assert not [s for s in started if s[2]]                      # the altered blob never went to disk
