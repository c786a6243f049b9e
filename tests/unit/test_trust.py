"""Files the node trusts (migrt/trust.py): the config and the runtime it names, the migration key, the
TLS files, the registry credentials and CA. Each must be one that nobody but root (or the user migrt
runs as) could have written, the secrets read by nobody else; migrt refuses the others, naming the file
and the fix. Files of another user are made with os.chown to uid 65534 (the tests run as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from migrt import config, trust
from migrt.errors import ConfigError
from migrt.migration.protocol import load_key
from migrt.migration import tls
from migrt.node import doctor, doctor_gpu
from migrt.registry import auth
from tests.unit.support import make_fake_runtime, write_bundle
from tests.unit.test_shim import CID, containerd_argv, last_log_line, run_py, sh_shim  # noqa: F401 - fixture

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")


def _file(path: Path, text: str = "x" * 32, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


# -- the rule --------------------------------------------------------------------------------------------

def test_a_file_of_ours_in_our_directories_is_trusted(tmp_path):
    f = _file(tmp_path / "etc" / "config.yaml", mode=0o644)
    assert trust.problem(str(f)) is None
    assert trust.problem(str(f), secret=True) is not None  # readable by others: fine for a config, not a key


def test_sticky_world_writable_directory_is_accepted(tmp_path):
    d = tmp_path / "sticky"
    d.mkdir()
    d.chmod(0o1777)
    assert trust.problem(str(_file(d / "key"))) is None
    d.chmod(0o777)
    why = trust.problem(str(d / "key"))
    assert f"{d} is writable by group or others (mode 777)" in why and f"chmod go-w {d}" in why


def test_group_or_world_writable_file_is_refused(tmp_path):
    f = _file(tmp_path / "config.yaml", mode=0o664)
    with pytest.raises(trust.Untrusted) as info:
        trust.check(str(f), "migrt config")
    msg = str(info.value)
    assert msg.startswith(f"migrt config {f}: {f} is writable by group or others (mode 664)")
    assert f"run 'chmod go-w {f}'" in msg and info.value.exit_code == 7


@root_only
def test_file_or_directory_of_another_user_is_refused(tmp_path):
    f = _file(tmp_path / "d" / "config.yaml", mode=0o644)
    os.chown(f, NOBODY, NOBODY)
    assert f"{f} is owned by uid {NOBODY}, not root" in trust.problem(str(f))
    assert f"chown root {f}" in trust.problem(str(f))
    os.chown(f, 0, 0)
    os.chown(f.parent, NOBODY, NOBODY)  # nobody could rename another file in its place
    assert f"{f.parent} is owned by uid {NOBODY}" in trust.problem(str(f))


@root_only
def test_links_are_followed_only_when_ours_and_to_a_trusted_place(tmp_path):
    real = _file(tmp_path / "real" / "key")
    link = tmp_path / "link"
    link.symlink_to(real)
    assert trust.problem(str(link), secret=True) is None
    os.lchown(link, NOBODY, NOBODY)
    assert f"{link} is owned by uid {NOBODY}" in trust.problem(str(link))
    os.lchown(link, 0, 0)
    os.chown(real.parent, NOBODY, NOBODY)  # the target's directory: checked once the link is resolved
    assert f"{real.parent} is owned by uid {NOBODY}" in trust.problem(str(link))


# -- the config and the runtime it names -----------------------------------------------------------------

def test_config_writable_by_others_is_refused_by_every_loader(migrt_env):
    migrt_env.config.chmod(0o666)
    with pytest.raises(trust.Untrusted, match=r"migrt config .*writable by group or others \(mode 666\).*chmod go-w"):
        config.load()
    from migrt.runtime import lower

    with pytest.raises(trust.Untrusted):
        lower.lower_runtime()
    assert lower.configured_value("store") is None  # nothing read from it
    migrt_env.config.chmod(0o644)
    assert config.load().runtime == str(migrt_env.fake.path)


@root_only
def test_runtime_of_another_user_is_refused(migrt_env):
    os.chown(migrt_env.fake.path, NOBODY, NOBODY)
    with pytest.raises(trust.Untrusted, match=f"lower runtime {migrt_env.fake.path}: .*owned by uid {NOBODY}"):
        config.load().runtime_path()


@root_only
@pytest.mark.parametrize("how", ["mode", "owner", "directory"])
def test_py_shim_refuses_an_untrusted_config_and_runs_nothing(migrt_env, tmp_path, how):
    """Item 9: a config writable by another user named the runtime that a pass-through call ran as root."""
    bundle = write_bundle(tmp_path / "bundle")
    cfg = migrt_env.config
    if how == "mode":
        cfg.chmod(0o666)
    elif how == "owner":
        os.chown(cfg, NOBODY, NOBODY)
    else:
        d = tmp_path / "shared"
        d.mkdir(mode=0o777)
        d.chmod(0o777)
        cfg = d / "config.yaml"
        cfg.write_text(migrt_env.config.read_text())
    env = {**migrt_env.env, "MIGRT_CONFIG": str(cfg)}
    r = run_py([*containerd_argv(tmp_path / "root", bundle), "delete", CID], env)
    assert (r.returncode, r.stdout, r.stderr) == (7, b"", b"")
    assert migrt_env.fake.calls() == []
    msg = last_log_line(bundle / "log.json")["msg"]
    assert msg.startswith(f"migrt: migrt config {cfg}: ") and "refuses to use it" in msg
    assert ("chmod go-w" if how != "owner" else "chown root") in msg


@root_only
@pytest.mark.parametrize("how", ["config-mode", "config-owner", "config-directory", "runtime-owner", "runtime-mode"])
def test_sh_fast_path_never_execs_a_runtime_from_an_untrusted_config(sh_shim, tmp_path, how):
    bundle = write_bundle(tmp_path / "bundle")
    env = dict(sh_shim.env.env)
    cfg, fake = sh_shim.env.config, sh_shim.env.fake
    if how == "config-mode":
        cfg.chmod(0o646)
    elif how == "config-owner":
        os.chown(cfg, NOBODY, 0)
    elif how == "config-directory":
        d = tmp_path / "shared"
        d.mkdir()
        d.chmod(0o770)
        env["MIGRT_CONFIG"] = str(_file(d / "config.yaml", cfg.read_text(), 0o644))
    elif how == "runtime-owner":
        os.chown(fake.path, NOBODY, NOBODY)
    else:
        fake.path.chmod(0o757)
    argv = [*containerd_argv(tmp_path / "root", bundle), "kill", CID, "9"]
    r = sh_shim.run(argv, env)
    assert (r.returncode, r.stdout, r.stderr) == (7, b"", b"")
    assert fake.calls() == []
    assert len(sh_shim.py_calls()) == 1  # the decision went to Python, which refused
    assert "refuses to use it" in last_log_line(bundle / "log.json")["msg"]


@root_only
@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) runs the script as another user")
def test_sh_fast_path_of_a_non_root_user_trusts_its_own_files():
    """migrt-runc run by a user (rootless): its own config and runtime pass straight through, as root's
    do for root; made writable by others, they go to Python."""
    from migrt.node import launchers

    d = Path(tempfile.mkdtemp(prefix="migrt-nonroot-", dir="/tmp"))
    try:
        script = d / "migrt-runc"
        script.write_text(launchers.render("migrt-runc", str(d / "no-python"), "repair"))
        rt = d / "rt"
        rt.write_text('#!/bin/sh\necho "ran $*"\n')
        cfg = d / "config.yaml"
        cfg.write_text(f"runtime: {rt}\n")
        for f in (d, script, rt, cfg):
            os.chown(f, NOBODY, NOBODY)
            f.chmod(0o755 if f != cfg else 0o644)
        argv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "env",
                f"MIGRT_CONFIG={cfg}", str(script), "state", CID]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert (r.returncode, r.stdout) == (0, f"ran state {CID}\n"), r.stderr
        cfg.chmod(0o666)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert r.returncode == 127 and "Python interpreter" in r.stderr and "ran" not in r.stdout
    finally:
        shutil.rmtree(d)


def test_sh_fast_path_hands_a_linked_config_to_python_which_follows_a_trusted_link(sh_shim, tmp_path):
    link = tmp_path / "link.yaml"
    link.symlink_to(sh_shim.env.config)
    r = sh_shim.run(["state", CID], {**sh_shim.env.env, "MIGRT_CONFIG": str(link)})
    assert r.returncode == 0
    assert sh_shim.env.fake.argvs() == [[b"state", CID.encode()]]
    assert len(sh_shim.py_calls()) == 1


def test_sh_fast_path_with_a_trusted_config_starts_no_python(sh_shim, tmp_path):
    """The positive control of the refusals above: same config, trusted modes, straight exec."""
    sh_shim.env.config.chmod(0o600)
    assert sh_shim.run(["state", CID]).returncode == 0
    assert sh_shim.env.fake.argvs() == [[b"state", CID.encode()]] and sh_shim.py_calls() == []


@root_only
def test_criu_named_by_the_config_must_be_trusted(tmp_path):
    from migrt.criu import binary

    criu = make_fake_runtime(tmp_path / "criubin", "criu").path
    assert binary.choose(str(criu)) == (str(criu), "'criu:' in the migrt config")
    os.chown(criu, NOBODY, NOBODY)
    path, why = binary.choose(str(criu))
    assert path is None and f"owned by uid {NOBODY}" in why


# -- secrets: migration key, TLS key, registry credentials ---------------------------------------------------

@root_only
def test_migration_key_of_another_user_is_refused(tmp_path):
    key = _file(tmp_path / "migration.key")
    assert load_key(str(key)) == b"x" * 32
    os.chown(key, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"migration key file {key}: {key} is owned by uid {NOBODY}, not root"):
        load_key(str(key))


@root_only
def test_symlinked_migration_key_says_what_and_why(tmp_path):
    """It was refused with only "Too many levels of symbolic links"; now a link that is root's, to a
    trusted file, is followed (Kubernetes secret volumes are links), and any other is refused by name."""
    key = _file(tmp_path / "secrets" / "migration.key")
    link = tmp_path / "migration.key"
    link.symlink_to(key)
    assert load_key(str(link)) == b"x" * 32
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as info:
        load_key(str(link))
    assert f"{link} is owned by uid {NOBODY}" in str(info.value) and "symbolic" not in str(info.value)
    os.lchown(link, 0, 0)
    key.chmod(0o640)
    with pytest.raises(ConfigError, match=f"{key} is readable by group or others .*chmod 600 {key}"):
        load_key(str(link))


@root_only
def test_tls_key_and_ca_of_another_user_are_refused(tmp_path):
    files = tls.TLSFiles(cert=str(_file(tmp_path / "node.crt", mode=0o644)), key=str(_file(tmp_path / "node.key")),
                     ca=str(_file(tmp_path / "ca.crt", mode=0o644)))
    tls.check_files(files)
    os.chown(files.key, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"migration_tls private key {files.key}: .*uid {NOBODY}"):
        tls.check_files(files)
    os.chown(files.key, 0, 0)
    os.chmod(files.key, 0o644)
    with pytest.raises(ConfigError, match="readable by group or others"):
        tls.check_files(files)
    os.chmod(files.key, 0o600)
    os.chmod(files.ca, 0o666)
    with pytest.raises(ConfigError, match=f"migration_tls CA {files.ca}: .*writable"):
        tls.check_files(files)


@root_only
def test_registry_auth_file_of_another_user_is_refused(tmp_path):
    f = _file(tmp_path / "auth.json", json.dumps({"auths": {"r.example": {"username": "u", "password": "p"}}}))
    assert auth.load(str(f), "r.example").username == "u"
    os.chown(f, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"registry auth file {f}: .*owned by uid {NOBODY}"):
        auth.load(str(f), "r.example")


# -- doctor ----------------------------------------------------------------------------------------------

def test_doctor_fails_an_untrusted_config(migrt_env):
    """Item 9: doctor said ok for a config writable by others."""
    migrt_env.config.chmod(0o666)
    checks = {c["name"]: c for c in doctor.run_checks()}
    assert checks["config"]["status"] == "fail" and "writable by group or others" in checks["config"]["detail"]
    migrt_env.config.chmod(0o644)
    assert {c["name"]: c for c in doctor.run_checks()}["config"]["status"] == "ok"


def test_doctor_names_untrusted_files_the_config_points_at(migrt_env, tmp_path):
    key = _file(tmp_path / "k", mode=0o644)
    with open(migrt_env.config, "a") as fh:
        fh.write(f"migration_key_file: {key}\n")
    check = doctor.trusted_files_check(config.load())
    assert check["status"] == "fail" and f"migration_key_file {key}: {key} is readable" in check["detail"]
    key.chmod(0o600)
    assert doctor.trusted_files_check(config.load())["status"] == "ok"


def test_doctor_does_not_run_a_criu_hook_others_could_change(tmp_path, monkeypatch):
    ran = tmp_path / "ran"
    hook = _file(tmp_path / "hook", f"#!/bin/sh\ntouch {ran}\n", 0o777)
    conf = _file(tmp_path / "runc.conf", f"action-script {hook}\n", 0o644)
    monkeypatch.setattr(doctor_gpu, "CRIU_CONFIGS", (str(conf),))
    check = doctor_gpu._hook_check()
    assert check["status"] == "fail" and "writable by group or others" in check["detail"]
    assert not ran.exists()
    hook.chmod(0o755)
    assert doctor_gpu._hook_check()["status"] == "ok" and ran.exists()


def test_doctor_checks_the_script_migrts_hook_wrapper_runs(tmp_path, monkeypatch):
    from migrt.node import launchers

    script = _file(tmp_path / "checkout" / "cuda-criu-action", "print('hook')\n", 0o664)
    wrapper = tmp_path / "cuda-criu-action"
    wrapper.write_text(launchers.render("cuda-criu-action", "/nonexistent/python", "repair", hook=str(script)))
    wrapper.chmod(0o755)
    conf = _file(tmp_path / "runc.conf", f"action-script {wrapper}\n", 0o644)
    monkeypatch.setattr(doctor_gpu, "CRIU_CONFIGS", (str(conf),))
    check = doctor_gpu._hook_check()
    assert check["status"] == "fail" and f"{script} is writable by group or others" in check["detail"]

