"""What a bundle's config.json grants its process: identity, capabilities, no_new_privs, seccomp,
LSM label, devices, a read-only root, masked and read-only paths, its mounts, its user namespace and
its mappings, rlimits and oom_score_adj. Read the way runc reads them
(runc's defaults where config.json is silent), for comparison with what a checkpoint's tasks hold
(ops/restore_privileges.py). Stdlib only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from migrt.oci.bundle import Bundle

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import Any

CAPS = ("CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
        "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
        "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
        "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
        "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
        "CHECKPOINT_RESTORE")
ALL_CAPS = (1 << 64) - 1  # no capabilities section: runc leaves the sets as they are (all of them for root)
CAP_SETUID, CAP_SETGID = 1 << CAPS.index("SETUID"), 1 << CAPS.index("SETGID")
CAP_SETPCAP, CAP_SYS_RESOURCE = 1 << CAPS.index("SETPCAP"), 1 << CAPS.index("SYS_RESOURCE")
RLIMITS = ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_DATA", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_RSS", "RLIMIT_NPROC",
           "RLIMIT_NOFILE", "RLIMIT_MEMLOCK", "RLIMIT_AS", "RLIMIT_LOCKS", "RLIMIT_SIGPENDING", "RLIMIT_MSGQUEUE",
           "RLIMIT_NICE", "RLIMIT_RTPRIO", "RLIMIT_RTTIME")  # by number, as the kernel (and CRIU's images) order them
IdMap = tuple[tuple[int, int, int], ...]  # (first inside, first outside, count), as /proc/<pid>/uid_map lists them
WILDCARD = -1
# runc's devices, always created in /dev and allowed in the device cgroup after the bundle's own rules
# (libcontainer/specconv AllowedDevices): path -> (type, major, minor)
DEFAULT_DEVICES = {"/dev/null": ("c", 1, 3), "/dev/zero": ("c", 1, 5), "/dev/full": ("c", 1, 7),
                   "/dev/random": ("c", 1, 8), "/dev/urandom": ("c", 1, 9), "/dev/tty": ("c", 5, 0),
                   "/dev/ptmx": ("c", 5, 2), "/dev/pts/ptmx": ("c", 5, 2)}
PTY_MAJOR = 136
_DEFAULT_RULES = [(True, "c", WILDCARD, WILDCARD, "m"), (True, "b", WILDCARD, WILDCARD, "m"),
                  *[(True, t, ma, mi, "rwm") for t, ma, mi in sorted(set(DEFAULT_DEVICES.values()))],
                  (True, "c", PTY_MAJOR, WILDCARD, "rwm")]



def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    """config.json's object at `key`, or an empty one where it is absent or not an object."""
    value = data.get(key)
    return value if isinstance(value, dict) else {}

def cap_names(mask: int) -> list[str]:
    return [f"CAP_{CAPS[i]}" if i < len(CAPS) else f"capability {i}" for i in range(64) if mask >> i & 1]


def cap_mask(names) -> int:
    """A capability list of config.json as a bit mask (names runc does not know grant nothing)."""
    mask = 0
    for name in names if isinstance(names, list) else []:
        if isinstance(name, str) and name.upper().removeprefix("CAP_") in CAPS:
            mask |= 1 << CAPS.index(name.upper().removeprefix("CAP_"))
    return mask


@dataclass(frozen=True)
class DeviceRule:
    allow: bool
    type: str           # "a", "c" or "b"
    major: int          # WILDCARD for any
    minor: int
    access: str

    def matches(self, kind: str, major: int, minor: int, access: str) -> bool:
        return (self.type in ("a", kind) and self.major in (WILDCARD, major) and self.minor in (WILDCARD, minor)
                and access in self.access)


@dataclass(frozen=True)
class MountDecl:
    """One entry of config.json mounts[] as runc mounts it."""
    destination: str     # normalised; `resolved`: the same with the root filesystem's symlinks followed
    type: str            # "bind" for a bind mount whatever its type field says
    read_only: bool
    recursive: bool      # rbind: the source's submounts come along
    resolved: str = ""


