"""Find the lower runtime without third-party imports (hot path).

The config file is YAML, but only its top-level `runtime:` line is read here: a plain scalar (quotes
and a trailing comment allowed). A missing, unreadable or broken config, or a runtime that is not an
executable file, falls back to `runc` on PATH: pass-through of ordinary containers never breaks.
The full config (yaml) is loaded only after the decision to intercept.
"""

from __future__ import annotations

import os

DEFAULT_CONFIG = "/etc/migrt/config.yaml"
SELF_NAMES = ("migrt-runc", "migrt-runc-py")


def config_path() -> str:
    return os.environ.get("MIGRT_CONFIG") or DEFAULT_CONFIG


def configured_value(key: str, path: str | None = None) -> str | None:
    """A top-level plain scalar `key: value` line of the config (quotes, trailing comment allowed)."""
    try:
        with open(path or config_path(), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(f"{key}:"):
                    value = line[len(key) + 1:].split(" #", 1)[0].strip()
                    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                        value = value[1:-1]
                    return value or None
    except OSError:
        return None
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
    """(path of the lower runtime, warning or None). path None: no runtime could be found at all."""
    wanted = configured_runtime()
    path = resolve(wanted)
    if path:
        return path, None
    fallback = _which("runc")
    warning = None
    if wanted:
        warning = f"configured runtime {wanted!r} is not an executable file; using {fallback or 'nothing'}"
    return fallback, warning


def default_root(runtime_path: str) -> str:
    """The state root the lower runtime uses when no --root is given."""
    name = os.path.basename(runtime_path)
    if "crun" in name:
        return "/run/crun"
    return "/run/runc"
