"""packaging/setup-host.sh installs migrt's node payload (packaging/build-payload.sh, here from the
build cache test_payload.py shares) with install-host.sh, into a temporary prefix and bindir (never the
system's /opt/migrt): no compiler, no make and not the host's Python is run on the node; a second run
finds it up to date; an installation broken on the node (its interpreter gone, then migrt's package
gone) makes migrt-runc and migrt say what is broken and name the repair, `migrt doctor`
(from a working migrt) find it, and re-running setup-host.sh repair it. A payload that is neither a tree
nor an image is refused by name. Last, what a real containerd shows when migrt-runc's Python side
cannot start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from migrt.node import launchers
from migrt.node.doctor_containerd import containerd_handler_check
from migrt.node.doctor_install import installation_check, launcher_check
from tests.helpers.containerd import DEPS
from tests.unit.support import make_executable, write_bundle

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CID = "setup-host-ctr"
# Programs a node set-up must not run: a compiler, make, and the host's own Python and pip.
FORBIDDEN = ("gcc", "cc", "make", "python3", "pip", "pip3")


@pytest.fixture(scope="module")
def payload(stack) -> str:
    """The installer image (oci.tar), built once and cached with test_payload.py's build."""
    r = subprocess.run(["sh", str(REPO / "packaging" / "build-payload.sh"), "image", "--cache",
                        os.path.join(DEPS, "payload")], capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout.strip().splitlines()[-1]


def forbidding_path(tmp: Path) -> tuple[str, Path]:
    """PATH with stand-ins for FORBIDDEN first (each records its call in the returned file and fails)."""
    calls = tmp / "forbidden-calls"
    for name in FORBIDDEN:
        make_executable(tmp / "forbidden" / name, f"#!/bin/sh\necho {name} \"$@\" >> {calls}\nexit 97\n")
    return f"{tmp / 'forbidden'}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}", calls


def setup_host(prefix: Path, bindir: Path, payload: str, ok: bool = True, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("MIGRT_DEV", "MIGRT_PAYLOAD")}
    full.update(MIGRT_PREFIX=str(prefix), MIGRT_BINDIR=str(bindir), MIGRT_SKIP_APT="1", MIGRT_CRIU_LINK="0",
                MIGRT_PAYLOAD=payload, **env)
    r = subprocess.run(["sh", str(REPO / "packaging" / "setup-host.sh")], env=full, capture_output=True, text=True,
                       timeout=600)
    assert (r.returncode == 0) == ok, r.stderr
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


def assert_broken(bindir: Path, prefix: Path, tmp: Path, what: str) -> None:
    repair = (prefix / "repair").read_text().strip()
    assert "installer" in repair  # the payload's: re-run the installer
    r, last = restore_create(bindir, tmp, "ck-1")
    assert (r.returncode, r.stdout) == (127, "")
    line = one_line(r.stderr)
    assert what in line and line.endswith(f"; repair: {repair}"), line
    assert last["level"] == "error" and last["msg"] == line
    r = subprocess.run([str(bindir / "migrt-runc"), "checkpoint", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 127 and what in one_line(r.stderr)  # podman's probe
    r = subprocess.run([str(bindir / "migrt"), "doctor"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 127 and one_line(r.stderr).endswith(f"; repair: {repair}")
    # doctor, from a working migrt (this one), finds the installation and the launcher broken
    inst = installation_check(str(prefix))
    assert inst["status"] == "fail" and inst["fix"] == repair, inst
    runc = launcher_check("migrt-runc", str(bindir / "migrt-runc"))
    assert runc["status"] == "fail" and runc["fix"] == repair, runc


def test_setup_host_installs_the_payload_without_building_and_repairs_it(payload, tmp_path):
    prefix, bindir = tmp_path / "prefix", tmp_path / "bin"
    path, calls = forbidding_path(tmp_path)
    r = setup_host(prefix, bindir, payload, PATH=path)
    assert f"installed {prefix}" in r.stderr and "done: migrt" in r.stderr, r.stderr
    assert not calls.exists(), calls.read_text()  # no compiler, make, host python or pip ran
    py = (prefix / "interpreter").read_text().strip()
    assert py.startswith(f"{prefix}/python/bin/python3")  # the payload's own interpreter, relocated
    assert launchers.read_installed(str(bindir / "migrt-runc"))["python"] == f"{prefix}/venv/bin/python"
    subprocess.run([str(prefix / "venv" / "bin" / "python"), "-c", "import pycriu, google.protobuf"], check=True,
                   timeout=60)
    assert "Version: 4." in subprocess.run([str(prefix / "criu" / "sbin" / "criu"), "--version"],
                                           capture_output=True, text=True, timeout=60).stdout
    assert_works(bindir, tmp_path)
    assert installation_check(str(prefix))["status"] == "ok"

    # containerd's handler pointing at this migrt-runc (a private config; containerd is not restarted)
    ctd = tmp_path / "containerd" / "config.toml"
    ctd.parent.mkdir()
    ctd.write_text("version = 3\n")
    subprocess.run([str(bindir / "migrt"), "install", "containerd", "--config", str(ctd), "--binary",
                    str(bindir / "migrt-runc")], check=True, capture_output=True, timeout=120)
    assert containerd_handler_check(str(ctd))["status"] == "ok"

    # run twice: nothing is copied again
    t0 = time.monotonic()
    r = setup_host(prefix, bindir, payload, PATH=path)
    print(f"setup-host.sh over an installed payload: {time.monotonic() - t0:.1f} s")
    assert f"{prefix} is up to date" in r.stderr and "installed" not in r.stderr, r.stderr
    assert_works(bindir, tmp_path)

    # the venv's interpreter gone (a node's clean-up removed it)
    shutil.rmtree(prefix / "python")
    assert_broken(bindir, prefix, tmp_path, f"migrt's Python interpreter {prefix}/venv/bin/python is missing")
    h = containerd_handler_check(str(ctd))
    assert h["status"] == "fail" and "BinaryName" in h["detail"], h
    r = setup_host(prefix, bindir, payload, PATH=path)  # the repair
    assert f"installed {prefix}" in r.stderr, r.stderr
    assert_works(bindir, tmp_path)
    assert containerd_handler_check(str(ctd))["status"] == "ok"

    # migrt's package gone from the venv: the interpreter runs but cannot import it
    site = next((prefix / "venv" / "lib").glob("python3*/site-packages"))
    shutil.rmtree(site / "migrt")
    assert_broken(bindir, prefix, tmp_path, "migrt does not import with")
    setup_host(prefix, bindir, payload, PATH=path)
    assert_works(bindir, tmp_path)
    assert launcher_check("migrt-runc", str(bindir / "migrt-runc"))["status"] == "ok"
    assert not calls.exists(), calls.read_text()


def test_setup_host_refuses_what_is_no_payload(stack, tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar")
    r = setup_host(tmp_path / "prefix", tmp_path / "bin", str(junk), ok=False)
    assert f"{junk}: no OCI image layout" in r.stderr, r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = setup_host(tmp_path / "prefix", tmp_path / "bin", str(empty), ok=False)
    assert f"{empty} is not a migrt payload" in r.stderr, r.stderr
    assert not (tmp_path / "prefix").exists() and not (tmp_path / "bin").exists()


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
