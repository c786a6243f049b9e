"""migrt.config.load (full YAML) and migrt.runtime.lower (the hot path's one-line reader)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from migrt import config
from migrt.errors import ConfigError
from migrt.runtime import lower
from tests.unit.support import REPO, make_executable

SHIPPED = REPO / "configs" / "config.yaml"


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- config.load -------------------------------------------------------------------------------------
def test_defaults_when_file_is_missing(tmp_path):
    cfg = config.load(str(tmp_path / "nope.yaml"))
    assert cfg.loaded is False
    assert cfg.path == str(tmp_path / "nope.yaml")
    assert (cfg.runtime, cfg.store, cfg.restore_failure_policy, cfg.log_level) == ("runc", "/var/lib/migrt", "fail", "info")
    assert cfg.log_file == "/var/log/migrt/migrt.log"
    assert cfg.runtime_roots == [] and cfg.criu_options == {}


def test_migrt_config_env_names_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, "store: /srv/ckpt\n")
    monkeypatch.setenv("MIGRT_CONFIG", path)
    cfg = config.load()
    assert cfg.path == path
    assert cfg.loaded is True
    assert cfg.store == "/srv/ckpt"


def test_default_path_without_env(monkeypatch):
    monkeypatch.delenv("MIGRT_CONFIG", raising=False)
    assert lower.config_path() == "/etc/migrt/config.yaml"
    monkeypatch.setenv("MIGRT_CONFIG", "")
    assert lower.config_path() == "/etc/migrt/config.yaml"


def test_empty_file_means_defaults(tmp_path):
    cfg = config.load(write(tmp_path, "# only a comment\n"))
    assert cfg.loaded is True
    assert cfg.store == "/var/lib/migrt"


def test_full_config(tmp_path):
    cfg = config.load(write(tmp_path, """\
