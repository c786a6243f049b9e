"""A runc bundle for the GPU tests, without an image: the host's own Python, PyTorch and NVIDIA
libraries made visible read-only by bind mounts, /dev/nvidia* nodes for the chosen GPUs, and /data
bind-mounted read-write from a host directory.

Bind mounts because runc declares every bind mount external to CRIU: nothing of the host's file
systems is dumped, and on restore each one is mounted again from the new config's source. Plain
(non-recursive) binds, one per needed directory, because CRIU refuses mounts it would have to dump
that it cannot (e.g. a squashfs under an rbind). The directories needed are found by asking the
workload's Python where it and torch live, plus LD_LIBRARY_PATH and libcuda's directory.

Network: by default the host's network namespace (CRIU locks a container's own netns with iptables,
and the GPU machine's kernel lacks xt_mark). A two-node rig (tests/gpu/twonodes.py) gives each
node's container the node's network namespace instead (`netns`: joined by path, /run/netns/<name>),
so that a frozen source and its restored copy never share abstract unix sockets; runc declares such
a namespace external to CRIU and joins the new bundle's on restore. Where CRIU's iptables lock cannot
work (`network_lock_problem()`), `criu_config_file()` writes a CRIU configuration with `network-lock
skip` that the bundle names in its `org.criu.config` annotation (runc hands it to CRIU as the RPC
config file, for that container's checkpoints and restores only; nothing node-wide).
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
                mounts: list[dict] | None = None, netns: str | None = None, criu_config: str | None = None) -> str:
    """A bundle at `path` whose rootfs is made of binds of the host's directories. netns: the name of
    a network namespace (/run/netns/<name>) the container joins (None: the host's); criu_config: a
    CRIU configuration file for its checkpoints and restores (the org.criu.config annotation)."""
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
        # one of runc spec's own (e.g. /dev/shm, 64 MiB) is replaced, not mounted over
        cfg["mounts"] = [x for x in cfg["mounts"] if x.get("destination") != m["destination"]]
        cfg["mounts"].append(m)
    devices = nvidia_devices(gpu_minors) if gpu_minors is not None else []
    linux = cfg.setdefault("linux", {})
    # The host's network namespace unless one is named: CRIU locks a container's own netns with
    # iptables, and the GPU machine's kernel lacks xt_mark ("Locking network failed: iptables-restore
    # returned -1"); a named one is joined by path (external to CRIU), see the module doc.
    linux["namespaces"] = [ns for ns in linux.get("namespaces", []) if ns.get("type") != "network"]
    if netns:
        linux["namespaces"].append({"type": "network", "path": f"/run/netns/{netns}"})
    linux["devices"] = devices
    rules = linux.setdefault("resources", {}).setdefault("devices", [{"allow": False, "access": "rwm"}])
    rules += [{"allow": True, "type": "c", "major": d["major"], "minor": d["minor"], "access": "rwm"} for d in devices]
    annotations = dict(annotations or {})
    if criu_config:
        annotations[CRIU_CONFIG_ANNOTATION] = criu_config
    if annotations:
        cfg["annotations"] = annotations
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path


CRIU_CONFIG_ANNOTATION = "org.criu.config"  # runc: the CRIU configuration file for this container
# CRIU's own lock (criu/net.c iptables_network_lock_internal; SOCCR_MARK 0xC114)
CRIU_LOCK_RULES = ("*filter\n:CRIU - [0:0]\n-I INPUT -j CRIU\n-I OUTPUT -j CRIU\n"
                   "-A CRIU -m mark --mark 0xC114 -j ACCEPT\n-A CRIU -j DROP\nCOMMIT\n")


def network_lock_problem() -> str | None:
    """Why CRIU's iptables network lock would fail here (None: it works): CRIU's own rules, applied
    with iptables-restore in a network namespace of their own that vanishes with the command."""
    try:
        r = subprocess.run(["unshare", "--net", "iptables-restore"], input=CRIU_LOCK_RULES, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run iptables-restore: {exc}"
    if r.returncode:
        return f"iptables-restore of CRIU's lock rules failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return None


def criu_config_file(directory: str, *, force_skip: bool = False) -> tuple[str | None, str]:
    """(a CRIU configuration file saying `network-lock skip`, or None when CRIU's iptables lock works
    here; what the network lock is, in words). For the rig's bundles (org.criu.config) only."""
    problem = "asked for" if force_skip else network_lock_problem()
    if problem is None:
        return None, "iptables (CRIU's default)"
    path = os.path.join(directory, "criu-rig.conf")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("# the GPU rig's containers only (tests/gpu/rig.py): CRIU's iptables lock cannot work here\n"
                 "network-lock skip\n")
    return path, f"skip (org.criu.config {path}; {problem})"
