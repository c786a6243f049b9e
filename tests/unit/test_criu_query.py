"""CRIU's queries (`criu check`, `--version`) leave nothing in the caller's directory.

runc's test suite leaves `log-file=runc-criu-log-XXXXXX.log` (a relative path) in /etc/criu/default.conf;
CRIU reads that file for every command, so each `criu check` that `migrt doctor` ran wrote such a log
into the directory doctor was started from."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from migrt.criu import lazy, version
from migrt.criu.binary import own_build
from migrt.node import doctor
from tests.unit.support import make_executable

REAL_CRIU = next((p for p in (own_build(), "/opt/migrt/criu/sbin/criu") if os.access(p, os.X_OK)), None)


def _fake_criu(tmp_path: Path) -> str:
    """A criu that, like the real one with such a config, writes its log where it is started."""
    return str(make_executable(tmp_path / "bin" / "criu",
                               "#!/bin/sh\necho log > runc-criu-log-abc123.log\necho 'Version: 4.2.1'\nexit 0\n"))


def test_doctor_and_feature_checks_leave_no_criu_log_in_the_current_directory(migrt_env, tmp_path, monkeypatch):
    criu = _fake_criu(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("MIGRT_CRIU", criu)
    assert doctor._criu_feature(criu, "uffd-noncoop") is True
    assert lazy.criu_feature("mem_dirty_track") is True
    assert version.criu_version() == "4.2.1"
    checks = {c["name"]: c for c in doctor.run_checks()}
    assert checks["criu check"]["status"] == "ok"
    assert sorted(os.listdir(here)) == []


@pytest.mark.skipif(REAL_CRIU is None, reason="migrt's CRIU build is not installed here")
def test_real_criu_check_with_a_relative_log_file_in_its_config(tmp_path, monkeypatch):
    conf = tmp_path / "criu.conf"
    conf.write_text("log-file=runc-criu-log-abc123.log\n")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("CRIU_CONFIG_FILE", str(conf))  # read like /etc/criu/default.conf
    control = tmp_path / "control"
    control.mkdir()
    subprocess.run([REAL_CRIU, "check", "--feature", "uffd-noncoop"], cwd=control, capture_output=True, timeout=30)
    assert os.listdir(control) == ["runc-criu-log-abc123.log"]  # what CRIU does with such a config
    version.run_query([REAL_CRIU, "check", "--feature", "uffd-noncoop"], 30)
    doctor._criu_feature(REAL_CRIU, "mem_dirty_track")
    assert os.listdir(here) == []
