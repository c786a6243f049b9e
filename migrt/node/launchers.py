"""The executables migrt puts on PATH, rendered for one Python interpreter: `migrt-runc` (the sh fast
path, migrt/shim/migrt-runc.sh) and `migrt` (a launcher for the CLI).

The rule they follow: each names the interpreter it needs by path (written in at install time, never
`python3` from PATH) and checks it before use. When migrt cannot start there (the interpreter is gone,
or migrt does not import with it: a venv whose python moved to a newer version under an apt upgrade),
the user gets one line saying what is broken and the command that repairs it, never a traceback, and
exit status 127 (BROKEN_EXIT); migrt-runc also appends a runc-style error line to `--log`, which
containerd shows as "OCI runtime create failed: <msg>". migrt-runc's pass-through never starts Python,
so it is not touched by any of this.

Both hand over to Python through BOOT, a small program given with `python -P -c`: it takes the
launcher's own path and the repair command as its first two arguments (then removes them, so the
entry point sees argv as it was given), imports the entry point, and reports a failed import.
"""

from __future__ import annotations

import os
import re
import sys

from migrt.errors import ConfigError
from migrt.store.fsutil import atomic_file

BROKEN_EXIT = 127
RUNC_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim", "migrt-runc.sh")
NAMES = ("migrt-runc", "migrt")
ENTRY = {"migrt-runc": "migrt.shim.__main__", "migrt": "migrt.cli.main"}

# Python run by `-c` (between sh single quotes: no single quote inside). {entry}: the module with
# main(); {report}: RUNC_LOG for migrt-runc, else nothing.
BOOT = """import sys
argv0, repair = sys.argv[1], sys.argv[2]
sys.argv[0:3] = [argv0]
try:
    from {entry} import main
except Exception as exc:
    import os
    msg = "%s: migrt does not import with %s (%s, Python %s): %s: %s; repair: %s" % (
        argv0.rpartition("/")[2], sys.executable, os.path.realpath(sys.executable), sys.version.split()[0],
        type(exc).__name__, exc, repair)
{report}    sys.stderr.write(msg + "\\n")
    sys.exit({broken})
sys.exit(main())
"""
# migrt-runc only: the same message as runc's error line in --log (runc's global flags; default text).
RUNC_LOG = """    import json, time
    log, fmt, args = None, "text", sys.argv[1:]
    for i, a in enumerate(args):
        if a == "--":
            break
        key, eq, value = a.partition("=")
        if key in ("--log", "-log", "--log-format", "-log-format"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if key.endswith("format"):
                fmt = value
            else:
                log = value
    if log:
        t = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%09dZ" % int(t % 1 * 1e9)
        line = (json.dumps({"level": "error", "msg": msg, "time": stamp}) if fmt == "json"
                else "time=%s level=error msg=%s" % (json.dumps(stamp), json.dumps(msg)))
        try:
            with open(log, "a") as fh:
                fh.write(line + "\\n")
        except OSError:
            pass
"""

CLI_TEMPLATE = """#!/bin/sh
# migrt: the node CLI (written by `migrt install runtime`). It starts migrt with the interpreter named
# below and, when that cannot work (interpreter gone, or migrt not importable by it), says so in one
# line with the repair command instead of a traceback (exit 127).
PYTHON=@MIGRT_PYTHON@
REPAIR=@MIGRT_REPAIR@
BOOT=@MIGRT_BOOT@
if [ ! -x "$PYTHON" ]; then
    printf '%s\\n' "${0##*/}: migrt's Python interpreter $PYTHON is missing; repair: $REPAIR" >&2
    exit 127
fi
exec "$PYTHON" -P -c "$BOOT" "$0" "$REPAIR" "$@"
"""

HOOK_TEMPLATE = """#!/bin/sh
# CRIU action script (written by `migrt install runtime --criu-hook`): runs migrt's GPU hook, HOOK
# (hooks/cuda-criu-action), with migrt's interpreter; name this file in CRIU's configuration
# (action-script <path> in /etc/criu/runc.conf). Actions the hook ignores end here, without Python.
# When the interpreter is gone, CRIU's log gets the reason and the repair command (exit 1: CRIU
# aborts a dump or restore it could not make GPU-safe).
case ${CRTOOLS_SCRIPT_ACTION:-}:${1:-} in
pre-dump:*|pre-restore:*|post-resume:*|*:--check|*:--watchdog) ;;
*) exit 0 ;;
esac
PYTHON=@MIGRT_PYTHON@
REPAIR=@MIGRT_REPAIR@
HOOK=@MIGRT_HOOK@
if [ ! -x "$PYTHON" ]; then
    printf '%s\\n' "cuda-criu-action: migrt's Python interpreter $PYTHON is missing; repair: $REPAIR" >&2
    exit 1
fi
MIGRT_REPAIR=$REPAIR exec "$PYTHON" -P "$HOOK" "$@"
"""


