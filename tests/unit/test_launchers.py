"""The launchers `migrt install runtime` writes (migrt-runc, migrt, the CRIU hook's wrapper) when the
Python side cannot start: the interpreter is gone, or it no longer sees migrt (a venv whose python an
upgrade moved). One line naming what is broken and the repair, a runc-style error line in --log,
exit 127; never a traceback; pass-through untouched. Also `migrt install runtime` itself and the
doctor checks that find such an installation."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from migrt.node import doctor_install, launchers
from tests.unit.support import REPO, VENV_BIN, make_executable, write_bundle

CID = "c0ffee"
REPAIR = "MIGRT_PREFIX=/opt/x sh /src/packaging/setup-host.sh"
ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")
SHELLS = ["shebang"] + [s for s in ("dash", "bash", "busybox") if shutil.which(s)]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter that runs but does not see migrt: a fresh venv of the same base Python (what a
    venv looks like once its python moved to a version without its site-packages)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([os.path.realpath(sys.executable), "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    return str(venv / "bin" / "python")


def run(script: Path, argv: list[str], env: dict, shell: str = "shebang") -> subprocess.CompletedProcess:
    cmd = [str(script)] if shell == "shebang" else ([shutil.which("busybox"), "sh"] if shell == "busybox"
                                                     else [shutil.which(shell)]) + [str(script)]
    env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([*cmd, *argv], env=env, capture_output=True, text=True, timeout=60)


def restore_create(tmp_path: Path, log_format: str | None = "json") -> tuple[list[str], Path]:
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=ck-1"])
    flags = ["--root", str(tmp_path / "root"), "--log", str(bundle / "log.json")]
    if log_format:
        flags += ["--log-format", log_format]
    return [*flags, "create", "--bundle", str(bundle), CID], bundle / "log.json"


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("shell", SHELLS)
def test_runc_interpreter_missing(tmp_path, migrt_env, shell):
    python = tmp_path / "gone" / "bin" / "python"
    script = make_executable(tmp_path / "migrt-runc", launchers.render("migrt-runc", str(python), REPAIR))
    argv, log = restore_create(tmp_path)
    r = run(script, argv, migrt_env.env, shell)
    assert (r.returncode, r.stdout) == (127, "")
    line = one_line(r.stderr)
    assert line == f"migrt-runc: migrt's Python interpreter {python} is missing; repair: {REPAIR}"
    rec = json.loads(log.read_text().splitlines()[-1])
    assert (rec["level"], rec["msg"]) == ("error", line)
    assert ISO_TIME.match(rec["time"]), rec
    # podman's probe (`checkpoint --help` must exit 0 for "supports checkpoint") fails the same clear way
    r = run(script, ["checkpoint", "--help"], migrt_env.env, shell)
    assert r.returncode == 127 and "is missing; repair:" in one_line(r.stderr)
    # pass-through never needed Python: untouched
    r = run(script, ["--root", str(tmp_path / "root"), "kill", CID, "9"], migrt_env.env, shell)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert migrt_env.fake.argvs() == [[b"--root", str(tmp_path / "root").encode(), b"kill", CID.encode(), b"9"]]


@pytest.mark.parametrize("shell", SHELLS)
def test_runc_interpreter_without_migrt(tmp_path, migrt_env, bare_python, shell):
    script = make_executable(tmp_path / "migrt-runc", launchers.render("migrt-runc", bare_python, REPAIR))
    argv, log = restore_create(tmp_path)
    r = run(script, argv, migrt_env.env, shell)
    assert (r.returncode, r.stdout) == (127, "")
    line = one_line(r.stderr)
    assert line.startswith(f"migrt-runc: migrt does not import with {bare_python} (")
    assert "ModuleNotFoundError: No module named 'migrt'" in line and line.endswith(f"; repair: {REPAIR}")
    rec = json.loads(log.read_text().splitlines()[-1])
    assert (rec["level"], rec["msg"]) == ("error", line) and ISO_TIME.match(rec["time"])
    assert migrt_env.fake.calls() == []


def test_runc_text_log_format(tmp_path, migrt_env, bare_python):
    """runc's default --log-format is text: the line then has runc's text shape."""
    script = make_executable(tmp_path / "migrt-runc", launchers.render("migrt-runc", bare_python, REPAIR))
    argv, log = restore_create(tmp_path, log_format=None)
    r = run(script, argv, migrt_env.env)
    assert r.returncode == 127
    text = log.read_text().splitlines()[-1]
    m = re.match(r'^time="([^"]+)" level=error msg=(".*")$', text)
    assert m and ISO_TIME.match(m.group(1)) and json.loads(m.group(2)) == one_line(r.stderr)
    script = make_executable(tmp_path / "migrt-runc2", launchers.render("migrt-runc", str(tmp_path / "nope"), REPAIR))
    r = run(script, [f"--log={log}", "checkpoint", CID], migrt_env.env)
    assert r.returncode == 127
    assert log.read_text().splitlines()[-1].endswith(
        f'level=error msg="migrt-runc2: migrt\'s Python interpreter {tmp_path}/nope is missing; repair: {REPAIR}"')


def test_runc_working_interpreter_reaches_migrt(tmp_path, migrt_env):
    """The same launcher with the venv's python: migrt decides (here: refuses a bad checkpoint name)."""
    script = make_executable(tmp_path / "migrt-runc", launchers.render("migrt-runc", sys.executable, REPAIR))
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=../etc"])
    r = run(script, ["--log", str(bundle / "log.json"), "--log-format", "json", "create", "--bundle", str(bundle),
                     CID], migrt_env.env)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", "")
    assert "invalid checkpoint name '../etc'" in json.loads((bundle / "log.json").read_text().splitlines()[-1])["msg"]


