"""What the checkpointed tasks hold, read from CRIU's images: the privileges CRIU gives back to every
task and thread it restores, whatever the new container's config.json says.

CRIU restores credentials, capability sets, securebits, no_new_privs, the seccomp mode and filters,
the LSM label, open files and the mount table exactly as its images record them; `runc restore`
applies neither process.user nor process.capabilities, noNewPrivileges or the seccomp profile to
restored tasks. So a restore compares these facts with what the new bundle grants before CRIU runs
(ops/restore_privileges.py). The images are the authority (they are what CRIU reads); a manifest
could be hand-made and is not consulted here.

Where the facts live (CRIU 3.x/4.x):
  pstree.img                 every process and its threads
  core-<tid>.img             per thread: thread_core.creds (uids, gids, groups, capability words,
                             secbits, no_new_privs, lsm_profile), thread_core.seccomp_mode;
                             per process: tc.task_state, tc.comm, tc.rlimits, tc.oom_score_adj,
                             ids (files_id, mnt_ns_id, user_ns_id; ids-<pid>.img in some versions)
  inventory.img              root_ids: CRIU's own namespaces at dump (a tree whose user_ns_id
                             differs ran in a user namespace of its own, which CRIU recreates);
                             lsmtype
  userns-<id>.img            that user namespace's uid and gid maps
  creds-<pid>.img            the same creds in images of CRIU before 3.0 (read when core has none)
  files.img, fdinfo-<id>.img open files (reg: path, flags, st_mode, mnt_id; tty: tty_info_id)
  tty-info.img               a tty's kind and device number
  mountpoints-<ns>.img       the mount table CRIU recreates, per mount namespace (fstype, mountpoint,
                             flags, sb_flags, root, ext_key: runc's key of a bind it supplies)
  seccomp.img                the BPF filters: program bytes, the index of the filter installed before
                             it (prev), flags (TSYNC: CRIU recorded the chain on the leader only)

Stdlib only (criu/protobuf.py: no pycriu on the restore path, whose import costs ~0.3 s); the unit
tests check it against pycriu-written images.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from migrt.criu.protobuf import ImageError, read_entries
from migrt.criu.protobuf import fields as _fields
from migrt.criu.protobuf import varint as _varint

TASK_ALIVE, TASK_DEAD, TASK_STOPPED, TASK_HELPER = 1, 2, 3, 4
SECCOMP_DISABLED, SECCOMP_STRICT, SECCOMP_FILTER = 0, 1, 2
FD_REG, FD_TTY = 1, 11
TTY_PTY, TTY_CONSOLE, TTY_CTTY = 1, 2, 4
CAP_SETS = ("effective", "permitted", "inheritable", "bounding", "ambient")
_CRED_CAPS = {9: "inheritable", 10: "permitted", 11: "effective", 12: "bounding", 19: "ambient"}
MS_RDONLY = 1
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1  # protobuf-c keeps the low bits of an over-wide varint
# mnt.proto fstype
FS_UNSUPPORTED, FS_PROC, FS_SYSFS, FS_DEVTMPFS, FS_BINFMT_MISC, FS_TMPFS, FS_DEVPTS = 0, 1, 2, 3, 4, 5, 6
FS_SECURITYFS, FS_FUSECTL, FS_DEBUGFS, FS_CGROUP, FS_MQUEUE, FS_TRACEFS, FS_CGROUP2 = 9, 10, 11, 12, 14, 19, 23
FS_SIMFS, FS_AUFS, FS_FUSE, FS_AUTO, FS_OVERLAY, FS_AUTOFS = 7, 13, 15, 16, 17, 18
FS_NAMES = {FS_PROC: "proc", FS_SYSFS: "sysfs", FS_DEVTMPFS: "devtmpfs", FS_BINFMT_MISC: "binfmt_misc",
            FS_TMPFS: "tmpfs", FS_DEVPTS: "devpts", 8: "pstore", FS_SECURITYFS: "securityfs", FS_FUSECTL: "fusectl",
            FS_DEBUGFS: "debugfs", FS_CGROUP: "cgroup", 13: "aufs", FS_MQUEUE: "mqueue", 15: "fuse", 16: "auto",
            17: "overlay", 18: "autofs", FS_TRACEFS: "tracefs", FS_CGROUP2: "cgroup2"}
O_ACCMODE, O_WRONLY, O_RDWR, O_PATH = 0o3, 0o1, 0o2, 0o10000000


@dataclass
class Thread:
    """One restored thread's privileges."""
    pid: int                      # its process (the pstree entry)
    tid: int
    comm: str
    uids: tuple[int, int, int, int] | None = None   # real, effective, saved, fs (None: not recorded)
    gids: tuple[int, int, int, int] | None = None
    groups: tuple[int, ...] = ()
    caps: dict[str, int] = field(default_factory=dict)  # CAP_SETS -> bit mask
    secbits: int = 0
    no_new_privs: int = 0            # CRIU writes it only when set (and CRIU that predates it never restores it)
    lsm_profile: str | None = None
    seccomp_mode: int = SECCOMP_DISABLED
    seccomp_filter: int | None = None  # index of the last filter of its chain in seccomp.img
    # per process, on its main thread only (tid == pid): the hard limits by RLIMIT_* number, oom_score_adj
    rlimits_max: tuple[int, ...] = ()
    oom_score_adj: int | None = None

    @property
    def what(self) -> str:
        who = f"process {self.pid}" if self.tid == self.pid else f"thread {self.tid} of process {self.pid}"
        return f"{who} ({self.comm})" if self.comm else who


