"""Bundle: the read-only view of config.json that decides whether a create is a restore."""

from __future__ import annotations

import json
import os

import pytest

from migrt.errors import MigrtError
from migrt.oci.bundle import CONTAINER_TYPE, Bundle, BundleError, RestoreRequest
from tests.unit.support import write_bundle


def _bundle(tmp_path, env=None, annotations=None) -> Bundle:
    return Bundle.load(str(write_bundle(tmp_path / "b", env=env, annotations=annotations)))


def test_no_request(tmp_path):
    assert _bundle(tmp_path).restore_request() is None
    assert _bundle(tmp_path, env=["OTHER=1"], annotations={"x": "y"}).restore_request() is None


def test_request_from_env(tmp_path):
    req = _bundle(tmp_path, env=["MIGRT_RESTORE=train-7"]).restore_request()
    assert req == RestoreRequest(name="train-7", fallback=None, source="env")


def test_request_from_annotation(tmp_path):
    req = _bundle(tmp_path, annotations={"migrt.io/restore": "train-7"}).restore_request()
    assert req == RestoreRequest(name="train-7", fallback=None, source="annotation")


def test_env_wins_over_annotation(tmp_path):
    req = _bundle(tmp_path, env=["MIGRT_RESTORE=from-env"], annotations={"migrt.io/restore": "from-ann"}).restore_request()
    assert (req.name, req.source) == ("from-env", "env")


def test_empty_env_value_falls_back_to_annotation(tmp_path):
    req = _bundle(tmp_path, env=["MIGRT_RESTORE="], annotations={"migrt.io/restore": "from-ann"}).restore_request()
    assert (req.name, req.source) == ("from-ann", "annotation")
    assert _bundle(tmp_path, env=["MIGRT_RESTORE="]).restore_request() is None


def test_env_value_keeps_equals_signs(tmp_path):
    b = _bundle(tmp_path, env=["MIGRT_RESTORE=a=b", "EMPTY=", "NOEQ"])
    assert b.env["MIGRT_RESTORE"] == "a=b"
    assert b.env["EMPTY"] == "" and b.env["NOEQ"] == ""
    assert b.restore_request().name == "a=b"  # validated later, by the restore


@pytest.mark.parametrize("ctype", ["sandbox", "podsandbox", ""])
def test_non_application_container_is_never_restored(tmp_path, ctype):
    b = _bundle(tmp_path, env=["MIGRT_RESTORE=x"], annotations={CONTAINER_TYPE: ctype, "migrt.io/restore": "y"})
    assert not b.is_application_container
    assert b.restore_request() is None


def test_container_type_container_is_restored(tmp_path):
    b = _bundle(tmp_path, env=["MIGRT_RESTORE=x"], annotations={CONTAINER_TYPE: "container"})
    assert b.is_application_container
    assert b.container_type == "container"
    assert b.restore_request().name == "x"


def test_fallback_from_env_and_annotation(tmp_path):
    b = _bundle(tmp_path, env=["MIGRT_RESTORE=x", "MIGRT_RESTORE_FALLBACK=fresh"],
                annotations={"migrt.io/restore-fallback": "fail"})
    assert b.restore_request().fallback == "fresh"
    b = _bundle(tmp_path, env=["MIGRT_RESTORE=x"], annotations={"migrt.io/restore-fallback": "fail"})
    assert b.restore_request().fallback == "fail"
    b = _bundle(tmp_path, annotations={"migrt.io/restore": "x", "migrt.io/restore-fallback": "fresh"})
    assert b.restore_request() == RestoreRequest(name="x", fallback="fresh", source="annotation")


def test_fallback_alone_is_not_a_request(tmp_path):
    assert _bundle(tmp_path, env=["MIGRT_RESTORE_FALLBACK=fresh"]).restore_request() is None


def test_cri_metadata(tmp_path):
    ann = {
        CONTAINER_TYPE: "container",
        "io.kubernetes.cri.sandbox-namespace": "default",
        "io.kubernetes.cri.sandbox-name": "trainer-0",
        "io.kubernetes.cri.sandbox-uid": "uid-1",
        "io.kubernetes.cri.container-name": "main",
        "io.kubernetes.cri.image-name": "docker.io/library/busybox:latest",
        "io.kubernetes.cri.sandbox-id": "sb123",
        "unrelated": "x",
    }
    assert _bundle(tmp_path, annotations=ann).cri_metadata() == {
        "pod_namespace": "default", "pod_name": "trainer-0", "pod_uid": "uid-1", "container_name": "main",
        "image_name": "docker.io/library/busybox:latest", "sandbox_id": "sb123",
    }
    assert _bundle(tmp_path, annotations={"io.kubernetes.cri.sandbox-name": "p"}).cri_metadata() == {"pod_name": "p"}
    assert _bundle(tmp_path).cri_metadata() == {}