def test_cli_launcher(tmp_path, migrt_env, bare_python):
    good = make_executable(tmp_path / "ok" / "migrt", launchers.render("migrt", sys.executable, REPAIR))
    r = run(good, ["--help"], migrt_env.env)
    assert r.returncode == 0 and r.stdout.startswith("Usage: migrt ")
    gone = make_executable(tmp_path / "gone" / "migrt", launchers.render("migrt", str(tmp_path / "nope"), REPAIR))
    r = run(gone, ["doctor"], migrt_env.env)
    assert (r.returncode, r.stdout) == (127, "")
    assert one_line(r.stderr) == f"migrt: migrt's Python interpreter {tmp_path}/nope is missing; repair: {REPAIR}"
    bare = make_executable(tmp_path / "bare" / "migrt", launchers.render("migrt", bare_python, REPAIR))
    r = run(bare, ["doctor"], migrt_env.env)
    assert r.returncode == 127
    assert re.match(rf"^migrt: migrt does not import with {re.escape(bare_python)} .*No module named 'migrt'; "
                    rf"repair: {re.escape(REPAIR)}$", one_line(r.stderr))


def test_odd_paths_are_quoted(tmp_path, migrt_env):
    (tmp_path / "it's a venv").symlink_to(sys.prefix)  # the venv under a path that needs quoting
    odd = tmp_path / "it's a venv" / "bin" / os.path.basename(sys.executable)
    repair = "echo 'quoted' \"double\" $HOME \\ back"
    script = make_executable(tmp_path / "migrt", launchers.render("migrt", str(odd), repair))
    assert launchers.read_installed(str(script)) == {"python": str(odd), "repair": repair}
    r = run(script, ["--version"], migrt_env.env)
    assert r.returncode == 0 and "migrt, version" in r.stdout
    (tmp_path / "it's a venv").unlink()
    r = run(script, ["--version"], migrt_env.env)
    assert one_line(r.stderr).endswith(f"repair: {repair}")


def test_hook_wrapper(tmp_path, migrt_env):
    hook_src = REPO / "hooks" / "cuda-criu-action"
    gone = make_executable(tmp_path / "gone" / "cuda-criu-action",
                           launchers.render("cuda-criu-action", str(tmp_path / "nope"), REPAIR, hook=str(hook_src)))
    env = {**migrt_env.env, "MIGRT_HOOK_LOG": str(tmp_path / "hook.log")}
    for action in ("post-dump", "setup-namespaces", ""):  # nothing to do: no Python, no failure
        r = run(gone, [], {**env, "CRTOOLS_SCRIPT_ACTION": action})
        assert (r.returncode, r.stderr) == (0, ""), action
    r = run(gone, [], {**env, "CRTOOLS_SCRIPT_ACTION": "pre-dump"})  # CRIU aborts the dump, its log says why
    assert r.returncode == 1
    assert one_line(r.stderr) == f"cuda-criu-action: migrt's Python interpreter {tmp_path}/nope is missing; repair: {REPAIR}"
    assert doctor_install.script_problem(str(gone)).endswith(f"repair: {REPAIR}")
    ok = make_executable(tmp_path / "ok" / "cuda-criu-action",
                         launchers.render("cuda-criu-action", sys.executable, REPAIR, hook=str(hook_src)))
    assert doctor_install.script_problem(str(ok)) is None


def test_hook_wrapper_python_without_migrt(tmp_path, migrt_env, bare_python):
    """The hook copied away from the checkout (as setup-host.sh does) and a python that lacks migrt."""
    hook = tmp_path / "libexec" / "cuda-criu-action.py"
    hook.parent.mkdir()
    shutil.copy(REPO / "hooks" / "cuda-criu-action", hook)
    wrapper = make_executable(tmp_path / "libexec" / "cuda-criu-action",
                              launchers.render("cuda-criu-action", bare_python, REPAIR, hook=str(hook)))
    env = {**migrt_env.env, "MIGRT_HOOK_LOG": str(tmp_path / "hook.log"), "MIGRT_PREFIX": str(tmp_path / "none"),
           "CRTOOLS_SCRIPT_ACTION": "pre-restore"}
    r = run(wrapper, [], env)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert line.startswith(f"cuda-criu-action: cannot import migrt.gpu with {bare_python} (Python ")
    assert line.endswith(f"; repair: {REPAIR}")


