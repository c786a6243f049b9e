"""migrt-runc: the Python shim and the POSIX sh fast path, against a fake lower runtime that records
its argv. No container is started: the fake stands in for runc, and every restore attempted here
fails before runc would be called (bad name, missing checkpoint, broken config)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from migrt.node import launchers
from migrt.runtime.markers import MARKER
from tests.unit.support import (
    PY_SHIM,
    SH_SHIM_SRC,
    FakeRuntime,
    MigrtEnv,
    make_executable,
    make_fake_runtime,
    write_bundle,
)

CID = "c0ffee"
HEAVY = ("click", "structlog", "yaml", "pynvml", "pycriu", "psutil")
ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")


def containerd_argv(root: Path, bundle: Path, *rest: str) -> list[str]:
    return ["--root", str(root), "--log", str(bundle / "log.json"), "--log-format", "json", *rest]


def pass_through_cases(root: Path, b: Path) -> list[list[str]]:
    """containerd's shapes (FIELD.md) for everything migrt does not intercept."""
    g = containerd_argv(root, b)
    return [
        [*g, "create", "--bundle", str(b), "--pid-file", f"{b}/init.pid", "--console-socket", "/tmp/pty/s.sock",
         "--no-pivot", "--no-new-keyring", CID],
        [*g, "start", CID],
        [*g, "exec", "--process", "/tmp/runc-process123", "--detach", "--pid-file", f"{b}/x.pid", CID],
        [*g, "kill", "--all", CID, "9"],
        [*g, "delete", CID],
        [*g, "delete", "--force", CID],
        [*g, "pause", CID],
        [*g, "resume", CID],
        [*g, "ps", "--format", "json", CID],
        [*g, "update", "--resources=-", CID],
        [*g, "--systemd-cgroup", "state", CID],
        [*g, "checkpoint", "--image-path", "/ck/img", "--work-path", "/ck/w", "--tcp-established", "--ext-unix-sk",
         "--shell-job", "--file-locks", "--empty-ns", "network", "--leave-running", CID],
        [*g, "restore", "--image-path", "/ck/img", "--work-path", "/ck/w", "--detach", "--pid-file", f"{b}/init.pid",
         "--no-pivot", "-no-subreaper", "--bundle", str(b), CID],
        ["features"],
        ["--version"],
        ["-root", str(root), "list", "-q"],
        ["--root=" + str(root), "--debug", "events", "--stats", CID],
        [],
    ]


def last_log_line(path: Path) -> dict:
    lines = path.read_text().splitlines()
    assert lines, f"{path} is empty"
    return json.loads(lines[-1])


# -- (a) the hot path imports the standard library only -------------------------------------------
PROBE = textwrap.dedent("""\
    import json, os, sys
    HEAVY = {heavy!r}
    import migrt.shim.__main__ as shim
    report = {{"import": sorted(m for m in HEAVY if m in sys.modules)}}
    class Exec(Exception):
        pass
    def fake_execv(path, args):
        raise Exec(args)
    os.execv = fake_execv
    for name, argv in {calls!r}:
        try:
            shim.main(argv)
            report[name] = "returned"
        except Exec:
            report[name] = sorted(m for m in HEAVY if m in sys.modules)
    import migrt.cli.main  # positive control: the check does see heavy imports
    report["control"] = sorted(m for m in HEAVY if m in sys.modules)
    print(json.dumps(report))
    """)


def test_shim_entry_point_imports_no_third_party_module(migrt_env, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", env=["PLAIN=1"])
    sandbox = write_bundle(tmp_path / "sandbox", env=["MIGRT_RESTORE=x"],
                           annotations={"io.kubernetes.cri.container-type": "sandbox"})
    root = tmp_path / "root"
    calls = [
        ("create", [*containerd_argv(root, bundle), "create", "--bundle", str(bundle), CID]),
        ("create-sandbox", [*containerd_argv(root, sandbox), "create", "--bundle", str(sandbox), CID]),
        ("start", [*containerd_argv(root, bundle), "start", CID]),
        ("exec", [*containerd_argv(root, bundle), "exec", "--process", "/tmp/p", "--detach", CID]),
        ("features", ["features"]),
    ]
    out = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, calls=calls)], env=migrt_env.env,
                         capture_output=True, text=True, timeout=30, check=True)
    report = json.loads(out.stdout)
    assert report["import"] == []
    for name, _ in calls:
        assert report[name] == [], f"{name}: pass-through imported {report[name]}"
    assert "click" in set(report["control"])


