"""A restore never gives the restored processes more than the new container grants.

CRIU restores every task with the credentials its images record (uids, gids, groups, the five
capability sets, no_new_privs, the seccomp filters, the LSM label), reopens the files they held and
recreates the mount table; `runc restore` applies none of process.user, process.capabilities,
noNewPrivileges, linux.seccomp or root.readonly to restored tasks (a root recorded read-write comes
back writable in a read-only bundle: tested). A checkpoint of a root process with every
capability restored into a pod that asks for uid 1000, no capabilities and noNewPrivileges would
run as root with every capability. So before CRIU runs, every thread the images hold
(criu/tasks.py: the images are the authority, not the manifest) is compared with what the new
bundle's config.json grants (oci/grants.py), and the restore is refused, naming the setting:

  identity      real, effective, saved and filesystem uid and gid == process.user.uid/gid, and the
                supplementary groups within gid + additionalGids (any, for a root process keeping
                CAP_SETUID / CAP_SETGID, which may switch to any id)
  capabilities  each set (effective, permitted, inheritable, bounding, ambient) within the same set
                of process.capabilities (effective within effective + permitted; a root process
                without noNewPrivileges also within bounding + inheritable: what exec gives root);
                no capabilities section: runc drops nothing, nothing to compare
  no_new_privs  set on every thread when process.noNewPrivileges is true
  seccomp       CRIU restores the checkpoint's BPF programs, not the profile: every thread's stack
                of filters (seccomp.img, chained by prev) must answer every system call, on every
                architecture this kernel runs, at least as strictly as the program runc compiles
                from linux.seccomp (libseccomp and runc's -ENOSYS stub; seccomp/compare.py: both
                read symbolically, arguments included); strict mode passes; a filter that cannot
                be decided, or no libseccomp here, is refused
  LSM label     the label the bundle names (process.apparmorProfile / selinuxLabel, for the LSM this
                node runs) is applied to every task with runc's --lsm-profile when a task's
                recorded label differs (SELinux categories differ from pod to pod, so refusing would
                refuse every restore into a new pod); refused when the images come from a node with
                another LSM (CRIU cannot apply it then)
  devices       every device a task holds open is one the container has (runc's defaults,
                linux.devices, a bind mount) and the device rules (linux.resources.devices, then
                runc's defaults) allow it for the access it is open for
  read-only root  no file open for writing on the root mount, a root mount CRIU recreates read-only,
                no change to the root filesystem in the checkpoint's writable layer but directories
  masked and read-only paths  the mount table CRIU recreates masks each linux.maskedPaths entry and
                mounts each linux.readonlyPaths entry read-only (where the path exists on this node)

A bundle that restricts none of these (root, no capabilities section, nothing else asked) has
nothing to compare: its images are not read. Not compared: rlimits, oom_score_adj, securebits,
personality, cgroups (runc sets the new cgroup's limits itself). Used by migrt's restores
(ops/restore.py check_target: the shim's create, `migrt restore`, migrations, pulls) and by
migrt-runc's `restore` (the lower runtime's own checkpoints). Stdlib only.
"""

from __future__ import annotations

import json
import os
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field

from migrt.criu import tasks as criu_tasks
from migrt.criu.protobuf import ImageError, fields, read_entries
from migrt.criu.tasks import SECCOMP_DISABLED, SECCOMP_FILTER, OpenFile, Tasks, Thread
from migrt.errors import CheckpointInvalid, PreconditionFailed
from migrt.oci.bundle import Bundle
from migrt.oci.grants import DEFAULT_DEVICES, PTY_MAJOR, Grants, cap_names

_ID_ROLES = ("runs as", "runs with effective", "keeps saved", "has filesystem")
LSM_NONE, LSM_SELINUX, LSM_APPARMOR = 0, 1, 2


@dataclass
class Verdict:
    """What the restore must pass to runc, and what was left as recorded (for the log)."""
    runc_args: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def host_lsm() -> int:
    """The LSM whose labels runc and CRIU apply on this node."""
    try:
        with open("/sys/module/apparmor/parameters/enabled", encoding="ascii") as fh:
            if fh.read().strip() == "Y":
                return LSM_APPARMOR
    except OSError:
        pass
    return LSM_SELINUX if os.path.exists("/sys/fs/selinux/enforce") else LSM_NONE


def unrestricted(g: Grants) -> bool:
    """A bundle that restricts nothing this module compares (runc's own defaults everywhere)."""
    return (g.uid == 0 and g.caps is None and not g.no_new_privs and not g.seccomp and not g.apparmor
            and not g.selinux and not g.readonly_root and g.device_rules is None and not g.devices
            and not g.masked_paths and not g.readonly_paths)