@dataclass(frozen=True)
class OpenFile:
    """A descriptor CRIU reopens: a regular or device file by path, or a tty by device number."""
    pid: int
    fd: int
    path: str
    flags: int
    mode: int | None = None        # st_mode as recorded (None: not recorded)
    mnt_id: int | None = None
    rdev: int | None = None        # ttys: the device number CRIU recorded

    @property
    def writes(self) -> bool:
        return not self.flags & O_PATH and self.flags & O_ACCMODE in (O_WRONLY, O_RDWR)

    @property
    def reads(self) -> bool:
        return not self.flags & O_PATH and self.flags & O_ACCMODE != O_WRONLY


@dataclass(frozen=True)
class Mount:
    mnt_id: int
    mountpoint: str
    flags: int
    fstype: int
    sb_flags: int = 0
    root: str = "/"
    ext_key: str | None = None     # an external bind: CRIU mounts what the restore supplies for this key
    root_dev: int = 0              # its filesystem's device: CRIU binds mounts of one device from the first
    source: str = ""               # what CRIU mounts afresh (a device, "overlay": then its options name layers)
    fsname: str = ""               # the filesystem's name for fstype auto
    parent_mnt_id: int = 0

    @property
    def read_only(self) -> bool:
        """Read-only as the mount itself: CRIU applies sb_flags only to a filesystem it mounts afresh; a
        bind (an external mount, or one of another's device) is remounted with `flags` alone, so a
        read-only superblock flag on a read-write bind leaves it writable."""
        return bool(self.flags & MS_RDONLY)

    @property
    def fs(self) -> str:
        name = FS_NAMES.get(self.fstype, f"fstype {self.fstype}")
        return f"{name} ({self.fsname})" if self.fsname and self.fstype == FS_AUTO else name


@dataclass(frozen=True)
class SeccompFilter:
    """One filter of seccomp.img: a classic BPF program, the filter installed before it, flags."""
    program: bytes
    prev: int | None
    flags: int


SECCOMP_FILTER_FLAG_TSYNC = 1


IdMap = tuple[tuple[int, int, int], ...]  # (first inside, first outside, count), as uid_map lists them


@dataclass
class Tasks:
    threads: list[Thread]
    files: list[OpenFile]
    mounts: list[Mount]             # the mount namespace of the tree's root task
    seccomp_filters: int            # filters in seccomp.img
    other_mounts: dict[int, list[Mount]] = field(default_factory=dict)  # nested mount namespaces by id
    userns: tuple[IdMap, IdMap] | None = None  # (uid map, gid map) of the tree's own user namespace
    lsmtype: int | None = None      # inventory.img lsmtype (None: unreadable)
    filters: list[SeccompFilter] = field(default_factory=list)  # seccomp.img's filters, in order

    @property
    def root_mount(self) -> Mount | None:
        return root_of(self.mounts)

    def seccomp_chain(self, th: Thread) -> list[SeccompFilter] | None:
        """The filters CRIU installs on `th`, newest first (prev links); None when its mode is not
        filter or the chain is broken. A thread CRIU recorded without filters while its process
        leader's chain has TSYNC gets the leader's chain (CRIU's dump keeps shared chains once)."""
        index = th.seccomp_filter
        if th.seccomp_mode == SECCOMP_DISABLED and th.tid != th.pid:
            leader = next((t for t in self.threads if t.tid == th.pid), None)
            chain = self.seccomp_chain(leader) if leader is not None else None
            return chain if chain and all(f.flags & SECCOMP_FILTER_FLAG_TSYNC for f in chain) else None
        if th.seccomp_mode != SECCOMP_FILTER or index is None:
            return None
        out: list[SeccompFilter] = []
        while index is not None:
            if not 0 <= index < len(self.filters) or len(out) >= len(self.filters):
                return None  # out of range, or a loop
            out.append(self.filters[index])
            index = self.filters[index].prev
        return out


