"""Which CRIU migrt uses, why, and how runc gets the same one (standard library only).

The first of these that is an executable file wins:
  1. MIGRT_CRIU in the environment (a path);
  2. `criu:` in the migrt config (a path; read as one plain line, like `runtime:`);
  3. migrt's own build beside its venv: <prefix>/criu/sbin/criu, where <prefix> holds the venv that
     runs migrt (packaging/build-criu.sh; /opt/migrt/criu by default);
  4. /opt/migrt/criu/sbin/criu (the default prefix, for a migrt run from another interpreter);
  5. `criu` on PATH, then /usr/sbin/criu and /sbin/criu (the distribution's).
runc has no other way to be told (runc >= 1.4 dropped `--criu`; containerd's shim never passes it): it
runs `criu` from PATH. So migrt's entry points (the CLI and the migrt-runc shim, after its pass-through
decision) call use_migrt_criu() with the config's `criu:` value, which puts the chosen CRIU's directory
first on their own PATH (runc, CRIU and its action scripts inherit it) and records the choice for the
rest of the process. The node's PATH and its /usr/sbin/criu stay as they are.
"""

from __future__ import annotations

import os
import sys

from migrt import trust

DEFAULT_PREFIX = "/opt/migrt"
ENV = "MIGRT_CRIU"


def _executable(path: str | None) -> bool:
    return path is not None and path != "" and os.path.isfile(path) and os.access(path, os.X_OK)


def _on_path(name: str) -> str | None:
    for d in os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
        cand = os.path.join(d or ".", name)
        if _executable(cand):
            return cand
    return None


def own_build() -> str:
    """<prefix>/criu/sbin/criu for the prefix whose venv runs this interpreter."""
    return os.path.join(os.path.dirname(os.path.abspath(sys.prefix)), "criu", "sbin", "criu")


def choose(cfg: str | None = None) -> tuple[str | None, str]:
    """(path or None, why): the CRIU migrt uses and the rule that picked it; `cfg` is the config's
    `criu:` value (migrt.runtime.lower.configured_value("criu"))."""
    env = os.environ.get(ENV)
    if env:
        if _executable(env):
            return env, f"{ENV} in the environment"
        return None, f"{ENV}={env} is not an executable file"
    if cfg:
        if not _executable(cfg):
            return None, f"'criu: {cfg}' in the migrt config is not an executable file"
        untrusted = trust.problem(cfg)  # CRIU runs as root: only a binary nobody else could have written
        if untrusted:
            return None, f"'criu: {cfg}' in the migrt config: {untrusted}"
        return cfg, "'criu:' in the migrt config"
    own = own_build()
    if _executable(own):
        return own, "migrt's own build beside its venv"
    default = os.path.join(DEFAULT_PREFIX, "criu", "sbin", "criu")
    if _executable(default):
        return default, "migrt's own build in the default prefix"
    found = _on_path("criu") or next((p for p in ("/usr/sbin/criu", "/sbin/criu") if _executable(p)), None)
    if found:
        return found, "criu on PATH (no migrt build of CRIU found: run packaging/setup-host.sh)"
    return None, "no CRIU: neither migrt's own build (packaging/setup-host.sh) nor criu on PATH"


_chosen: tuple[str | None, str] | None = None  # what use_migrt_criu picked in this process, and why


def criu_binary() -> str | None:
    return chosen()[0]


def chosen(cfg: str | None = None) -> tuple[str | None, str]:
    """(path, why) as use_migrt_criu picked it in this process, else as choose(cfg) would."""
    return _chosen if _chosen is not None else choose(cfg)


def use_migrt_criu(cfg: str | None = None) -> str | None:
    """Record the chosen CRIU for this process (chosen(), criu_binary()) and put its directory first on
    this process's PATH (for runc and every child) unless `criu` on PATH already is that file. Returns
    the chosen path."""
    global _chosen
    _chosen = choose(cfg)
    path = _chosen[0]
    if not path:
        return None
    current = _on_path("criu")
    if current and os.path.realpath(current) == os.path.realpath(path):
        return path
    d = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) != "criu":
        return path  # runc looks for the name `criu`: only a file of that name can be handed over
    default = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", default)
    return path
