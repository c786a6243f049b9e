"""ops/pod_checkpoint.py: the pod checkpoint's layout read back (parts), and which part a create restores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from migrt.errors import CheckpointInvalid, PreconditionFailed, UsageError
from migrt.oci.bundle import Bundle
from migrt.ops.pod_checkpoint import parse_pod
from migrt.ops.pod_restore import for_container, is_pod, part, parts_of
from migrt.store import Store

PARTS = [{"name": "native", "image": "reg/n:1", "kind": "container", "container_id": "c1"},
         {"name": "app", "image": "reg/app:1", "kind": "container", "container_id": "c2"}]


def _write(path: Path, data: dict) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    (path / "manifest.json").write_text(json.dumps(data))


def _pod_checkpoint(tmp_path: Path, name: str = "trio-1") -> Store:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    ck = root / name
    _write(ck, {"schema": 1, "name": name, "created": "2026-11-27T20:00:00Z", "files": {},
                "source": {"cri": {"pod_namespace": "team-a", "pod_name": "trio"}},
                "pod": {"namespace": "team-a", "name": "trio", "parts": PARTS}})
    for p in PARTS:
        _write(ck / "parts" / p["name"], {"schema": 1, "name": p["name"], "created": "2026-11-27T20:00:00Z",
                                          "files": {}, "source": {"container_id": p["container_id"]}})
    return Store(str(root))


def _bundle(name: str, image: str = "") -> Bundle:
    ann = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": name}
    if image:
        ann["io.kubernetes.cri.image-name"] = image
    return Bundle("/nonexistent", {"annotations": ann})


def test_a_part_reads_as_a_checkpoint_of_its_own(tmp_path):
    ckpt = _pod_checkpoint(tmp_path).get("trio-1")
    assert is_pod(ckpt.manifest) and [p["name"] for p in parts_of(ckpt.manifest)] == ["native", "app"]
    app = part(ckpt, "app")
    assert app.name == "trio-1" and app.path == os.path.join(ckpt.path, "parts", "app")
    assert app.images == os.path.join(app.path, "images") and app.manifest.source.container_id == "c2"


def test_a_create_gets_its_namesake_part_with_the_same_image(tmp_path):
    ckpt = _pod_checkpoint(tmp_path).get("trio-1")
    assert for_container(ckpt, _bundle("app", "reg/app:1")).path.endswith("/parts/app")
    assert for_container(ckpt, _bundle("app")).path.endswith("/parts/app")  # no image said: not compared


def test_another_name_or_image_is_refused_naming_what_the_checkpoint_has(tmp_path):
    ckpt = _pod_checkpoint(tmp_path).get("trio-1")
    with pytest.raises(PreconditionFailed, match=r"pod checkpoint trio-1 has no container 'other' \(it has native, "
                                                 r"app\)"):
        for_container(ckpt, _bundle("other"))
    with pytest.raises(PreconditionFailed, match=r"pod checkpoint trio-1, container app: image 'reg/app:2', the "
                                                 r"checkpoint's is 'reg/app:1'; .* nothing was restored"):
        for_container(ckpt, _bundle("app", "reg/app:2"))
    with pytest.raises(PreconditionFailed, match="this container has no CRI container name"):
        for_container(ckpt, Bundle("/nonexistent", {}))


def test_a_tampered_part_names_the_pod_checkpoint_and_the_part(tmp_path):
    store = _pod_checkpoint(tmp_path)
    path = Path(store.root) / "trio-1" / "parts" / "app" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "name": "native"}))
    with pytest.raises(CheckpointInvalid, match="pod checkpoint trio-1, part app: checkpoint app: manifest names"):
        part(store.get("trio-1"), "app")


def test_an_ordinary_checkpoint_restores_as_itself(tmp_path):
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    _write(root / "one", {"schema": 1, "name": "one", "created": "2026-11-27T20:00:00Z", "files": {}})
    ckpt = Store(str(root)).get("one")
    assert not is_pod(ckpt.manifest) and for_container(ckpt, _bundle("app")) is ckpt


@pytest.mark.parametrize("value", ["team-a", "/web", "team-a/", "a/b/c", "team a/web", "../x/y"])
def test_pod_must_be_namespace_slash_name(value):
    with pytest.raises(UsageError, match="give the pod as <namespace>/<name>"):
        parse_pod(value)
    assert parse_pod("team-a/web-0.x") == ("team-a", "web-0.x")


@pytest.mark.parametrize("args, says", [
    ([], "give a CONTAINER_ID or --pod NS/POD (one of them)"),
    (["abc", "--pod", "a/b"], "give a CONTAINER_ID or --pod NS/POD (one of them)"),
    (["--pod", "bad"], "give the pod as <namespace>/<name>"),
    (["--pod", "a/b", "--root", "/x"], "--pod takes no --root, --ext-unix-sk or --file-locks"),
])
def test_checkpoint_takes_a_container_or_a_pod(migrt_env, args, says):
    from click.testing import CliRunner

    from migrt.cli.main import cli

    res = CliRunner().invoke(cli, ["checkpoint", *args, "--json"])
    assert res.exit_code == 2 and says in json.loads(res.stdout)["error"], res.output


def _listed_bundle(name: str, listed: str | None, env: list[str] | None = None) -> Bundle:
    ann = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": name,
           "migrt.io/restore": "trio-1"}
    if listed is not None:
        ann["migrt.io/migrate-pod"] = listed
    return Bundle("/nonexistent", {"annotations": ann, "process": {"env": env or []}})


def test_a_container_the_pods_list_leaves_out_starts_fresh():
    assert _listed_bundle("app", "native=a,app=b").restore_request().name == "trio-1"
    assert _listed_bundle("setup", "native=a,app=b").restore_request() is None  # an init container: fresh
    assert _listed_bundle("setup", None).restore_request().name == "trio-1"      # no list: every container
    assert _listed_bundle("setup", "app=b", ["MIGRT_RESTORE=x"]).restore_request().name == "x"  # its own env


def test_the_whole_new_pod_is_checked_at_each_create(tmp_path):
    from migrt.ops.pod_restore import _whole_pod

    ckpt = _pod_checkpoint(tmp_path).get("trio-1")
    _whole_pod(ckpt, _listed_bundle("native", "native=reg/n:1,app="))  # no image given: the name alone
    _whole_pod(ckpt, _listed_bundle("native", None))
    with pytest.raises(PreconditionFailed, match=r"does not match the new pod \(migrt.io/migrate-pod\): container "
                                                 r"extra: the checkpoint has no container of that name .*; container "
                                                 r"app: the new pod has no container of that name; nothing"):
        _whole_pod(ckpt, _listed_bundle("native", "native=reg/n:1,extra=x"))
    with pytest.raises(UsageError, match="expected <container>=<image>"):
        _whole_pod(ckpt, _listed_bundle("native", "Not A Name"))