@dataclass
class Grants:
    uid: int = 0
    gid: int = 0
    additional_gids: frozenset[int] = frozenset()
    caps: dict[str, int] | None = None          # None: no capabilities section (nothing dropped)
    no_new_privs: bool = False
    seccomp: bool = False                        # linux.seccomp is set
    apparmor: str | None = None
    selinux: str | None = None
    readonly_root: bool = False
    device_rules: list[DeviceRule] | None = None  # None: no linux.resources.devices (runc's defaults)
    devices: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # linux.devices path -> (type, maj, min)
    binds: dict[str, str] = field(default_factory=dict)  # bind mount destination -> host source
    masked_paths: tuple[str, ...] = ()
    readonly_paths: tuple[str, ...] = ()
    oom_score_adj: int | None = None
    mounts: list[MountDecl] = field(default_factory=list)
    userns: bool = False                         # linux.namespaces has a user namespace
    uid_map: IdMap | None = None                 # its mappings (None: unknown, a path joined without them)
    gid_map: IdMap | None = None
    rlimits: dict[int, int] = field(default_factory=dict)  # RLIMIT_* number -> hard limit process.rlimits sets

    @classmethod
    def of(cls, bundle: Bundle) -> Grants:
        cfg = bundle.config
        proc = _section(cfg, "process")
        linux = _section(cfg, "linux")
        user = _section(proc, "user")
        g = cls(uid=_int(user.get("uid"), 0), gid=_int(user.get("gid"), 0),
                additional_gids=frozenset(x for x in user.get("additionalGids") or [] if isinstance(x, int)))
        caps = proc.get("capabilities")
        if isinstance(caps, dict):
            g.caps = {name: cap_mask(caps.get(name)) for name in ("effective", "permitted", "inheritable",
                                                                   "bounding", "ambient")}
        g.no_new_privs = proc.get("noNewPrivileges") is True
        g.seccomp = isinstance(linux.get("seccomp"), dict)
        g.apparmor = _label(proc.get("apparmorProfile"))
        g.selinux = _label(proc.get("selinuxLabel"))
        root = _section(cfg, "root")
        g.readonly_root = root.get("readonly") is True
        resources = _section(linux, "resources")
        rules = resources.get("devices")
        if isinstance(rules, list):
            g.device_rules = [r for r in (_rule(x) for x in rules) if r is not None]
        for d in linux.get("devices") or []:
            if isinstance(d, dict) and isinstance(d.get("path"), str) and d.get("type") in ("c", "b", "u", "p"):
                kind = "c" if d["type"] == "u" else d["type"]
                g.devices[os.path.normpath(d["path"])] = (kind, _int(d.get("major"), 0), _int(d.get("minor"), 0))
        for m in bundle.mounts:
            if isinstance(m.get("destination"), str) and isinstance(m.get("source"), str) and (
                    m.get("type") == "bind" or any(o in ("bind", "rbind") for o in m.get("options") or [])):
                g.binds[os.path.normpath(m["destination"])] = m["source"]
        g.masked_paths = tuple(p for p in linux.get("maskedPaths") or [] if isinstance(p, str))
        g.readonly_paths = tuple(p for p in linux.get("readonlyPaths") or [] if isinstance(p, str))
        oom = proc.get("oomScoreAdj")
        g.oom_score_adj = oom if isinstance(oom, int) and not isinstance(oom, bool) else None
        g.mounts = [d for d in (_mount(m, bundle.rootfs) for m in bundle.mounts) if d is not None]
        g._user_namespace(linux)
        for r in proc.get("rlimits") or []:
            if isinstance(r, dict) and r.get("type") in RLIMITS and isinstance(r.get("hard"), int):
                g.rlimits[RLIMITS.index(r["type"])] = r["hard"]
        return g

    def _user_namespace(self, linux: dict) -> None:
        """linux.namespaces' user entry and its mappings (from uid/gidMappings, or for a namespace joined
        by path /proc/<pid>/ns/user, from that process's uid_map and gid_map)."""
        ns = next((n for n in linux.get("namespaces") or [] if isinstance(n, dict) and n.get("type") == "user"), None)
        if ns is None:
            return
        self.userns = True
        self.uid_map, self.gid_map = _mappings(linux.get("uidMappings")), _mappings(linux.get("gidMappings"))
        path = ns.get("path")
        if isinstance(path, str) and path and (self.uid_map is None or self.gid_map is None):
            pid_dir = os.path.dirname(os.path.dirname(path))  # /proc/<pid>/ns/user -> /proc/<pid>
            self.uid_map = self.uid_map or read_id_map(os.path.join(pid_dir, "uid_map"))
            self.gid_map = self.gid_map or read_id_map(os.path.join(pid_dir, "gid_map"))

    @property
    def may_raise_limits(self) -> bool:
        """Can the container's process raise its own rlimits and lower its oom_score_adj (CAP_SYS_RESOURCE,
        which counts only in the node's user namespace)?"""
        return not self.userns and bool(self.cap_ceiling("permitted") & self.cap_ceiling("bounding") & CAP_SYS_RESOURCE)

    @property
    def may_setpcap(self) -> bool:
        return bool(self.cap_ceiling("permitted") & self.cap_ceiling("bounding") & CAP_SETPCAP)

    @property
    def may_setuid(self) -> bool:
        """Can the container's process take any uid (root keeping CAP_SETUID)?"""
        return self.uid == 0 and bool(self.cap_ceiling("permitted") & self.cap_ceiling("bounding") & CAP_SETUID)

    @property
    def may_setgid(self) -> bool:
        return self.uid == 0 and bool(self.cap_ceiling("permitted") & self.cap_ceiling("bounding") & CAP_SETGID)

    def cap_ceiling(self, which: str) -> int:
        """The most a process of this container may hold in capability set `which`: the configured set;
        for permitted and effective of a root process without no_new_privs also what exec gives root
        (bounding | inheritable, as the kernel computes it); effective may be raised up to permitted."""
        if self.caps is None:
            return ALL_CAPS
        c = self.caps
        if which in ("permitted", "effective"):
            top = c["permitted"] | (c["effective"] if which == "effective" else 0)
            if self.uid == 0 and not self.no_new_privs:
                top |= c["bounding"] | c["inheritable"]
            return top
        return c[which]

    def device_allowed(self, kind: str, major: int, minor: int, access: str) -> bool:
        """runc's device cgroup for this bundle: its rules, then runc's defaults; the last rule that
        matches decides. Without linux.resources.devices nothing is restricted here."""
        if self.device_rules is None:
            return True
        decision = True
        for r in [*self.device_rules, *(DeviceRule(*x) for x in _DEFAULT_RULES)]:
            if r.matches(kind, major, minor, access):
                decision = r.allow
        return decision