def check(images: str, bundle: Bundle, name: str, *, rootfs_changes: Callable[[], list[str]] | None = None,
          lsm: int | None = None) -> Verdict:
    """Refuse (PreconditionFailed) a restore of `images` into `bundle` that would give a task more
    than the bundle grants; return what runc must be told. `rootfs_changes`: lists what applying the
    checkpoint's writable layer changes beyond directories (None: the restore applies no layer);
    called only for a read-only root. `lsm`: the node's LSM (tests; default: host_lsm())."""
    g = Grants.of(bundle)
    if unrestricted(g):
        return Verdict(notes=["the container restricts nothing: nothing compared"])
    try:
        t = criu_tasks.read(images)
    except (ImageError, OSError, ValueError, TypeError, IndexError, OverflowError) as exc:  # a hand-made image
        raise CheckpointInvalid(f"checkpoint {name}: cannot read what its processes hold from the CRIU images "
                                f"({exc}); refusing to restore it") from exc
    verdict = Verdict()
    problems: list[str] = []
    for th in t.threads:
        problems += _identity(th, g) + _caps(th, g) + _nnp(th, g)
    problems += _seccomp(t, g, bundle)
    problems += _devices(t, g)
    problems += _readonly_root(t, g, rootfs_changes() if rootfs_changes is not None and g.readonly_root else None)
    problems += _masked(t, g, bundle)
    problems += _lsm(t, g, images, verdict, host_lsm() if lsm is None else lsm)
    if g.seccomp and not problems:
        verdict.notes.append("seccomp: every thread's filters answer at least as strictly as linux.seccomp")
    if problems:
        lines = _by_setting(problems)
        raise PreconditionFailed(
            f"checkpoint {name}: {lines[0]}; a restore never grants more than the new container's config.json "
            "(restore it into a container whose security settings allow this, or checkpoint a container that "
            "runs with the new one's settings)", details=lines[1:])
    return verdict


def _by_setting(problems: list[str]) -> list[str]:
    """One line per setting (the "(process.user.uid)" a problem ends with): its first occurrence and
    how many more tasks, devices or paths it concerns."""
    groups: dict[str, list[str]] = {}
    for text in problems:
        same = groups.setdefault(text[text.rfind("("):] if text.endswith(")") else text, [])
        if text not in same:
            same.append(text)
    return [same[0] + (f" (and {len(same) - 1} more like it)" if len(same) > 1 else "") for same in groups.values()]


def _identity(th: Thread, g: Grants) -> list[str]:
    out = []
    if not g.may_setuid:
        for role, uid in zip(_ID_ROLES, th.uids or ()):
            if uid != g.uid:
                out.append(f"{th.what} {role} uid {uid} but the container asks for uid {g.uid} (process.user.uid)")
                break
    if not g.may_setgid:
        for role, gid in zip(_ID_ROLES, th.gids or ()):
            if gid != g.gid:
                out.append(f"{th.what} {role} gid {gid} but the container asks for gid {g.gid} (process.user.gid)")
                break
        allowed = {g.gid, *g.additional_gids}
        extra = sorted(set(th.groups) - allowed)
        if extra:
            out.append(f"{th.what} is in supplementary group(s) {', '.join(map(str, extra))} but the container "
                       f"grants {', '.join(map(str, sorted(allowed)))} (process.user.additionalGids)")
    return out


def _caps(th: Thread, g: Grants) -> list[str]:
    out = []
    for which in ("bounding", "permitted", "effective", "inheritable", "ambient"):
        extra = th.caps.get(which, 0) & ~g.cap_ceiling(which)
        if extra:
            names = cap_names(extra)
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            out.append(f"{th.what} holds {which} capabilities the container does not grant: {shown} "
                       f"(process.capabilities.{which})")
    return out


def _nnp(th: Thread, g: Grants) -> list[str]:
    if not g.no_new_privs or th.no_new_privs:
        return []
    return [f"{th.what} runs without no_new_privs but the container asks for it (process.noNewPrivileges)"]


_SECCOMP_DOES = ("the process killed", "the thread killed", "SIGSYS", "an error", "its seccomp agent asked",
                 "a tracer asked", "allowed, logged", "")
_SECCOMP_VERB = ("answers by killing the process", "answers by killing the thread", "traps (SIGSYS)", "denies",
                 "hands to its seccomp agent", "hands to a tracer", "logs", "allows")