# The one writer of runc's log line for a call: handlers (ops/, migration/) take runtime/argv.py's Call and
# raise MigrtErrors; the shim writes the line and exits with the error's code. The page filler, a process
# of its own that outlives the call, reports its own failures there (pagefill/guard.py).
RUNCLOG_WRITERS = {"shim/__main__.py", "runtime/runclog.py", "pagefill/guard.py"}


def test_only_the_shim_writes_runcs_log_and_it_picks_no_exit_code_by_number():
    import ast

    import migrt

    pkg = Path(migrt.__file__).parent
    writers = set()
    for path in pkg.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("migrt.runtime", "migrt.runtime.runclog") and (
                    node.module.endswith("runclog") or any(a.name == "runclog" for a in node.names)):
                writers.add(str(path.relative_to(pkg)))
    assert writers <= RUNCLOG_WRITERS, f"runc's log written outside the shim: {sorted(writers - RUNCLOG_WRITERS)}"
    shim = ast.parse((pkg / "shim" / "__main__.py").read_text())
    numbers = [n.lineno for n in ast.walk(shim) if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)
               and isinstance(n.value.value, int) and n.value.value != 0]
    assert numbers == [], f"shim/__main__.py returns exit codes by number at lines {numbers}: raise the MigrtError"


# -- (b) the Python shim passes everything else through, byte-identical ------------------------------
def run_py(argv: list, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(PY_SHIM), *argv], env=env, capture_output=True, timeout=60, **kw)


def test_py_shim_is_installed():
    assert PY_SHIM.is_file() and os.access(PY_SHIM, os.X_OK), f"{PY_SHIM}: install with MIGRT_DEV=1 setup-host.sh"


def test_py_pass_through_is_byte_identical(migrt_env, tmp_path):
    bundle = write_bundle(tmp_path / "bundle")
    cases = pass_through_cases(tmp_path / "root", bundle)
    for argv in cases:
        r = run_py(argv, migrt_env.env)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b""), argv
    calls = migrt_env.fake.calls()
    assert [[bytes.fromhex(a) for a in c["argv_hex"]] for c in calls] == [[os.fsencode(a) for a in c] for c in cases]
    assert {c["argv0"] for c in calls} == {str(migrt_env.fake.path)}


def test_py_pass_through_odd_bytes(migrt_env):
    argv = [b"--root", b"/r", b"exec", b"--process", b"/p", b"id", b"sh", b"-c", b"echo 'a  b'\n\xff\xfe", b"",
            "\u00e9\u4e2d".encode()]
    r = run_py(argv, migrt_env.env)
    assert r.returncode == 0
    assert migrt_env.fake.argvs() == [argv]


@pytest.mark.parametrize("rc", [1, 3, 42, 255])
def test_py_exit_code_propagates(migrt_env, rc):
    env = {**migrt_env.env, "FAKE_RC": str(rc)}
    r = run_py(["delete", "--force", CID], env)
    assert r.returncode == rc
    assert migrt_env.fake.argvs() == [[b"delete", b"--force", CID.encode()]]


def test_py_stdin_env_and_fds_pass_through(migrt_env):
    read, write = os.pipe()
    try:
        env = {**migrt_env.env, "FAKE_READ_STDIN": "1", "MIGRT_EXTRA": "kept"}
        r = run_py(["update", "--resources=-", CID], env, input=b'{"memory": {"limit": 1}}', pass_fds=(read,))
    finally:
        os.close(read)
        os.close(write)
    assert r.returncode == 0
    (call,) = migrt_env.fake.calls()
    assert call["stdin"] == '{"memory": {"limit": 1}}'
    assert call["env"]["MIGRT_EXTRA"] == "kept"
    assert read in call["fds"], "an inherited fd (e.g. --preserve-fds) must reach the lower runtime"


