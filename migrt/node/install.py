"""`migrt install containerd`: declare the runtime handler `migrt` in containerd's configuration.

The handler goes into a drop-in file that the main config imports:
- config version 3 (containerd 2.x): the drop-in holds just the handler (2.x merges sections);
- config version 2 (containerd 1.6/1.7): an imported file replaces the whole CRI plugin section, so
  the drop-in holds the node's complete CRI section (main file and other imports, as merged now)
  plus the handler. Running the command again refreshes that copy.
If the main config already imports a glob covering `<dir>/migrt.toml` (e.g. conf.d/*.toml), the
drop-in goes there and the main file is left alone; otherwise `<main dir>/conf.d/migrt.toml` is
written and added to the main file's `imports`. Changed files are backed up (timestamped) first;
writes are atomic. containerd is never restarted here.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import os
import re
import shutil
import time
import tomllib
from dataclasses import dataclass, field
from typing import TypeVar

from migrt import __version__
from migrt.errors import ConfigError
from migrt.node import containerd_config as cc
from migrt.store.fsutil import atomic_file

T = TypeVar("T")

DROPIN_NAME = "migrt.toml"


@dataclass
class FileChange:
    path: str  # host path
    before: str | None  # None: the file does not exist yet
    after: str
    backup: str | None = None

    @property
    def action(self) -> str:
        if self.before is None:
            return "create"
        return "unchanged" if self.before == self.after else "update"

    def diff(self) -> str:
        return "".join(difflib.unified_diff(
            (self.before or "").splitlines(keepends=True), self.after.splitlines(keepends=True),
            fromfile=self.path if self.before is not None else "/dev/null", tofile=self.path))


@dataclass
class InstallPlan:
    main: str
    dropin: str
    version: int
    changes: list[FileChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(c.action != "unchanged" for c in self.changes)

    def to_dict(self) -> dict:
        return {"config": self.main, "dropin": self.dropin, "version": self.version, "changed": self.changed,
                "restart_needed": self.changed, "notes": self.notes,
                "files": [{"path": c.path, "action": c.action, "backup": c.backup, "diff": c.diff()}
                          for c in self.changes]}


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _choose_dropin(cfg: cc.LoadedConfig) -> tuple[str, bool]:
    """(drop-in host path, whether the main config must import it)."""
    main_dir = os.path.dirname(cfg.main)
    imports = [i if os.path.isabs(i) else os.path.join(main_dir, i)
               for i in cfg.main_data.get("imports", []) if isinstance(i, str)]
    for imp in imports:  # an explicit import of our file (from an earlier run)
        if not cc.has_glob(imp) and os.path.basename(imp) == DROPIN_NAME:
            return imp, False
    for imp in imports:  # a drop-in directory the main config already imports
        if cc.has_glob(imp):
            candidate = os.path.join(os.path.dirname(imp), DROPIN_NAME)
            if fnmatch.fnmatchcase(candidate, imp):
                return candidate, False
    return os.path.join(main_dir, "conf.d", DROPIN_NAME), True


def _of(kind: type[T], value: object) -> T:
    """value when it is a `kind` (a TOML table or array), else an empty one."""
    return value if isinstance(value, kind) else kind()


def _handler_table(existing: dict | None, runc: dict | None, binary: str) -> dict:
    """The migrt handler: an existing one's extra keys are kept; the keys migrt needs are set;
    SystemdCgroup follows the node's runc handler."""
    h = copy.deepcopy(existing) if isinstance(existing, dict) else {}
    h["runtime_type"] = cc.RUNTIME_TYPE
    annotations = _of(list, h.get("pod_annotations"))
    h["pod_annotations"] = annotations + [a for a in cc.POD_ANNOTATIONS if a not in annotations]
    opts = _of(dict, h.get("options"))
    opts["BinaryName"] = binary
    runc_opts = _of(dict, (runc or {}).get("options"))
    if "SystemdCgroup" in runc_opts:
        opts["SystemdCgroup"] = runc_opts["SystemdCgroup"]
    h["options"] = opts
    return h


