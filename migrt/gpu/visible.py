"""Which GPUs a container was given, as GPU UUIDs, from its config.json (or its /dev).

Sources, first that speaks wins:
  1. `linux.devices` entries /dev/nvidia<N> (what runc creates; CDI and the NVIDIA container
     toolkit's CDI mode resolve their devices into these), N = the GPU's minor number;
  2. `process.env` NVIDIA_VISIBLE_DEVICES (the toolkit's legacy mode): 'all', 'none'/'void'/'',
     or a comma list of indices and UUIDs;
  3. CDI annotations `cdi.k8s.io/*` naming `nvidia.com/gpu=<index|UUID|all>` devices.
A container that none of them mention gets None: "not said", for the caller to decide.
"""

from __future__ import annotations

import os
import re
import stat

from migrt.gpu.inventory import Inventory

_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")


class VisibleError(ValueError):
    pass


def _resolve(token: str, inv: Inventory, where: str) -> list[str]:
    t = token.strip()
    if not t:
        return []
    if t == "all":
        return [g.uuid for g in inv.gpus]
    if t.isdigit():
        g = inv.by_index(int(t))
        if g is None:
            raise VisibleError(f"{where} names GPU index {t}, which this node does not have")
        return [g.uuid]
    if t.upper().startswith("GPU-"):
        g = inv.by_uuid(t)
        if g is None:
            raise VisibleError(f"{where} names GPU {t}, which this node does not have")
        return [g.uuid]
    raise VisibleError(f"{where} names {t!r}: only GPU indices, GPU-<uuid> and 'all' are supported (no MIG)")


def _from_devices(config: dict, inv: Inventory) -> list[str] | None:
    out = []
    for dev in (config.get("linux") or {}).get("devices") or []:
        if not isinstance(dev, dict):
            continue
        m = _GPU_NODE.match(str(dev.get("path", "")))
        if not m:
            continue
        given = dev.get("minor")
        minor = given if isinstance(given, int) else int(m.group(1))
        g = inv.by_minor(minor)
        if g is None:
            raise VisibleError(f"config.json device {dev.get('path')} (minor {minor}) is no GPU of this node")
        out.append(g.uuid)
    return out or None


def _from_env(config: dict, inv: Inventory) -> list[str] | None:
    for item in (config.get("process") or {}).get("env") or []:
        if isinstance(item, str) and item.startswith("NVIDIA_VISIBLE_DEVICES="):
            value = item.partition("=")[2].strip()
            if value in ("", "none", "void"):
                return []
            out: list[str] = []
            for tok in value.split(","):
                out += _resolve(tok, inv, "NVIDIA_VISIBLE_DEVICES")
            return out
    return None


def _from_cdi(config: dict, inv: Inventory) -> list[str] | None:
    out: list[str] = []
    said = False
    for key, value in sorted((config.get("annotations") or {}).items()):
        if not key.startswith("cdi.k8s.io/") or not isinstance(value, str):
            continue
        for dev in value.split(","):
            kind, _, name = dev.strip().partition("=")
            if kind == "nvidia.com/gpu":
                said = True
                out += _resolve(name, inv, f"CDI annotation {key}")
    return out if said else None


def from_config(config: dict, inv: Inventory) -> list[str] | None:
    """The container's GPU UUIDs in config order, without duplicates; None if config is silent."""
    for source in (_from_devices, _from_env, _from_cdi):
        found = source(config, inv)
        if found is not None:
            return list(dict.fromkeys(found))
    return None


def from_devnodes(pid: int, inv: Inventory) -> list[str] | None:
    """The GPUs whose /dev/nvidia<N> node exists in pid's root (a running container's view)."""
    dev = f"/proc/{pid}/root/dev"
    try:
        names = os.listdir(dev)
    except OSError:
        return None
    out = []
    for name in sorted(names, key=lambda n: (len(n), n)):
        if not re.fullmatch(r"nvidia\d+", name):
            continue
        try:
            st = os.stat(os.path.join(dev, name))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            g = inv.by_minor(os.minor(st.st_rdev))
            if g is not None:
                out.append(g.uuid)
    return out or None