def sh_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def boot(name: str) -> str:
    code = BOOT.format(entry=ENTRY[name], report=RUNC_LOG if name == "migrt-runc" else "", broken=BROKEN_EXIT)
    assert "'" not in code  # it goes between single quotes
    return code


def default_python() -> str:
    """The interpreter running now, as launchers should name it: a venv's own python (its
    site-packages), else the versioned path behind python3 (/usr/bin/python3 -> /usr/bin/python3.11),
    which a distribution upgrade that moves python3 leaves where it is."""
    if sys.prefix != sys.base_prefix:
        return sys.executable
    return os.path.realpath(sys.executable)


def default_repair(bindir: str) -> str:
    return (f"reinstall migrt for a Python >= 3.11 (pip install migrt), then run "
            f"'migrt install runtime --bindir {bindir}'")


def render(name: str, python: str, repair: str, hook: str | None = None) -> str:
    """The text of launcher `name` (migrt-runc, migrt, or cuda-criu-action: the CRIU hook's wrapper,
    which runs the script `hook`) for that interpreter and repair command."""
    if name == "migrt-runc":
        with open(RUNC_TEMPLATE, encoding="utf-8") as fh:
            template = fh.read()
        values = {"BOOT": boot(name)}
    elif name == "migrt":
        template, values = CLI_TEMPLATE, {"BOOT": boot(name)}
    elif name == "cuda-criu-action":
        template, values = HOOK_TEMPLATE, {"HOOK": hook or ""}
    else:
        raise ValueError(name)
    for key, value in (("PYTHON", python), ("REPAIR", repair), *values.items()):
        placeholder = f"@MIGRT_{key}@"
        if template.count(placeholder) != 1:
            raise ConfigError(f"{name} template: {placeholder} must occur exactly once")
        template = template.replace(placeholder, sh_quote(value))
    return template


_ASSIGN = re.compile(r"^(PYTHON|REPAIR|HOOK)='((?:[^']|'\\'')*)'$", re.M)


def read_installed(path: str) -> dict | None:
    """{"python": ..., "repair": ...} of a launcher this module wrote, None for anything else (e.g. an
    older migrt-runc, or a symlink to a console script)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(1 << 16)
    except OSError:
        return None
    found = {k.lower(): v.replace("'\\''", "'") for k, v in _ASSIGN.findall(text)}
    return found if "python" in found else None


def default_hook_source() -> str | None:
    """hooks/cuda-criu-action of the checkout this migrt runs from (an editable install), if any."""
    path = os.path.join(os.path.dirname(os.path.dirname(RUNC_TEMPLATE)), "..", "hooks", "cuda-criu-action")
    return os.path.abspath(path) if os.path.isfile(path) else None


def install(bindir: str, python: str | None = None, repair: str | None = None, names: tuple[str, ...] = NAMES,
            criu_hook: str | None = None, hook_source: str | None = None) -> list[dict]:
    """Write the launchers into bindir (atomically, 0755), and the CRIU hook's wrapper at `criu_hook`
    (running `hook_source`) if asked. Returns [{"path", "action", "python"}]."""
    python = python or default_python()
    if not os.path.isabs(python):
        raise ConfigError(f"--python {python}: give an absolute path")
    repair = repair or default_repair(bindir)
    jobs = [(os.path.join(bindir, name), render(name, python, repair)) for name in names]
    if criu_hook:
        hook_source = hook_source or default_hook_source()
        if not hook_source or not os.path.isfile(hook_source):
            raise ConfigError(f"the CRIU hook's script {hook_source or '(hooks/cuda-criu-action)'} is not there: give "
                              "--criu-hook-source (hooks/cuda-criu-action of a migrt checkout)")
        jobs.append((criu_hook, render("cuda-criu-action", python, repair, hook=os.path.abspath(hook_source))))
    out = []
    for path, text in jobs:
        try:
            with open(path, encoding="utf-8") as fh:
                same = fh.read() == text and os.access(path, os.X_OK) and not os.path.islink(path)
        except (OSError, UnicodeDecodeError):
            same = False
        if not same:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            _write(path, text)
        out.append({"path": path, "action": "unchanged" if same else "written", "python": python})
    return out


def _write(path: str, text: str) -> None:
    try:
        with atomic_file(path, 0o755, text=True) as fh:
            fh.write(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from exc


def python_problem(python: str, timeout: float = 30) -> str | None:
    """Why `python` cannot run migrt (None: it can): missing, or migrt does not import with it."""
    import subprocess

    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return "no such interpreter (missing or not executable)"
    try:
        res = subprocess.run([python, "-P", "-c", "import migrt.shim.__main__, migrt.cli.main"],
                             capture_output=True, text=True, timeout=timeout, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"does not run ({exc})"
    if res.returncode != 0:
        lines = (res.stderr or res.stdout).strip().splitlines()
        return f"migrt does not import with it ({lines[-1] if lines else f'exit {res.returncode}'})"
    return None