def _seccomp(t: Tasks, g: Grants, bundle: Bundle) -> list[str]:
    """linux.seccomp: every thread's restored filter stack at least as strict as the profile."""
    if not g.seccomp:
        return []
    from migrt.seccomp import bpf, compare, profile

    try:
        compiled = profile.compile_profile(bundle.config["linux"]["seccomp"])
    except (profile.ProfileError, bpf.BpfError, OSError) as exc:
        return [f"its seccomp profile cannot be compared with the restored filters: {exc} (linux.seccomp)"]
    if compiled is None:
        return []  # runc loads no filter for this profile
    comparer = compare.Comparer(compiled)
    out = []
    for th in t.threads:
        chain = t.seccomp_chain(th)
        if chain is None and th.seccomp_mode == SECCOMP_FILTER:
            out.append(f"{th.what} is in seccomp filter mode but seccomp.img holds no filter for it (linux.seccomp)")
        elif chain is None and th.seccomp_mode != criu_tasks.SECCOMP_STRICT:  # CRIU installs nothing then
            out.append(f"{th.what} runs without a seccomp filter but the container asks for one (linux.seccomp)")
        else:
            out += _seccomp_stack(th, chain, comparer)
    return out


def _seccomp_stack(th: Thread, chain, comparer) -> list[str]:
    """One thread's filters (None: strict mode) against the profile."""
    from migrt.seccomp import bpf, compare

    try:
        w = comparer.weaker([(f.program, bpf.decode(f.program)) for f in chain] if chain is not None
                            else [(b"SECCOMP_MODE_STRICT", compare.STRICT_MODE)])
    except (bpf.BpfError, bpf.Uncomparable) as exc:
        return [f"{th.what} runs a seccomp filter that cannot be compared with the container's profile ({exc}) "
                "(linux.seccomp)"]
    if w is None:
        return []
    does = _SECCOMP_DOES[compare.level(w.image)]
    return [f"{th.what} may call {w.call}{f' ({does})' if does else ''}{' with some arguments' if w.some_args else ''}"
            f", which the container's seccomp profile {_SECCOMP_VERB[compare.level(w.profile)]} (linux.seccomp)"]


def _device_number(f: OpenFile, g: Grants) -> tuple[str, int, int] | None:
    """(type, major, minor) of the device CRIU would reopen for `f`, as the new container has it."""
    if f.rdev is not None:
        return ("c", os.major(f.rdev), os.minor(f.rdev))
    path = os.path.normpath(f.path)
    if path in g.devices:
        return g.devices[path]
    if path in DEFAULT_DEVICES:
        return DEFAULT_DEVICES[path]
    pts = path.removeprefix("/dev/pts/")
    if pts != path and pts.isdigit():
        return ("c", PTY_MAJOR, int(pts))
    for dest, source in sorted(g.binds.items(), key=lambda kv: -len(kv[0])):
        if path == dest or path.startswith(dest.rstrip("/") + "/"):
            try:
                st = os.stat(source + path[len(dest):])
            except OSError:
                return None
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                return ("c" if stat.S_ISCHR(st.st_mode) else "b", os.major(st.st_rdev), os.minor(st.st_rdev))
            return None
    return None


def _devices(t: Tasks, g: Grants) -> list[str]:
    out = []
    for f in t.files:
        if not criu_tasks.is_device(f):
            continue
        label = f.path or "a terminal"
        dev = _device_number(f, g)
        if dev is None:
            out.append(f"process {f.pid} holds {label} open (fd {f.fd}), a device the container is not given "
                       "(linux.devices)")
            continue
        kind, major, minor = dev
        for access, word in (("r", "reading"), ("w", "writing")):
            if (f.reads if access == "r" else f.writes) and not g.device_allowed(kind, major, minor, access):
                out.append(f"process {f.pid} holds device {label} ({kind} {major}:{minor}) open for {word}, which "
                           "the container's device rules deny (linux.resources.devices)")
    return out


def _readonly_root(t: Tasks, g: Grants, rootfs_changes: list[str] | None) -> list[str]:
    if not g.readonly_root:
        return []
    out = []
    root = t.root_mount
    if root is not None and not root.read_only:
        out.append("its root filesystem is mounted read-write in the images (CRIU would mount it so) but the "
                   "container asks for a read-only root (root.readonly)")
    if root is not None:
        for f in t.files:
            if f.writes and f.mnt_id == root.mnt_id and not criu_tasks.is_device(f):
                out.append(f"process {f.pid} holds {f.path} open for writing on the root filesystem but the "
                           "container asks for a read-only root (root.readonly)")
    if rootfs_changes:
        shown = ", ".join(rootfs_changes[:3]) + (f" and {len(rootfs_changes) - 3} more" if len(rootfs_changes) > 3 else "")
        out.append(f"its writable layer changes the root filesystem ({shown}) but the container asks for a "
                   "read-only root (root.readonly)")
    return out


