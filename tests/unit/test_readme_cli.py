"""README's "CLI reference" table and the CLI agree: every command there exists with every option the
row names, and every command of the CLI has a row (commands added without docs, options renamed)."""

from __future__ import annotations

import os
import re

import click

from migrt.cli.main import cli

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _leaves(group: click.Group, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    out = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(_leaves(cmd, path + (name,)))
        else:
            out[path + (name,)] = cmd
    return out


def _rows() -> list[tuple[tuple[str, ...], set[str]]]:
    """(command path, options named) of each row of the CLI reference table."""
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("## CLI reference", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\| `migrt ([^`]*)` \|", line)
        if not m:
            continue
        usage = m.group(1)
        words = []
        for w in usage.split():
            if not re.fullmatch(r"[a-z][a-z-]*(\\\|[a-z][a-z-]*)*", w):
                break
            words.append(w.split("\\|"))
        options = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", usage))
        paths: list[tuple[str, ...]] = [()]
        for alternatives in words:
            paths = [p + (a,) for p in paths for a in alternatives]
        rows.extend((p, options) for p in paths)
    return rows


def test_every_documented_command_and_option_exists():
    leaves = _leaves(cli)
    rows = _rows()
    assert len(rows) >= 15
    for path, options in rows:
        assert path in leaves, f"README documents 'migrt {' '.join(path)}', which the CLI lacks"
        known = {o for p in leaves[path].params for o in p.opts + p.secondary_opts}
        missing = options - known
        assert not missing, f"README documents {sorted(missing)} for 'migrt {' '.join(path)}': not in its --help"


def test_every_command_is_documented():
    documented = {path for path, _ in _rows()}
    missing = [" ".join(p) for p in _leaves(cli) if p not in documented]
    assert not missing, f"commands without a row in README's CLI reference: {missing}"


def test_every_option_is_documented():
    leaves = _leaves(cli)
    for path, options in _rows():
        for param in leaves[path].params:
            names = [o for o in param.opts + param.secondary_opts if o.startswith("-")]
            if names and "--help" not in names:
                assert set(names) & options, f"'migrt {' '.join(path)}' has {names[0]}, missing from README's row"
