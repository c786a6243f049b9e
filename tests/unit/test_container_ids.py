"""Container ids are checked before they become paths (migrt.names.container_id, runc's own rule):
`migrt gpu resume ../fakeid` once read `<root>/../fakeid/...` and died with a KeyError traceback."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from migrt import names
from migrt.cli.main import cli
from migrt.errors import InvalidName, MigrtError
from migrt.ops import gpu_preempt
from migrt.runtime import markers, runc


@pytest.mark.parametrize("cid", ["abc", "0123abcdef", "my-ctr_1.2", "a+b,c", "...", "x" * 255])
def test_runc_ids_are_accepted(cid):
    assert names.container_id(cid) == cid and names.is_container_id(cid)


@pytest.mark.parametrize("cid", ["", ".", "..", "../fakeid", "a/b", "/abs", "x\n", "é", "a\x1b[2J", "a b",
                                 "x" * 256, None, 7])
def test_anything_else_is_refused_with_a_clear_escaped_message(cid):
    assert not names.is_container_id(cid)
    with pytest.raises(InvalidName) as info:
        names.container_id(cid)
    msg = str(info.value)
    assert msg.startswith("invalid container id ") and "runc list" in msg and msg.isprintable()
    assert info.value.exit_code == 2


@pytest.fixture
def outside(tmp_path):
    """A runc root, and beside it a directory that looks like a container with a crafted record."""
    root = tmp_path / "root"
    root.mkdir()
    fake = tmp_path / "fakeid"
    fake.mkdir()
    (fake / "state.json").write_text(json.dumps({"init_process_pid": 1}))
    (fake / gpu_preempt.RECORD).write_text(json.dumps({"status": "suspended"}))
    return root


@pytest.mark.parametrize("args", [
    ["gpu", "resume", "../fakeid"], ["gpu", "suspend", "../fakeid"], ["gpu", "status", "../fakeid"],
    ["checkpoint", "../fakeid"], ["restore", "c1", "../fakeid", "--bundle", "."],
])
def test_cli_refuses_an_id_that_is_a_path(migrt_env, outside, args):
    res = CliRunner().invoke(cli, [*args, "--root", str(outside), "--json"])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception  # no traceback
    assert "invalid container id '../fakeid'" in json.loads(res.stdout)["error"]
    assert migrt_env.fake.calls() == []


def test_a_record_migrt_did_not_write_is_a_clear_error_not_a_key_error(migrt_env, outside):
    res = CliRunner().invoke(cli, ["gpu", "resume", "fakeid", "--root", str(outside.parent), "--json"])
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "is not one migrt wrote for it" in json.loads(res.stdout)["error"]


def test_ops_check_the_id_where_they_build_the_path(tmp_path):
    for build in (lambda: gpu_preempt.record_path(str(tmp_path), "../x"), lambda: markers.marker_path(str(tmp_path), ".."),
                  lambda: runc.find_root("../x", [str(tmp_path)]), lambda: gpu_preempt.find_root("a/b", [str(tmp_path)])):
        with pytest.raises(InvalidName):
            build()
    assert markers.is_restored(str(tmp_path), "../x") is False
    with pytest.raises(MigrtError, match="invalid container id"):
        gpu_preempt.status(None, "../x", str(tmp_path))
