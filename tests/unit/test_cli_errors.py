"""The CLI's error contract (README "CLI reference", "Exit codes"): bad input gives one clear line on
stderr and the exit code of its kind, never a traceback; with --json the error is also the JSON object
{"error", "exit_code", "type"} on stdout, usage errors included."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from migrt.cli.group import handle_errors
from migrt.cli.main import cli
from migrt.pods import import_cri


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def _json_error(res) -> dict:
    data = json.loads(res.stdout)
    assert set(data) == {"error", "exit_code", "type"}, data
    assert data["exit_code"] == res.exit_code
    return data


def test_usage_error_with_json_is_json_on_stdout(migrt_env, tmp_path):
    res = invoke("restore", "c1", "ctr", "--json")            # --bundle missing
    assert res.exit_code == 2
    data = _json_error(res)
    assert data["type"] == "UsageError" and "--bundle" in data["error"]
    assert "--bundle" in res.stderr                           # click's own message stays on stderr


def test_usage_error_in_a_nested_group_with_json(migrt_env):
    res = invoke("gpu", "resume", "ctr", "--bogus", "--json")
    assert res.exit_code == 2
    assert "--bogus" in _json_error(res)["error"]


def test_usage_error_without_json_prints_no_json(migrt_env):
    res = invoke("restore", "c1", "ctr")
    assert res.exit_code == 2 and res.stdout == ""


def test_restore_output_that_cannot_be_opened(migrt_env, tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    res = invoke("restore", "c1", "ctr", "--bundle", str(bundle), "--output", str(tmp_path / "no" / "such" / "out"),
                 "--json")
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)   # no traceback
    assert "--output" in _json_error(res)["error"] and "No such file or directory" in res.stderr
    assert migrt_env.fake.calls() == []                       # nothing was run


def test_an_untranslated_oserror_is_a_clear_error_not_a_traceback(migrt_env, tmp_path, monkeypatch):
    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(import_cri, "import_archive", denied)
    res = invoke("import", str(tmp_path / "a.tar"), "--json")
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit)
    data = _json_error(res)
    assert data["type"] == "PermissionError" and "Permission denied" in data["error"]
    assert res.stderr.startswith("migrt: error: ")


def test_config_named_on_the_command_line_must_exist(migrt_env, tmp_path):
    missing = tmp_path / "typo.yaml"
    res = invoke("--config", str(missing), "ls", "--json")
    assert res.exit_code == 2
    assert str(missing) in _json_error(res)["error"]
    assert not os.path.exists(migrt_env.store)                # nothing done with the default config


def test_config_from_the_environment_may_be_absent(tmp_path, monkeypatch):
    # MIGRT_CONFIG / /etc/migrt/config.yaml absent still means defaults (the shim relies on it)
    monkeypatch.setenv("MIGRT_CONFIG", str(tmp_path / "absent.yaml"))
    res = invoke("version", "--json")
    assert res.exit_code == 0, res.output



def test_a_closed_stdout_ends_quietly(capfd):
    # `migrt inspect X | head`: the reader went away; no "error", no traceback (like cat)
    @handle_errors
    def cmd(as_json: bool = False) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(SystemExit) as exc:
        cmd(as_json=False)
    assert exc.value.code == 1
    assert capfd.readouterr().err == ""


def test_recover_says_it_may_wait_before_waiting(migrt_env, monkeypatch):
    from migrt.store import journal

    journal.begin(str(migrt_env.store), "op-from-a-newer-migrt", container="c9").release()  # its owner is gone
    monkeypatch.setenv("MIGRT_PROGRESS", "json")
    res = invoke("recover", "--wait", "7")
    assert res.exit_code == 6, res.output                    # an unknown operation is left as it is
    events = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    assert events[0]["progress"] == "phase" and events[0]["name"] == "recover"
    assert events[0]["entries"] == 1 and events[0]["wait_s"] == 7
    assert events[-1]["progress"] == "done"


def test_version_says_when_the_config_names_another_runtime_than_the_one_shown(migrt_env, tmp_path, monkeypatch):
    cfg = tmp_path / "rt.yaml"
    cfg.write_text(f"runtime: {tmp_path / 'gone' / 'runc'}\n")
    monkeypatch.setenv("MIGRT_CONFIG", str(cfg))
    res = invoke("version", "--json")
    assert res.exit_code == 0, res.output                     # versions stay available for bug reports
    out = json.loads(res.stdout)
    assert "gone/runc" in out["config_error"] and out["runtime_path"] == "runc"
    assert "warning" in res.stderr and "showing 'runc' from PATH" in res.stderr
    monkeypatch.setenv("MIGRT_CONFIG", str(migrt_env.config))
    assert "config_error" not in json.loads(invoke("version", "--json").stdout)


def test_export_to_dash_is_refused_not_a_file_named_dash(migrt_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("export", "c1", "-o", "-", "--json")
    assert res.exit_code == 2 and "give a path" in _json_error(res)["error"]
    assert not (tmp_path / "-").exists()