def _ints(fields: list, num: int) -> list[int]:
    """A repeated uint32 field, packed or not."""
    out: list[int] = []
    for n, v in fields:
        if n != num:
            continue
        if isinstance(v, bytes):  # packed
            i = 0
            while i < len(v):
                x, i = _varint(v, i)
                out.append(x)
        else:
            out.append(int(v))
    return [x & _U32 for x in out]


def _one(fields: list, num: int, default=None):
    """A scalar field: its last occurrence, as protobuf reads it."""
    for n, v in reversed(fields):
        if n == num:
            return v
    return default


def _u32(v) -> int:
    """A uint32 (or enum) field's value as CRIU's protobuf-c reads it: the varint's low 32 bits (a
    fstype of 2**32 + 2 is procfs to CRIU, whatever a wider reading says)."""
    return int(v) & _U32


def _msg(fields: list, num: int) -> list | None:
    """An embedded message field, as protobuf reads one written several times: all occurrences
    merged (the fields of their concatenation: the last scalar wins, repeated fields add up), not
    only the last (CRIU would restore creds merged from two thread_core entries). None: absent."""
    parts = [v for n, v in fields if n == num and isinstance(v, bytes)]
    return _fields(b"".join(parts)) if parts else None


def _text(raw) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else ""


def _mask(words: list[int]) -> int:
    return sum((w & 0xFFFFFFFF) << (32 * i) for i, w in enumerate(words))


def _creds(thread: Thread, f: list) -> None:
    ids = [_one(f, n) for n in range(1, 9)]
    if any(x is None for x in ids):
        raise ImageError(f"{thread.what}: credentials without all uids and gids")
    thread.uids = (_u32(ids[0]), _u32(ids[2]), _u32(ids[4]), _u32(ids[6]))
    thread.gids = (_u32(ids[1]), _u32(ids[3]), _u32(ids[5]), _u32(ids[7]))
    thread.groups = tuple(_ints(f, 14))
    thread.caps = {name: _mask(_ints(f, num)) for num, name in _CRED_CAPS.items()}
    thread.secbits = _u32(_one(f, 13, 0))
    thread.no_new_privs = _u32(_one(f, 18, 0))
    profile = _one(f, 15)
    thread.lsm_profile = _text(profile) if profile is not None else None


def _core(images: str, tid: int) -> list:
    path = os.path.join(images, f"core-{tid}.img")
    entries = read_entries(path)
    if not entries:
        raise ImageError(f"core-{tid}.img is empty")
    return _fields(entries[0])


def read(images: str) -> Tasks:
    """Every task and thread CRIU would restore from `images`, with what it holds. Raises
    ImageError when an image is missing or unreadable (a restore must then refuse: CRIU reads them)."""
    tree = read_entries(os.path.join(images, "pstree.img"))
    if not tree:
        raise ImageError("pstree.img lists no process")
    threads: list[Thread] = []
    files_ids: dict[int, int] = {}
    mnt_ns: list[int] = []          # the root task's first
    user_ns: int | None = None      # the root task's
    for raw in tree:
        entry = _fields(raw)
        pid = _u32(_one(entry, 1, 0))
        tids = _ints(entry, 5) or [pid]
        core = _core(images, pid)
        tc = _msg(core, 3) or []
        state = _u32(_one(tc, 1, TASK_ALIVE))
        ids = _msg(core, 4)
        ids = ids if ids is not None else _ids_image(images, pid)
        if ids:
            files_ids[pid] = _u32(_one(ids, 2, 0))
            if _u32(_one(ids, 9, 0)) not in mnt_ns:  # missing: 0 to protobuf, so mountpoints-0.img to CRIU
                mnt_ns.append(_u32(_one(ids, 9, 0)))
            if raw is tree[0] and _one(ids, 10) is not None:
                user_ns = _u32(_one(ids, 10))
            elif raw is not tree[0] and _u32(_one(ids, 10, 0)) != (user_ns or 0):
                raise ImageError(f"process {pid} is in another user namespace than the tree's first process: CRIU "
                                 "would create a nested one (CRIU itself never dumps that)")
        if state in (TASK_DEAD, TASK_HELPER):
            continue  # a zombie or CRIU's helper: never runs code after the restore
        for tid in tids:
            threads.append(_thread(images, pid, tid, core if tid == pid else _core(images, tid), tc))
    filters = _seccomp_filters(images)
    criu_user_ns, lsmtype = _inventory(images)
    tables = {ns: _mounts(images, ns) for ns in mnt_ns}
    return Tasks(threads=threads, files=_open_files(images, files_ids),
                 mounts=tables.pop(mnt_ns[0]) if mnt_ns else [], seccomp_filters=len(filters), filters=filters,
                 other_mounts=tables, userns=_userns(images, user_ns, criu_user_ns), lsmtype=lsmtype)


