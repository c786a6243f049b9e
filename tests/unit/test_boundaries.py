"""Two boundaries of issue 28 that a reader of one file cannot see: the lower runtime is run by one
runner (runtime/runc.py's LowerRuntime), and no module of migrt/ imports itself back through another
(the last circle was runtime/runc.py <-> runtime/stop.py). Both read the source, not the behaviour."""

from __future__ import annotations

import ast
import pathlib
import re

import migrt

PKG = pathlib.Path(migrt.__file__).parent
SPAWNERS = {"run", "Popen", "call", "check_call", "check_output"}
# an argv whose first word names the lower runtime: a runtime's or the lower runtime's path
RUNTIME = re.compile(r"(^|\.)(runtime|lower|lower_runtime|runtime_path|lower_path|runc)(\(\))?$")
# the runner; the shim hands the process over *as* the lower runtime (argv untouched), standard library only
RUNNERS = {"runtime/runc.py", "shim/__main__.py"}


def _first_words(node: ast.expr | None, assigned: dict[str, list[ast.expr]]) -> list[str]:
    """The source of an argv's first element(s): through a local name, both branches of an `a if c else b`."""
    if isinstance(node, ast.Name) and node.id in assigned:
        return [w for value in assigned[node.id] for w in _first_words(value, {})]
    if isinstance(node, ast.IfExp):
        return _first_words(node.body, assigned) + _first_words(node.orelse, assigned)
    if isinstance(node, ast.List) and node.elts and not isinstance(node.elts[0], ast.Starred):
        return [ast.unparse(node.elts[0])]
    return []


def lower_runtime_spawns(source: str) -> list[int]:
    """Lines where `subprocess.<run|Popen|...>` is given an argv that starts with the lower runtime."""
    hits = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        assigned: dict[str, list[ast.expr]] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(n.value)
        for n in ast.walk(fn):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in SPAWNERS
                    and ast.unparse(n.func.value) == "subprocess" and n.args
                    and any(RUNTIME.search(w) for w in _first_words(n.args[0], assigned))):
                hits.append(n.lineno)
    return sorted(set(hits))


def test_only_the_runner_runs_the_lower_runtime():
    bad = [f"{path.relative_to(PKG)}:{line}" for path in sorted(PKG.rglob("*.py"))
           if str(path.relative_to(PKG)) not in RUNNERS for line in lower_runtime_spawns(path.read_text())]
    assert not bad, ("the lower runtime run outside runtime/runc.py's LowerRuntime (use its run, call, spawn or "
                     "a verb):\n" + "\n".join(bad))


def test_the_scan_sees_the_ways_runc_was_run_by_hand():
    """Positive control: the shapes the five modules used before LowerRuntime was the one runner."""
    src = '''
import subprocess
def a(runtime, root, cid):
    subprocess.run([runtime, "--root", root, "state", cid], capture_output=True)
def b(self, cid):
    return subprocess.run([self.runtime, "--root", self.root, "state", cid])
def c(lower, parsed, args):
    argv = [lower, *parsed.render()] if args is None else [lower, *args]
    return subprocess.run(argv, check=False).returncode
def d(runtime, root):
    argv = [runtime, "--root", root, "checkpoint", "--lazy-pages"]
    return subprocess.Popen(argv)
def fine(path, python):
    subprocess.run([python, "-c", "pass"])
    subprocess.run([path, "--version"])
'''
    assert lower_runtime_spawns(src) == [4, 6, 9, 12]