@pytest.mark.parametrize("root_tokens", [["--root", "{root}"], ["--root={root}"], ["-root", "{root}"]])
def test_py_start_of_restored_container_is_a_no_op(migrt_env, tmp_path, root_tokens):
    root = tmp_path / "root"
    (root / CID).mkdir(parents=True)
    (root / CID / MARKER).write_text("{}")
    argv = [t.format(root=root) for t in root_tokens] + ["start", CID]
    r = run_py(argv, migrt_env.env)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    assert migrt_env.fake.calls() == []
    # another container in the same root is started normally
    r = run_py([t.format(root=root) for t in root_tokens] + ["start", "other"], migrt_env.env)
    assert r.returncode == 0
    assert len(migrt_env.fake.calls()) == 1


def test_py_marker_for_another_root_does_not_count(migrt_env, tmp_path):
    (tmp_path / "root-a" / CID).mkdir(parents=True)
    (tmp_path / "root-a" / CID / MARKER).write_text("{}")
    r = run_py(["--root", str(tmp_path / "root-b"), "start", CID], migrt_env.env)
    assert r.returncode == 0
    assert migrt_env.fake.argvs() == [[b"--root", os.fsencode(tmp_path / "root-b"), b"start", CID.encode()]]


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_py_no_lower_runtime(tmp_path, log_format):
    empty = tmp_path / "empty"
    empty.mkdir()
    log = tmp_path / "log.json"
    env = {"PATH": str(empty), "MIGRT_CONFIG": str(tmp_path / "nope.yaml")}
    r = run_py(["--log", str(log), "--log-format", log_format, "start", CID], env)
    assert (r.returncode, r.stdout, r.stderr) == (127, b"", b"")
    text = log.read_text()
    if log_format == "json":
        rec = json.loads(text.splitlines()[-1])
        assert rec["level"] == "error"
        assert "no lower runtime found" in rec["msg"]
        assert ISO_TIME.match(rec["time"])
    else:
        assert re.match(r'^time="[^"]+" level=error msg=".*no lower runtime found.*"$', text.strip())


def test_py_falls_back_to_runc_on_path_when_config_is_broken(tmp_path, migrt_env):
    runc = make_fake_runtime(tmp_path / "pathbin", "runc")
    migrt_env.config.write_text("runtime: [unclosed\nstore: {\n")
    env = {**migrt_env.env, "PATH": f"{tmp_path / 'pathbin'}:/usr/bin:/bin"}
    r = run_py(["kill", CID, "9"], env)
    assert r.returncode == 0
    assert runc.argvs() == [[b"kill", CID.encode(), b"9"]]
    assert migrt_env.fake.calls() == []


# -- (c) the POSIX sh fast path ------------------------------------------------------------------------
# "shebang" runs /bin/sh (dash on Debian); bash and busybox sh are the other shells nodes may have.
SHELLS = ["shebang"] + [s for s in ("bash", "busybox") if shutil.which(s)]


@dataclass
class ShShim:
    script: Path
    spy_log: Path
    shell: str
    env: MigrtEnv

    def run(self, argv: list, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        if self.shell == "shebang":
            cmd = [str(self.script)]
        elif self.shell == "busybox":
            cmd = [shutil.which("busybox"), "sh", str(self.script)]
        else:
            cmd = [shutil.which(self.shell), str(self.script)]
        return subprocess.run([*cmd, *argv], env=env or self.env.env, capture_output=True, timeout=60, **kw)

    def py_calls(self) -> list[str]:
        return self.spy_log.read_text().splitlines() if self.spy_log.exists() else []


def render_sh(dest: Path, python: str, repair: str = "sh packaging/setup-host.sh") -> Path:
    """What `migrt install runtime` (run by packaging/setup-host.sh) writes, for that interpreter."""
    return make_executable(dest, launchers.render("migrt-runc", python, repair))


@pytest.fixture(params=SHELLS)
def sh_shim(request, tmp_path, migrt_env) -> ShShim:
    # Python is reached through a spy interpreter that notes each hand-over (the argv after
    # `-P -c BOOT argv0 repair`), then execs the real one.
    spy_log = tmp_path / "py-calls.log"
    spy = make_executable(tmp_path / "spybin" / "python",
                          f'#!/bin/sh\n(shift 5; echo "$*") >> "{spy_log}"\nexec "{sys.executable}" "$@"\n')
    script = render_sh(tmp_path / "sbin" / "migrt-runc", str(spy))
    return ShShim(script=script, spy_log=spy_log, shell=request.param, env=migrt_env)


def test_sh_pass_through_is_byte_identical(sh_shim, tmp_path):
    bundle = write_bundle(tmp_path / "bundle")
    cases = pass_through_cases(tmp_path / "root", bundle)
    for argv in cases:
        r = sh_shim.run(argv)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b""), argv
    calls = sh_shim.env.fake.calls()
    assert [[bytes.fromhex(a) for a in c["argv_hex"]] for c in calls] == [[os.fsencode(a) for a in c] for c in cases]
    assert {c["argv0"] for c in calls} == {str(sh_shim.env.fake.path)}
    # Only calls that need a decision reach Python: checkpoint and restore (--version/--help are
    # runc's own boolean globals and pass straight through).
    handed = sh_shim.py_calls()
    assert len(handed) == 2, handed
    assert "checkpoint" in handed[0].split() and "restore" in handed[1].split()


