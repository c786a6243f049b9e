"""A restore never gives the restored processes more than the new container grants.

CRIU restores every task with the credentials its images record (uids, gids, groups, the five
capability sets, securebits, no_new_privs, the seccomp filters, the LSM label, rlimits,
oom_score_adj), reopens the files they held, recreates the mount table and the user namespace its
images record; `runc restore` applies none of process.user, process.capabilities, noNewPrivileges,
linux.seccomp, root.readonly, mounts' flags, process.rlimits, oomScoreAdj or linux.uidMappings to
restored tasks (a root recorded read-write comes back writable in a read-only bundle, /sys
read-write in a bundle that mounts it read-only, a tree of the node's user namespace in a bundle
that asks for one: tested). A checkpoint of a root process with every
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
  mounts        every mount of every mount namespace in the images is one runc makes for the bundle:
                a mounts[] entry at its destination (symlinks of the new root followed) of the same
                kind (proc, sysfs, tmpfs, devpts, mqueue, cgroup: a fresh one; a bind: the external
                mount runc supplies for that destination, or a filesystem that is no kernel
                interface), a cgroup v1 controller below a declared cgroup mount, runc's masks
                (/dev/null or a tmpfs) and read-only remounts (the filesystem below, no other),
                the device nodes runc binds (their own key), a mask of /dev/null anywhere (another
                engine's: it only hides), a read-only mount of the filesystem below it (another
                engine's read-only path: a read-only view of what is there), what a declared rbind brings along
                (no kernel filesystem), or a fresh tmpfs, mqueue or devpts (the checkpoint's own
                files); never writable where the bundle says read-only (the entry's "ro", the one
                above it, linux.readonlyPaths; a tmpfs under root.readonly); no table at all
                (CRIU would leave the tree in the node's mounts) is refused; so are a filesystem
                CRIU would mount afresh from the images' source and options (overlay, auto, aufs,
                fuse, autofs, simfs) unless of the device of the new root or an external mount, a
                second mount at a point with mounts below it (it hides them), a root or mount point
                with '..', and more than MAX_MOUNTS mounts; masked and read-only paths are compared
                in every mount namespace; images are read as CRIU's protobuf-c reads them (a
                varint's low 32 bits, an embedded message written twice merged)
  user namespace  CRIU recreates the one its images record (userns-<id>.img) and runc passes no
                mapping: with linux.namespaces user, the images' uid and gid maps == uidMappings /
                gidMappings (a namespace joined by path: that process's maps); without one, the
                images record none (or the node's own maps: uids compared above keep their meaning)
  rlimits       each hard limit process.rlimits sets >= the image's (recorded at all); not compared
                where the container may raise its own (CAP_SYS_RESOURCE, no user namespace)
  oom_score_adj the image's >= process.oomScoreAdj (lower: the OOM killer spares it at the others'
                expense); not compared where the container holds CAP_SYS_RESOURCE
  securebits    no SECBIT_NO_SETUID_FIXUP (kept capabilities across a change of uid; runc sets no
                bit, and a process sets this one only with CAP_SETPCAP); the others only take away
                or a process sets them itself (KEEP_CAPS)

A bundle that restricts none of these (root, no capabilities section, no user namespace, nothing
else asked) has nothing to compare: its images are not read. Its mounts are not compared either:
root with every capability in the node's user namespace, without seccomp or an LSM label, may mount
a procfs or remount /sys read-write itself. Not compared: personality, cgroups (runc sets the new
cgroup's limits itself). Used by migrt's restores
(ops/restore.py check_target: the shim's create, `migrt restore`, migrations, pulls) and by
migrt-runc's `restore` (the lower runtime's own checkpoints). Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from migrt import jsonsafe
from migrt.criu import tasks as criu_tasks
from migrt.criu.protobuf import ImageError
from migrt.criu.tasks import SECCOMP_FILTER, IdMap, Mount, OpenFile, Tasks, Thread
from migrt.errors import CheckpointInvalid, PreconditionFailed
from migrt.oci.bundle import Bundle
from migrt.oci.grants import DEFAULT_DEVICES, PTY_MAJOR, RLIMITS, Grants, MountDecl, cap_names, read_id_map
from migrt.text import printable

_ID_ROLES = ("runs as", "runs with effective", "keeps saved", "has filesystem")
LSM_NONE, LSM_SELINUX, LSM_APPARMOR = 0, 1, 2


@dataclass
class Verdict:
    """What the restore must pass to runc, and what was left as recorded (for the log)."""
    runc_args: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    userns_root: int | None = None  # the node's uid of the root of the user namespace CRIU recreates


@contextlib.contextmanager
def shared_with_userns(view: str, verdict: Verdict) -> Iterator[None]:
    """CRIU's tasks read their own images after entering the user namespace CRIU recreates, as its
    root (verdict.userns_root on the node): for such a restore the image directory `view` is made
    searchable and its files readable by others while the restore runs (its parents stay 0700: the
    files are reached through CRIU's descriptor only), and their modes put back after (the files may
    be hard links to the store's). Nothing is changed for a restore without a user namespace."""
    modes: dict[str, int] = {}
    try:
        if verdict.userns_root is not None:
            for path in [view, *(os.path.join(view, f) for f in os.listdir(view))]:
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                    modes[path] = stat.S_IMODE(st.st_mode)
                    os.chmod(path, modes[path] | (0o011 if stat.S_ISDIR(st.st_mode) else 0o044))
        yield
    finally:
        for path, mode in modes.items():
            with contextlib.suppress(OSError):
                os.chmod(path, mode)


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
    """A bundle that restricts nothing this module compares (runc's own defaults everywhere): root with
    every capability in the node's user namespace, no seccomp, no LSM label, no device rules. Its
    process may mount anything itself (and raise its limits, and set any securebit), so its mounts,
    rlimits, oom_score_adj and securebits are not compared either."""
    return (g.uid == 0 and g.caps is None and not g.no_new_privs and not g.seccomp and not g.apparmor
            and not g.selinux and not g.readonly_root and g.device_rules is None and not g.devices
            and not g.masked_paths and not g.readonly_paths and not g.userns)


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
    problems: list[str] = _userns(t, g, verdict)
    for th in t.threads:
        problems += _identity(th, g) + _caps(th, g) + _nnp(th, g) + _secbits(th, g) + _limits(th, g)
    problems += _seccomp(t, g, bundle)
    problems += _devices(t, g)
    problems += _readonly_root(t, g, rootfs_changes() if rootfs_changes is not None and g.readonly_root else None)
    problems += _masked(t, g, bundle)
    problems += _mount_tables(t, g)
    problems += _lsm(t, g, verdict, host_lsm() if lsm is None else lsm)
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
        for role, uid in zip(_ID_ROLES, th.uids or (), strict=False):
            if uid != g.uid:
                out.append(f"{th.what} {role} uid {uid} but the container asks for uid {g.uid} (process.user.uid)")
                break
    if not g.may_setgid:
        for role, gid in zip(_ID_ROLES, th.gids or (), strict=False):
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


MAX_FILTERS = 16  # different programs (threads sharing a chain, or equal bytes, count once)
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
    programs = {f.program for th in t.threads for f in t.seccomp_chain(th) or ()}
    if len(programs) > MAX_FILTERS:  # each costs up to ~0.4 s per architecture to read (a budget of steps)
        return [f"its threads run {len(programs)} different seccomp filters, more than the {MAX_FILTERS} a restore "
                "compares with the container's profile (linux.seccomp)"]
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
        more = len(rootfs_changes) - 3
        shown = ", ".join(rootfs_changes[:3]) + (f" and {more} more" if more > 0 else "")
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
        with open(os.path.join(top, DIFF_META), "rb") as fh:
            meta = jsonsafe.load(fh)  # the checkpoint's: from an archive or a registry (60k '[' was a RecursionError)
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


def _norm(path: str) -> str:
    """A mount point as the kernel resolves it: '//proc' (which normpath keeps) is /proc."""
    return "/" + os.path.normpath(path).lstrip("/")


def _masked(t: Tasks, g: Grants, bundle: Bundle) -> list[str]:
    """In every mount namespace of the images (a second one's table is restored as recorded too)."""
    if not t.mounts or not (g.masked_paths or g.readonly_paths):
        return []
    return [p for table in (t.mounts, *t.other_mounts.values()) for p in _masked_in(table, g, bundle)]


def _masked_in(table: list[Mount], g: Grants, bundle: Bundle) -> list[str]:
    by_point = {_norm(m.mountpoint): m for m in table}  # the last mount at a point is the one seen
    out = []
    for p in g.masked_paths:
        if _norm(p) not in by_point and _exists_here(p, bundle):
            out.append(f"the mount table in its images leaves {p} unmasked but the container masks it "
                       "(linux.maskedPaths)")
    for p in g.readonly_paths:
        m = by_point.get(_norm(p))
        if (m is None or not m.read_only) and _exists_here(p, bundle):
            out.append(f"the mount table in its images leaves {p} writable but the container makes it read-only "
                       "(linux.readonlyPaths)")
    return out


# -- mounts: the images' mount table against what the bundle declares ------------------------------------
# filesystems that are a kernel interface of their own: a fresh mount of one shows the container what the
# node's own mount shows (procfs's /proc/sys and core_pattern, sysfs, cgroup files, devtmpfs's devices)
_KERNEL_FS = {criu_tasks.FS_PROC, criu_tasks.FS_SYSFS, criu_tasks.FS_DEVTMPFS, criu_tasks.FS_BINFMT_MISC,
              criu_tasks.FS_SECURITYFS, criu_tasks.FS_FUSECTL, criu_tasks.FS_DEBUGFS, criu_tasks.FS_CGROUP,
              criu_tasks.FS_TRACEFS, criu_tasks.FS_CGROUP2, 8}  # 8: pstore
_CGROUP_FS = {criu_tasks.FS_CGROUP, criu_tasks.FS_CGROUP2}
MAX_MOUNTS = 2048  # a container has tens; 2048 read-only views cost ~2 s to compare
_PLAIN_FS = {criu_tasks.FS_TMPFS, criu_tasks.FS_MQUEUE, criu_tasks.FS_DEVPTS}
# filesystems CRIU mounts afresh from what its images name (a block device for fstype auto, overlay or
# aufs layers in the options: the node's own root for lowerdir=/), unless it binds the mount from
# another one of the same device that the restore supplies
_SOURCE_FS = {criu_tasks.FS_SIMFS, criu_tasks.FS_AUFS, criu_tasks.FS_FUSE, criu_tasks.FS_AUTO,
              criu_tasks.FS_OVERLAY, criu_tasks.FS_AUTOFS}
# a declared type -> what runc mounts for it (cgroup v1 without a cgroup namespace: a tmpfs, each
# controller's cgroup below it)
_DECLARED_FS = {"proc": {criu_tasks.FS_PROC}, "sysfs": {criu_tasks.FS_SYSFS}, "tmpfs": {criu_tasks.FS_TMPFS},
                "devpts": {criu_tasks.FS_DEVPTS}, "mqueue": {criu_tasks.FS_MQUEUE},
                "cgroup": {*_CGROUP_FS, criu_tasks.FS_TMPFS}, "cgroup2": {criu_tasks.FS_CGROUP2}}


def _mount_tables(t: Tasks, g: Grants) -> list[str]:
    if not t.mounts:
        return ["its images record no mount table of its own (CRIU would leave its processes in the node's "
                "mounts) (mounts)"]
    masked = {_norm(p) for p in g.masked_paths}
    ro_paths = {_norm(p) for p in g.readonly_paths}
    out = []
    for table in (t.mounts, *t.other_mounts.values()):
        if len(table) > MAX_MOUNTS:  # each mount is compared with the others: a huge table is not worth the time
            return [f"its images record {len(table)} mounts in one mount namespace, more than {MAX_MOUNTS} (mounts)"]
        root = criu_tasks.root_of(table)
        out += _stacked(table)
        for m in table:
            if ".." in m.root.split("/") or ".." in m.mountpoint.split("/"):  # CRIU joins them to paths as written
                out.append(f"the mount table in its images has {m.fs} at {printable(m.mountpoint, 100)} of root "
                           f"{printable(m.root, 100)}: a path with '..' (mounts)")
                continue
            problem = _mount(m, table, g, masked, ro_paths) if m is not root else None
            if problem:
                out.append(problem)
    return out


def _stacked(table: list[Mount]) -> list[str]:
    """Two mounts at one point with mounts below it: the upper one hides what the lower one holds (a
    second /proc over the first hides the masks and the read-only /proc/sys that runc put there)."""
    points = sorted(_norm(m.mountpoint) for m in table)
    twice = {p for p, q in zip(points, points[1:], strict=False) if p == q}
    below = {p for p in twice if any(q.startswith(p.rstrip("/") + "/") for q in points)}
    return [f"the mount table in its images has a second mount at {printable(p, 100)} over one with mounts below it, "
            "which it would hide (mounts)" for p in sorted(below)]


def _declared(g: Grants, path: str, *, above: bool = False) -> MountDecl | None:
    """The mounts[] entry at `path` (the last one, as runc mounts them in order), or with `above` the
    nearest one whose destination holds `path`."""
    found = None
    for d in g.mounts:
        for dest in {d.destination, d.resolved}:
            if (path.startswith(dest.rstrip("/") + "/") if above else path == dest) and (
                    found is None or not above or len(dest) >= len(found.destination)):
                found = d
    return found


def _under(table: list[Mount], m: Mount) -> int | None:
    """The fstype of the mount `m` was made on (the nearest mount above its mountpoint)."""
    p = _norm(m.mountpoint)
    best = None
    for o in table:
        q = _norm(o.mountpoint)
        if o is not m and (q == "/" or p.startswith(q + "/")) and (best is None or len(q) >= len(best[0])):
            best = (q, o.fstype)
    return None if best is None else best[1]


def _mount(m: Mount, table: list[Mount], g: Grants, masked: set[str], ro_paths: set[str]) -> str | None:
    """Why the mount `m` CRIU would recreate is not one the container declares (None: it is)."""
    p = _norm(m.mountpoint)
    what = f"the mount table in its images has {m.fs} mounted at {p}" + \
        (f" (a bind of the external mount {m.ext_key})" if m.ext_key is not None else "")
    need_ro = "linux.readonlyPaths" if p in ro_paths else None
    decl = _declared(g, p)
    if m.fstype in _SOURCE_FS and m.ext_key is None and not _supplied_device(m, table):
        return f"{what} from {printable(m.source or '?', 100)}, which CRIU would mount as its images describe: the " \
            "container supplies no such filesystem (mounts)"
    if decl is not None:
        if not _fits(m, decl):
            return f"{what} where the container declares {decl.type or 'a mount of no type'} (mounts)"
        # runc leaves the tmpfs holding cgroup v1's controllers writable (it holds only their directories)
        plain = decl.type in ("cgroup", "cgroup2") and m.fstype == criu_tasks.FS_TMPFS
        need_ro = "mounts" if decl.read_only and not plain else need_ro
    elif p in masked:
        # runc's mask: /dev/null bound over a file (runc supplies it as the external /dev/null), a tmpfs
        # over a directory
        return None if m.ext_key == "/dev/null" or (m.fstype == criu_tasks.FS_TMPFS and m.ext_key is None) else \
            f"{what} where the container masks the path (linux.maskedPaths)"
    elif p in ro_paths:
        if m.ext_key is not None or m.fstype != _under(table, m):
            return f"{what} where the container only remounts the path read-only (linux.readonlyPaths)"
    elif p in DEFAULT_DEVICES or p in g.devices:
        # a device node runc binds from the node (user namespaces); supplied as the external key of its path
        return None if m.ext_key == p else f"{what} where runc binds the device node (linux.devices)"
    elif p == "/dev/console" and m.fstype == criu_tasks.FS_DEVPTS and m.ext_key is None:
        return None  # the container's terminal
    elif m.ext_key == "/dev/null":
        return None  # a mask the source engine added (podman's): it hides a file, gives nothing
    elif m.read_only and m.ext_key is None and m.fstype == _under(table, m):
        return None  # a read-only view of the filesystem below it (another engine's read-only path)
    else:
        need_ro, problem = _submount(m, p, g)
        if problem is not None:
            return f"{what} that the container does not declare{problem} (mounts)"
    if need_ro and not m.read_only:
        return f"the mount table in its images has {p} ({m.fs}) read-write but the container makes it read-only " \
               f"({need_ro})"
    return None


def _supplied_device(m: Mount, table: list[Mount]) -> bool:
    """Does CRIU bind `m` from a filesystem the restore supplies (the new root, an external mount): one
    of the same device in the table whose root holds `m`'s (otherwise CRIU has nothing to bind it from)?"""
    root = criu_tasks.root_of(table)
    return any(o is not m and o.root_dev == m.root_dev and (o.ext_key is not None or o is root)
               and (m.root + "/").startswith(o.root.rstrip("/") + "/") for o in table)  # CRIU binds from within


def _fits(m: Mount, decl: MountDecl) -> bool:
    """Would CRIU recreate at `decl`'s destination what runc mounts there for it?"""
    if decl.type in _DECLARED_FS:
        return m.fstype in _DECLARED_FS[decl.type] and m.ext_key is None
    if m.ext_key is not None:  # runc supplies each bind's source as the external key of its destination
        return decl.type == "bind" and m.ext_key in (decl.destination, decl.resolved)
    return m.fstype not in _KERNEL_FS


def _submount(m: Mount, p: str, g: Grants) -> tuple[str | None, str | None]:
    """An undeclared mount that gives nothing the container lacks: a cgroup v1 controller below a
    declared cgroup mount (runc's), a fresh tmpfs, mqueue or devpts (holding only the checkpoint's own
    files, as the container could make them), what a declared recursive bind brings from its source
    if it is not a kernel filesystem. (the setting that asks it read-only, why it is refused: None
    when it is not)."""
    parent = _declared(g, p, above=True)
    setting = "mounts" if parent is not None and parent.read_only else None
    if parent is not None and parent.type in ("cgroup", "cgroup2") and m.fstype in _CGROUP_FS:
        return setting, None if m.ext_key in (None, p) else f" (below the cgroup mount at {parent.destination})"
    if m.fstype in _PLAIN_FS and m.ext_key is None:
        return setting or ("root.readonly" if g.readonly_root and m.fstype == criu_tasks.FS_TMPFS else None), None
    if parent is not None and parent.type == "bind" and parent.recursive:
        ok = m.fstype not in _KERNEL_FS and m.ext_key is None
        return setting, None if ok else f" (below the recursive bind at {parent.destination}, not as a bind)"
    return None, ""


# -- user namespace --------------------------------------------------------------------------------------
def _fmt_map(m: IdMap | None) -> str:
    return ", ".join(f"{a}->{b} ({c})" for a, b, c in m) if m else "nothing"


def _userns(t: Tasks, g: Grants, verdict: Verdict) -> list[str]:
    """CRIU recreates the user namespace its images record (userns-<id>.img, with its maps) or leaves
    the tree in its own, the node's; runc restore passes no mapping. So the images must record the
    bundle's: the same maps, or none when the bundle asks for none."""
    if not g.userns:
        if t.userns is None or t.userns == (_host_map("uid_map"), _host_map("gid_map")):
            return []
        return [f"its images record a user namespace mapping uids {_fmt_map(t.userns[0])} that the container does "
                "not ask for (CRIU would recreate it, and the ids compared here would be other ids on this node) "
                "(linux.namespaces)"]
    if t.userns is None:
        return [f"its processes ran in the node's user namespace (CRIU would restore them there) but the container "
                f"asks for a user namespace mapping uids {_fmt_map(g.uid_map)} (linux.namespaces)"]
    out = []
    for kind, have, want in (("uid", t.userns[0], g.uid_map), ("gid", t.userns[1], g.gid_map)):
        if have != want:
            out.append(f"its images record a user namespace mapping {kind}s {_fmt_map(have)} (CRIU recreates it so) "
                       f"but the container maps {_fmt_map(want)} (linux.{kind}Mappings)")
    verdict.userns_root = next((outside for inside, outside, _ in t.userns[0] if inside == 0), None)
    return out


def _host_map(name: str) -> IdMap | None:
    """This node's own uid_map / gid_map (a tree in a namespace mapping the same ids is as good as none)."""
    return read_id_map(f"/proc/self/{name}")


# -- rlimits, oom_score_adj, securebits ------------------------------------------------------------------
SECBIT_NO_SETUID_FIXUP = 1 << 2
_RLIM_INFINITY = (1 << 64) - 1


def _limits(th: Thread, g: Grants) -> list[str]:
    """CRIU restores each process's rlimits and oom_score_adj; runc restore applies neither. Without
    CAP_SYS_RESOURCE (in the node's user namespace) a process can raise neither its hard limits nor
    lower its oom_score_adj below what runc set: the images may not hold more."""
    if th.tid != th.pid or g.may_raise_limits:
        return []
    out = []
    for num, hard in sorted(g.rlimits.items()):
        hard &= _RLIM_INFINITY  # runc reads it as an unsigned 64-bit number
        have = th.rlimits_max[num] if num < len(th.rlimits_max) else None
        if have is None or have > hard:
            shown = "no limit recorded (CRIU would leave the node's)" if have is None else \
                f"hard limit {'unlimited' if have == _RLIM_INFINITY else have}"
            out.append(f"{th.what} has {RLIMITS[num]} {shown} but the container sets "
                       f"{'unlimited' if hard == _RLIM_INFINITY else hard} (process.rlimits)")
    if g.oom_score_adj is not None and th.oom_score_adj is not None and th.oom_score_adj < g.oom_score_adj:
        out.append(f"{th.what} has oom_score_adj {th.oom_score_adj} but the container sets {g.oom_score_adj} "
                   "(the OOM killer would spare it at the others' expense) (process.oomScoreAdj)")
    return out


def _secbits(th: Thread, g: Grants) -> list[str]:
    """runc sets no securebit. Of the bits, only SECBIT_NO_SETUID_FIXUP grants: a process keeps its
    capabilities when it changes uid; setting it takes CAP_SETPCAP. The others only take away
    (NOROOT, NO_CAP_AMBIENT_RAISE, the locks) or a process may set them itself (KEEP_CAPS)."""
    if not th.secbits & SECBIT_NO_SETUID_FIXUP or g.may_setpcap:
        return []
    return [f"{th.what} has securebit SECBIT_NO_SETUID_FIXUP (keeps its capabilities across a change of uid), "
            "which runc never sets and the container cannot set without CAP_SETPCAP (securebits)"]


def _lsm(t: Tasks, g: Grants, verdict: Verdict, lsm: int) -> list[str]:
    kind, want, key = {LSM_APPARMOR: ("apparmor", g.apparmor, "process.apparmorProfile"),
                       LSM_SELINUX: ("selinux", g.selinux, "process.selinuxLabel")}.get(lsm, (None, None, None))
    if kind is None or want is None or (lsm == LSM_APPARMOR and want == "unconfined"):
        return []  # nothing asked (runc would leave the runtime's own label): the recorded labels stay
    if all(th.lsm_profile == want for th in t.threads):
        return []
    image_lsm = t.lsmtype  # the LSM of the node the images were made on
    if image_lsm is not None and image_lsm != lsm:
        return [f"its images were made on a node without {kind} (CRIU cannot apply the container's label "
                f"{want!r} to them) ({key})"]
    verdict.runc_args += ["--lsm-profile", f"{kind}:{want}"]
    differing = sorted({th.lsm_profile or "none" for th in t.threads if th.lsm_profile != want})
    verdict.notes.append(f"{kind} label {want!r} applied to every task (recorded: {', '.join(differing)})")
    return []
