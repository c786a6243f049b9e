"""`migrt doctor`'s containerd check: runtime handler `migrt` in containerd's config (main file and
imports, merged as containerd does), migrt-runc behind it, and the drop-in up to date."""

from __future__ import annotations

import os

from migrt.errors import MigrtError
from migrt.node import containerd_config as cc
from migrt.node.doctor_install import SETUP, launcher_check


def _check(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def containerd_handler_check(config: str | None = None, root: str = "/") -> dict:
    """Runtime handler `migrt` in containerd's config (main file + imports, merged as containerd does)."""
    from migrt.node.install import plan_containerd

    config = config or cc.DEFAULT_CONFIG
    name, fix = "containerd handler migrt", "run 'migrt install containerd', then restart containerd"
    try:
        cfg = cc.load(config, root)
    except MigrtError as exc:
        return _check(name, "fail", str(exc), "fix the file; containerd cannot start with it either")
    if not cfg.exists:
        return _check(name, "warn", f"{config} absent: containerd runs with defaults, no handler migrt", fix)
    if cfg.version not in cc.SUPPORTED_VERSIONS:
        return _check(name, "fail", f"{config}: config version {cfg.version} not supported",
                      "containerd config migrate")
    h = cc.handler(cfg.effective(), cfg.version)
    if h is None:
        return _check(name, "warn", f"not configured in {config} or its imports (needed for Kubernetes)", fix)
    binary = (h.get("options") or {}).get("BinaryName") or ""
    if h.get("runtime_type") != cc.RUNTIME_TYPE:
        return _check(name, "fail", f"runtime_type {h.get('runtime_type')!r}, not {cc.RUNTIME_TYPE!r}", fix)
    if not os.access(cc.host_path(root, binary or "/-"), os.X_OK):
        return _check(name, "fail", f"BinaryName {binary!r} is missing or not executable (containerd cannot start "
                      "pods of RuntimeClass migrt)", f"{SETUP} to put migrt-runc back, or {fix}")
    launcher = launcher_check(name, cc.host_path(root, binary))
    if launcher["status"] == "fail":
        return _check(name, "fail", f"BinaryName {binary}: {launcher['detail']}", launcher["fix"])
    detail = f"{binary} (config version {cfg.version}); containerd reads it at start"
    if cfg.version == 2:  # containerd 1.x (README "Neighbours")
        detail += ("; containerd 1.x does not serve kubelet's checkpoint API (CRI CheckpointContainer, 2.1+): "
                   "checkpoint with 'migrt checkpoint' on the node")
    try:
        plan = plan_containerd(config, root=root, binary=binary)
    except MigrtError:
        return _check(name, "ok", detail)
    ours = next((c for c in plan.changes if c.path == plan.dropin), None)
    if ours and ours.before is not None and plan.changed:
        return _check(name, "warn", f"{detail}; but {plan.dropin} is out of date with the rest of the config",
                      "run 'migrt install containerd' again, then restart containerd")
    return _check(name, "ok", detail)
