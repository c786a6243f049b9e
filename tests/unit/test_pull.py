"""Live migration into a new pod (migration/pull.py, agent.py, runtime/moved.py) without containers:
the migrate-from value, which containers ask, the agent's rules, the records that refuse a moved
container's restart, and migrt-runc's decisions for both (sh fast path and Python shim)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from migrt.config import Config
from migrt.errors import PreconditionFailed, UsageError
from migrt.migration.agent import Located, check_rules
from migrt.migration.pull import parse
from migrt.oci.bundle import Bundle
from migrt.runtime import moved
from tests.unit.support import write_bundle
from tests.unit.test_shim import CID, bundle_argv, last_log_line, sh_shim  # noqa: F401 - the fixture

SANDBOX = "5a" * 32


def _pod_annotations(name: str = "app", sandbox: str = SANDBOX, **extra) -> dict:
    return {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": name,
            "io.kubernetes.cri.sandbox-id": sandbox, "io.kubernetes.cri.sandbox-name": "web-0",
            "io.kubernetes.cri.sandbox-namespace": "team-a", **extra}


# -- the value --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, address, source", [
    ("10.0.0.5/team-a/web-0/app", "10.0.0.5:7070", {"namespace": "team-a", "pod": "web-0", "container": "app"}),
    ("node-a.example:7171/team-a/web-0", "node-a.example:7171", {"namespace": "team-a", "pod": "web-0",
                                                                 "container": "mine"}),
    ("[fd00::5]:7000/abc123", "[fd00::5]:7000", {"container_id": "abc123"}),
    ("[fd00::5]/abc123", "[fd00::5]:7070", {"container_id": "abc123"}),
])
def test_migrate_from_forms(value, address, source):
    assert parse(value, "mine") == (address, source)


@pytest.mark.parametrize("value", ["10.0.0.5", "10.0.0.5/", "/team-a/web-0/app", "10.0.0.5:99999/x", "h:p/x",
                                   "10.0.0.5/a/b/c/d", "10.0.0.5/team a/web/app", "10.0.0.5//web/app",
                                   "[fd00::5/x"])
def test_malformed_migrate_from_is_refused_with_the_forms(value):
    with pytest.raises(UsageError, match="expected <node address>"):
        parse(value, "app")


def test_namespace_and_pod_without_a_container_name_is_refused():
    with pytest.raises(UsageError, match="no name to look for in pod team-a/web-0"):
        parse("10.0.0.5/team-a/web-0", None)


# -- which containers ask -----------------------------------------------------------------------------

def test_env_asks_and_sandboxes_never_do(tmp_path):
    b = Bundle.load(str(write_bundle(tmp_path / "c", env=["MIGRT_MIGRATE_FROM=n/ns/p/other"],
                                     annotations=_pod_annotations())))
    assert (b.migrate_request().value, b.migrate_request().origin) == ("n/ns/p/other", "env")
    sandbox = Bundle.load(str(write_bundle(tmp_path / "s", annotations={
        **_pod_annotations(), "io.kubernetes.cri.container-type": "sandbox", "migrt.io/migrate-from": "n/ns/p"})))
    assert sandbox.migrate_request() is None
    assert Bundle.load(str(write_bundle(tmp_path / "n", annotations=_pod_annotations()))).migrate_request() is None


def test_the_pod_wide_annotation_naming_a_container_is_for_that_container_only(tmp_path):
    ann = {"migrt.io/migrate-from": "n/team-a/web-0/app"}
    app = Bundle.load(str(write_bundle(tmp_path / "a", annotations=_pod_annotations("app", **ann))))
    sidecar = Bundle.load(str(write_bundle(tmp_path / "b", annotations=_pod_annotations("sidecar", **ann))))
    assert app.migrate_request().origin == "annotation"
    assert sidecar.migrate_request() is None  # starts fresh
    whole_pod = {"migrt.io/migrate-from": "n/team-a/web-0"}
    assert Bundle.load(str(write_bundle(tmp_path / "c", annotations=_pod_annotations("sidecar", **whole_pod)))) \
        .migrate_request().value == "n/team-a/web-0"


# -- the agent's rules ---------------------------------------------------------------------------------

def _located(tmp_path: Path, **ann) -> Located:
    bundle = write_bundle(tmp_path / "src", annotations=_pod_annotations(**ann))
    return Located(str(tmp_path), "c" * 64, Bundle.load(str(bundle)))


def test_a_source_without_opt_in_is_refused_unless_the_node_allows_any(tmp_path):
    src = _located(tmp_path)
    with pytest.raises(PreconditionFailed, match=r"has not opted in .* migrt.io/migratable=true .* node 10.0.0.5.*"
                                                 r"it was not touched"):
        check_rules(Config(path="x"), src, {"namespace": "team-a"}, "10.0.0.5")
    check_rules(Config(path="x", migrate_any_container=True), src, {"namespace": "team-a"}, "10.0.0.5")
    check_rules(Config(path="x"), _located(tmp_path, **{"migrt.io/migratable": "true"}), {"namespace": "team-a"}, "n")


def test_another_namespace_is_refused_unless_both_nodes_allow_it(tmp_path):
    src = _located(tmp_path, **{"migrt.io/migratable": "true"})
    with pytest.raises(PreconditionFailed, match="namespace 'team-a' and may only move into a pod of that namespace"):
        check_rules(Config(path="x"), src, {"namespace": "team-b"}, "n")
    check_rules(Config(path="x", allow_cross_namespace_restore=True), src, {"namespace": "team-b"}, "n")


# -- the records of containers moved away --------------------------------------------------------------

def test_record_refuses_its_container_only_and_goes_with_its_pod(tmp_path):
    root = tmp_path / "root"
    (root / SANDBOX).mkdir(parents=True)
    (root / SANDBOX / "state.json").write_text("{}")
    rec = moved.record(_pod_annotations(), to="10.0.0.6", target_container_id="t" * 64)
    moved.leave(str(root), rec)
    assert moved.find(str(root), _pod_annotations())["to"] == "10.0.0.6"
    assert moved.find(str(root), _pod_annotations("sidecar")) is None
    assert moved.find(str(root), _pod_annotations(sandbox="6b" * 32)) is None  # a new pod of the same name
    text = moved.refusal(moved.find(str(root), _pod_annotations()))
    assert text.startswith("container app of pod team-a/web-0 was migrated to node 10.0.0.6 (container ttt")
    assert "Delete this pod" in text
    assert moved.sweep(str(root)) == []  # its pod is still there
    (name,) = moved.present(str(root))
    os.unlink(root / SANDBOX / "state.json")
    assert moved.sweep(str(root)) == [name]
    assert moved.present(str(root)) == [] and moved.find(str(root), _pod_annotations()) is None


def test_no_record_for_a_container_of_no_pod(tmp_path):
    assert moved.record({}, to="x") is None
    assert moved.record(_pod_annotations(sandbox="../etc"), to="x") is None
    moved.leave(str(tmp_path), None)
    assert os.listdir(tmp_path) == []


# -- migrt-runc ------------------------------------------------------------------------------------------

def test_sh_hands_a_pull_to_python_which_fails_fast_on_an_agent_that_is_not_there(sh_shim, tmp_path):  # noqa: F811
    key = tmp_path / "key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    with open(sh_shim.env.config, "a") as fh:
        fh.write(f"migration_key_file: {key}\n")
    bundle = write_bundle(tmp_path / "bundle", annotations=_pod_annotations(**{"migrt.io/migrate-from":
                                                                              "127.0.0.1:1/team-a/web-0/app"}))
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    t0 = time.monotonic()
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (9, b"", b"")  # TransferError
    assert time.monotonic() - t0 < 10
    assert sh_shim.py_calls() == [" ".join(argv)]
    assert sh_shim.env.fake.calls() == []  # never a fresh start beside the source
    msg = last_log_line(bundle / "log.json")["msg"]
    assert msg.startswith("migrt: pull of container app of pod team-a/web-0 from 127.0.0.1:1 failed: connecting to "
                          "127.0.0.1:1: Connection refused; nothing was touched there"), msg


def test_sh_sends_creates_to_python_while_a_record_is_there(sh_shim, tmp_path):  # noqa: F811
    root = tmp_path / "root"
    (root / SANDBOX).mkdir(parents=True)
    (root / SANDBOX / "state.json").write_text("{}")
    moved.leave(str(root), moved.record(_pod_annotations(), to="10.0.0.6"))
    again = write_bundle(tmp_path / "again", annotations=_pod_annotations())
    argv, _ = bundle_argv(tmp_path, again, "--bundle")
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (6, b"", b"")
    assert sh_shim.env.fake.calls() == []
    assert "container app of pod team-a/web-0 was migrated to node 10.0.0.6" in last_log_line(again / "log.json")["msg"]
    # another container (of this pod or any other) is created as usual, through Python while records exist
    other = write_bundle(tmp_path / "other", annotations=_pod_annotations("sidecar"))
    argv, _ = bundle_argv(tmp_path, other, "--bundle")
    assert sh_shim.run(argv).returncode == 0
    assert len(sh_shim.py_calls()) == 2 and len(sh_shim.env.fake.calls()) == 1
    # the pod is deleted: the next create sweeps its record, and creates no longer need Python
    os.unlink(root / SANDBOX / "state.json")
    assert sh_shim.run(argv).returncode == 0
    assert moved.present(str(root)) == []
    assert sh_shim.run(argv).returncode == 0
    assert len(sh_shim.py_calls()) == 3 and len(sh_shim.env.fake.calls()) == 3


def test_record_is_json_with_where_it_went(tmp_path):
    moved.leave(str(tmp_path), moved.record(_pod_annotations(), to="10.0.0.6", target_pod="team-a/web-0"))
    (name,) = moved.present(str(tmp_path))
    data = json.loads((tmp_path / name).read_text())
    assert data["container"] == "app" and data["pod"] == "team-a/web-0" and data["sandbox_id"] == SANDBOX
    assert data["to"] == "10.0.0.6" and data["at"].endswith("Z")
