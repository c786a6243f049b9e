"""packaging/setup-host.sh into a temporary prefix (never the system's /opt/migrt), then the upgrades
that broke installations: python3 moving to another version, the venv's interpreter replaced by one
that does not see the venv, the interpreter removed. The installation must survive the first; for the
others migrt-runc, migrt and the CRIU hook must say what is broken and name the repair, `migrt doctor`
(from a working migrt) must find it, and re-running setup-host.sh must repair it. Last, what a real
containerd shows when migrt-runc's Python side cannot start.

The interpreter the venv is made with is a copy of this one's base interpreter under the temporary
directory, so it can be moved, replaced and removed without touching the system's Python.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from migrt.node import launchers
from migrt.node.doctor_containerd import containerd_handler_check
from migrt.node.doctor_install import installation_check, launcher_check
from tests.unit.support import make_executable, write_bundle

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CID = "setup-host-ctr"


def setup_host(prefix: Path, bindir: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("MIGRT_DEV", "MIGRT_PYTHON")}
    full.update(MIGRT_PREFIX=str(prefix), MIGRT_BINDIR=str(bindir), MIGRT_SKIP_APT="1", **env)
    r = subprocess.run(["sh", str(REPO / "packaging" / "setup-host.sh")], env=full, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return r


def restore_create(bindir: Path, tmp: Path, name: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """A create that asks for a restore (the path that needs Python), as containerd's shim calls it."""
    bundle = write_bundle(tmp / f"bundle-{name}", env=[f"MIGRT_RESTORE={name}"])
    log = bundle / "log.json"
    r = subprocess.run([str(bindir / "migrt-runc"), "--root", str(tmp / "runc-root"), "--log", str(log),
                        "--log-format", "json", "create", "--bundle", str(bundle), CID],
                       capture_output=True, text=True, timeout=120)
    last = json.loads(log.read_text().splitlines()[-1]) if log.exists() and log.read_text().strip() else None
    return r, last


