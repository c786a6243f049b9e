"""The rooms of migrt/ and the direction of imports between them (README "Development").

Each room may import only the rooms listed for it: entry points on top, capabilities in the middle,
mechanisms and foundations below. A new room must be added here with its place, so the layering is
a decision, not an accident.
"""

from __future__ import annotations

import ast
import pathlib

import migrt

PKG = pathlib.Path(migrt.__file__).parent
FOUNDATION = {"errors", "faults", "log", "names", "progress", "trust", "jsonsafe", "text", "kernel",
              "migrate_peers", "__init__"}
MECHANISMS = {"runtime", "criu", "gpu", "store", "oci", "pagefill", "pagedump", "seccomp"}
ALLOWED = {
    # entry points
    "cli": {"migration", "node", "ops", "pods", "registry", "config"} | MECHANISMS | FOUNDATION,
    "shim": {"ops", "migration", "config"} | MECHANISMS | FOUNDATION,  # migration: a pod's pull at create
    # capabilities
    "migration": {"ops", "pods", "config"} | MECHANISMS | FOUNDATION,
    "node": {"config"} | MECHANISMS | FOUNDATION,
    "ops": {"pods", "registry", "config"} | MECHANISMS | FOUNDATION,
    "registry": {"pods", "config"} | MECHANISMS | FOUNDATION,
    "pods": {"config"} | MECHANISMS | FOUNDATION,
    # configuration, then the mechanisms (runtime quotes CRIU's logs), then the foundation
    "config": {"runtime"} | FOUNDATION,
    "runtime": {"criu"} | FOUNDATION,
    "pagefill": {"runtime", "criu"} | FOUNDATION,  # the page filler beside CRIU's lazy pages (runc log lines)
    "pagedump": {"pagefill"} | FOUNDATION,  # the parallel memory dump (reads images with pagefill's reader)
    "criu": FOUNDATION,
    "gpu": FOUNDATION,
    "store": FOUNDATION,
    "oci": FOUNDATION,
    "seccomp": FOUNDATION,  # seccomp filters compared by what they answer (libc's seccomp call through kernel/)
    "errors": set(), "faults": {"errors"}, "log": set(), "names": {"errors", "text"}, "progress": set(),
    "__init__": set(),
    "jsonsafe": set(), "text": set(),  # the bounded JSON reader, the escaping of outside text in messages
    "migrate_peers": set(),  # which node agents a pod may pull from: the config's entries parsed and matched
    "kernel": set(),  # libc through ctypes, mmap/madvise/userfaultfd numbers, the atomic write: stdlib only
    "trust": {"errors"},  # who may own and write the files a node trusts (config, keys, store, runtime)
    "apphook": set(),  # the application hook's client side, copied into apps: standard library only
}


def _room(parts: list[str]) -> str:
    return parts[0] if parts else "__init__"


def _edges():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("").parts
        src = _room(list(rel))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "migrt":
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "migrt"]
            else:
                continue
            for t in targets:
                dst = _room(t.split(".")[1:])
                if dst != src:
                    yield str(path.relative_to(PKG)), src, dst


def test_every_room_is_placed():
    rooms = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in PKG.glob("*.py")}
    assert rooms <= set(ALLOWED), f"rooms without a place in ALLOWED: {sorted(rooms - set(ALLOWED))}"


def test_imports_point_down_only():
    bad = sorted({f"{f}: {s} -> {d}" for f, s, d in _edges() if d not in ALLOWED.get(s, set())})
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_every_room_has_a_docstring():
    for init in PKG.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 20, f"{init.parent.name}/ has no one-line purpose"