def layer_changes(top: str) -> list[str]:
    """What applying the writable layer of the checkpoint at `top` would change in a root filesystem
    beyond creating directories (runc creates mount points in a read-only root too): files and
    links it writes, paths it deletes, directories it empties."""
    from migrt.pods.rootfs import DIFF_META, DIFF_TAR

    out: list[str] = []
    try:
        with open(os.path.join(top, DIFF_META), encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        meta = {}
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(f"checkpoint at {top}: unreadable {DIFF_META}: {exc}") from exc
    meta = meta if isinstance(meta, dict) else {}
    out += [f"deletes /{p}" for p in meta.get("deleted") or [] if isinstance(p, str)]
    out += [f"empties /{p}" for p in meta.get("opaque") or [] if isinstance(p, str)]
    path = os.path.join(top, DIFF_TAR)
    if os.path.isfile(path):
        try:
            with tarfile.open(path) as tar:
                out += ["/" + m.name.removeprefix("./") for m in tar if not m.isdir()]
        except (OSError, tarfile.TarError) as exc:
            raise CheckpointInvalid(f"checkpoint at {top}: unreadable {DIFF_TAR}: {exc}") from exc
    return out


def _exists_here(path: str, bundle: Bundle) -> bool:
    """Would runc find `path` in the new container (it skips masked/read-only paths that are absent)?
    /proc and /sys as this node's kernel shows them; other paths in the new root filesystem."""
    if path.startswith(("/proc/", "/sys/")) or path in ("/proc", "/sys"):
        return os.path.lexists(path)
    return os.path.lexists(os.path.join(bundle.rootfs, path.lstrip("/")))


def _masked(t: Tasks, g: Grants, bundle: Bundle) -> list[str]:
    if not t.mounts or not (g.masked_paths or g.readonly_paths):
        return []
    by_point = {}
    for m in t.mounts:
        by_point[os.path.normpath(m.mountpoint)] = m  # the last mount at a point is the one seen
    out = []
    for p in g.masked_paths:
        if os.path.normpath(p) not in by_point and _exists_here(p, bundle):
            out.append(f"the mount table in its images leaves {p} unmasked but the container masks it (linux.maskedPaths)")
    for p in g.readonly_paths:
        m = by_point.get(os.path.normpath(p))
        if (m is None or not m.read_only) and _exists_here(p, bundle):
            out.append(f"the mount table in its images leaves {p} writable but the container makes it read-only "
                       "(linux.readonlyPaths)")
    return out


def _inventory_lsm(images: str) -> int | None:
    """The LSM of the node the images were made on (inventory.img lsmtype); None when unreadable."""
    try:
        entries = read_entries(os.path.join(images, "inventory.img"))
    except ImageError:
        return None
    found = fields(entries[0]) if entries else []
    return next((int(v) for n, v in found if n == 6 and isinstance(v, int)), LSM_NONE)


def _lsm(t: Tasks, g: Grants, images: str, verdict: Verdict, lsm: int) -> list[str]:
    kind, want, key = {LSM_APPARMOR: ("apparmor", g.apparmor, "process.apparmorProfile"),
                       LSM_SELINUX: ("selinux", g.selinux, "process.selinuxLabel")}.get(lsm, (None, None, None))
    if kind is None or want is None or (lsm == LSM_APPARMOR and want == "unconfined"):
        return []  # nothing asked (runc would leave the runtime's own label): the recorded labels stay
    if all(th.lsm_profile == want for th in t.threads):
        return []
    image_lsm = _inventory_lsm(images)
    if image_lsm is not None and image_lsm != lsm:
        return [f"its images were made on a node without {kind} (CRIU cannot apply the container's label "
                f"{want!r} to them) ({key})"]
    verdict.runc_args += ["--lsm-profile", f"{kind}:{want}"]
    differing = sorted({th.lsm_profile or "none" for th in t.threads if th.lsm_profile != want})
    verdict.notes.append(f"{kind} label {want!r} applied to every task (recorded: {', '.join(differing)})")
    return []
