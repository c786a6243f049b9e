"""`migrt doctor`'s installation checks: the interpreter migrt runs on, the venv packaging/setup-host.sh
made (pinned interpreter recorded in <prefix>/interpreter), the launchers on PATH (migrt-runc, and the
BinaryName of containerd's handler) and the interpreter behind each.

What they catch is an upgrade that moved or removed a Python migrt depends on (e.g. apt moving
/usr/bin/python3 from 3.11 to 3.14): the venv's interpreter vanished or changed version, a venv named
an unversioned python3, or a launcher names an interpreter that no longer imports migrt. The fix they
give is the repair command the launcher carries (the setup-host.sh command as it was run), else
re-running packaging/setup-host.sh.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from migrt.node.launchers import python_problem, read_installed

SETUP = "re-run packaging/setup-host.sh (as root, from a migrt checkout)"
VERSIONED = re.compile(r"python\d+\.\d+$")
DEBIAN_PYCRIU = "/usr/lib/python3/dist-packages/pycriu"
SYSTEM_BIN = ("/usr/bin", "/bin", "/usr/local/bin")  # where the distribution moves `python3` on upgrades


def _check(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def prefix() -> str:
    """MIGRT_PREFIX, else the prefix of the venv running now if setup-host.sh made it, else /opt/migrt."""
    if os.environ.get("MIGRT_PREFIX"):
        return os.environ["MIGRT_PREFIX"]
    here = os.path.dirname(sys.prefix)
    if os.path.basename(sys.prefix) == "venv" and os.path.isfile(os.path.join(here, "interpreter")):
        return here
    return "/opt/migrt"


def venv_base(venv: str) -> str | None:
    """What a venv's bin/python names outside the venv (its first link target out of it), or None."""
    path = os.path.join(venv, "bin", "python")
    for _ in range(16):
        if not os.path.islink(path):
            return None
        target = os.readlink(path)
        path = target if os.path.isabs(target) else os.path.normpath(os.path.join(os.path.dirname(path), target))
        if not path.startswith(venv.rstrip("/") + "/"):
            return path
    return None


def python_check() -> dict:
    """The interpreter running migrt now, and whether its venv names a versioned interpreter."""
    real = os.path.realpath(sys.executable)
    detail = f"{sys.executable} -> {real} (Python {sys.version.split()[0]})"
    if sys.prefix == sys.base_prefix:
        return _check("python", "ok", detail)
    base = venv_base(sys.prefix)
    if base and not VERSIONED.search(os.path.basename(base)) and os.path.dirname(base) in SYSTEM_BIN:
        return _check("python", "warn", f"{detail}; the venv {sys.prefix} names {base}, which an upgrade may move "
                      "to another Python version (its site-packages then vanish from view)",
                      f"make the venv with a versioned interpreter ({real} -m venv), as packaging/setup-host.sh does")
    return _check("python", "ok", detail)


def _version(python: str) -> str | None:
    try:
        res = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _venv_version(venv: str) -> str | None:
    try:
        with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition("=")
                if key.strip() == "version":
                    return ".".join(value.strip().split(".")[:2])
    except OSError:
        return None
    return None


def installation_problem(root: str) -> str | None:
    """Why the venv setup-host.sh made under `root` cannot run migrt (None: it can)."""
    venv = os.path.join(root, "venv")
    try:
        with open(os.path.join(root, "interpreter"), encoding="utf-8") as fh:
            recorded = fh.read().strip()
    except FileNotFoundError:
        recorded = None
    except OSError as exc:
        return f"cannot read {root}/interpreter: {exc}"
    if recorded is None:
        return f"{venv} has no recorded interpreter ({root}/interpreter): made by an older setup-host.sh"
    if not os.access(recorded, os.X_OK):
        return f"its interpreter {recorded} is gone"
    real = os.path.realpath(os.path.join(venv, "bin", "python"))
    if real != recorded:
        return f"{venv}/bin/python is {real}, not the recorded {recorded}"
    made, now = _venv_version(venv), _version(recorded)
    if made and now and made != now:
        return f"its interpreter {recorded} is now Python {now}; the venv was made for {made}"
    problem = python_problem(os.path.join(venv, "bin", "python"))
    return f"{venv}/bin/python: {problem}" if problem else None