def _thread(images: str, pid: int, tid: int, core: list, tc: list) -> Thread:
    """One thread of process `pid` from its core image (`tc`: the process's task_core)."""
    th = _msg(core, 5) or []
    thread = Thread(pid=pid, tid=tid, comm=_text(_one(th, 13)) or _text(_one(tc, 6)))
    creds = _msg(th, 10)
    if creds is not None:
        _creds(thread, creds)
    else:
        legacy = os.path.join(images, f"creds-{tid}.img")
        if tid == pid and os.path.exists(legacy):
            ce = read_entries(legacy)
            if ce:
                _creds(thread, _fields(ce[0]))
    if thread.uids is None:
        raise ImageError(f"core-{tid}.img: {thread.what} records no credentials")
    mode = _one(th, 11)
    thread.seccomp_mode = _u32(mode) if mode is not None else _u32(_one(tc, 11, SECCOMP_DISABLED))
    filt = _one(th, 12, _one(tc, 12))
    thread.seccomp_filter = None if filt is None else _u32(filt)
    if tid == pid:
        limits = _msg(tc, 8)
        if limits is not None:
            thread.rlimits_max = tuple(int(_one(_fields(e), 2, 0)) & _U64 for n, e in limits
                                       if n == 1 and isinstance(e, bytes))
        oom = _one(tc, 14)
        thread.oom_score_adj = None if oom is None else _int32(int(oom))
    return thread


def _int32(v: int) -> int:
    """A protobuf int32 read as a varint (negative ones are written as 64-bit two's complement): its low
    32 bits, as protobuf-c reads it (2**40 - 1000 is -1000 to CRIU, not a large positive number)."""
    v &= _U32
    return v - (1 << 32) if v >> 31 else v


def _inventory(images: str) -> tuple[int | None, int | None]:
    """(the user namespace CRIU itself ran in at dump, lsmtype) from inventory.img; (None, None) when
    it is absent (its root_ids are then unknown: the tree is taken to share CRIU's namespaces)."""
    path = os.path.join(images, "inventory.img")
    if not os.path.exists(path):
        return None, None
    entries = read_entries(path)
    inv = _fields(entries[0]) if entries else []
    root_ids = _msg(inv, 3)
    own = _one(root_ids, 10) if root_ids is not None else None
    return (None if own is None else _u32(own)), _u32(_one(inv, 6, 0))


def _userns(images: str, user_ns: int | None, criu_ns: int | None) -> tuple[IdMap, IdMap] | None:
    """The uid and gid maps of the tree's own user namespace; None when it ran in CRIU's (as CRIU
    decides: the root task's user_ns_id differs from the inventory's root_ids)."""
    if (user_ns is None) != (criu_ns is None):
        # protobuf reads a missing id as 0: CRIU may then create a namespace this reading would not see,
        # or none where it would see one (a bundle's user namespace compared with maps CRIU never applies)
        raise ImageError(f"{'inventory.img' if criu_ns is None else 'the root task'} records no user namespace id "
                         "while the other does: cannot tell which user namespace CRIU restores the tree in")
    if user_ns is None or user_ns == criu_ns:
        return None
    entries = read_entries(os.path.join(images, f"userns-{user_ns}.img"))
    f = _fields(entries[0]) if entries else []

    def extents(num: int) -> IdMap:
        out = []
        for n, raw in f:
            if n == num and isinstance(raw, bytes):
                e = _fields(raw)
                out.append((_u32(_one(e, 1, 0)), _u32(_one(e, 2, 0)), _u32(_one(e, 3, 0))))
        return tuple(sorted(out))
    return extents(1), extents(2)


def _ids_image(images: str, pid: int) -> list | None:
    path = os.path.join(images, f"ids-{pid}.img")  # images of CRIU before the ids moved into core
    if not os.path.exists(path):
        return None
    entries = read_entries(path)
    return _fields(entries[0]) if entries else None


