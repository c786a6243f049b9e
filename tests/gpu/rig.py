"""A runc bundle for the GPU tests, without an image: the host's own Python, PyTorch and NVIDIA
libraries made visible read-only by bind mounts, /dev/nvidia* nodes for the chosen GPUs, and /data
bind-mounted read-write from a host directory.

Bind mounts because runc declares every bind mount external to CRIU: nothing of the host's file
systems is dumped, and on restore each one is mounted again from the new config's source. Plain
(non-recursive) binds, one per needed directory, because CRIU refuses mounts it would have to dump
that it cannot (e.g. a squashfs under an rbind). The directories needed are found by asking the
workload's Python where it and torch live, plus LD_LIBRARY_PATH and libcuda's directory.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess

SKIP_TOP = {"proc", "sys", "dev", "run", "tmp", "var", "mnt", "media", "boot", "srv", "lost+found", "snap"}
BASE_TOP = ("usr", "etc", "lib", "lib32", "lib64", "libx32", "bin", "sbin")
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")

PROBE = r"""
import json, os, sys, ctypes
paths = [os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, sys.exec_prefix]
paths += [p for p in sys.path if p and os.path.isdir(p)]
try:
    import torch
    paths.append(os.path.dirname(os.path.dirname(torch.__file__)))
    torch_version = torch.__version__
except Exception as exc:
    torch_version = None
try:
    ctypes.CDLL("libcuda.so.1")
    for line in open("/proc/self/maps"):
        if "libcuda.so" in line:
            paths.append(os.path.dirname(line.split()[-1]))
            break
except OSError:
    pass
print(json.dumps({"paths": paths, "torch": torch_version, "executable": sys.executable}))
"""


def _unescape(path: str) -> str:
    return path.encode().decode("unicode_escape") if "\\" in path else path


def mount_points() -> list[str]:
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            out.append(_unescape(line.split()[4]))
    return out


def mount_of(path: str, mounts: list[str]) -> str:
    best = "/"
    for m in mounts:
        if (path == m or path.startswith(m.rstrip("/") + "/")) and len(m) > len(best):
            best = m
    return best


def probe(python: str, env: dict | None = None) -> dict:
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True, env=env, timeout=300)
    return json.loads(out.stdout)


def bind_sources(needed: list[str], mounts: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(directories to bind, parents first), {top-level name: symlink target} for merged-/usr links."""
    mounts = mounts if mounts is not None else mount_points()
    binds: set[str] = set()
    links: dict[str, str] = {}
    for top in BASE_TOP:
        p = "/" + top
        if os.path.islink(p):
            links[top] = os.readlink(p)
        elif os.path.isdir(p):
            binds.add(p)
    for raw in needed:
        p = os.path.realpath(raw)
        if not os.path.isdir(p) or p == "/":
            continue
        top = "/" + p.strip("/").split("/")[0]
        m = mount_of(p, mounts)
        if top[1:] in SKIP_TOP:
            binds.add(m if m != "/" and m.startswith(top + "/") else p)
            continue
        if top[1:] not in links:
            binds.add(top)
        if m not in ("/", top) and m.startswith(top + "/"):
            binds.add(m)
    return sorted(binds, key=lambda b: (b.count("/"), b)), links


def nvidia_devices(minors: list[int]) -> list[dict]:
    devs = []
    for name in [*CONTROL_NODES, *(f"nvidia{m}" for m in minors)]:
        path = f"/dev/{name}"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if name == "nvidia-uvm-tools":
                continue
            raise
        if not stat.S_ISCHR(st.st_mode):
            continue
        devs.append({"path": path, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
                     "fileMode": 0o666, "uid": 0, "gid": 0})
    return devs


def make_bundle(path: str, *, args: list[str], data_dir: str, needed: list[str], gpu_minors: list[int] | None,
                env: list[str] | None = None, annotations: dict | None = None, runc: str = "runc",
                mounts: list[dict] | None = None) -> str:
    """A bundle at `path` whose rootfs is made of binds of the host's directories."""
    rootfs = os.path.join(path, "rootfs")
    os.makedirs(rootfs, exist_ok=True)
    binds, links = bind_sources(needed)
    for top, target in links.items():
        link = os.path.join(rootfs, top)
        if not os.path.lexists(link):
            os.symlink(target, link)
    for d in ("proc", "sys", "dev", "tmp", "data", "run"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    os.chmod(os.path.join(rootfs, "tmp"), 0o1777)
    for b in binds:
        os.makedirs(os.path.join(rootfs, b.lstrip("/")), exist_ok=True)
    cfg_path = os.path.join(path, "config.json")
    if os.path.exists(cfg_path):
        os.unlink(cfg_path)
    subprocess.run([runc, "spec"], cwd=path, check=True)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["process"].update(terminal=False, args=args, cwd="/tmp", env=list(env or []))
    cfg["root"] = {"path": "rootfs", "readonly": False}
    cfg["hostname"] = "migrt-gpu-test"
    cfg["mounts"] += [{"destination": b, "type": "bind", "source": b, "options": ["bind", "ro"]} for b in binds]
    cfg["mounts"].append({"destination": "/data", "type": "bind", "source": data_dir, "options": ["bind", "rw"]})
    for m in mounts or []:  # e.g. a tmpfs (CRIU dumps its contents: what is in it comes back with a restore)
        os.makedirs(os.path.join(rootfs, m["destination"].lstrip("/")), exist_ok=True)
        cfg["mounts"].append(m)
    devices = nvidia_devices(gpu_minors) if gpu_minors is not None else []
    linux = cfg.setdefault("linux", {})
    # The host's network namespace: CRIU locks a container's own netns with iptables, and the GPU
    # machine's kernel lacks xt_mark ("Locking network failed: iptables-restore returned -1").
    linux["namespaces"] = [ns for ns in linux.get("namespaces", []) if ns.get("type") != "network"]
    linux["devices"] = devices
    rules = linux.setdefault("resources", {}).setdefault("devices", [{"allow": False, "access": "rwm"}])
    rules += [{"allow": True, "type": "c", "major": d["major"], "minor": d["minor"], "access": "rwm"} for d in devices]
    if annotations:
        cfg["annotations"] = annotations
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path
