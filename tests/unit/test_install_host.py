"""packaging/install-host.sh (what the DaemonSet runs) against a temporary root directory and a small
stand-in payload (its `migrt` is this checkout's CLI; python and CRIU are scripts, so the check that
runs them in the root is skipped with --no-check except where a test runs them on this host).
tests/integration/test_payload.py runs the real payload from the real image."""

from __future__ import annotations

import os
import shutil
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


def _payload(path: Path, home: str = f"{PREFIX}/python/bin", built: str = PREFIX) -> Path:
    """The layout packaging/build-payload.sh builds under /opt/migrt (or `built`)."""
    (path / "python" / "bin").mkdir(parents=True)
    (path / "python" / "bin" / "python3").write_text("#!/bin/sh\n# stand-in for the payload's CPython\necho 3.11.2\n")
    (path / "criu" / "sbin").mkdir(parents=True)
    (path / "criu" / "sbin" / "criu").write_text("#!/bin/sh\necho 'Version: 4.2.1'\n")
    (path / "interpreter").write_text(f"{built}/python/bin/python3.11\n")
    venv = path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = false\n")
    os.symlink(f"{built}/python/bin/python3", venv / "bin" / "python")  # absolute, like a real venv
    cli = venv / "bin" / "migrt"
    cli.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.argv[0] = \"migrt\"; "
                   "from migrt.cli.main import main; main()' \"$@\"\n")
    (venv / "bin" / "migrt-runc-py").write_text(f"#!{built}/venv/bin/python\nimport migrt\n")  # as pip writes them
    (venv / "bin" / "activate").write_text(f'VIRTUAL_ENV="{built}/venv"\nexport VIRTUAL_ENV\n')
    (path / "libexec").mkdir()
    (path / "libexec" / "cuda-criu-action.py").write_text("# the hook\n")
    launchers.install(str(path / "bin"), python=f"{built}/venv/bin/python", repair="re-run the migrt installer",
                      criu_hook=str(path / "libexec" / "cuda-criu-action"),
                      hook_source=str(path / "libexec" / "cuda-criu-action.py"))
    hook = path / "libexec" / "cuda-criu-action"  # as built: the hook named at its built location
    hook.write_text(hook.read_text().replace(f"HOOK='{path}/libexec/", f"HOOK='{built}/libexec/"))
    (path / "share").mkdir()
    (path / "share" / "config.yaml").write_text((REPO / "configs" / "config.yaml").read_text())
    for f in (cli, path / "python" / "bin" / "python3", path / "criu" / "sbin" / "criu"):
        f.chmod(0o755)
    return path


def _run(root: Path, source: Path, *args: str, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SCRIPT), "--root", str(root), "--source", str(source),
                           *([] if check else ["--no-check"]), *args],
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
    (source / "python" / "bin" / "old-tool").write_text("v1\n")
    assert _run(root, source).returncode == 0
    (source / "venv" / "bin" / "new-tool").write_text("v2\n")
    (source / "python" / "bin" / "old-tool").unlink()
    res = _run(root, source)
    assert res.returncode == 0, res.stderr
    dest = root / PREFIX.lstrip("/")
    assert (dest / "venv/bin/new-tool").read_text() == "v2\n"
    assert not (dest / "python/bin/old-tool").exists()  # replaced as a whole, not merged
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