def _open_files(images: str, files_ids: dict[int, int]) -> list[OpenFile]:
    regs: dict[int, list] = {}
    ttys: dict[int, list] = {}
    path = os.path.join(images, "files.img")
    if os.path.exists(path):
        for raw in read_entries(path):
            f = _fields(raw)
            kind, fid = _u32(_one(f, 1, 0)), _u32(_one(f, 2, 0))
            if kind == FD_REG and _msg(f, 3) is not None:
                regs[fid] = _msg(f, 3) or []
            elif kind == FD_TTY and _msg(f, 19) is not None:
                ttys[fid] = _msg(f, 19) or []
    for legacy, into in (("reg-files.img", regs), ("tty.img", ttys)):  # images of old CRIU
        p = os.path.join(images, legacy)
        if os.path.exists(p):
            for raw in read_entries(p):
                f = _fields(raw)
                into.setdefault(_u32(_one(f, 1, 0)), f)
    infos: dict[int, int] = {}
    p = os.path.join(images, "tty-info.img")
    if ttys and os.path.exists(p):
        for raw in read_entries(p):
            f = _fields(raw)
            infos[_u32(_one(f, 1, 0))] = _u32(_one(f, 8, 0))
    out: list[OpenFile] = []
    seen: set[int] = set()
    for pid, files_id in files_ids.items():
        if files_id in seen:
            continue  # a table shared by several processes (CLONE_FILES): once
        seen.add(files_id)
        p = os.path.join(images, f"fdinfo-{files_id}.img")
        if not os.path.exists(p):
            continue
        for raw in read_entries(p):
            fd = _fields(raw)
            fid, kind, num = _u32(_one(fd, 1, 0)), _u32(_one(fd, 3, 0)), _u32(_one(fd, 4, 0))
            if kind == FD_REG and fid in regs:
                r = regs[fid]
                mnt = _one(r, 7)
                out.append(OpenFile(pid=pid, fd=num, path=_text(_one(r, 6)), flags=_u32(_one(r, 2, 0)),
                                    mode=None if _one(r, 10) is None else _u32(_one(r, 10)),
                                    mnt_id=None if mnt is None else _zigzag(_u32(mnt))))
            elif kind == FD_TTY and fid in ttys:
                t = ttys[fid]
                rdev = infos.get(_u32(_one(t, 2, 0)))
                out.append(OpenFile(pid=pid, fd=num, path="", flags=_u32(_one(t, 3, 0)),
                                    mode=stat.S_IFCHR, rdev=rdev))
    return out


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _mounts(images: str, mnt_ns: int) -> list[Mount]:
    p = os.path.join(images, f"mountpoints-{mnt_ns}.img")
    if not os.path.exists(p):
        return []
    out = []
    for raw in read_entries(p):
        f = _fields(raw)
        key = _one(f, 18)
        out.append(Mount(mnt_id=_u32(_one(f, 2, 0)), mountpoint=_text(_one(f, 7)) or "/",
                         flags=_u32(_one(f, 5, 0)), fstype=_u32(_one(f, 1, 0)), sb_flags=_u32(_one(f, 17, 0)),
                         root=_text(_one(f, 6)) or "/", ext_key=None if key is None else _text(key),
                         root_dev=_u32(_one(f, 3, 0)), source=_text(_one(f, 8)), fsname=_text(_one(f, 14)),
                         parent_mnt_id=_u32(_one(f, 4, 0))))
    return out


def root_of(table: list[Mount]) -> Mount | None:
    """The root of a mount table as CRIU takes it (what the restore replaces with the new root): the
    mount at / whose parent is not in the table, not another one stacked on it."""
    ids = {m.mnt_id for m in table}
    at_root = [m for m in table if os.path.normpath(m.mountpoint) in ("/", "//")]
    return next((m for m in at_root if m.parent_mnt_id not in ids), at_root[0] if at_root else None)


def _seccomp_filters(images: str) -> list[SeccompFilter]:
    p = os.path.join(images, "seccomp.img")
    if not os.path.exists(p):
        return []
    out = []
    for entry in read_entries(p):
        for n, raw in _fields(entry):
            if n == 1 and isinstance(raw, bytes):
                f = _fields(raw)
                prev = _one(f, 2)
                program = _one(f, 1, b"")
                out.append(SeccompFilter(program=program if isinstance(program, bytes) else b"",
                                         prev=None if prev is None else _u32(prev), flags=_u32(_one(f, 3, 0))))
    return out


def is_device(f: OpenFile) -> bool:
    """A device node: by its recorded st_mode, or (images without it) by a path under /dev."""
    if f.mode is not None:
        return stat.S_ISCHR(f.mode) or stat.S_ISBLK(f.mode)
    return f.path.startswith("/dev/") and not f.path.startswith(("/dev/shm/", "/dev/mqueue/", "/dev/hugepages/"))