def test_sh_containerd_hot_calls_never_start_python(sh_shim, tmp_path):
    bundle = write_bundle(tmp_path / "bundle")
    hot = [c for c in pass_through_cases(tmp_path / "root", bundle)
           if not ({"checkpoint", "restore"} & set(c))]
    for argv in hot:
        assert sh_shim.run(argv).returncode == 0
    assert sh_shim.py_calls() == []
    assert len(sh_shim.env.fake.calls()) == len(hot)


@pytest.mark.parametrize("rc", [1, 42])
def test_sh_exit_code_propagates(sh_shim, rc):
    r = sh_shim.run(["kill", CID, "9"], {**sh_shim.env.env, "FAKE_RC": str(rc)})
    assert r.returncode == rc
    assert sh_shim.env.fake.argvs() == [[b"kill", CID.encode(), b"9"]]


def test_sh_odd_bytes_stdin_and_fds(sh_shim):
    argv = [b"exec", b"--process", b"/p", b"id", b"sh", b"-c", b"x=\"$HOME\" '*' \n\xff", b"", b"--", b"-x"]
    read, write = os.pipe()
    try:
        r = sh_shim.run(argv, {**sh_shim.env.env, "FAKE_READ_STDIN": "1"}, input=b"data", pass_fds=(read,))
    finally:
        os.close(read)
        os.close(write)
    assert r.returncode == 0
    assert sh_shim.env.fake.argvs() == [argv]
    (call,) = sh_shim.env.fake.calls()
    assert call["stdin"] == "data"
    assert read in call["fds"]


def test_sh_unknown_global_flag_goes_through_python_unchanged(sh_shim, tmp_path):
    argv = ["--future-flag", "--root", str(tmp_path / "root"), "create", "--bundle", str(tmp_path), CID]
    write_bundle(tmp_path)
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    assert sh_shim.py_calls() == [" ".join(argv)]
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]


@pytest.mark.parametrize("form", ["--bundle", "--bundle=", "-b", "-bundle", "cwd"])
def test_sh_ordinary_create_execs_the_lower_runtime_directly(sh_shim, tmp_path, form):
    bundle = write_bundle(tmp_path / "bundle", env=["APP=1"])
    argv, cwd = bundle_argv(tmp_path, bundle, form)
    r = sh_shim.run(argv, cwd=cwd)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    assert sh_shim.py_calls() == []
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]


def bundle_argv(tmp_path: Path, bundle: Path, form: str) -> tuple[list[str], Path | None]:
    g = containerd_argv(tmp_path / "root", bundle)
    tail = ["--pid-file", f"{bundle}/init.pid", "--no-new-keyring", CID]
    if form == "cwd":
        return [*g, "create", *tail], bundle
    if form.endswith("="):
        return [*g, "create", form + str(bundle), *tail], None
    return [*g, "create", form, str(bundle), *tail], None


@pytest.mark.parametrize("form", ["--bundle", "--bundle=", "-b", "cwd"])
def test_sh_restore_request_goes_to_python_which_reports_in_runc_format(sh_shim, tmp_path, form):
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=no/such/name"])
    argv, cwd = bundle_argv(tmp_path, bundle, form)
    r = sh_shim.run(argv, cwd=cwd)
    # migrt writes nothing to stdout/stderr: they belong to the container and to containerd
    assert (r.stdout, r.stderr) == (b"", b"")
    assert r.returncode == 2  # InvalidName
    assert sh_shim.py_calls() == [" ".join(argv)]
    assert sh_shim.env.fake.calls() == []
    rec = last_log_line(bundle / "log.json")
    assert set(rec) == {"level", "msg", "time"}
    assert rec["level"] == "error"
    assert rec["msg"].startswith("migrt: invalid checkpoint name 'no/such/name'")
    assert ISO_TIME.match(rec["time"])
    assert not (tmp_path / "root" / CID).exists()


