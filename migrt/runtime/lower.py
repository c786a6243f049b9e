"""Find the lower runtime without third-party imports (hot path).

The config file is YAML, but only its top-level `runtime:` line is read here: a plain scalar (quotes
and a trailing comment allowed). A missing, unreadable or broken config, or a runtime that is not an
executable file, falls back to `runc` on PATH: pass-through of ordinary containers never breaks.
The full config (yaml) is loaded only after the decision to intercept.

A config or a runtime binary that another user could have written (migrt/trust.py) is refused, never
skipped: its `runtime:` would run as root. lower_runtime() raises trust.Untrusted; configured_value()
reads nothing from such a config (whoever loads it in full says why).
"""

from __future__ import annotations

import os

from migrt import trust

DEFAULT_CONFIG = "/etc/migrt/config.yaml"
SELF_NAMES = ("migrt-runc", "migrt-runc-py")


def config_path() -> str:
    return os.environ.get("MIGRT_CONFIG") or DEFAULT_CONFIG


def config_text(path: str | None = None) -> str | None:
    """The config's text; None when it is missing or unreadable. Raises trust.Untrusted for a config
    another user could have written."""
    path = path or config_path()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with open(fd, encoding="utf-8", errors="replace", closefd=True) as fh:
        trust.check(path, "migrt config", st=os.fstat(fd))
        try:
            return fh.read()
        except OSError:
            return None


def _value(text: str | None, key: str) -> str | None:
    for line in (text or "").splitlines():
        if line.startswith(f"{key}:"):
            value = line[len(key) + 1:].split(" #", 1)[0].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            return value or None
    return None


def configured_value(key: str, path: str | None = None) -> str | None:
    """A top-level plain scalar `key: value` line of the config (quotes, trailing comment allowed);
    None from an untrusted config."""
    try:
        return _value(config_text(path), key)
    except trust.Untrusted:
        return None


def configured_runtime(path: str | None = None) -> str | None:
    return configured_value("runtime", path)


def _is_self(path: str) -> bool:
    if os.path.basename(path) in SELF_NAMES:
        return True
    try:
        real = os.path.realpath(path)
    except OSError:
        return False
    return os.path.basename(real) in SELF_NAMES or real.endswith("/migrt/shim/migrt-runc.sh")


def _which(name: str) -> str | None:
    for d in os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
        cand = os.path.join(d or ".", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK) and not _is_self(cand):
            return cand
    return None


def resolve(value: str | None) -> str | None:
    """An absolute executable path for a runtime given as a path or a name on PATH; never migrt."""
    if not value:
        return None
    if "/" in value:
        ok = os.path.isfile(value) and os.access(value, os.X_OK) and not _is_self(value)
        return os.path.abspath(value) if ok else None
    return _which(value)


def lower_runtime() -> tuple[str | None, str | None]:
    """(path of the lower runtime, warning or None). path None: no runtime could be found at all.
    trust.Untrusted when the config or the runtime binary is one another user could have written."""
    wanted = _value(config_text(), "runtime")
    path = resolve(wanted)
    warning = None
    if not path:
        path = _which("runc")
        if wanted:
            warning = f"configured runtime {wanted!r} is not an executable file; using {path or 'nothing'}"
    if path:
        trust.check(path, "lower runtime")
    return path, warning


def default_root(runtime_path: str) -> str:
    """The state root the lower runtime uses when no --root is given."""
    name = os.path.basename(runtime_path)
    if "crun" in name:
        return "/run/crun"
    return "/run/runc"
