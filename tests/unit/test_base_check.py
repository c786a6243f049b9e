"""packaging/base-check.sh against this machine's own package database: a record made now compares
clean; a package that "moved" since a doctored record is failed by the node set-up's check, and by the
test set-up's (--point-updates) unless it is a later point update of this release (+debNuM -> +debNuM'),
which it lists; a downgrade and a removal fail both."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "packaging" / "base-check.sh"
pytestmark = pytest.mark.skipif(not (shutil.which("dpkg-query") and shutil.which("apt-cache")),
                                reason="needs a Debian package database")


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _point_updated(record: Path) -> tuple[str, str, str]:
    """A package installed at +debNuM (M >= 2) that this release's suites carry: (name, now, one before)."""
    for line in record.read_text().splitlines():
        name, _, version = line.partition(" ")
        m = re.fullmatch(r"(.*[+~]deb(\d+)u)(\d+)", version)
        if m and int(m.group(3)) >= 2 and name != "os-release":
            madison = subprocess.run(["apt-cache", "madison", name.split(":")[0]], capture_output=True, text=True,
                                     timeout=60).stdout
            if f" {version} " in madison:
                return name, version, f"{m.group(1)}{int(m.group(3)) - 1}"
    pytest.skip("no installed package at a +debNuM (M >= 2) version of this release")


def _doctored(record: Path, out: Path, name: str, version: str | None) -> Path:
    lines = [ln for ln in record.read_text().splitlines() if not ln.startswith(name + " ")]
    if version is not None:
        lines.append(f"{name} {version}")
    out.write_text("\n".join(sorted(lines)) + "\n")
    return out


def test_a_record_made_now_compares_clean(tmp_path):
    rec = tmp_path / "base.txt"
    assert _check("record", str(rec)).returncode == 0
    for mode in ([], ["--point-updates"]):
        r = _check("compare", *mode, str(rec))
        assert r.returncode == 0 and "moved" not in r.stderr.replace("no installed package moved", ""), r.stderr


def test_point_updates_pass_the_test_set_up_only_and_are_listed(tmp_path):
    rec = tmp_path / "base.txt"
    _check("record", str(rec))
    name, now, before = _point_updated(rec)
    old = _doctored(rec, tmp_path / "older.txt", name, before)
    r = _check("compare", str(old))
    assert r.returncode == 1 and f"changed: {name} {before} -> {now}" in r.stderr, r.stderr
    r = _check("compare", "--point-updates", str(old))
    assert r.returncode == 0, r.stderr
    assert "same-release point updates apt required" in r.stderr and f"{name} {before} -> {now}" in r.stderr


def test_a_downgrade_and_a_removal_fail_both_checks(tmp_path):
    rec = tmp_path / "base.txt"
    _check("record", str(rec))
    name, now, _ = _point_updated(rec)
    newer = now[:-1] + str(int(now[-1]) + 1)  # the record says a later version: now is a downgrade
    down = _doctored(rec, tmp_path / "newer.txt", name, newer)
    gone = _doctored(rec, tmp_path / "gone.txt", "migrt-ghost:amd64", None)
    gone.write_text(gone.read_text() + "migrt-ghost:amd64 1.0\n")
    for mode in ([], ["--point-updates"]):
        r = _check("compare", *mode, str(down))
        assert r.returncode == 1 and f"changed: {name} {newer} -> {now}" in r.stderr, r.stderr
        r = _check("compare", *mode, str(gone))
        assert r.returncode == 1 and "removed: migrt-ghost:amd64 1.0" in r.stderr, r.stderr