def test_non_string_annotations_are_ignored(tmp_path):
    path = tmp_path / "b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"annotations": {"migrt.io/restore": 7, "a": "b"}}))
    b = Bundle.load(str(path))
    assert b.annotations == {"a": "b"}
    assert b.restore_request() is None


@pytest.mark.parametrize("config", [
    {"annotations": ["migrt.io/restore"], "process": {"env": ["MIGRT_RESTORE=x"]}},
    {"process": ["MIGRT_RESTORE=x"]},
    {"process": {"env": "MIGRT_RESTORE=x"}},
    {"process": None, "annotations": None},
])
def test_malformed_sections_do_not_crash(tmp_path, config):
    # The shim reads these before deciding; a crash there would print a traceback into the container's
    # stderr. runc itself reports the malformed config.
    path = tmp_path / "b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    b = Bundle.load(str(path))
    req = b.restore_request()
    if isinstance(config.get("process"), dict) and isinstance(config["process"].get("env"), list):
        assert req is not None and req.name == "x"
    else:
        assert req is None


def test_bad_json_is_a_bundle_error(tmp_path):
    path = tmp_path / "b"
    path.mkdir()
    (path / "config.json").write_text('{"process": ')
    with pytest.raises(BundleError, match="cannot read config.json") as info:
        Bundle.load(str(path))
    assert isinstance(info.value, MigrtError)
    assert info.value.exit_code == 2


def test_non_object_json_is_a_bundle_error(tmp_path):
    path = tmp_path / "b"
    path.mkdir()
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(BundleError, match="not a JSON object"):
        Bundle.load(str(path))


def test_missing_config_is_a_bundle_error(tmp_path):
    with pytest.raises(BundleError, match="config.json not found"):
        Bundle.load(str(tmp_path))


def test_unreadable_config_is_a_bundle_error(tmp_path):
    (tmp_path / "config.json").mkdir()  # a directory: open() fails with IsADirectoryError
    with pytest.raises(BundleError, match="cannot read"):
        Bundle.load(str(tmp_path))


def test_views(tmp_path):
    path = tmp_path / "b"
    path.mkdir()
    cfg = {
        "process": {"terminal": True, "env": []},
        "root": {"path": "rootfs"},
        "mounts": [{"destination": "/proc", "type": "proc"}, "junk"],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/proc/1/ns/net"}, 3]},
    }
    (path / "config.json").write_text(json.dumps(cfg))
    b = Bundle.load(str(path))
    assert b.terminal is True
    assert b.rootfs == os.path.join(str(path), "rootfs")
    assert b.mounts == [{"destination": "/proc", "type": "proc"}]
    assert b.namespaces == [{"type": "pid"}, {"type": "network", "path": "/proc/1/ns/net"}]
    cfg["root"]["path"] = "/abs/rootfs"
    cfg["process"]["terminal"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    b = Bundle.load(str(path))
    assert b.rootfs == "/abs/rootfs"
    assert b.terminal is False


def test_load_never_writes_config(tmp_path):
    path = write_bundle(tmp_path / "b", env=["MIGRT_RESTORE=x"])
    before = (path / "config.json").read_bytes()
    mtime = os.stat(path / "config.json").st_mtime_ns
    b = Bundle.load(str(path))
    b.restore_request()
    b.cri_metadata()
    assert (path / "config.json").read_bytes() == before
    assert os.stat(path / "config.json").st_mtime_ns == mtime


def test_of_state_follows_runc_bundle_label(tmp_path):
    bundle = write_bundle(tmp_path / "b", annotations={CONTAINER_TYPE: "container"})
    state = {"config": {"labels": ["other=1", f"bundle={bundle}"]}}
    got = Bundle.of_state(state)
    assert got is not None and got.path == str(bundle) and got.annotations[CONTAINER_TYPE] == "container"
    assert Bundle.of_state(None) is None
    assert Bundle.of_state({"config": {"labels": ["other=1"]}}) is None
    assert Bundle.of_state({"config": {"labels": [f"bundle={tmp_path / 'gone'}"]}}) is None  # unreadable: None
