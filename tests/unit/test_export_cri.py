"""`migrt export` (migrt.pods.export_cri): the archive layout, deterministic bytes, a corrupted
checkpoint refused, and the archive read back by the Kubernetes-archive importer."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest

from migrt.config import Config
from migrt.errors import CheckpointInvalid
from migrt.pods import rootfs
from migrt.pods.export_cri import export
from migrt.store import Store

GPU = {"schema": 1, "gpus": ["GPU-0"]}


def _checkpoint(store: Store, name: str = "ck", *, gpu: bool = False) -> object:
    with store.writer(name) as w:
        for f, data in (("inventory.img", b"inv"), ("pages-1.img", os.urandom(70 << 10)), ("stats-dump", b"st")):
            with open(os.path.join(w.images, f), "wb") as fh:
                fh.write(data)
        with tarfile.open(os.path.join(w.path, rootfs.DIFF_TAR), "w") as tar:
            ti = tarfile.TarInfo("etc/new.conf")
            ti.size = 3
            tar.addfile(ti, io.BytesIO(b"abc"))
        with open(os.path.join(w.path, rootfs.DIFF_META), "w") as fh:
            json.dump({"deleted": ["etc/old.conf"], "opaque": ["var/cache"]}, fh)
        fields = {"created": "2026-11-24T06:00:00Z",
                  "source": {"container_id": "abc123", "cri": {"pod_name": "p", "pod_namespace": "team",
                                                               "container_name": "app"}, "annotations": {}},
                  "options": {"shell_job": False}, "rootfs": {"captured": True},
                  "mounts": [{"destination": "/data", "type": "bind", "source": "/srv/data"}]}
        if gpu:
            fields["gpu"] = GPU
        w.commit(fields)
    return store.get(name)


def _members(path: str) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: (tar.extractfile(m).read() if m.isreg() else b"") for m in tar}


def test_layout_and_determinism(tmp_path):
    store = Store(str(tmp_path / "store"))
    ckpt = _checkpoint(store, gpu=True)
    a, b = str(tmp_path / "a.tar"), str(tmp_path / "b.tar")
    info = export(ckpt, a)
    export(ckpt, b)
    assert open(a, "rb").read() == open(b, "rb").read()  # same checkpoint, same bytes
    assert info["sha256"] == "sha256:" + hashlib.sha256(open(a, "rb").read()).hexdigest()
    m = _members(a)
    assert {"checkpoint/inventory.img", "checkpoint/pages-1.img", "config.dump", "spec.dump", "rootfs-diff.tar",
            "deleted.files", "stats-dump", "migrt-manifest.json", "checkpoint/migrt-gpu.json"} <= set(m)
    assert json.loads(m["checkpoint/migrt-gpu.json"]) == GPU
    assert json.loads(m["deleted.files"]) == ["/etc/old.conf"]
    spec = json.loads(m["spec.dump"])
    assert spec["annotations"]["io.kubernetes.pod.namespace"] == "team"
    assert spec["mounts"][0]["destination"] == "/data"
    assert json.loads(m["config.dump"])["id"] == "abc123"
    with tarfile.open(fileobj=io.BytesIO(m["rootfs-diff.tar"])) as diff:
        assert {"etc/new.conf", "var/cache/.wh..wh..opq"} <= set(diff.getnames())


def test_progress_reports_every_byte_written(tmp_path):
    store = Store(str(tmp_path / "store"))
    ckpt = _checkpoint(store)
    events = []
    info = export(ckpt, str(tmp_path / "a.tar"), progress=lambda event, **f: events.append((event, f)))
    assert events[0] == ("phase", {"name": "export", "total_bytes": ckpt.manifest["size_bytes"]})
    assert events[-1][0] == "done" and events[-1][1]["name"] == "export"
    written = [f["bytes"] for e, f in events if e == "bytes"]
    assert sum(written) == info["size"] == os.path.getsize(tmp_path / "a.tar")
    assert len(written) < 10  # coalesced, not one event per 512-byte tar header
    assert os.stat(tmp_path / "a.tar").st_mode & 0o777 == 0o600  # it holds the processes' memory
    assert sorted(os.listdir(tmp_path)) == ["a.tar", "store"]  # no temporary file left


def test_corrupted_checkpoint_not_exported(tmp_path):
    store = Store(str(tmp_path / "store"))
    ckpt = _checkpoint(store)
    with open(os.path.join(ckpt.path, "images", "pages-1.img"), "r+b") as fh:
        fh.write(b"X")
    out = tmp_path / "x.tar"
    with pytest.raises(CheckpointInvalid, match="sha256 mismatch in images/pages-1.img"):
        export(ckpt, str(out))
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith("x.tar")]


def test_import_reads_the_export(tmp_path):
    from migrt.pods.import_cri import import_archive

    store = Store(str(tmp_path / "store"))
    ckpt = _checkpoint(store, gpu=True)
    tar = str(tmp_path / "ck.tar")
    export(ckpt, tar)
    cfg = Config(path="-", store=store.root)
    data = import_archive(cfg, tar, name="back")
    src = ckpt.manifest["files"]
    assert data["files"]["images/pages-1.img"] == src["images/pages-1.img"]
    assert data["gpu"] == GPU
    assert data["source"]["cri"]["pod_namespace"] == "team"
    assert data["rootfs"]["captured"] and data["rootfs"]["deleted"] == 1 and data["rootfs"]["opaque"] == 1


def test_push_cri_reports_the_archive_bytes_in_its_archive_phase(tmp_path, monkeypatch):
    # migrt push --format cri builds the archive with export(): its bytes land in push's "archive" phase
    from migrt.registry import push as push_mod

    store = Store(str(tmp_path / "store"))
    ckpt = _checkpoint(store)
    events = []

    class _Stop(Exception):
        pass

    def no_upload(*_a, **_k):
        raise _Stop

    monkeypatch.setattr(push_mod, "_upload", no_upload)
    with pytest.raises(_Stop):
        push_mod._push_archive(Config(path="", store=str(tmp_path / "store")), None, store, ckpt, None,
                               lambda e, **f: events.append((e, f)))
    names = [(e, f.get("name")) for e, f in events if e != "bytes"]
    assert names == [("phase", "archive"), ("done", "archive")]            # export's own phase is not shown
    assert sum(f["bytes"] for e, f in events if e == "bytes" and f["name"] == "archive") > 70 << 10