def _module(path: pathlib.Path, pkg: pathlib.Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip |= {id(c) for c in ast.walk(n)}
    return skip


def import_graph(pkg: pathlib.Path = PKG) -> dict[str, set[str]]:
    """Module -> the migrt modules it imports, at any depth of its code (a function's late import too),
    but not under `if TYPE_CHECKING:` (never run)."""
    mods = {_module(p, pkg): p for p in pkg.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        out: set[str] = set()
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "migrt":
                out |= {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in mods else str(n.module) for a in n.names}
            elif isinstance(n, ast.Import):
                out |= {a.name for a in n.names if a.name.split(".")[0] == "migrt"}
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = stack[stack.index(v):]
                del stack[stack.index(v):]
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circle_in_migrt():
    assert circles(import_graph()) == []


def test_a_circle_is_seen():
    """Positive control: runc.py <-> stop.py as it was (a late import counts), and a longer ring."""
    graph = {"migrt.runtime.runc": {"migrt.runtime.stop", "migrt.errors"},
             "migrt.runtime.stop": {"migrt.runtime.runc"}, "migrt.errors": set(),
             "a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["migrt.runtime.runc", "migrt.runtime.stop"]]


def libc_loaders(source: str) -> list[int]:
    """Lines that load the C library: ctypes.CDLL(None) or CDLL(find_library("c"))."""
    hits = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("CDLL") and n.args:
            arg = ast.unparse(n.args[0])
            if arg == "None" or "find_library('c')" in arg:
                hits.append(n.lineno)
    return hits


def test_libc_is_loaded_in_the_kernel_room_only():
    """One loader, one set of prototypes (kernel/libc.py): another CDLL of libc would carry its own."""
    bad = [f"{path.relative_to(PKG)}:{line}" for path in sorted(PKG.rglob("*.py"))
           if path.relative_to(PKG).parts[0] != "kernel" for line in libc_loaders(path.read_text())]
    assert not bad, "libc loaded outside migrt/kernel/libc.py:\n" + "\n".join(bad)
    assert libc_loaders("import ctypes, ctypes.util\na = ctypes.CDLL(None, use_errno=True)\n"
                        "b = ctypes.CDLL(ctypes.util.find_library('c'))\nc = ctypes.CDLL('libcuda.so.1')\n") == [2, 3]


def private_imports(source: str) -> list[str]:
    """`from migrt.x import _name` and `module._name` of a migrt module imported by name: another module's
    private names, which it may rename or drop without looking here."""
    tree = ast.parse(source)
    modules: set[str] = set()
    hits = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "migrt":
            modules |= {a.asname or a.name for a in n.names}
            hits += [f"{n.lineno}: {n.module}.{a.name}" for a in n.names if re.match(r"_[^_]", a.name)]
        elif isinstance(n, ast.Import):
            modules |= {a.asname or a.name for a in n.names if a.name.split(".")[0] == "migrt"}
    hits += [f"{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and re.match(r"_[^_]", n.attr) and isinstance(n.value, ast.Name) and n.value.id in modules]
    return hits


def test_no_module_uses_another_modules_private_names():
    bad = [f"{path.relative_to(PKG)}:{hit}" for path in sorted(PKG.rglob("*.py"))
           for hit in private_imports(path.read_text())]
    assert not bad, "private names used across modules (make them public or move them):\n" + "\n".join(bad)
    assert private_imports("from migrt.store.fsutil import _hash_range, chunk_record\n"
                           "from migrt.node import containerd_config as cc\nfrom migrt import __version__\n"
                           "cc._has_glob('x'); cc.has_glob('y'); self._x\n") == [
        "1: migrt.store.fsutil._hash_range", "4: cc._has_glob"]


MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`name:line (n lines)` of every function or method longer than `limit` lines, from its `def` to
    its last line (docstring and comments included)."""
    return [f"{n.name}:{n.lineno} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno is not None
            and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_in_migrt_is_over_80_lines():
    """Issue 28's target: a function reads in one sitting; a longer one becomes named steps."""
    bad = [f"{path.relative_to(PKG)}:{hit}" for path in sorted(PKG.rglob("*.py"))
           for hit in long_functions(path.read_text())]
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(bad)
    body = "".join(f"    x{i} = {i}\n" for i in range(79))  # with its def: 80 lines, the most allowed
    method = "".join("    " + line + "\n" for line in body.splitlines())
    assert long_functions(f"def ok():\n{body}class C:\n    def long(self):\n{method}        pass\n") == [
        "long:82 (81 lines)"]