def _dropin_text(cfg: cc.LoadedConfig, dropin: str, binary: str) -> str:
    version, plugin = cfg.version, cc.CRI_PLUGIN[cfg.version]
    others = cfg.effective(exclude=(dropin,))
    existing_dropin = dict(cfg.files).get(dropin, {})
    existing = cc.handler(existing_dropin, version) or cc.handler(others, version)
    runc = cc.handler(others, version, "runc")
    head = [f"# Written by `migrt install containerd` (migrt {__version__}): runtime handler `{cc.HANDLER}`",
            f"# (Kubernetes RuntimeClass handler: {cc.HANDLER}). Run the command again to update this file;",
            "# to uninstall, delete it and its entry in the main config's imports, then restart containerd."]
    if version == 3:
        section: dict = {"containerd": {"runtimes": {cc.HANDLER: _handler_table(existing, runc, binary)}}}
    else:
        head += ["#",
                 "# containerd 1.x replaces a plugin's whole section with an imported file's, so this file",
                 f"# carries the node's complete [plugins.\"{plugin}\"] section, copied from {cfg.main}",
                 "# and its other imports. Change CRI settings there, then run `migrt install containerd`",
                 "# again (`migrt doctor` warns when this copy is out of date)."]
        section = copy.deepcopy((others.get("plugins") or {}).get(plugin) or {})
        rts = section.setdefault("containerd", {}).setdefault("runtimes", {})
        default_name = section["containerd"].get("default_runtime_name", "runc")
        if "runc" not in rts and default_name == "runc":
            rts["runc"] = {"runtime_type": cc.RUNTIME_TYPE}  # containerd's default, lost if not repeated
        rts[cc.HANDLER] = _handler_table(existing, runc, binary)
    return "\n".join(head) + "\n\n" + cc.dumps({"version": version, "plugins": {plugin: section}})


def _same_values(before: str | None, after: str) -> bool:
    if before is None:
        return False
    try:
        return tomllib.loads(before) == tomllib.loads(after)
    except tomllib.TOMLDecodeError:
        return False


def _imports_span(head: str) -> tuple[int, int] | None:
    """(start, end) of the top-level `imports = [...]` in `head`: the shortest text from `imports`
    to a `]` that parses as TOML (brackets inside strings and comments are skipped that way)."""
    m = re.search(r"(?m)^imports[ \t]*=[ \t]*\[", head)
    if not m:
        return None
    for end in (i + 1 for i, c in enumerate(head) if c == "]" and i > m.start()):
        try:
            if "imports" in tomllib.loads(head[m.start():end]):
                return m.start(), end
        except tomllib.TOMLDecodeError:
            continue
    return None


def set_imports(text: str, imports: list[str]) -> str:
    """`text` with its top-level `imports` set to `imports` (inserted after `version` if absent).
    The result is checked: everything else must parse to the same values."""
    line = "imports = [" + ", ".join(cc.toml_string(i) for i in imports) + "]"
    first_table = re.search(r"(?m)^[ \t]*\[", text)
    head_end = first_table.start() if first_table else len(text)
    head, tail = text[:head_end], text[head_end:]
    span = _imports_span(head)
    if span:
        head = head[:span[0]] + line + head[span[1]:]
    else:
        v = re.search(r"(?m)^version[ \t]*=.*$", head)
        head = (head[:v.end()] + "\n" + line + head[v.end():]) if v else (line + "\n" + head)
    new = head + tail
    try:
        before, after = tomllib.loads(text), tomllib.loads(new)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cannot add the drop-in to imports automatically ({exc})") from exc
    before["imports"] = imports
    if after != before:
        raise ConfigError("cannot add the drop-in to imports automatically: the file's layout is unusual")
    return new