def installation_check(root: str | None = None) -> dict | None:
    """The setup-host.sh installation under MIGRT_PREFIX (default /opt/migrt); None if there is none."""
    root = root or prefix()
    if not os.path.isdir(os.path.join(root, "venv")):
        return None
    problem = installation_problem(root)
    if problem:
        status = "warn" if "older setup-host.sh" in problem else "fail"
        try:
            with open(os.path.join(root, "repair"), encoding="utf-8") as fh:
                fix = fh.read().strip() or SETUP
        except OSError:
            fix = SETUP
        return _check("installation", status, f"{root}: {problem}", fix)
    with open(os.path.join(root, "interpreter"), encoding="utf-8") as fh:
        return _check("installation", "ok", f"{root}/venv, pinned to {fh.read().strip()}")


def launcher_check(name: str, path: str | None) -> dict:
    """A migrt-runc (or migrt) launcher: written by `migrt install runtime`, and its interpreter runs migrt."""
    if not path:
        return _check(name, "warn", "not on PATH", f"{SETUP}, or 'migrt install runtime --bindir DIR'")
    if not os.access(path, os.X_OK):
        return _check(name, "fail", f"{path} is missing or not executable", SETUP)
    info = read_installed(path)
    if info is None:
        return _check(name, "warn", f"{path} was not written by 'migrt install runtime' (an older migrt?): when its "
                      "Python breaks it shows a traceback, not the repair", f"{SETUP}, or 'migrt install runtime'")
    problem = python_problem(info["python"])
    if problem:
        return _check(name, "fail", f"{path}: its Python side {info['python']}: {problem}",
                      info.get("repair") or SETUP)
    return _check(name, "ok", f"{path} (Python side: {info['python']})")


def pycriu_check() -> dict:
    try:
        import pycriu
    except Exception as exc:  # noqa: BLE001 - ImportError, or protobuf refusing pycriu's generated code
        return _check("pycriu", "warn", f"not importable with {sys.executable} ({type(exc).__name__}: {exc})",
                      f"{SETUP} (it copies Debian's python3-pycriu into the venv); 'migrt inspect' needs it")
    mine = getattr(pycriu, "__version__", "?")
    debian = _read_version(os.path.join(DEBIAN_PYCRIU, "version.py"))
    if debian and os.path.realpath(os.path.dirname(pycriu.__file__)) != DEBIAN_PYCRIU and debian != mine:
        return _check("pycriu", "warn", f"{mine} (a copy in {os.path.dirname(pycriu.__file__)}); Debian's is {debian}",
                      f"{SETUP} to copy the new one in")
    return _check("pycriu", "ok", f"{mine} ({os.path.dirname(pycriu.__file__)})")


def _read_version(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            m = re.search(r"""__version__\s*=\s*["']([^"']+)""", fh.read())
    except OSError:
        return None
    return m.group(1) if m else None


def install_checks() -> list[dict]:
    out = [python_check()]
    inst = installation_check()
    if inst:
        out.append(inst)
    out.append(launcher_check("migrt-runc", shutil.which("migrt-runc")))
    out.append(pycriu_check())
    return out


def script_problem(path: str, timeout: float = 30) -> str | None:
    """Run an installed helper script with --check (e.g. the CRIU hook): None if it exits 0, else why."""
    try:
        res = subprocess.run([path, "--check"], capture_output=True, text=True, timeout=timeout, cwd="/",
                             env={k: v for k, v in os.environ.items() if not k.startswith("CRTOOLS_")})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if res.returncode == 0:
        return None
    lines = (res.stderr or res.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {res.returncode}"