def test_sh_restore_request_by_annotation_goes_to_python(sh_shim, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", annotations={"migrt.io/restore": "Bad Name"})
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    r = sh_shim.run(argv)
    assert r.returncode == 2
    assert sh_shim.env.fake.calls() == []
    assert "invalid checkpoint name 'Bad Name'" in last_log_line(bundle / "log.json")["msg"]


def test_sh_restore_request_in_a_sandbox_passes_through(sh_shim, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=ck"],
                          annotations={"io.kubernetes.cri.container-type": "sandbox"})
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    assert sh_shim.py_calls() == [" ".join(argv)]  # the text test cannot tell; Python decides
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]
    assert not (bundle / "log.json").exists()


def test_sh_text_mention_without_a_request_passes_through(sh_shim, tmp_path):
    # MIGRT_RESTORE appears in config.json, but not as an env var: Python looks and passes it through.
    bundle = write_bundle(tmp_path / "bundle", env=["NOTE=set MIGRT_RESTORE to restore"])
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    assert sh_shim.run(argv).returncode == 0
    assert len(sh_shim.py_calls()) == 1
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]


def test_sh_missing_checkpoint_with_policy_fail(sh_shim, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=missing-ckpt"])
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (3, b"", b"")  # NotFound
    assert sh_shim.env.fake.calls() == []
    rec = last_log_line(bundle / "log.json")
    assert rec["level"] == "error"
    assert "checkpoint missing-ckpt: not found" in rec["msg"]
    # migrt's own debug log (structlog JSON lines) records the failure
    events = [json.loads(line) for line in sh_shim.env.log_file.read_text().splitlines()]
    assert any(e.get("event") == "restore_failed" and e.get("checkpoint") == "missing-ckpt" for e in events)


def test_without_log_the_error_goes_to_stderr_as_runc_writes_it(sh_shim, tmp_path):
    """podman's conmon passes no --log: runc then writes its error to stderr, which conmon reports as
    the reason the create failed; migrt's own refusals must reach it the same way (before, podman said
    only 'conmon bytes ""')."""
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=missing-ckpt"])
    argv = ["--root", str(tmp_path / "root"), "create", "--bundle", str(bundle), "--pid-file",
            f"{bundle}/init.pid", CID]
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout) == (3, b"")
    line = r.stderr.decode()
    assert line.count("\n") == 1 and re.match(r'time="[^"]+" level=error msg="migrt: checkpoint missing-ckpt: not found',
                                               line), line
    assert sh_shim.env.fake.calls() == []


@pytest.mark.parametrize("source", ["env", "annotation", "config"])
def test_sh_missing_checkpoint_with_policy_fresh_runs_the_original_create(sh_shim, tmp_path, source):
    env, ann = ["MIGRT_RESTORE=missing-ckpt"], None
    if source == "env":
        env.append("MIGRT_RESTORE_FALLBACK=fresh")
    elif source == "annotation":
        ann = {"migrt.io/restore-fallback": "fresh"}
    else:
        with open(sh_shim.env.config, "a") as fh:
            fh.write("restore_failure_policy: fresh\n")
    bundle = write_bundle(tmp_path / "bundle", env=env, annotations=ann)
    argv = [*containerd_argv(tmp_path / "root", bundle), "--systemd-cgroup", "create", "--bundle", str(bundle),
            "--pid-file", f"{bundle}/init.pid", "--console-socket", "/tmp/pty/s.sock", "--no-pivot",
            "--no-new-keyring", CID]
    r = sh_shim.run(argv, {**sh_shim.env.env, "FAKE_RC": "5"})
    assert (r.returncode, r.stdout, r.stderr) == (5, b"", b"")  # the lower runtime's own exit code
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]
    assert sh_shim.env.fake.calls()[0]["argv0"] == str(sh_shim.env.fake.path)
    lines = [json.loads(line) for line in (bundle / "log.json").read_text().splitlines()]
    assert [rec["level"] for rec in lines] == ["warning"]
    assert "restore of 'missing-ckpt' failed" in lines[0]["msg"] and "starting the container fresh" in lines[0]["msg"]
    assert (sh_shim.env.store / ".locks").is_dir()  # it did look in the configured store


