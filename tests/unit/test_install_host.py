"""packaging/install-host.sh (what the DaemonSet runs) against a temporary root directory and a small
stand-in payload (its `migrt` is this checkout's CLI)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from migrt.node import launchers

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "packaging" / "install-host.sh"
PREFIX = "/opt/migrt"


def _payload(path: Path, home: str = f"{PREFIX}/python/bin") -> Path:
    """The layout packaging/Containerfile builds under /opt/migrt."""
    (path / "python" / "bin").mkdir(parents=True)
    (path / "python" / "bin" / "python3").write_text("#!/bin/sh\n# stand-in for a relocatable CPython\n")
    venv = path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = false\n")
    os.symlink(f"{PREFIX}/python/bin/python3", venv / "bin" / "python")  # absolute, like a real venv
    cli = venv / "bin" / "migrt"
    cli.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.argv[0] = \"migrt\"; "
                   "from migrt.cli.main import main; main()' \"$@\"\n")
    launchers.install(str(path / "bin"), python=f"{PREFIX}/venv/bin/python", repair="re-run the migrt installer")
    (path / "share").mkdir()
    (path / "share" / "config.yaml").write_text((REPO / "configs" / "config.yaml").read_text())
    for f in (cli, path / "python" / "bin" / "python3"):
        f.chmod(0o755)
    return path


def _run(root: Path, source: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SCRIPT), "--root", str(root), "--source", str(source), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MIGRT_RESTART_CONTAINERD": "0", **(env or {})})


def _snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, st.st_mtime_ns,
                                             os.readlink(p) if p.is_symlink() else None)
    return out


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    (root / "etc" / "containerd").mkdir(parents=True)
    (root / "etc" / "containerd" / "config.toml").write_text("version = 3\n")
    return root, _payload(tmp_path / "payload")


def test_installs_payload_links_config_and_handler(host):
    root, source = host
    res = _run(root, source)
    assert res.returncode == 0, res.stderr
    dest = root / PREFIX.lstrip("/")
    assert subprocess.run(["diff", "-r", "--no-dereference", str(source), str(dest)]).returncode == 0
    assert os.readlink(dest / "venv" / "bin" / "python") == f"{PREFIX}/python/bin/python3"  # host paths kept
    assert os.readlink(root / "usr/local/bin/migrt") == f"{PREFIX}/bin/migrt"
    assert os.readlink(root / "usr/local/bin/migrt-runc") == f"{PREFIX}/bin/migrt-runc"
    for name in ("migrt-runc", "migrt"):
        assert launchers.read_installed(str(dest / "bin" / name))["python"] == f"{PREFIX}/venv/bin/python"
    assert (root / "etc/migrt/config.yaml").read_text() == (REPO / "configs/config.yaml").read_text()
    assert stat.S_IMODE((root / "var/lib/migrt").stat().st_mode) == 0o700
    # containerd: the drop-in, imported by the main config (host paths inside the files)
    main = tomllib.loads((root / "etc/containerd/config.toml").read_text())
    assert main["imports"] == ["/etc/containerd/conf.d/migrt.toml"]
    dropin = tomllib.loads((root / "etc/containerd/conf.d/migrt.toml").read_text())
    rt = dropin["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["migrt"]
    assert rt["options"]["BinaryName"] == "/usr/local/bin/migrt-runc"
    assert "restart containerd on this node" in res.stderr and "not done" in res.stderr
    assert not list(root.glob("opt/.migrt.*"))  # no temporary directories left


def test_second_run_changes_nothing(host):
    root, source = host
    assert _run(root, source).returncode == 0
    before = _snapshot(root)
    res = _run(root, source)
    assert res.returncode == 0, res.stderr
    assert _snapshot(root) == before  # same files, same mtimes: nothing rewritten, no new backup
    assert "up to date" in res.stderr and "restart" not in res.stderr


def test_existing_config_kept_and_new_payload_replaces_old(host):
    root, source = host
    (root / "etc/migrt").mkdir(parents=True)
    (root / "etc/migrt/config.yaml").write_text("runtime: crun\n")
    assert _run(root, source).returncode == 0
    (source / "venv" / "bin" / "new-tool").write_text("v2\n")
    (source / "python" / "bin" / "python3").unlink()
    res = _run(root, source)
    assert res.returncode == 0, res.stderr
    dest = root / PREFIX.lstrip("/")
    assert (dest / "venv/bin/new-tool").read_text() == "v2\n"
    assert not (dest / "python/bin/python3").exists()  # replaced as a whole, not merged
    assert (root / "etc/migrt/config.yaml").read_text() == "runtime: crun\n"
    assert not list(root.glob("opt/.migrt.*"))


def test_restart_only_when_asked_and_config_changed(host, tmp_path):
    root, source = host
    marker = tmp_path / "restarted"
    env = {"MIGRT_RESTART_CONTAINERD": "1", "MIGRT_RESTART_COMMAND": f"echo restart >> {marker}"}
    assert _run(root, source, env=env).returncode == 0
    assert marker.read_text() == "restart\n"
    assert _run(root, source, env=env).returncode == 0  # nothing changed: no restart
    assert marker.read_text() == "restart\n"


def test_no_containerd_option(host):
    root, source = host
    res = _run(root, source, "--no-containerd")
    assert res.returncode == 0, res.stderr
    assert (root / "etc/containerd/config.toml").read_text() == "version = 3\n"
    assert not (root / "etc/containerd/conf.d").exists()


def test_refuses_payload_built_for_another_prefix(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    source = _payload(tmp_path / "payload", home="/usr/local/migrt/python/bin")
    res = _run(root, source)
    assert res.returncode != 0 and "built for another location" in res.stderr
    assert not (root / "opt").exists() and not (root / "usr").exists()


def test_refuses_incomplete_payload(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    source = _payload(tmp_path / "payload")
    (source / "bin" / "migrt-runc").unlink()
    res = _run(root, source)
    assert res.returncode != 0 and "bin/migrt-runc missing" in res.stderr


def test_containerd_failure_stops_before_any_restart(host, tmp_path):
    root, source = host
    (root / "etc/containerd/config.toml").write_text("[plugins.cri]\n")  # version 1: refused
    marker = tmp_path / "restarted"
    res = _run(root, source, env={"MIGRT_RESTART_CONTAINERD": "1", "MIGRT_RESTART_COMMAND": f"touch {marker}"})
    assert res.returncode != 0 and "not supported" in res.stderr and "nothing restarted" in res.stderr
    assert not marker.exists()