def one_line(text: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def assert_works(bindir: Path, tmp: Path) -> None:
    r = subprocess.run([str(bindir / "migrt"), "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "migrt, version" in r.stdout, r.stderr
    r, last = restore_create(bindir, tmp, "../bad")  # migrt's own decision: a bad checkpoint name
    assert r.returncode == 2 and "invalid checkpoint name" in last["msg"], (r.stderr, last)


def assert_broken(bindir: Path, prefix: Path, tmp: Path, what: str, hook: bool) -> None:
    repair = (prefix / "repair").read_text().strip()
    assert "packaging/setup-host.sh" in repair and f"MIGRT_PREFIX={prefix}" in repair
    r, last = restore_create(bindir, tmp, "ck-1")
    assert (r.returncode, r.stdout) == (127, "")
    line = one_line(r.stderr)
    assert what in line and line.endswith(f"; repair: {repair}"), line
    assert last["level"] == "error" and last["msg"] == line
    r = subprocess.run([str(bindir / "migrt-runc"), "checkpoint", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 127 and what in one_line(r.stderr)  # podman's probe
    r = subprocess.run([str(bindir / "migrt"), "doctor"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 127 and one_line(r.stderr).endswith(f"; repair: {repair}")
    if hook:  # (an interpreter that runs finds migrt.gpu through the hook's own fallbacks)
        r = subprocess.run([str(prefix / "libexec" / "cuda-criu-action")],
                           env={**os.environ, "CRTOOLS_SCRIPT_ACTION": "pre-dump", "MIGRT_HOOK_LOG": str(tmp / "hook.log")},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and one_line(r.stderr).endswith(f"; repair: {repair}")  # CRIU's log says why
    # doctor, from a working migrt (this one), finds the installation and the launcher broken
    inst = installation_check(str(prefix))
    assert inst["status"] == "fail" and inst["fix"] == repair, inst
    runc = launcher_check("migrt-runc", str(bindir / "migrt-runc"))
    assert runc["status"] == "fail" and runc["fix"] == repair, runc


def test_setup_host_twice_survives_python3_moving_and_repairs_a_broken_interpreter(stack, tmp_path):
    base = os.path.realpath(sys.executable)  # e.g. /usr/bin/python3.11
    pydir = tmp_path / "py" / "bin"
    pydir.mkdir(parents=True)
    versioned = pydir / os.path.basename(base)
    shutil.copy2(base, versioned)
    (pydir / "python3").symlink_to(versioned.name)  # the distribution's unversioned name
    prefix, bindir = tmp_path / "prefix", tmp_path / "bin"

    r = setup_host(prefix, bindir, MIGRT_PYTHON=str(pydir / "python3"))
    assert f"creating {prefix}/venv with {versioned}" in r.stderr
    assert (prefix / "interpreter").read_text().strip() == str(versioned)  # pinned: the versioned path
    assert os.path.realpath(prefix / "venv" / "bin" / "python") == str(versioned)
    assert "include-system-site-packages = false" in (prefix / "venv" / "pyvenv.cfg").read_text()
    assert launchers.read_installed(str(bindir / "migrt-runc"))["python"] == f"{prefix}/venv/bin/python"
    subprocess.run([str(prefix / "venv" / "bin" / "python"), "-c", "import pycriu, google.protobuf"], check=True,
                   timeout=60)
    assert_works(bindir, tmp_path)
    assert installation_check(str(prefix))["status"] == "ok"

    # containerd's handler pointing at this migrt-runc (a private config; containerd is not restarted)
    ctd = tmp_path / "containerd" / "config.toml"
    ctd.parent.mkdir()
    ctd.write_text("version = 3\n")
    subprocess.run([str(bindir / "migrt"), "install", "containerd", "--config", str(ctd), "--binary",
                    str(bindir / "migrt-runc")], check=True, capture_output=True, timeout=120)
    assert containerd_handler_check(str(ctd))["status"] == "ok"

    # run twice: nothing is made again
    r = setup_host(prefix, bindir)
    assert "creating" not in r.stderr and "done: Python " + str(versioned) in r.stderr
    assert_works(bindir, tmp_path)

    # python3 moves to another interpreter (what `apt-get install -t sid podman` did): nothing breaks
    (pydir / "python3").unlink()
    (pydir / "python3").write_text("#!/bin/sh\necho 'not the Python the venv was made with' >&2\nexit 1\n")
    (pydir / "python3").chmod(0o755)
    assert_works(bindir, tmp_path)

    # the venv's own interpreter replaced by one that does not see the venv (a rebuilt python)
    versioned.unlink()
    versioned.write_text(f"#!/bin/sh\nexec {base} -S \"$@\"\n")
    versioned.chmod(0o755)
    assert_broken(bindir, prefix, tmp_path, "migrt does not import with", hook=False)
    h = containerd_handler_check(str(ctd))
    assert h["status"] == "fail" and "BinaryName" in h["detail"], h
    r = setup_host(prefix, bindir)  # the repair
    assert f"creating {prefix}/venv with {base} (pycriu does not import in it)" in r.stderr, r.stderr
    assert_works(bindir, tmp_path)
    assert installation_check(str(prefix))["status"] == "ok"
    assert containerd_handler_check(str(ctd))["status"] == "ok"

    # the interpreter removed: the venv's link and the record point at an interpreter that is gone
    # (the on-disk state of a venv made from it; made so rather than by a third venv on a copy)
    gone = tmp_path / "gone" / "bin" / os.path.basename(base)
    link = prefix / "venv" / "bin" / os.path.basename(base)
    assert os.readlink(link) == base
    link.unlink()
    link.symlink_to(gone)
    (prefix / "interpreter").write_text(f"{gone}\n")
    assert_broken(bindir, prefix, tmp_path, f"migrt's Python interpreter {prefix}/venv/bin/python is missing", hook=True)
    r = setup_host(prefix, bindir)
    assert f"(its interpreter {gone} is gone)" in r.stderr, r.stderr
    assert_works(bindir, tmp_path)
    assert launcher_check("migrt-runc", str(bindir / "migrt-runc"))["status"] == "ok"

    # the containerd drop-in pointing at a binary that is gone
    (bindir / "migrt-runc").unlink()
    h = containerd_handler_check(str(ctd))
    assert h["status"] == "fail" and "missing or not executable" in h["detail"], h


@pytest.mark.parametrize("broken", ["interpreter gone", "migrt not importable"])
def test_containerd_shows_the_broken_python_side(containerd, tmp_path, broken):
    """Through a real containerd and its runc shim: a create that needs Python fails with our one line
    as "OCI runtime create failed: ..." (no traceback); an ordinary container still runs."""
    if broken == "interpreter gone":
        python, expect = str(tmp_path / "gone" / "python"), "migrt's Python interpreter"
    else:  # an interpreter that runs but does not see migrt (like a venv whose python3 moved)
        python = str(make_executable(tmp_path / "py" / "python",
                                     f"#!/bin/sh\nexec {os.path.realpath(sys.executable)} -S \"$@\"\n"))
        expect = "migrt does not import with"
    repair = "sh packaging/setup-host.sh"
    shim = make_executable(tmp_path / "bin" / "migrt-runc", launchers.render("migrt-runc", python, repair))
    cid = f"broken-{uuid.uuid4().hex[:6]}"
    res = containerd.ctr("run", "--rm", "--runc-binary", str(shim), "--env", "MIGRT_RESTORE=ck-1",
                         containerd.image, cid, "sh", "-c", "echo fresh", check=False)
    assert res.returncode != 0 and "fresh" not in res.stdout
    assert "OCI runtime create failed" in res.stderr and expect in res.stderr, res.stderr
    assert f"repair: {repair}" in res.stderr and "Traceback" not in res.stderr
    containerd.ctr("rm", cid, check=False)
    res = containerd.ctr("run", "--rm", "--runc-binary", str(shim), containerd.image, cid + "-ok",
                         "sh", "-c", "echo fine", check=False)
    assert res.returncode == 0 and "fine" in res.stdout, res.stderr