def test_refuses_a_venv_not_made_by_the_payloads_python(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    source = _payload(tmp_path / "payload", home="/usr/bin")  # e.g. made with the build machine's python3
    res = _run(root, source)
    assert res.returncode != 0 and "was not made by the payload's own python" in res.stderr
    assert not (root / "opt").exists() and not (root / "usr").exists()


@pytest.mark.parametrize("built,prefix", [
    ("/opt/migrt", "/srv/x/opt/migrt"),  # the new prefix ends with the old one
    ("/usr/local/migrt", "/opt/migrt"),  # a payload built elsewhere, to the default
])
def test_another_prefix_rewrites_every_path(tmp_path, built, prefix):
    root = tmp_path / "root"
    (root / "etc" / "containerd").mkdir(parents=True)
    (root / "etc" / "containerd" / "config.toml").write_text("version = 3\n")
    source = _payload(tmp_path / "payload", home=f"{built}/python/bin", built=built)
    args = ["--bindir", "/b"] + ([] if prefix == PREFIX else ["--prefix", prefix])
    res = _run(root, source, *args)
    assert res.returncode == 0, res.stderr
    assert f"installed {prefix} (from a payload built for {built})" in res.stderr
    dest = root / prefix.lstrip("/")
    assert (dest / "venv/pyvenv.cfg").read_text().startswith(f"home = {prefix}/python/bin\n")
    assert os.readlink(dest / "venv/bin/python") == f"{prefix}/python/bin/python3"
    assert (dest / "venv/bin/migrt-runc-py").read_text().startswith(f"#!{prefix}/venv/bin/python\n")
    assert (dest / "venv/bin/activate").read_text().startswith(f'VIRTUAL_ENV="{prefix}/venv"\n')
    assert (dest / "interpreter").read_text() == f"{prefix}/python/bin/python3.11\n"
    for name in ("migrt", "migrt-runc"):
        assert launchers.read_installed(str(dest / "bin" / name))["python"] == f"{prefix}/venv/bin/python"
    assert f"HOOK='{prefix}/libexec/cuda-criu-action.py'" in (dest / "libexec/cuda-criu-action").read_text()
    assert os.readlink(root / "b/migrt-runc") == f"{prefix}/bin/migrt-runc"
    dropin = tomllib.loads((root / "etc/containerd/conf.d/migrt.toml").read_text())
    rt = dropin["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["migrt"]
    assert rt["options"]["BinaryName"] == "/b/migrt-runc"
    # the source is untouched, and a second run finds the relocated copy up to date
    assert (source / "venv/pyvenv.cfg").read_text().startswith(f"home = {built}/python/bin\n")
    res = _run(root, source, *args)
    assert res.returncode == 0 and f"{prefix} is up to date" in res.stderr, res.stderr


@pytest.mark.parametrize("bad", ["relative/path", "/opt/it's", "/opt/a b", "/opt/a|b"])
def test_refuses_a_prefix_the_launchers_cannot_carry(host, bad):
    root, source = host
    res = _run(root, source, "--prefix", bad)
    assert res.returncode != 0 and f"--prefix {bad}" in res.stderr
    assert not (root / "opt").exists() and not (root / "usr").exists()


def test_refuses_a_payload_whose_python_does_not_run_on_this_host(tmp_path):
    """The check runs the copy's python and CRIU on the host (--root /: no chroot) before anything is
    replaced: a loader error (a node whose C library is too old) stops the install."""
    source = _payload(tmp_path / "payload")
    (source / "python/bin/python3").write_text(
        "#!/bin/sh\necho 'python3.11: error while loading shared libraries: libc.so.6: version GLIBC_2.36 not found' >&2\nexit 127\n")
    prefix, bindir = tmp_path / "p" / "migrt", tmp_path / "b"
    res = _run(Path("/"), source, "--prefix", str(prefix), "--bindir", str(bindir), "--no-containerd", check=True)
    assert res.returncode != 0 and "the payload's python does not run on this node (" in res.stderr, res.stderr
    assert "GLIBC_2.36 not found" in res.stderr and "nothing changed" in res.stderr
    assert not prefix.exists() and not bindir.exists() and not list(prefix.parent.glob(".migrt.*"))


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


def _needs(source: Path, line: str) -> None:
    (source / "PAYLOAD").write_text(f"payload: migrt 0.1.0 recipe 2\n{line}\n")


@pytest.mark.parametrize("needs,words", [
    (f"needs: {'aarch64' if os.uname().machine != 'aarch64' else 'x86_64'}, Linux >= 3.11", "is built for"),
    (f"needs: {os.uname().machine}, Linux >= 99.0", "older than Linux 99.0"),
])
def test_refuses_a_node_of_another_architecture_or_too_old_a_kernel(host, needs, words):
    """The payload's PAYLOAD says what it cannot run without; nothing is written on such a node."""
    root, source = host
    _needs(source, needs)
    res = _run(root, source)
    assert res.returncode != 0 and words in res.stderr and "nothing changed" in res.stderr, res.stderr
    assert not (root / "opt").exists() and not (root / "usr").exists()
    _needs(source, f"needs: {os.uname().machine}, Linux >= 3.11")  # this node: installed
    assert _run(root, source).returncode == 0


def _own_loader(payload: Path, built: str, room: bool) -> None:
    """Like the real payload: libc/ holds a loader (this host's) that python/bin/python3.11 names as its ELF
    interpreter at the built prefix, with the build's room for another path (packaging/elf-interp.sh) or
    none. The stand-in python3.11 is /bin/true (the installer's check only needs it to run)."""
    (payload / "libc").mkdir()
    shutil.copy2(os.path.realpath("/lib64/ld-linux-x86-64.so.2"), payload / "libc" / "ld-linux-x86-64.so.2")
    py = payload / "python" / "bin" / "python3.11"
    shutil.copy2("/bin/true", py)
    interp = f"{built}/libc/ld-linux-x86-64.so.2"
    lib = REPO / "packaging" / "elf-interp.sh"
    placeholder = "x" * 255 if room else interp
    subprocess.run(["patchelf", "--set-interpreter", placeholder, str(py)], check=True)
    subprocess.run(["sh", "-c", f'. "{lib}" && set_elf_interp "$1" "$2"', "-", str(py), interp], check=True)
    (payload / "python" / "bin" / "python3").unlink()
    os.symlink("python3.11", payload / "python" / "bin" / "python3")


@pytest.mark.skipif(os.uname().machine != "x86_64" or not shutil.which("patchelf"), reason="x86_64 loader, patchelf")
def test_another_prefix_gets_the_elf_interpreter_rewritten_and_runs_here(tmp_path):
    """The copy's python names the payload's own loader by absolute path: under another prefix the installer
    writes the new path into the same bytes, and its check runs that copy on this host (--root /)."""
    source = _payload(tmp_path / "payload")
    _own_loader(source, PREFIX, room=True)
    prefix, bindir = tmp_path / ("long-" * 20) / "migrt", tmp_path / "b"
    res = _run(Path("/"), source, "--prefix", str(prefix), "--bindir", str(bindir), "--no-containerd", check=True)
    assert res.returncode == 0 and f"installed {prefix}" in res.stderr, res.stderr
    interp = subprocess.run(["readelf", "-l", str(prefix / "python/bin/python3.11")], capture_output=True, text=True)
    assert f"[Requesting program interpreter: {prefix}/libc/ld-linux-x86-64.so.2]" in interp.stdout, interp.stdout
    assert subprocess.run([str(prefix / "python/bin/python3")]).returncode == 0
    interp = subprocess.run(["readelf", "-l", str(source / "python/bin/python3.11")], capture_output=True, text=True)
    assert f"interpreter: {PREFIX}/libc/ld-linux-x86-64.so.2]" in interp.stdout  # the source untouched


@pytest.mark.skipif(os.uname().machine != "x86_64" or not shutil.which("patchelf"), reason="x86_64 loader, patchelf")
def test_an_elf_interpreter_without_room_for_the_prefix_stops_the_install(tmp_path):
    source = _payload(tmp_path / "payload")
    _own_loader(source, PREFIX, room=False)
    prefix, bindir = tmp_path / "p" / "migrt", tmp_path / "b"
    res = _run(Path("/"), source, "--prefix", str(prefix), "--bindir", str(bindir), "--no-containerd", check=True)
    assert res.returncode != 0 and "has room for" in res.stderr, res.stderr
    assert "could not move the payload" in res.stderr, res.stderr
    assert not prefix.exists() and not bindir.exists() and not list(prefix.parent.glob(".migrt.*"))
