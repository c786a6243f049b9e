"""`migrt install containerd` and the doctor's handler check, against config files in a temp dir.

Paths inside the configs are host paths; `root` (the temp dir) prefixes them, as in a DaemonSet."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from migrt.cli.main import cli
from migrt.errors import ConfigError
from migrt.node import containerd_config as cc
from migrt.node.doctor_containerd import containerd_handler_check
from migrt.node.install import apply, plan_containerd, set_imports

import migrt.cli.install  # noqa: F401,E402 - registers `migrt install`

REPO = Path(__file__).resolve().parents[2]
MAIN = "/etc/containerd/config.toml"
DROPIN = "/etc/containerd/conf.d/migrt.toml"

V2_MAIN = """\
# node config (kubeadm style)
version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "/etc/containerd/certs.d"
"""

V3_MAIN = """\
version = 3
root = '/var/lib/containerd'

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = 'registry.k8s.io/pause:3.10'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    SystemdCgroup = false
"""


def _host(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _write(root: Path, path: str, text: str) -> Path:
    p = _host(root, path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def _install(root: Path, **kw):
    return apply(plan_containerd(MAIN, root=str(root), **kw), root=str(root))


def _effective(root: Path) -> tuple[int, dict]:
    cfg = cc.load(MAIN, str(root))
    assert not cfg.missing
    return cfg.version, cfg.effective()


def _backups(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.migrt-backup-*"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "host"
    r.mkdir()
    return r


# -- version 3 (containerd 2.x) ---------------------------------------------------------------------

def test_v3_adds_dropin_and_import(root):
    _write(root, MAIN, V3_MAIN)
    plan = _install(root)
    assert [(c.path, c.action) for c in plan.changes] == [(DROPIN, "create"), (MAIN, "update")]
    main = tomllib.loads(_host(root, MAIN).read_text())
    assert main["imports"] == [DROPIN]
    assert {k: v for k, v in main.items() if k != "imports"} == tomllib.loads(V3_MAIN)  # nothing else touched
    dropin = tomllib.loads(_host(root, DROPIN).read_text())
    assert dropin["version"] == 3
    h = dropin["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["migrt"]
    assert h == {"runtime_type": "io.containerd.runc.v2", "pod_annotations": ["migrt.io/*"],
                 "options": {"BinaryName": "/usr/local/bin/migrt-runc", "SystemdCgroup": False}}
    # containerd 2.x merges key by key: the main file's settings survive next to the handler
    version, eff = _effective(root)
    assert cc.handler(eff, version)["options"]["BinaryName"] == "/usr/local/bin/migrt-runc"
    assert cc.handler(eff, version, "runc")["options"]["SystemdCgroup"] is False
    assert eff["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"].endswith("pause:3.10")
    # the main file was backed up before it changed; the new drop-in needs no backup
    assert plan.changes[1].backup and plan.changes[0].backup is None
    assert _host(root, plan.changes[1].backup).read_text() == V3_MAIN
    assert _backups(root) == [plan.changes[1].backup.lstrip("/")]


def test_idempotent_second_run_changes_nothing(root):
    _write(root, MAIN, V3_MAIN)
    _install(root)
    files = {p: p.read_text() for p in root.rglob("*") if p.is_file()}
    plan = _install(root)
    assert not plan.changed and [c.action for c in plan.changes] == ["unchanged", "unchanged"]
    assert {p: p.read_text() for p in root.rglob("*") if p.is_file()} == files  # not even a new backup


def test_v3_conf_d_glob_already_imported(root):
    _write(root, MAIN, 'version = 3\nimports = ["/etc/containerd/conf.d/*.toml"]\n')
    _write(root, "/etc/containerd/conf.d/10-other.toml", "version = 3\n[plugins.'io.containerd.cri.v1.runtime']\n"
           "  enable_cdi = true\n")
    plan = _install(root)
    assert [(c.path, c.action) for c in plan.changes] == [(DROPIN, "create"), (MAIN, "unchanged")]
    version, eff = _effective(root)
    assert cc.handler(eff, version) is not None
    assert eff["plugins"]["io.containerd.cri.v1.runtime"]["enable_cdi"] is True
    assert _backups(root) == []


def test_existing_multiline_imports_kept(root):
    text = 'version = 3\nimports = [\n  "/etc/containerd/extra.toml",  # keep me\n]\n\n[grpc]\n  address = "/run/x.sock"\n'
    _write(root, MAIN, text)
    _write(root, "/etc/containerd/extra.toml", "version = 3\n")
    _install(root)
    main = tomllib.loads(_host(root, MAIN).read_text())
    assert main["imports"] == ["/etc/containerd/extra.toml", DROPIN]
    assert main["grpc"] == {"address": "/run/x.sock"}


def test_user_additions_to_handler_survive_update(root):
    _write(root, MAIN, V3_MAIN)
    _install(root)
    p = _host(root, DROPIN)
    p.write_text(p.read_text().replace('  SystemdCgroup = false\n', '  SystemdCgroup = false\n  Root = "/run/migrt-runc"\n')
                 .replace('runtime_type = "io.containerd.runc.v2"', 'runtime_type = "io.containerd.runc.v1"'))
    plan = _install(root)
    assert [c.action for c in plan.changes] == ["update", "unchanged"]
    h = tomllib.loads(p.read_text())["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["migrt"]
    assert h["runtime_type"] == "io.containerd.runc.v2"  # what migrt needs is enforced
    assert h["options"]["Root"] == "/run/migrt-runc"  # what the user added is kept
    assert len(_backups(root)) == 2  # main (first run) and the drop-in (this run)


def test_absent_config_uses_installed_containerd_version(root):
    plan = _install(root, containerd_major=2)
    assert plan.version == 3
    assert tomllib.loads(_host(root, MAIN).read_text()) == {"version": 3, "imports": [DROPIN]}
    version, eff = _effective(root)
    assert version == 3 and cc.handler(eff, 3)
    plan = _install(_fresh(root), containerd_major=1)
    assert plan.version == 2


def _fresh(root: Path) -> Path:
    new = root.parent / "host2"
    new.mkdir()
    return new


def test_absent_config_and_no_containerd_is_an_error(root):
    with pytest.raises(ConfigError, match="no containerd binary"):
        plan_containerd(MAIN, root=str(root))


def test_version_1_refused(root):
    _write(root, MAIN, '[plugins.cri]\n  sandbox_image = "x"\n')
    with pytest.raises(ConfigError, match="version 1 is not supported.*containerd config migrate"):
        plan_containerd(MAIN, root=str(root))


def test_missing_import_refused(root):
    _write(root, MAIN, 'version = 3\nimports = ["/etc/containerd/nope.toml"]\n')
    with pytest.raises(ConfigError, match="nope.toml"):
        plan_containerd(MAIN, root=str(root))


def test_broken_toml_names_the_file(root):
    _write(root, MAIN, "version = 3\n[plugins\n")
    with pytest.raises(ConfigError, match=r"config\.toml: invalid TOML"):
        plan_containerd(MAIN, root=str(root))


# -- version 2 (containerd 1.6/1.7): imports replace whole plugin sections -----------------------------

def test_v2_dropin_carries_the_whole_cri_section(root):
    _write(root, MAIN, V2_MAIN)
    plan = _install(root)
    assert [(c.path, c.action) for c in plan.changes] == [(DROPIN, "create"), (MAIN, "update")]
    assert plan.notes and "copy of the whole CRI section" in plan.notes[0]
    # merged the 1.x way (the drop-in's CRI section replaces the main file's): nothing is lost
    version, eff = _effective(root)
    assert version == 2
    cri = eff["plugins"]["io.containerd.grpc.v1.cri"]
    original = tomllib.loads(V2_MAIN)["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == original["sandbox_image"] and cri["registry"] == original["registry"]
    assert cri["containerd"]["runtimes"]["runc"] == original["containerd"]["runtimes"]["runc"]
    assert cri["containerd"]["runtimes"]["migrt"]["options"] == {"BinaryName": "/usr/local/bin/migrt-runc",
                                                                 "SystemdCgroup": True}  # follows runc


def test_v2_without_cri_section_keeps_default_runc_handler(root):
    _write(root, MAIN, "version = 2\n")
    _install(root)
    version, eff = _effective(root)
    rts = cc.runtimes(eff, version)
    assert set(rts) == {"runc", "migrt"}  # containerd 1.x would otherwise lose its default runc handler
    assert rts["runc"] == {"runtime_type": "io.containerd.runc.v2"}


def test_v2_later_import_replacing_cri_is_refused(root):
    _write(root, MAIN, 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n')
    _write(root, "/etc/containerd/conf.d/zz-nvidia.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri".'
           'containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n')
    with pytest.raises(ConfigError, match="zz-nvidia.toml replaces the CRI section"):
        plan_containerd(MAIN, root=str(root))
    assert not _host(root, DROPIN).exists()


def test_v2_rerun_picks_up_cri_changes_and_doctor_notices_drift(root):
    _write(root, MAIN, V2_MAIN)
    _install(root)
    _write(root, "/usr/local/bin/migrt-runc", "#!/bin/sh\n").chmod(0o755)
    check = containerd_handler_check(MAIN, root=str(root))
    assert check["status"] == "ok" and "does not serve kubelet's checkpoint API" in check["detail"], check
    main = _host(root, MAIN)
    main.write_text(main.read_text().replace("pause:3.9", "pause:3.10"))
    check = containerd_handler_check(MAIN, root=str(root))
    assert check["status"] == "warn" and "out of date" in check["detail"], check
    _install(root)
    _version, eff = _effective(root)
    assert eff["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"].endswith("pause:3.10")
    assert containerd_handler_check(MAIN, root=str(root))["status"] == "ok"


# -- the CLI -------------------------------------------------------------------------------------

def test_cli_dry_run_shows_diff_and_writes_nothing(root):
    _write(root, MAIN, V3_MAIN)
    res = CliRunner().invoke(cli, ["install", "containerd", "--root", str(root), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"+++ {DROPIN}" in res.stdout and "+imports = [\"/etc/containerd/conf.d/migrt.toml\"]" in res.stdout
    assert "would create" in res.stderr and "nothing written" in res.stderr
    assert _host(root, MAIN).read_text() == V3_MAIN and not _host(root, DROPIN).exists()
    assert _backups(root) == []


def test_cli_json_and_restart_hint(root):
    _write(root, MAIN, V3_MAIN)
    res = CliRunner().invoke(cli, ["install", "containerd", "--root", str(root), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["changed"] and data["restart_needed"] and data["version"] == 3
    assert {f["path"]: f["action"] for f in data["files"]} == {DROPIN: "create", MAIN: "update"}
    res = CliRunner().invoke(cli, ["install", "containerd", "--root", str(root)])
    assert res.exit_code == 0 and "nothing to do" in res.stderr
    _write(root, MAIN, V3_MAIN)  # undo the import: the command says to restart, and restarts nothing
    res = CliRunner().invoke(cli, ["install", "containerd", "--root", str(root)])
    assert "restart it to load the handler" in res.stderr


def test_cli_error_exit_code(root):
    _write(root, MAIN, "[plugins.cri]\n")
    res = CliRunner().invoke(cli, ["install", "containerd", "--root", str(root)])
    assert res.exit_code == 7 and "not supported" in res.stderr


# -- the doctor's check and the shipped drop-ins --------------------------------------------------------

def test_doctor_handler_check(root):
    assert containerd_handler_check(MAIN, root=str(root))["status"] == "warn"  # no config at all
    _write(root, MAIN, V3_MAIN)
    check = containerd_handler_check(MAIN, root=str(root))
    assert check["status"] == "warn" and "migrt install containerd" in check["fix"]
    _install(root)
    check = containerd_handler_check(MAIN, root=str(root))
    assert check["status"] == "fail" and "not executable" in check["detail"]  # no migrt-runc on that host
    _write(root, "/usr/local/bin/migrt-runc", "#!/bin/sh\n").chmod(0o755)
    check = containerd_handler_check(MAIN, root=str(root))
    assert check["status"] == "ok", check
    _write(root, MAIN, "version = 3\n[broken\n")
    assert containerd_handler_check(MAIN, root=str(root))["status"] == "fail"


@pytest.mark.parametrize("name,version", [("migrt-v2.toml", 2), ("migrt-v3.toml", 3)])
def test_shipped_dropins_match_what_install_writes(root, name, version):
    _write(root, f"/etc/containerd/{name}", (REPO / "configs" / "containerd" / name).read_text())
    _write(root, MAIN, f'version = {version}\nimports = ["/etc/containerd/{name}"]\n')
    _version, eff = _effective(root)
    shipped = cc.handler(eff, version)
    assert shipped["options"].pop("SystemdCgroup") is True  # documented: match the runc handler
    _write(root, MAIN, f"version = {version}\n")
    written = cc.handler(tomllib.loads(plan_containerd(MAIN, root=str(root)).changes[0].after), version)
    assert written == shipped


def test_toml_writer_round_trip():
    data = {"version": 2, "oom_score": -999, "imports": ["/a b/*.toml"], "plugins": {
        "io.containerd.grpc.v1.cri": {"sandbox_image": 'we"ird\\\n', "x": 1.5, "flag": False,
                                      "mirrors": [{"endpoint": ["https://m"]}],
                                      "containerd": {"runtimes": {"my.rt": {"options": {"A": 1}}, "empty": {}}}}}}
    assert tomllib.loads(cc.dumps(data)) == data


def test_set_imports_edits_only_imports():
    text = 'version = 3\nimports = ["/x]y.toml",   # a comment ]\n  "/z.toml"]\n[grpc]\n  address = "/s"\n'
    assert tomllib.loads(set_imports(text, ["/x]y.toml", "/z.toml", "/new.toml"])) == {
        "version": 3, "imports": ["/x]y.toml", "/z.toml", "/new.toml"], "grpc": {"address": "/s"}}
    # a text edit that would change anything else is refused, not written
    tricky = 'version = 3\nnote = """\nimports = ["/in-a-string"]\n"""\n'
    with pytest.raises(ConfigError, match="imports"):
        set_imports(tricky, ["/new.toml"])


@pytest.mark.skipif(not shutil.which("containerd"), reason="containerd not installed")
@pytest.mark.parametrize("main", [V2_MAIN, V3_MAIN])
def test_installed_containerd_reads_the_result(tmp_path, main):
    """containerd itself (`config dump`, no daemon) sees the handler; host paths, no --root."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(main)
    apply(plan_containerd(str(cfg)))
    res = subprocess.run(["containerd", "--config", str(cfg), "config", "dump"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    dump = tomllib.loads(res.stdout)
    major = cc.containerd_major()
    h = cc.handler(dump, cc.default_version_for(major))
    assert h and h["options"]["BinaryName"] == cc.MIGRT_RUNC, textwrap.shorten(res.stdout, 2000)
    assert cc.handler(dump, cc.default_version_for(major), "runc")
