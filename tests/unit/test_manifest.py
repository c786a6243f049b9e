"""The typed manifest (store/manifest.py): a manifest written by today's commit and a hand-made older one
read into the same fields, written back byte for byte, a field of the wrong type read as absent, a
schema from the future refused."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from migrt.errors import CheckpointInvalid
from migrt.pods.export_cri import config_dump, spec_dump
from migrt.store import Store
from migrt.store import manifest as mf

FIELDS = {  # what ops/checkpoint.py's _fields gives a commit
    "created": "2026-11-27T18:00:00Z",
    "source": {"container_id": "c1", "runtime_root": "/run/runc", "bundle": "/b", "pid": 42, "status": "running",
               "cri": {"pod_namespace": "team", "pod_name": "p", "container_name": "app", "sandbox_id": "s"},
               "annotations": {"io.kubernetes.cri.container-name": "app"}},
    "versions": {"migrt": "0.9", "criu": "4.2", "runc": "1.3.0"},
    "options": {"tcp_established": True, "shell_job": False, "leave_running": False},
    "mounts": [{"destination": "/data", "type": "bind", "source": "/srv/data"}],
    "rootfs": {"captured": True, "files": 3},
    "timings": {"dump_s": 0.5},
    "estimate": {"memory": 1},
    "op_id": "j-1",
    "root_mode": 0o40755,
    "dump_pages": {"mode": "criu"},
    "gpu": {"schema": 1, "driver_version": "580"},
    "a_field_from_a_newer_migrt": {"kept": [1, 2]},
}


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "store"))
    s.ensure()
    return s


def _commit(store: Store, name: str, fields: dict) -> dict:
    with store.writer(name) as w:
        with open(os.path.join(w.images, "inventory.img"), "wb") as fh:
            fh.write(b"inv")
        return w.commit(fields)


def test_a_manifest_of_todays_commit_reads_typed_and_writes_back_the_same_bytes(store):
    data = _commit(store, "ck", FIELDS)
    path = os.path.join(store.root, "ck", mf.MANIFEST)
    with open(path, "rb") as fh:
        before = fh.read()
    m = store.get("ck").manifest
    assert (m.schema, m.name, m.created, m.size_bytes) == (mf.SCHEMA, "ck", "2026-11-27T18:00:00Z", 3)
    assert (m.source.container_id, m.source.runtime_root, m.source.pid, m.source.status) == ("c1", "/run/runc", 42,
                                                                                           "running")
    assert (m.source.cri.pod_namespace, m.source.cri.container_name, m.source.cri.sandbox_id) == ("team", "app", "s")
    assert m.mounts == [mf.Mount("/data", "bind", "/srv/data")]
    assert m.captured and m.root_mode == 0o40755 and m.op_id == "j-1" and m.gpu == FIELDS["gpu"]
    assert m.options["tcp_established"] is True and m.versions["criu"] == "4.2"
    assert "checksum_s" in m.timings and m.files["images/inventory.img"]["size"] == 3
    assert m.raw == data and m["a_field_from_a_newer_migrt"] == {"kept": [1, 2]}  # unknown fields are kept
    mf.write(os.path.join(store.root, "ck"), m)
    with open(path, "rb") as fh:
        assert fh.read() == before


def test_a_hand_made_older_manifest_reads_with_its_fields_absent(store, tmp_path):
    """An early schema-1 manifest: no source, options, mounts, rootfs or timings; files by sha256."""
    ckpt = tmp_path / "store" / "old"
    (ckpt / "images").mkdir(parents=True)
    (ckpt / "images" / "inventory.img").write_bytes(b"inv")
    old = {"schema": 1, "name": "old", "created": "2024-01-01T00:00:00Z",
           "files": {"images/inventory.img": {"size": 3, "sha256": hashlib.sha256(b"inv").hexdigest()}}}
    text = json.dumps(old).encode()
    (ckpt / mf.MANIFEST).write_bytes(text)
    m = store.get("old").manifest
    assert m.source == mf.Source() and m.source.cri.pod_namespace is None
    assert (m.mounts, m.options, m.timings, m.size_bytes, m.gpu, m.pulled) == ([], {}, {}, None, None, None)
    assert not m.captured and not m.from_registry
    assert config_dump(m)["id"] == "old" and spec_dump(m)["mounts"] == []
    store.get("old").verify()
    mf.write(str(ckpt), m)
    assert json.loads((ckpt / mf.MANIFEST).read_bytes()) == old


def test_fields_of_the_wrong_type_read_as_absent(store, tmp_path):
    ckpt = tmp_path / "store" / "odd"
    (ckpt / "images").mkdir(parents=True)
    (ckpt / mf.MANIFEST).write_text(json.dumps({
        "schema": 1, "name": "odd", "created": 7, "files": {}, "size_bytes": True,
        "source": {"container_id": 5, "pid": "42", "cri": ["team"]}, "mounts": [{"destination": "/x"}, "junk"],
        "options": [], "rootfs": "yes", "gpu": {}, "root_mode": False, "pulled": {"reference": "r"}}))
    m = store.get("odd").manifest
    assert (m.created, m.size_bytes, m.source.container_id, m.source.pid) == (None, None, None, None)
    assert m.source.cri == mf.Cri() and m.mounts == [mf.Mount("/x", None, None)]
    assert (m.options, m.rootfs, m.gpu, m.root_mode) == ({}, {}, None, None)
    assert m.from_registry and m.pulled == {"reference": "r"}


def test_a_schema_from_the_future_is_refused(store, tmp_path):
    ckpt = tmp_path / "store" / "new"
    ckpt.mkdir(parents=True)
    (ckpt / mf.MANIFEST).write_text(json.dumps({"schema": mf.SCHEMA + 1, "name": "new", "files": {}}))
    with pytest.raises(CheckpointInvalid, match="newer than this migrt understands"):
        _ = store.get("new").manifest


def test_assemble_puts_the_stores_fields_last_over_the_writers():
    data = mf.assemble({"created": "t", "name": "evil", "schema": 9, "size_bytes": 1},
                       "ck", {"a": {"size": 2}, "b": {"size": 3}})
    assert list(data) == ["created", "schema", "name", "files", "size_bytes"]
    assert (data["name"], data["schema"], data["size_bytes"]) == ("ck", mf.SCHEMA, 5)