def test_sh_bad_fallback_value_fails_closed(sh_shim, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=ck", "MIGRT_RESTORE_FALLBACK=maybe"])
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    r = sh_shim.run(argv)
    assert r.returncode == 2
    assert sh_shim.env.fake.calls() == []
    assert "MIGRT_RESTORE_FALLBACK must be one of" in last_log_line(bundle / "log.json")["msg"]


def test_sh_broken_config_with_restore_request_fails_closed(sh_shim, tmp_path):
    with open(sh_shim.env.config, "a") as fh:
        fh.write("restore_failure_policy: sometimes\n")
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=ck", "MIGRT_RESTORE_FALLBACK=fresh"])
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (7, b"", b"")  # ConfigError: never guess a store or policy
    assert sh_shim.env.fake.calls() == []
    rec = last_log_line(bundle / "log.json")
    assert rec["level"] == "error" and "restore_failure_policy" in rec["msg"]


def test_sh_unsupported_create_flag_is_refused_for_a_restore(sh_shim, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=ck"])
    argv = [*containerd_argv(tmp_path / "root", bundle), "create", "--bundle", str(bundle), "--preserve-fds", "2", CID]
    r = sh_shim.run(argv)
    assert r.returncode == 2
    assert sh_shim.env.fake.calls() == []
    assert "--preserve-fds is not supported" in last_log_line(bundle / "log.json")["msg"]


@pytest.mark.parametrize("root_tokens", [["--root", "{root}"], ["--root={root}"], ["-root", "{root}"],
                                         ["--debug", "--root", "{root}", "--log", "{root}/l", "--log-format=json"]])
def test_sh_start_of_restored_container_is_a_no_op(sh_shim, tmp_path, root_tokens):
    root = tmp_path / "root"
    (root / CID).mkdir(parents=True)
    (root / CID / MARKER).write_text("{}")
    g = [t.format(root=root) for t in root_tokens]
    r = sh_shim.run([*g, "start", CID])
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    assert sh_shim.env.fake.calls() == []
    assert sh_shim.py_calls() == []
    r = sh_shim.run([*g, "start", "other"])
    assert r.returncode == 0
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in (*g, "start", "other")]]


def test_sh_start_without_marker_calls_the_lower_runtime(sh_shim, tmp_path):
    root = tmp_path / "root"
    (root / CID).mkdir(parents=True)  # state dir without migrt's marker
    argv = ["--root", str(root), "start", CID]
    r = sh_shim.run(argv, {**sh_shim.env.env, "FAKE_RC": "1"})
    assert r.returncode == 1
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]


def plant_path_markers(tmp_path: Path) -> Path:
    """Markers that a naive `<root>/<id>/migrt-restored` lookup would find for ids that are paths."""
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / MARKER).write_text("{}")  # `start .` and `start ../root`
    (tmp_path / MARKER).write_text("{}")  # `start ..`
    (root / "a" / "b" / MARKER).write_text("{}")  # `start a/b`
    return root


PATH_IDS = ["..", ".", "a/b", "../root"]


@pytest.mark.parametrize("cid", PATH_IDS)
def test_sh_start_marker_lookup_refuses_paths(sh_shim, tmp_path, cid):
    argv = ["--root", str(plant_path_markers(tmp_path)), "start", cid]
    assert sh_shim.run(argv).returncode == 0
    assert sh_shim.env.fake.argvs() == [[os.fsencode(a) for a in argv]]


@pytest.mark.parametrize("cid", PATH_IDS)
def test_py_start_marker_lookup_refuses_paths(migrt_env, tmp_path, cid):
    argv = ["--root", str(plant_path_markers(tmp_path)), "start", cid]
    assert run_py(argv, migrt_env.env).returncode == 0
    assert migrt_env.fake.argvs() == [[os.fsencode(a) for a in argv]]