def plan_containerd(config: str = cc.DEFAULT_CONFIG, root: str = "/", binary: str = cc.MIGRT_RUNC,
                    containerd_major: int | None = None) -> InstallPlan:
    """Work out the file changes; writes nothing. `containerd_major` skips running `containerd --version`
    (only needed when the main config does not exist)."""
    cfg = cc.load(config, root)
    if not cfg.exists:
        major = containerd_major if containerd_major is not None else cc.containerd_major(root)
        cfg.version = cc.default_version_for(major) or 0
        if not cfg.version:
            raise ConfigError(f"{config} does not exist and no containerd binary was found to tell which config "
                              "version to write; pass --config with the file containerd reads")
    if cfg.version not in cc.SUPPORTED_VERSIONS:
        fix = "migrate it with `containerd config migrate`" if cfg.version < 2 else "this migrt knows versions 2 and 3"
        raise ConfigError(f"{config}: containerd config version {cfg.version} is not supported; {fix}")
    if cfg.missing:
        raise ConfigError(f"{config} imports files that do not exist: {', '.join(cfg.missing)}; containerd would "
                          "not start with it; fix the imports first")
    dropin, needs_import = _choose_dropin(cfg)
    plan = InstallPlan(config, dropin, cfg.version)
    new_dropin = _dropin_text(cfg, dropin, binary)
    before_dropin = _read(cc.host_path(root, dropin))
    if before_dropin is not None and _same_values(before_dropin, new_dropin):
        new_dropin = before_dropin  # only comments or layout differ (e.g. written by another migrt version)
    plan.changes.append(FileChange(dropin, before_dropin, new_dropin))

    before_main = _read(cc.host_path(root, config))
    if before_main is None:
        after_main = (f"# containerd configuration; created by `migrt install containerd` (everything else default).\n"
                      f"version = {cfg.version}\n") + "imports = [" + cc.toml_string(dropin) + "]\n"
    elif needs_import:
        imports = [i for i in cfg.main_data.get("imports", []) if isinstance(i, str)]
        after_main = set_imports(before_main, imports + [dropin])
    else:
        after_main = before_main
    plan.changes.append(FileChange(config, before_main, after_main))
    _check_result(cfg, dropin, new_dropin, after_main, binary)
    if cfg.version == 2:
        plan.notes.append("config version 2: the drop-in carries a copy of the whole CRI section (containerd 1.x "
                          "replaces plugin sections on import); run this command again after changing CRI settings")
    return plan


def _check_result(cfg: cc.LoadedConfig, dropin: str, dropin_text: str, main_text: str, binary: str) -> None:
    """Simulate containerd's load with the new files: the handler must come out as written."""
    after = cc.load(cfg.main, cfg.root, overrides={cfg.main: main_text, dropin: dropin_text})
    h = cc.handler(after.effective(), after.version)
    if h and (h.get("options") or {}).get("BinaryName") == binary:
        return
    order = [p for p, _ in after.files]
    plugin = cc.CRI_PLUGIN[after.version]
    later = [p for p, d in after.files[order.index(dropin) + 1:] if plugin in (d.get("plugins") or {})] \
        if dropin in order else []
    raise ConfigError(f"the handler would not take effect: {', '.join(later) or 'a later import'} replaces the CRI "
                      f"section after {dropin} (containerd 1.x imports replace whole plugin sections); add the "
                      f"[plugins.\"{plugin}\".containerd.runtimes.{cc.HANDLER}] table to that file instead")


def apply(plan: InstallPlan, root: str = "/", now: float | None = None) -> InstallPlan:
    """Write the planned changes: drop-in first, then the main file; back up what is replaced."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now or time.time()))
    for change in plan.changes:
        if change.action == "unchanged":
            continue
        real = cc.host_path(root, change.path)
        os.makedirs(os.path.dirname(real), mode=0o755, exist_ok=True)
        mode = 0o644
        if change.before is not None:
            mode = os.stat(real).st_mode & 0o7777
            backup = f"{real}.migrt-backup-{stamp}"
            n = 1
            while os.path.exists(backup):
                backup = f"{real}.migrt-backup-{stamp}-{n}"
                n += 1
            shutil.copy2(real, backup)
            change.backup = backup if root in ("", "/") else "/" + os.path.relpath(backup, root)
        _atomic_write(real, change.after, mode)
    return plan


def _atomic_write(path: str, text: str, mode: int) -> None:
    try:
        with atomic_file(path, mode, text=True) as fh:
            fh.write(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from exc
