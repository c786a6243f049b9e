"""The docs and the code agree (docs/reference.md, README.md):
- the reference's "CLI reference" table and the CLI: every command there exists with every option the
  row names, and every command of the CLI has a row (commands added without docs, options renamed);
- every `migrt ...` line in the README's and the reference's code blocks is a command with options
  the CLI has (examples that went stale);
- the reference's "Configuration file" table lists exactly the keys migrt.config accepts;
- the reference's "Environment variables" section names every MIGRT_* variable the code reads, and
  none that no file of the repository mentions any more."""

from __future__ import annotations

import os
import re
from pathlib import Path

import click
import pytest

from migrt import config
from migrt.cli.main import cli
from migrt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
REFERENCE = REPO / "docs" / "reference.md"
CODE_DIRS = ("migrt", "hooks", "packaging", "scripts", "bench")  # what must be documented
MENTION_DIRS = CODE_DIRS + ("tests", ".ci", "configs")  # where a documented name must still occur
VARIABLE = re.compile(r"MIGRT_[A-Z0-9_]+")
OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def _section(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    assert f"\n## {heading}\n" in text, f"{path.name} has no '## {heading}' section"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _leaves(group: click.Group, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    out = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(_leaves(cmd, path + (name,)))
        else:
            out[path + (name,)] = cmd
    return out


def _options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in p.opts + p.secondary_opts}


def _rows() -> list[tuple[tuple[str, ...], set[str]]]:
    """(command path, options named) of each row of the CLI reference table."""
    rows = []
    for line in _section(REFERENCE, "CLI reference").splitlines():
        m = re.match(r"\| `migrt ([^`]*)` \|", line)
        if not m:
            continue
        usage = m.group(1)
        words = []
        for w in usage.split():
            if not re.fullmatch(r"[a-z][a-z0-9-]*(\\\|[a-z][a-z0-9-]*)*", w):
                break
            words.append(w.split("\\|"))
        paths: list[tuple[str, ...]] = [()]
        for alternatives in words:
            paths = [p + (a,) for p in paths for a in alternatives]
        rows.extend((p, set(OPTION.findall(usage))) for p in paths)
    return rows


def test_every_documented_command_and_option_exists():
    leaves = _leaves(cli)
    rows = _rows()
    assert len(rows) >= 15
    for path, options in rows:
        assert path in leaves, f"docs/reference.md documents 'migrt {' '.join(path)}', which the CLI lacks"
        missing = options - _options(leaves[path])
        where = f"'migrt {' '.join(path)}'"
        assert not missing, f"docs/reference.md documents {sorted(missing)} for {where}: not in its --help"


def test_every_command_is_documented():
    documented = {path for path, _ in _rows()}
    missing = [" ".join(p) for p in _leaves(cli) if p not in documented]
    assert not missing, f"commands without a row in docs/reference.md's CLI reference: {missing}"


def test_every_option_is_documented():
    leaves = _leaves(cli)
    for path, options in _rows():
        for param in leaves[path].params:
            names = [o for o in param.opts + param.secondary_opts if o.startswith("-")]
            if names and "--help" not in names:
                where = f"'migrt {' '.join(path)}'"
                assert set(names) & options, f"{where} has {names[0]}, missing from docs/reference.md's row"


def _example_lines() -> list[tuple[str, str]]:
    """(file name, line) of every `migrt ...` command line in a fenced code block."""
    out = []
    for path in (README, REFERENCE):
        blocks = path.read_text(encoding="utf-8").split("```")[1::2]
        for block in blocks:
            for line in block.splitlines():
                line = line.strip()
                if line.startswith("migrt "):
                    out.append((path.name, line.split("  #", 1)[0].strip()))
    return out


def test_every_example_command_exists():
    examples = _example_lines()
    assert len(examples) >= 8
    for name, line in examples:
        cmd: click.Command = cli
        for word in line.split()[1:]:
            if not isinstance(cmd, click.Group) or word not in cmd.commands:
                break
            cmd = cmd.commands[word]
        assert not isinstance(cmd, click.Group), f"{name}: '{line}' names no command of the CLI"
        unknown = set(OPTION.findall(line)) - _options(cmd)
        assert not unknown, f"{name}: '{line}' uses {sorted(unknown)}, which '{cmd.name}' lacks"


def _known_keys(tmp_path: Path) -> set[str]:
    """The keys migrt.config accepts, as its own error for an unknown key lists them."""
    path = tmp_path / "config.yaml"
    path.write_text("zz_no_such_key: 1\n")
    with pytest.raises(ConfigError) as exc:
        config.load(str(path))
    known = str(exc.value).rsplit("known: ", 1)[1]
    return {k.strip() for k in known.split(",")}


def test_the_reference_lists_every_config_key(tmp_path):
    known = _known_keys(tmp_path)
    assert {"runtime", "store", "criu"} <= known
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", _section(REFERENCE, "Configuration file"), re.M))
    assert not known - documented, f"config keys missing from docs/reference.md: {sorted(known - documented)}"
    stale = sorted(documented - known)
    assert not stale, f"docs/reference.md documents config keys migrt no longer has: {stale}"
    example = set(re.findall(r"^#? ?([a-z_]+):", (REPO / "configs" / "config.yaml").read_text(), re.M))
    assert not example - known, f"configs/config.yaml names unknown keys: {sorted(example - known)}"


def _mentions(dirs: tuple[str, ...]) -> dict[str, str]:
    """Every MIGRT_* name in the text files under dirs, with one file that has it."""
    found: dict[str, str] = {}
    for top in dirs:
        for root, subdirs, files in os.walk(REPO / top):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            for f in files:
                path = Path(root, f)
                data = path.read_bytes()
                if b"\0" in data[:4096]:
                    continue  # binary (e.g. the vendored CRIU tarball)
                for name in VARIABLE.findall(data.decode("utf-8", "replace")):
                    found.setdefault(name, str(path.relative_to(REPO)))
    return found


def _documented_variables() -> set[str]:
    return set(VARIABLE.findall(_section(REFERENCE, "Environment variables")))


def test_the_reference_names_every_migrt_variable_of_the_code():
    code = _mentions(CODE_DIRS)
    assert {"MIGRT_RESTORE", "MIGRT_CONFIG", "MIGRT_PREFIX"} <= set(code)
    missing = {name: where for name, where in code.items() if name not in _documented_variables()}
    assert not missing, f"MIGRT_* names without a line in docs/reference.md 'Environment variables': {missing}"


def test_the_reference_names_no_variable_the_repository_lost():
    gone = _documented_variables() - set(_mentions(MENTION_DIRS))
    assert not gone, f"docs/reference.md documents MIGRT_* names no file mentions any more: {sorted(gone)}"