def _mappings(v) -> IdMap | None:
    if not isinstance(v, list):
        return None
    out = [(_int(m.get("containerID"), -1), _int(m.get("hostID"), -1), _int(m.get("size"), -1))
           for m in v if isinstance(m, dict)]
    return tuple(sorted(out))


def read_id_map(path: str) -> IdMap | None:
    """A uid_map or gid_map file; None when unreadable."""
    try:
        with open(path, encoding="ascii") as fh:
            rows = [line.split() for line in fh.read(65536).splitlines() if line.strip()]
        return tuple(sorted((int(a), int(b), int(c)) for a, b, c in rows))
    except (OSError, ValueError):
        return None


def _mount(m, rootfs: str) -> MountDecl | None:
    if not isinstance(m, dict) or not isinstance(m.get("destination"), str) or not m["destination"].startswith("/"):
        return None
    opts = [o for o in m.get("options") or [] if isinstance(o, str)]
    ro = False
    for o in opts:
        ro = True if o in ("ro", "rro") else False if o in ("rw", "rrw") else ro
    bind = m.get("type") == "bind" or "bind" in opts or "rbind" in opts
    dest = os.path.normpath(m["destination"])
    return MountDecl(destination=dest, type="bind" if bind else str(m.get("type") or ""), read_only=ro,
                     recursive="rbind" in opts, resolved=resolve_in_root(rootfs, dest))


def resolve_in_root(rootfs: str, path: str) -> str:
    """`path` with the symlinks of the root filesystem followed inside it, as runc resolves a mount's
    destination (/var/run -> /run); components that do not exist are kept as written."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            done = done[:-1]
            continue
        if part == ".":
            continue
        real = os.path.join(rootfs, *done, part)
        if hops < 40 and os.path.islink(real):
            hops += 1
            target = os.readlink(real)
            done = [] if target.startswith("/") else done
            parts = [p for p in target.split("/") if p] + parts
            continue
        done.append(part)
    return "/" + "/".join(done)


def _int(v, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _label(v) -> str | None:
    return v if isinstance(v, str) and v else None


def _rule(x) -> DeviceRule | None:
    if not isinstance(x, dict) or not isinstance(x.get("allow"), bool):
        return None
    kind = x.get("type") or "a"
    if kind not in ("a", "c", "b"):
        return None
    major = x.get("major")
    minor = x.get("minor")
    return DeviceRule(allow=x["allow"], type=kind, major=major if isinstance(major, int) and major >= 0 else WILDCARD,
                      minor=minor if isinstance(minor, int) and minor >= 0 else WILDCARD,
                      access=access if isinstance(access := x.get("access"), str) and access else "rwm")