runtime: /usr/bin/crun
store: /data/migrt
restore_failure_policy: fresh
log_file: /tmp/m.log
log_level: debug
runtime_roots: [/run/a, /run/b]
criu_options: {tcp_established: true, file_locks: false}
"""))
    assert cfg.runtime == "/usr/bin/crun"
    assert cfg.store == "/data/migrt"
    assert cfg.restore_failure_policy == "fresh"
    assert cfg.log_file == "/tmp/m.log"
    assert cfg.log_level == "debug"
    assert cfg.runtime_roots == ["/run/a", "/run/b"]
    assert cfg.criu_options == {"tcp_established": True, "file_locks": False}


def test_dump_pages_keys(tmp_path):
    assert (config.Config(path="x").dump_pages, config.Config(path="x").dump_threads) == ("auto", 0)
    cfg = config.load(write(tmp_path, "dump_pages: parallel\ndump_threads: 6\n"))
    assert (cfg.dump_pages, cfg.dump_threads) == ("parallel", 6)


def test_shipped_config_loads_and_both_readers_agree():
    cfg = config.load(str(SHIPPED))
    assert cfg.loaded is True
    assert cfg.runtime == "runc"
    assert lower.configured_runtime(str(SHIPPED)) == cfg.runtime


@pytest.mark.parametrize(("text", "match"), [
    ("runtim: runc\n", r"unknown key\(s\) runtim"),
    ("store: relative/dir\n", "'store' must be an absolute path"),
    ("restore_failure_policy: retry\n", "'restore_failure_policy' must be one of"),
    ("log_level: verbose\n", "'log_level' must be one of"),
    ("runtime: ''\n", "'runtime' must be a non-empty string"),
    ("runtime: 5\n", "'runtime' must be a non-empty string"),
    ("store: [a]\n", "'store' must be a non-empty string"),
    ("runtime_roots: /run/a\n", "'runtime_roots' must be a list of absolute paths"),
    ("runtime_roots: [rel]\n", "'runtime_roots' must be a list of absolute paths"),
    ("criu_options: {tcp: true}\n", "'criu_options' keys must be among"),
    ("criu_options: {tcp_established: 'yes'}\n", "'criu_options' keys must be among"),
    ("dump_pages: fast\n", "'dump_pages' must be one of"),
    ("dump_threads: -1\n", "'dump_threads' must be an integer from 0 to 256"),
    ("dump_threads: true\n", "'dump_threads' must be an integer from 0 to 256"),
    ("- a\n- b\n", "expected a mapping of keys, got list"),
    ("runtime: [unclosed\n", "invalid YAML"),
    ("a: b: c\n", "invalid YAML"),
    ("\tbad: tab\n", "invalid YAML"),
])
def test_broken_config_is_a_config_error(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as info:
        config.load(path)
    assert info.value.exit_code == 7
    assert path in str(info.value)


@pytest.mark.parametrize("text, where", [
    ("runtime: [unclosed\n", "at line 2, column 1: "),
    ("store: /x\n  bad: indent\n", "at line 2, column 6: mapping values are not allowed here"),
    ("\tbad: tab\n", "at line 1, column 1: "),
])
def test_invalid_yaml_is_one_line_with_where(tmp_path, text, where):
    # the shim writes this message as one runc-shaped log line; PyYAML's own text spans several
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    msg = str(info.value)
    assert "\n" not in msg and f"invalid YAML {where}" in msg, msg


def test_undecodable_config_is_a_config_error(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"store: /x\xff\n")
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(str(path))


def test_unreadable_config_is_a_config_error(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(str(tmp_path / "dir.yaml"))


def test_runtime_path(tmp_path):
    exe = make_executable(tmp_path / "myrunc", "#!/bin/sh\n")
    cfg = config.load(write(tmp_path, f"runtime: {exe}\n"))
    assert cfg.runtime_path() == str(exe)
    cfg = config.load(write(tmp_path, f"runtime: {tmp_path}/missing\n"))
    with pytest.raises(ConfigError, match="not an executable file"):
        cfg.runtime_path()


# -- lower.configured_runtime --------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("runtime: /x # c\n", "/x"),
    ("runtime: /x\n", "/x"),
    ("runtime:    /x   \n", "/x"),
    ("runtime: /x\r\n", "/x"),
    ("runtime: \"/x y\"\n", "/x y"),
    ("runtime: '/x y' # quoted\n", "/x y"),
    ("runtime: \"/x\"  # c\n", "/x"),
    ("runtime: runc\n", "runc"),
    ("runtime: /x#notacomment\n", "/x#notacomment"),
    ("store: /s\nruntime: crun\nlog_level: info\n", "crun"),
    ("runtime: /first\nruntime: /second\n", "/first"),
    ("runtime:\n", None),
    ("runtime: ''\n", None),
    ("runtime: # nothing\n", None),
    ("# runtime: /commented\nstore: /s\n", None),
    ("  runtime: /indented\n", None),
    ("runtime_roots: [/r]\n", None),
    ("", None),
    ("runtime: /x", "/x"),  # no trailing newline
])
def test_configured_runtime(tmp_path, text, expected):
    assert lower.configured_runtime(write(tmp_path, text)) == expected


@pytest.mark.parametrize("text", [
    "runtime: /x # c\n", "runtime:    /x   \n", "runtime: /x\r\n", "runtime: \"/x y\"\n",
    "runtime: '/x y' # quoted\n", "runtime: /x#notacomment\n", "store: /s\nruntime: crun\n",
    "runtime: /x",
])
def test_fast_reader_agrees_with_yaml(tmp_path, text):
    path = write(tmp_path, text)
    assert lower.configured_runtime(path) == config.load(path).runtime


def test_configured_runtime_missing_file(tmp_path):
    assert lower.configured_runtime(str(tmp_path / "nope")) is None


def test_configured_runtime_binary_garbage(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage\nruntime: /ok\n")
    assert lower.configured_runtime(str(path)) == "/ok"


# -- lower.resolve / lower_runtime ---------------------------------------------------------------------
@pytest.fixture
def pathdir(tmp_path, monkeypatch) -> Path:
    """An isolated PATH with a fake `runc`."""
    d = tmp_path / "bin"
    d.mkdir()
    make_executable(d / "runc", "#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(d))
    return d


def test_lower_runtime_uses_the_configured_path(tmp_path, pathdir, monkeypatch):
    exe = make_executable(tmp_path / "crun", "#!/bin/sh\n")
    monkeypatch.setenv("MIGRT_CONFIG", write(tmp_path, f"runtime: {exe}\n"))
    assert lower.lower_runtime() == (str(exe), None)


def test_lower_runtime_resolves_a_name_on_path(tmp_path, pathdir, monkeypatch):
    make_executable(pathdir / "crun", "#!/bin/sh\n")
    monkeypatch.setenv("MIGRT_CONFIG", write(tmp_path, "runtime: crun\n"))
    assert lower.lower_runtime() == (str(pathdir / "crun"), None)


@pytest.mark.parametrize("text", ["runtime: [broken\n", "{{{{\n", "", "store: /x\n"])
def test_lower_runtime_falls_back_to_runc_when_config_is_broken(tmp_path, pathdir, monkeypatch, text):
    monkeypatch.setenv("MIGRT_CONFIG", write(tmp_path, text))
    path, warning = lower.lower_runtime()
    assert path == str(pathdir / "runc")
    if text.startswith("runtime:"):
        assert warning and "[broken" in warning and path in warning
    else:
        assert warning is None


def test_lower_runtime_falls_back_when_config_is_missing(tmp_path, pathdir, monkeypatch):
    monkeypatch.setenv("MIGRT_CONFIG", str(tmp_path / "nope.yaml"))
    assert lower.lower_runtime() == (str(pathdir / "runc"), None)


def test_lower_runtime_falls_back_when_configured_runtime_is_not_executable(tmp_path, pathdir, monkeypatch):
    plain = tmp_path / "notexec"
    plain.write_text("#!/bin/sh\n")
    for value in (str(plain), str(tmp_path / "missing"), str(tmp_path), "no-such-runtime"):
        monkeypatch.setenv("MIGRT_CONFIG", write(tmp_path, f"runtime: {value}\n"))
        path, warning = lower.lower_runtime()
        assert path == str(pathdir / "runc"), value
        assert warning and repr(value) in warning


def test_lower_runtime_none_when_nothing_found(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("MIGRT_CONFIG", str(tmp_path / "nope.yaml"))
    assert lower.lower_runtime() == (None, None)
    monkeypatch.setenv("MIGRT_CONFIG", write(tmp_path, "runtime: /gone\n"))
    path, warning = lower.lower_runtime()
    assert path is None
    assert "using nothing" in warning


@pytest.mark.parametrize("self_name", ["migrt-runc", "migrt-runc-py"])
def test_lower_runtime_never_returns_migrt(tmp_path, pathdir, monkeypatch, self_name):
    me = make_executable(tmp_path / "inst" / self_name, "#!/bin/sh\n")
    # configured by path, by name on PATH, and through a symlink called `runc` that points at migrt
    make_executable(pathdir / self_name, "#!/bin/sh\n")
    for value in (str(me), self_name):
        monkeypatch.setenv("MIGRT_CONFIG", write(tmp_path, f"runtime: {value}\n"))
        path, _ = lower.lower_runtime()
        assert path == str(pathdir / "runc")
        assert os.path.basename(os.path.realpath(path)) not in lower.SELF_NAMES
    link = tmp_path / "links" / "runc"
    link.parent.mkdir()
    os.symlink(me, link)
    monkeypatch.setenv("MIGRT_CONFIG", write(tmp_path, f"runtime: {link}\n"))
    assert lower.lower_runtime()[0] == str(pathdir / "runc")
    # a PATH whose first `runc` is migrt itself (a symlink): skipped
    monkeypatch.setenv("PATH", f"{link.parent}:{pathdir}")
    monkeypatch.setenv("MIGRT_CONFIG", str(tmp_path / "nope.yaml"))
    assert lower.lower_runtime()[0] == str(pathdir / "runc")
    monkeypatch.setenv("PATH", str(link.parent))
    assert lower.lower_runtime() == (None, None)


def test_lower_runtime_refuses_the_rendered_sh_shim(tmp_path, pathdir, monkeypatch):
    # an executable migrt-runc.sh from a checkout, linked under another name, is still migrt
    script = make_executable(tmp_path / "src" / "migrt" / "shim" / "migrt-runc.sh", "#!/bin/sh\n")
    link = tmp_path / "runc-real"
    os.symlink(script, link)
    assert lower.resolve(str(link)) is None
    other = make_executable(tmp_path / "src" / "other.sh", "#!/bin/sh\n")
    assert lower.resolve(str(other)) == str(other)


def test_resolve(tmp_path, pathdir):
    exe = make_executable(tmp_path / "x", "#!/bin/sh\n")
    assert lower.resolve(str(exe)) == str(exe)
    assert lower.resolve("runc") == str(pathdir / "runc")
    assert lower.resolve(None) is None
    assert lower.resolve("") is None
    assert lower.resolve("nope") is None


def test_default_root():
    assert lower.default_root("/usr/bin/runc") == "/run/runc"
    assert lower.default_root("/usr/local/bin/nvidia-container-runtime") == "/run/runc"
    assert lower.default_root("/usr/bin/crun") == "/run/crun"


def test_real_runc_is_found_on_the_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("MIGRT_CONFIG", str(tmp_path / "nope.yaml"))
    path, warning = lower.lower_runtime()
    assert path is not None and os.path.basename(path) == "runc"
    assert path == lower.resolve(shutil.which("runc"))


# -- the config read without PyYAML (restore path's start) must read exactly as PyYAML does ----------------
def test_flat_config_reads_as_pyyaml_does_or_defers_to_it():
    import random

    import yaml

    from migrt import config as config_mod

    keys = ["runtime", "store", "log_level", "on", "null", "a-b", "_x", "x1", "  nested", "-", "k y", "---"]
    values = ["", "runc", "/var/lib/migrt", "/opt/x y", "true", "True", "TRUE", "yes", "no", "On", "off", "y", "n",
              "~", "null", "Null", "NULL", "nULL", "0", "00", "017", "12", "-3", "+4", "1.5", "1e3", ".inf", "nan",
              "0x1f", "1_000", "2001-12-14", "1:30", "[]", "{}", "[a]", "{a: 1}", "'q'", '"q"', "a#b", "#c", "a #c",
              "a\t#c", "&a x", "*a", "!!str 1", "runc.v2", "-", ".", "a:b", "- x", "|", ">", "@x", "`x`", "%x"]
    rnd = random.Random(9)
    flat = 0
    for _ in range(5000):
        lines = []
        for _ in range(rnd.randint(0, 5)):
            kind = rnd.random()
            if kind < 0.1:
                lines.append(rnd.choice(["", "# comment", "   # indented comment", "\t"]))
            else:
                sep = rnd.choice([": ", ":", ":  ", ":\t", ": "])
                key = rnd.choice(keys[:6] if rnd.random() < 0.9 else keys)
                value = rnd.choice(values[:36] if rnd.random() < 0.9 else values)
                lines.append(f"{key}{sep}{value}".rstrip() if rnd.random() < 0.9 else f"{key}{sep}{value}")
        text = "\n".join(lines) + rnd.choice(["", "\n"])
        got = config_mod._flat_yaml(text)
        if got is None:
            continue
        flat += 1
        assert got == yaml.safe_load(text), text
        assert all(type(v) is type(w) for v, w in zip(got.values(), yaml.safe_load(text).values())), text
    assert flat > 150  # the fast path is taken often enough for this to mean something


def test_the_shipped_config_is_read_without_pyyaml():
    from pathlib import Path

    from migrt import config as config_mod

    text = (Path(__file__).resolve().parents[2] / "configs" / "config.yaml").read_text()
    assert config_mod._flat_yaml(text) == {"runtime": "runc", "store": "/var/lib/migrt",
                                           "restore_failure_policy": "fail", "log_file": "/var/log/migrt/migrt.log",
                                           "log_level": "info", "runtime_roots": [], "criu_options": {}}
