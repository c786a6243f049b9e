"""containerd's configuration as containerd itself reads it: the main file, its `imports` (globs and
nested imports, in containerd's order), merged with the rules of the config's version.

- version 2 (containerd 1.6/1.7): an imported file replaces a plugin's WHOLE section
  (`[plugins."io.containerd.grpc.v1.cri"]` from a drop-in wipes the main file's CRI settings);
- version 3 (containerd 2.x): sections are merged key by key.

Also a small TOML writer (the standard library reads TOML but does not write it).
Paths are host paths; `root` prefixes them when the host is mounted elsewhere (a DaemonSet's /host).
"""

from __future__ import annotations

import copy
import fnmatch
import glob
import json
import os
import re
import subprocess
import tomllib
from dataclasses import dataclass, field

from migrt.errors import ConfigError

DEFAULT_CONFIG = "/etc/containerd/config.toml"
HANDLER = "migrt"
RUNTIME_TYPE = "io.containerd.runc.v2"
MIGRT_RUNC = "/usr/local/bin/migrt-runc"
POD_ANNOTATIONS = ["migrt.io/*"]  # lets the pod annotations migrt.io/restore(-fallback) reach config.json

# Where the CRI runtimes live, by config version.
CRI_PLUGIN = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
SUPPORTED_VERSIONS = (2, 3)


def host_path(root: str, path: str) -> str:
    """The path on this machine of the host path `path` (root "/" leaves it alone)."""
    return path if root in ("", "/") else os.path.join(root, path.lstrip("/"))


def has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def parse_file(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"containerd config {path}: invalid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"containerd config {path}: {exc}") from exc


def version_of(data: dict) -> int:
    """containerd reads a file without `version` as version 1."""
    v = data.get("version", 1)
    return v if isinstance(v, int) else 1


@dataclass
class LoadedConfig:
    main: str  # host path
    root: str
    exists: bool
    version: int
    files: list[tuple[str, dict]] = field(default_factory=list)  # (host path, parsed), containerd's order
    missing: list[str] = field(default_factory=list)  # imports naming a file that does not exist

    @property
    def main_data(self) -> dict:
        return self.files[0][1] if self.exists else {}

    def effective(self, exclude: tuple[str, ...] = (), extra: tuple[tuple[str, dict], ...] = ()) -> dict:
        """The merged configuration, leaving out files in `exclude` and appending `extra` files."""
        out: dict = {}
        for _path, data in [*(f for f in self.files if f[0] not in exclude), *extra]:
            merge(self.version, out, data)
        return out


def resolve_imports(root: str, importer: str, imports: list,
                    overrides: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(existing host paths, missing host paths) of an `imports` list, as containerd resolves it:
    relative to the importing file's directory; globs expanded and sorted. Paths in `overrides`
    count as existing."""
    extra = set(overrides or ())
    found, missing = [], []
    for imp in imports if isinstance(imports, list) else []:
        if not isinstance(imp, str):
            continue
        path = imp if os.path.isabs(imp) else os.path.join(os.path.dirname(importer), imp)
        if has_glob(path):
            hits = {"/" + os.path.relpath(h, host_path(root, "/")) for h in glob.glob(host_path(root, path))}
            found += sorted(hits | {p for p in extra if fnmatch.fnmatchcase(p, path)})
        elif os.path.exists(host_path(root, path)) or path in extra:
            found.append(path)
        else:
            missing.append(path)
    return found, missing


def load(main: str = DEFAULT_CONFIG, root: str = "/", default_version: int | None = None,
         overrides: dict[str, str] | None = None) -> LoadedConfig:
    """Read the main config and every file it imports (recursively, each once). `overrides` maps host
    paths to file contents to use instead of the disk (to check a change before writing it)."""
    overrides = overrides or {}

    def read(path: str) -> dict:
        if path in overrides:
            try:
                return tomllib.loads(overrides[path])
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"containerd config {path} (new content): invalid TOML: {exc}") from exc
        return parse_file(host_path(root, path))

    if main not in overrides and not os.path.exists(host_path(root, main)):
        return LoadedConfig(main, root, False, default_version or 0)
    data = read(main)
    cfg = LoadedConfig(main, root, True, version_of(data))
    pending, seen = [(main, data)], set()
    while pending:
        path, data = pending.pop(0)
        if path in seen:
            continue
        seen.add(path)
        cfg.files.append((path, data))
        found, missing = resolve_imports(root, path, data.get("imports", []), overrides)
        cfg.missing += missing
        pending += [(p, read(p)) for p in found if p not in seen]
    return cfg


def merge(version: int, out: dict, data: dict) -> dict:
    """Merge one file into `out` the way containerd of that config version does."""
    for key, value in data.items():
        if key == "imports":
            out.setdefault("imports", [])
            out["imports"] += [i for i in value if i not in out["imports"]] if isinstance(value, list) else []
        elif key == "plugins" and isinstance(value, dict):
            plugins = out.setdefault("plugins", {})
            for name, section in value.items():
                if version >= 3 and isinstance(section, dict) and isinstance(plugins.get(name), dict):
                    _deep_merge(plugins[name], section)
                else:  # version 2: the imported plugin section replaces the previous one entirely
                    plugins[name] = copy.deepcopy(section)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _deep_merge(out: dict, data: dict) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)


def runtimes(effective: dict, version: int) -> dict:
    section = (effective.get("plugins") or {}).get(CRI_PLUGIN.get(version, ""), {})
    found = ((section.get("containerd") or {}).get("runtimes") or {}) if isinstance(section, dict) else {}
    return found if isinstance(found, dict) else {}


def handler(effective: dict, version: int, name: str = HANDLER) -> dict | None:
    h = runtimes(effective, version).get(name)
    return h if isinstance(h, dict) else None


def containerd_major(root: str = "/", binary: str | None = None) -> int | None:
    """Major version of the installed containerd (`containerd --version`), None if not found."""
    known = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd", "/bin/containerd")
    candidates = [binary] if binary else [host_path(root, p) for p in known]
    if not binary and root in ("", "/"):
        from shutil import which

        candidates.insert(0, which("containerd") or "")
    for path in candidates:
        if not path or not os.access(path, os.X_OK):
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        m = re.search(r"\sv?(\d+)\.(\d+)\.\d+", out)
        if m:
            return int(m.group(1))
    return None


def default_version_for(major: int | None) -> int | None:
    """The config version containerd of that major version writes (2.x: 3, 1.x: 2)."""
    if major is None:
        return None
    return 3 if major >= 2 else 2


# -- TOML writer -----------------------------------------------------------------------------------

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else toml_string(k)


def toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    if hasattr(v, "isoformat"):
        return v.isoformat()
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def dumps(data: dict) -> str:
    """TOML text for nested dicts (tables), scalars and lists (lists of tables become inline tables)."""
    lines: list[str] = []

    def emit(table: dict, path: list[str]) -> None:
        scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
        subs = [(k, v) for k, v in table.items() if isinstance(v, dict)]
        if path and (scalars or not subs):
            lines.append(f"\n[{'.'.join(_key(p) for p in path)}]")
        for k, v in scalars:
            lines.append(f"{'  ' if path else ''}{_key(k)} = {_value(v)}")
        for k, v in subs:
            emit(v, [*path, k])

    emit(data, [])
    return "\n".join(lines).lstrip("\n") + "\n"