def test_sh_falls_back_to_runc_on_path(sh_shim, tmp_path):
    runc = make_fake_runtime(tmp_path / "pathbin", "runc")
    env = {**sh_shim.env.env, "PATH": f"{tmp_path / 'pathbin'}:/usr/bin:/bin",
           "MIGRT_CONFIG": str(tmp_path / "missing.yaml")}
    r = sh_shim.run(["delete", CID], env)
    assert r.returncode == 0
    assert runc.argvs() == [[b"delete", CID.encode()]]
    assert sh_shim.py_calls() == []
    # a config without `runtime:` (or a garbled one): same
    sh_shim.env.config.write_text("store: [garbled\n\x00\xff")
    env["MIGRT_CONFIG"] = str(sh_shim.env.config)
    assert sh_shim.run(["delete", CID], env).returncode == 0
    assert len(runc.calls()) == 2
    assert sh_shim.env.fake.calls() == []


def test_sh_configured_runtime_not_executable_goes_through_python_to_runc(sh_shim, tmp_path):
    runc = make_fake_runtime(tmp_path / "pathbin", "runc")
    sh_shim.env.config.write_text(f"runtime: {tmp_path}/gone   # removed\n")
    env = {**sh_shim.env.env, "PATH": f"{tmp_path / 'pathbin'}:/usr/bin:/bin"}
    r = sh_shim.run(["kill", CID, "15"], env)
    assert r.returncode == 0
    assert runc.argvs() == [[b"kill", CID.encode(), b"15"]]
    assert len(sh_shim.py_calls()) == 1


def test_sh_never_execs_itself(sh_shim, tmp_path):
    runc = make_fake_runtime(tmp_path / "pathbin", "runc")
    # a config naming migrt-runc, and a PATH whose first runc is migrt itself
    links = tmp_path / "links"
    links.mkdir()
    os.symlink(sh_shim.script, links / "runc")
    sh_shim.env.config.write_text(f"runtime: {sh_shim.script}\n")
    env = {**sh_shim.env.env, "PATH": f"{links}:{tmp_path / 'pathbin'}:/usr/bin:/bin"}
    r = sh_shim.run(["state", CID], env)
    assert r.returncode == 0
    assert runc.argvs() == [[b"state", CID.encode()]]


def test_sh_quoted_runtime_with_comment(sh_shim, tmp_path):
    spaced = make_fake_runtime(tmp_path / "dir with space", "my runc")
    sh_shim.env.config.write_text(f"store: /x\nruntime: \"{spaced.path}\"   # quoted\n")
    assert sh_shim.run(["ps", CID]).returncode == 0
    assert spaced.argvs() == [[b"ps", CID.encode()]]
    assert sh_shim.py_calls() == []


def test_sh_rendered_exactly_like_setup_host(tmp_path, migrt_env):
    """No spy: the script as packaging installs it, pointing at the venv's python."""
    script = render_sh(tmp_path / "migrt-runc", sys.executable)
    assert os.stat(script).st_mode & 0o777 == 0o755
    bundle = write_bundle(tmp_path / "bundle", env=["MIGRT_RESTORE=../etc"])
    argv = [*containerd_argv(tmp_path / "root", bundle), "create", "--bundle", str(bundle), CID]
    r = subprocess.run([str(script), *argv], env=migrt_env.env, capture_output=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (2, b"", b"")
    assert migrt_env.fake.calls() == []
    assert "invalid checkpoint name '../etc'" in last_log_line(bundle / "log.json")["msg"]
    r = subprocess.run([str(script), "features"], env=migrt_env.env, capture_output=True, timeout=60)
    assert r.returncode == 0
    assert migrt_env.fake.argvs() == [[b"features"]]


def test_sh_script_is_posix(tmp_path):
    # dash -n parses without running; checkbashisms is not installed everywhere
    r = subprocess.run(["dash", "-n", str(SH_SHIM_SRC)], capture_output=True, timeout=10)
    assert r.returncode == 0, r.stderr


def test_python_dash_m_entry_point(migrt_env, tmp_path):
    argv = ["--root", str(tmp_path / "root"), "kill", "--all", CID, "9"]
    r = subprocess.run([sys.executable, "-m", "migrt.shim", *argv], env={**migrt_env.env, "FAKE_RC": "9"},
                       capture_output=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (9, b"", b"")
    assert migrt_env.fake.argvs() == [[os.fsencode(a) for a in argv]]