def test_install_runtime_command(tmp_path, migrt_env):
    """What a `pip install` user runs: the launchers, bound to this interpreter, idempotent."""
    bindir = tmp_path / "bin"
    cli = [str(VENV_BIN / "migrt"), "install", "runtime", "--bindir", str(bindir), "--repair", REPAIR, "--json"]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    files = json.loads(r.stdout)["files"]
    assert [(Path(f["path"]).name, f["action"]) for f in files] == [("migrt-runc", "written"), ("migrt", "written")]
    python = files[0]["python"]  # the venv's own python (the console script's interpreter)
    assert {f["python"] for f in files} == {python} and Path(python).parent == VENV_BIN
    r = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert [f["action"] for f in json.loads(r.stdout)["files"]] == ["unchanged", "unchanged"]
    for name in ("migrt-runc", "migrt"):
        assert os.stat(bindir / name).st_mode & 0o777 == 0o755
        assert launchers.read_installed(str(bindir / name)) == {"python": python, "repair": REPAIR}
    r = run(bindir / "migrt-runc", ["state", CID], migrt_env.env)  # pass-through to the configured runtime
    assert (r.returncode, r.stderr) == (0, "") and migrt_env.fake.argvs() == [[b"state", CID.encode()]]
    bad = subprocess.run([*cli[:-1], "--python", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 7 and "--python" in bad.stderr and "no such interpreter" in bad.stderr
    assert launchers.read_installed(str(bindir / "migrt-runc"))["python"] == python  # nothing written


def test_doctor_launcher_check(tmp_path, bare_python):
    gone = make_executable(tmp_path / "a" / "migrt-runc", launchers.render("migrt-runc", str(tmp_path / "nope"), REPAIR))
    c = doctor_install.launcher_check("migrt-runc", str(gone))
    assert c["status"] == "fail" and "no such interpreter" in c["detail"] and c["fix"] == REPAIR
    bare = make_executable(tmp_path / "b" / "migrt-runc", launchers.render("migrt-runc", bare_python, REPAIR))
    c = doctor_install.launcher_check("migrt-runc", str(bare))
    assert c["status"] == "fail" and "migrt does not import with it" in c["detail"]
    good = make_executable(tmp_path / "c" / "migrt-runc", launchers.render("migrt-runc", sys.executable, REPAIR))
    assert doctor_install.launcher_check("migrt-runc", str(good))["status"] == "ok"
    old = make_executable(tmp_path / "d" / "migrt-runc", "#!/bin/sh\nPYSHIM='/opt/migrt/venv/bin/migrt-runc-py'\n")
    assert doctor_install.launcher_check("migrt-runc", str(old))["status"] == "warn"
    assert doctor_install.launcher_check("migrt-runc", None)["status"] == "warn"


def _prefix(tmp_path: Path, interpreter: str, version: str | None = None) -> Path:
    """A setup-host.sh layout: venv/bin/python -> interpreter, <prefix>/interpreter, pyvenv.cfg."""
    root = tmp_path / "prefix"
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").symlink_to(interpreter)
    v = version or "%d.%d.%d" % sys.version_info[:3]
    (root / "venv" / "pyvenv.cfg").write_text(f"home = {os.path.dirname(interpreter)}\n"
                                              f"include-system-site-packages = false\nversion = {v}\n")
    (root / "interpreter").write_text(interpreter + "\n")
    (root / "repair").write_text(REPAIR + "\n")
    return root


def test_doctor_installation_check(tmp_path):
    real = os.path.realpath(sys.executable)
    copy = tmp_path / "py" / "python3.x"
    copy.parent.mkdir()
    shutil.copy(real, copy)
    root = _prefix(tmp_path, str(copy))
    c = doctor_install.installation_check(str(root))
    assert c["status"] == "fail" and "migrt does not import with it" in c["detail"]  # a venv without migrt
    assert c["fix"] == REPAIR
    shutil.rmtree(tmp_path / "prefix")
    root = _prefix(tmp_path, str(copy), version="3.99.0")  # the interpreter changed version under the venv
    assert doctor_install.installation_problem(str(root)) == (
        f"its interpreter {copy} is now Python {sys.version_info[0]}.{sys.version_info[1]}; the venv was made for 3.99")
    copy.unlink()  # the interpreter vanished
    assert doctor_install.installation_problem(str(root)) == f"its interpreter {copy} is gone"
    (root / "interpreter").unlink()
    c = doctor_install.installation_check(str(root))
    assert c["status"] == "warn" and "older setup-host.sh" in c["detail"]
    assert doctor_install.installation_check(str(tmp_path / "nothing")) is None


def test_venv_naming_unversioned_python_is_found(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3")  # what `python3 -m venv` makes
    (venv / "bin" / "python").symlink_to("python3")
    assert doctor_install.venv_base(str(venv)) == "/usr/bin/python3"
    monkeypatch.setattr(sys, "prefix", str(venv))
    c = doctor_install.python_check()
    assert c["status"] == "warn" and "names /usr/bin/python3, which an upgrade may move" in c["detail"]
    (venv / "bin" / "python3").unlink()
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3.11")  # what setup-host.sh makes
    assert doctor_install.venv_base(str(venv)) == "/usr/bin/python3.11"
    assert doctor_install.python_check()["status"] == "ok"
