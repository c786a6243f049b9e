"""The target side without containers: the store importer (paths, verify, atomic commit, discard) and
`Receiver` fed by a scripted sender over the real protocol; migration preflights."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from migrt import config
from migrt.criu import lazy as lazy_mod
from migrt.errors import CheckpointInvalid, Conflict, PreconditionFailed, UsageError
from migrt.migration import migrate as migrate_mod
from migrt.migration.receive import ReceiveOptions, Receiver
from migrt.store import Store
from migrt.store.importer import check_relpath, importing
from migrt.migration.wire import TransferError, connect
from tests.unit.support import is_private_dir

KEY = "unit-test-shared-secret-0123456789"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("rel", ["images/pages-1.img", "images/descriptors.json", "rootfs-diff.tar",
                                 "logs/dump.log", "images/sub/dir/x.img"])
def test_relpath_accepted(rel):
    assert check_relpath(rel) == rel


@pytest.mark.parametrize("rel", ["", "/etc/passwd", "../x", "images/../../x", "images/./x", "images//x",
                                 ".hidden", "images/.x", "manifest.json", "a/b/c/d/e/f", "images/x\ny", 7, None])
def test_relpath_refused(rel):
    with pytest.raises(CheckpointInvalid):
        check_relpath(rel)


def _import(store: Store, name: str, files: dict[str, bytes], declared: dict | None = None, **fields) -> dict:
    with importing(store, name) as imp:
        for rel, data in files.items():
            with imp.open(rel) as fd:
                os.write(fd, data)
            imp.record(rel, len(data), _sha(data))
        declared = declared if declared is not None else {r: {"size": len(d), "sha256": _sha(d)} for r, d in files.items()}
        return imp.commit({"created": "2026-01-01T00:00:00Z", "schema": 99, "name": "spoofed", **fields}, declared)


def test_import_commits_atomically_and_verifies(tmp_path):
    store = Store(str(tmp_path / "store"))
    store.ensure()
    files = {"images/pages-1.img": os.urandom(5000), "images/inventory.img": b"inv", "rootfs-diff.json": b"{}"}
    data = _import(store, "moved", files, source={"container_id": "c1"})
    ckpt = store.get("moved")
    ckpt.verify()  # the store's own verification agrees with the importer
    assert data["schema"] == 1 and data["name"] == "moved"  # the sender cannot choose these
    assert data["source"] == {"container_id": "c1"} and data["size_bytes"] == 5005
    assert ckpt.manifest["files"]["images/inventory.img"]["sha256"] == _sha(b"inv")
    assert is_private_dir(ckpt.path) and is_private_dir(ckpt.images)
    assert os.listdir(tmp_path / "store" / ".staging") == []


@pytest.mark.parametrize("change,match", [
    ({"images/a.img": {"size": 3, "sha256": "0" * 64}}, "sha256 mismatch in images/a.img"),
    ({"images/a.img": {"size": 4, "sha256": _sha(b"aaa")}}, "size mismatch"),
    ({"images/a.img": {"size": 3, "sha256": _sha(b"aaa")}, "images/b.img": {"size": 1, "sha256": "x"}},
     "never arrived"),
    ({}, "not in the sender's manifest"),
])
def test_import_mismatch_leaves_nothing(tmp_path, change, match):
    store = Store(str(tmp_path / "store"))
    store.ensure()
    with pytest.raises(CheckpointInvalid, match=match):
        _import(store, "bad", {"images/a.img": b"aaa"}, declared=change)
    assert not store.exists("bad")
    assert os.listdir(tmp_path / "store" / ".staging") == []


def test_import_refuses_existing_name_and_duplicates(tmp_path):
    store = Store(str(tmp_path / "store"))
    store.ensure()
    _import(store, "taken", {"images/a.img": b"1"})
    with pytest.raises(Conflict, match="already exists in the target store"):
        _import(store, "taken", {"images/a.img": b"1"})
    with pytest.raises(CheckpointInvalid, match="twice"), importing(store, "dup") as imp:
        for _ in range(2):
            with imp.open("images/a.img") as fd:
                os.write(fd, b"x")
            imp.record("images/a.img", 1, _sha(b"x"))
    assert not store.exists("dup") and os.listdir(tmp_path / "store" / ".staging") == []


# -- Receiver over the real protocol, no containers ---------------------------------------------

@pytest.fixture
def receiver_env(migrt_env, tmp_path):
    key = tmp_path / "migration.key"
    key.write_text(KEY)
    key.chmod(0o600)
    with open(migrt_env.config, "a") as fh:
        fh.write(f"migration_key_file: {key}\n")
    return migrt_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_once(cfg, **opts) -> tuple[str, dict]:
    address = f"127.0.0.1:{_free_port()}"
    reports: list[dict] = []
    recv = Receiver(cfg, ReceiveOptions(listen=address, once=True, **opts), reports.append)
    server = recv.bind()
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("result", recv.serve(server)), daemon=True)
    t.start()
    box["thread"], box["server"], box["reports"] = t, server, reports
    return address, box


def _finish(box) -> dict:
    box["thread"].join(20)
    box["server"].close()
    return box["result"]


def test_receiver_commits_what_a_sender_streams(receiver_env, tmp_path):
    cfg = config.load()
    address, box = _serve_once(cfg)
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True)
    blobs = {"images/pages-1.img": os.urandom(300_000), "images/core-1.img": b"core"}
    for rel, data in blobs.items():
        (src / rel).write_bytes(data)
    ch = connect(address, KEY.encode())
    ch.send({"type": "offer", "name": "from-a", "mode": "stop-and-copy", "container_id": "c1", "schema": 1})
    ready = ch.recv("ready")
    assert ready.pop("bulk")["protocol"] == "migrt-bulk/1"  # streams: tests/unit/test_transfer_bulk.py
    assert ready == {"type": "ready", "restore": False, "container_id": "c1", "pages": ["migrt-pages/1"]}
    files = {rel: ch.send_file(str(src / rel), rel) for rel in blobs}
    ch.send({"type": "commit", "manifest": {"created": "x", "source": {"container_id": "c1"}, "files": files}})
    assert ch.recv("committed")["name"] == "from-a"
    ch.send({"type": "bye"})
    ch.close()
    result = _finish(box)
    assert result["committed"] is True and result["error"] is None and result["bytes"] == 300_004
    ckpt = Store(cfg.store).get("from-a")
    ckpt.verify()
    assert ckpt.manifest["migration"]["from"].startswith("127.0.0.1:")
    assert ckpt.manifest["migration"]["source_container"] == "c1"


def test_receiver_refuses_before_the_source_freezes(receiver_env, tmp_path):
    """Offers that cannot succeed are answered with an error right away: lazy without --restore, a name
    already taken, a schema from the future."""
    cfg = config.load()
    Store(cfg.store).ensure()
    _import(Store(cfg.store), "taken", {"images/a.img": b"1"})
    for offer, match in (
        ({"name": "x1", "mode": "lazy", "schema": 1}, "needs a target that restores at once"),
        ({"name": "taken", "mode": "stop-and-copy", "schema": 1}, "already exists"),
        ({"name": "x2", "mode": "stop-and-copy", "schema": 2}, "upgrade migrt here"),
        ({"name": "../etc", "mode": "stop-and-copy", "schema": 1}, "invalid checkpoint name"),
        ({"name": "x3", "mode": "teleport", "schema": 1}, "unknown migration mode"),
    ):
        address, box = _serve_once(cfg)
        ch = connect(address, KEY.encode())
        ch.send({"type": "offer", "container_id": "c", **offer})
        with pytest.raises(TransferError, match=match):
            ch.recv("ready")
        ch.close()
        assert _finish(box)["error"]
    assert [c.name for c in Store(cfg.store).list()] == ["taken"]


def test_receiver_discards_on_corruption(receiver_env, tmp_path):
    cfg = config.load()
    address, box = _serve_once(cfg)
    blob = tmp_path / "blob"
    blob.write_bytes(b"z" * 4096)
    ch = connect(address, KEY.encode())
    ch.send({"type": "offer", "name": "corrupt", "mode": "stop-and-copy", "container_id": "c", "schema": 1})
    ch.recv("ready")
    meta = ch.send_file(str(blob), "images/pages-1.img")
    ch.send({"type": "commit", "manifest": {"files": {"images/pages-1.img": {**meta, "sha256": "0" * 64}}}})
    with pytest.raises(TransferError, match="sha256 mismatch in images/pages-1.img") as info:
        ch.recv("committed")
    assert info.value.exit_code == 4  # the receiver's CheckpointInvalid, carried across
    ch.close()
    _finish(box)
    assert Store(cfg.store).list() == []
    assert os.listdir(Path(cfg.store) / ".staging") == []


# -- preflights -------------------------------------------------------------------------------

def test_pre_dump_plan(monkeypatch):
    monkeypatch.setattr(lazy_mod, "soft_dirty", lambda: False)
    plan = migrate_mod.pre_dump_plan("auto")
    assert plan["available"] is False and plan["rounds"] == 0 and "CONFIG_MEM_SOFT_DIRTY" in plan["note"]
    assert migrate_mod.pre_dump_plan("0")["note"] == "off"
    assert migrate_mod.pre_dump_plan("3")["requested"] == 3
    for bad in ("-1", "x", "99"):
        with pytest.raises(UsageError):
            migrate_mod.pre_dump_plan(bad)
    monkeypatch.setattr(lazy_mod, "soft_dirty", lambda: True)
    assert migrate_mod.pre_dump_plan("auto")["available"] is True


def test_lazy_preflight_needs_criu_on_the_source_and_userfaultfd_on_the_target(monkeypatch):
    monkeypatch.setattr(lazy_mod, "criu_binary", lambda: None)
    with pytest.raises(PreconditionFailed, match="criu is not installed"):
        lazy_mod.lazy_preflight("source")
    monkeypatch.setattr(lazy_mod, "criu_binary", lambda: "/usr/sbin/criu")
    lazy_mod.lazy_preflight("source")  # no fs.pipe-max-size needed: CRIU's page server serves nothing
    monkeypatch.setattr(lazy_mod, "criu_feature", lambda f: False)
    with pytest.raises(PreconditionFailed, match="userfaultfd"):
        lazy_mod.lazy_preflight("target")


def test_config_key_file_must_be_absolute(migrt_env):
    with open(migrt_env.config, "a") as fh:
        fh.write("migration_key_file: relative/key\n")
    with pytest.raises(Exception, match="absolute path"):
        config.load()


def test_receive_json_is_one_line_per_migration(receiver_env):
    """`migrt receive --json` writes JSON lines; here just the shape of a report."""
    cfg = config.load()
    address, box = _serve_once(cfg)
    ch = connect(address, KEY.encode())
    ch.close()  # authenticated, then gone without asking anything: reported, but no migration (--once goes on)
    ch = connect(address, KEY.encode())
    ch.send({"type": "offer", "name": "x", "mode": "teleport", "container_id": "c", "schema": 1})
    with pytest.raises(TransferError, match="unknown migration mode"):
        ch.recv("ready")
    ch.close()
    result = _finish(box)
    assert result["mode"] == "teleport" and len(box["reports"]) == 2
    for report in box["reports"]:
        line = json.dumps(report, sort_keys=True, default=str)
        assert "\n" not in line and json.loads(line)["error"]


def test_lazy_dump_descriptors_are_checked_before_anything_is_frozen(monkeypatch):
    """A lazy dump holds two descriptors per page pipe (at most 3.2 MiB each): 32 GiB at 1 MiB pipes
    under a 20000 hard limit failed half-way on the GPU machine; the check says so first."""
    import resource

    monkeypatch.setattr(lazy_mod, "pipe_max_size", lambda: 1 << 20)
    monkeypatch.setattr(lazy_mod, "_has_cap", lambda bit: False)
    monkeypatch.setattr(lazy_mod, "unpiped_lazy_dump", lambda criu=None: False)  # a CRIU without migrt's patch
    monkeypatch.setattr(resource, "getrlimit", lambda what: (20000, 20000))
    assert lazy_mod.lazy_dump_fds(8 << 30) == 2 * 8192 + lazy_mod.FD_MARGIN
    assert lazy_mod.lazy_dump_problem(8 << 30) is None
    why = lazy_mod.lazy_dump_problem(32 << 30)
    assert "65536" in why.replace(" ", "") or "open files" in why
    assert "fs.pipe-max-size=4194304" in why and "20000" in why
    monkeypatch.setattr(lazy_mod, "pipe_max_size", lambda: 4 << 20)  # CRIU's pipes stop at 3.2 MiB
    assert lazy_mod.lazy_dump_problem(16 << 30) is None
    assert "fs.pipe-max-size" not in (lazy_mod.lazy_dump_problem(64 << 30) or "x")
    monkeypatch.setattr(lazy_mod, "_has_cap", lambda bit: True)
    assert lazy_mod.lazy_dump_problem(64 << 30) is None
    monkeypatch.setattr(lazy_mod, "_has_cap", lambda bit: False)
    monkeypatch.setattr(lazy_mod, "unpiped_lazy_dump", lambda criu=None: True)  # migrt's CRIU: no page pipes
    assert lazy_mod.lazy_dump_fds(64 << 30) == lazy_mod.FD_MARGIN and lazy_mod.lazy_dump_problem(64 << 30) is None


def test_migrts_criu_is_told_apart_by_its_switch(tmp_path, monkeypatch):
    """unpiped_lazy_dump(): the patched CRIU names MIGRT_CRIU_LAZY_NO_PIPES in its binary (anywhere, also
    across read boundaries); another does not; MIGRT_CRIU_LAZY_NO_PIPES=0 keeps CRIU's own way."""
    plain, patched = tmp_path / "plain", tmp_path / "patched"
    plain.write_bytes(os.urandom(3 << 20))
    patched.write_bytes(os.urandom((1 << 20) - 10) + b"MIGRT_CRIU_LAZY_NO_PIPES" + os.urandom(1000))
    monkeypatch.delenv("MIGRT_CRIU_LAZY_NO_PIPES", raising=False)
    assert lazy_mod.unpiped_lazy_dump(str(patched)) is True
    assert lazy_mod.unpiped_lazy_dump(str(plain)) is False
    assert lazy_mod.unpiped_lazy_dump(str(tmp_path / "absent")) is False
    monkeypatch.setenv("MIGRT_CRIU_LAZY_NO_PIPES", "0")
    assert lazy_mod.unpiped_lazy_dump(str(patched)) is False
