"""A restore never gives the restored processes more than the new container grants
(ops/restore_privileges.py, criu/tasks.py, oci/grants.py): CRIU images written with pycriu, bundles
as config.json dicts. The issue-22 case first: a root process with every capability, restored into a
bundle that asks for uid 1000, no capabilities and noNewPrivileges, was restored as it was."""

from __future__ import annotations

import base64
import io
import json
import os
import stat
import struct
import tarfile
from pathlib import Path

import pytest

from migrt.config import Config
from migrt.criu import protobuf as criu_protobuf
from migrt.criu import tasks as criu_tasks
from migrt.errors import CheckpointInvalid, PreconditionFailed
from migrt.oci.bundle import Bundle
from migrt.oci.grants import CAPS, Grants
from migrt.ops import restore as ops_restore
from migrt.ops import restore_privileges as rp
from migrt.pods import rootfs
from migrt.seccomp.bpf import encode
from migrt.seccomp.profile import compile_profile
from migrt.store import Store
from tests.unit.support import write_bundle

pycriu = pytest.importorskip("pycriu")

ALL = [f"CAP_{c}" for c in CAPS]
ALL_WORDS = [0xFFFFFFFF, (1 << (len(CAPS) - 32)) - 1]
DEFAULT = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID",
           "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
           "CAP_AUDIT_WRITE"]
O_RDONLY, O_WRONLY, O_RDWR = 0, 1, 2
ROOT_MNT = 100
PROC, SYSFS, DEVTMPFS, TMPFS, DEVPTS, CGROUP, MQUEUE, AUTO, OVERLAY, CGROUP2 = 1, 2, 3, 5, 6, 12, 14, 16, 17, 23
CRIU_IDS = {"vm_id": 1, "files_id": 1, "fs_id": 1, "sighand_id": 1}
UNLIMITED = (1 << 64) - 1
RET_ALLOW = b"\x06\x00\x00\x00\x00\x00\xff\x7f"  # one BPF instruction: return SECCOMP_RET_ALLOW


def words(names: list[str]) -> list[int]:
    mask = 0
    for n in names:
        mask |= 1 << CAPS.index(n.removeprefix("CAP_"))
    return [mask & 0xFFFFFFFF, mask >> 32]


def creds(uid: int = 0, gid: int = 0, caps: list[int] | None = None, *, groups=(), nnp: int | None = 0,
          lsm: str | None = None, amb: list[int] | None = None, inh: list[int] | None = None) -> dict:
    c = caps if caps is not None else ALL_WORDS
    out = {"uid": uid, "gid": gid, "euid": uid, "egid": gid, "suid": uid, "sgid": gid, "fsuid": uid, "fsgid": gid,
           "cap_inh": inh or [0, 0], "cap_prm": c, "cap_eff": c, "cap_bnd": c, "secbits": 0, "groups": list(groups),
           "cap_amb": amb or [0, 0]}
    if not out["groups"]:
        del out["groups"]  # pycriu cannot write an empty repeated field
    if nnp is not None:
        out["no_new_privs"] = nnp
    if lsm is not None:
        out["lsm_profile"] = lsm
    return out


class Images:
    """A CRIU image directory, written with pycriu: one process (pid 1) by default."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.procs: list[dict] = []
        self.files: list[dict] = []
        self.fdinfo: list[dict] = []
        self.mounts = [self._mnt(ROOT_MNT, "/", 0)]
        self.seccomp = 0
        self.seccomp_program = RET_ALLOW  # every filter of seccomp.img
        self.lsmtype = 0
        self.userns: dict | None = None  # {"uid_map": [...], "gid_map": [...]}: the tree's own user namespace
        self.nested: list[dict] = []  # the mount table of mount namespace 10 (proc(mnt_ns=10))

    @staticmethod
    def _mnt(mnt_id: int, point: str, flags: int, fstype: int = OVERLAY, ext_key: str | None = None,
             root: str = "/") -> dict:
        m = {"fstype": fstype, "mnt_id": mnt_id, "root_dev": 40, "parent_mnt_id": 1, "flags": flags, "root": root,
             "mountpoint": point, "source": "overlay", "options": ""}
        if ext_key is not None:
            m["ext_key"] = ext_key
        return m

    def proc(self, pid: int = 1, threads: dict[int, dict] | None = None, *, seccomp: str = "disabled",
             comm: str = "app", state: int = 1, rlimits: dict[int, int] | None = None,
             oom: int | None = None, mnt_ns: int = 9) -> Images:
        """`rlimits`: RLIMIT_* number -> hard limit (the others unlimited); `oom`: its oom_score_adj."""
        self.procs.append({"pid": pid, "threads": threads or {pid: creds()}, "seccomp": seccomp, "comm": comm,
                           "state": state, "rlimits": rlimits, "oom": oom, "mnt_ns": mnt_ns})
        return self

    def open(self, path: str, flags: int, mode: int, fd: int = 3, mnt_id: int = ROOT_MNT) -> Images:
        fid = len(self.files) + 1
        self.files.append({"type": "REG", "id": fid, "reg": {
            "id": fid, "flags": flags, "pos": 0, "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0},
            "name": path, "mnt_id": mnt_id, "mode": mode}})
        self.fdinfo.append({"id": fid, "flags": 0, "type": "REG", "fd": fd})
        return self

    def tty(self, rdev: int, fd: int = 0) -> Images:
        fid = len(self.files) + 1
        self.files.append({"type": "TTY", "id": fid, "tty": {
            "id": fid, "tty_info_id": fid, "flags": O_RDWR,
            "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0}}})
        self.fdinfo.append({"id": fid, "flags": 0, "type": "TTY", "fd": fd})
        self._ttys = getattr(self, "_ttys", []) + [{"id": fid, "type": "VT", "locked": False, "exclusive": False,
                                                     "packet_mode": False, "sid": 0, "pgrp": 0, "rdev": rdev}]
        return self

    def mount(self, point: str, read_only: bool, mnt_id: int | None = None, *, fs: int = OVERLAY,
              ext_key: str | None = None, root: str = "/") -> Images:
        mnt_id = mnt_id or 200 + len(self.mounts)
        self.mounts.append(self._mnt(mnt_id, point, 1 if read_only else 0, fs, ext_key, root))
        return self

    def runc_mounts(self, *, sys_ro: bool = True, cgroup_ro: bool = True) -> Images:
        """The mount table runc makes for runc's default spec on a cgroup v1 node, as CRIU records it."""
        self.mount("/proc", False, fs=PROC).mount("/dev", False, fs=TMPFS).mount("/dev/pts", False, fs=DEVPTS)
        self.mount("/dev/shm", False, fs=TMPFS).mount("/dev/mqueue", False, fs=MQUEUE)
        self.mount("/sys", sys_ro, fs=SYSFS).mount("/sys/fs/cgroup", cgroup_ro, fs=TMPFS)
        for ctl in ("memory", "cpu", "pids"):
            self.mount(f"/sys/fs/cgroup/{ctl}", cgroup_ro, fs=CGROUP, ext_key=f"/sys/fs/cgroup/{ctl}", root="/c1")
        self.mount("/proc/kcore", False, fs=TMPFS, ext_key="/dev/null", root="/null")
        self.mount("/sys/firmware", True, fs=TMPFS).mount("/proc/sys", True, fs=PROC, root="/sys")
        return self

    def write(self) -> str:
        d = str(self.path)

        def img(name: str, magic: str, entries: list) -> None:
            with open(os.path.join(d, name), "wb") as fh:
                pycriu.images.dump({"magic": magic, "entries": entries}, fh)

        lsm = ("NO_LSM", "SELINUX", "APPARMOR")[self.lsmtype]
        img("inventory.img", "INVENTORY", [{"img_version": 2, "fdinfo_per_id": True, "lsmtype": lsm,
                                            "root_ids": {**CRIU_IDS, "user_ns_id": 7}}])
        img("pstree.img", "PSTREE", [{"pid": p["pid"], "ppid": 0, "pgid": p["pid"], "sid": p["pid"],
                                      "threads": list(p["threads"])} for p in self.procs])
        for p in self.procs:
            for tid, cr in p["threads"].items():
                thread_core = {"futex_rla": 0, "futex_rla_len": 0, "seccomp_mode": p["seccomp"]}
                if cr is not None:
                    thread_core["creds"] = cr
                if p["seccomp"] == "filter" and self.seccomp:
                    thread_core["seccomp_filter"] = self.seccomp - 1
                core = {"mtype": "X86_64", "thread_core": thread_core}
                if tid == p["pid"]:
                    core["tc"] = {"task_state": p["state"], "exit_code": 0, "personality": 0, "flags": 0,
                                  "blk_sigset": 0, "comm": p["comm"]}
                    if p["rlimits"] is not None:
                        core["tc"]["rlimits"] = {"rlimits": [{"cur": 0, "max": p["rlimits"].get(n, UNLIMITED)}
                                                             for n in range(16)]}
                    if p["oom"] is not None:
                        core["tc"]["oom_score_adj"] = p["oom"]
                    core["ids"] = {**CRIU_IDS, "mnt_ns_id": p["mnt_ns"], "user_ns_id": 14 if self.userns else 7}
                img(f"core-{tid}.img", "CORE", [core])
        img("files.img", "FILES", self.files)
        img("fdinfo-1.img", "FDINFO", self.fdinfo)
        if getattr(self, "_ttys", None):
            img("tty-info.img", "TTY_INFO", self._ttys)
        img("mountpoints-9.img", "MNTS", self.mounts)
        if self.nested:
            img("mountpoints-10.img", "MNTS", self.nested)
        if self.userns:
            img("userns-14.img", "USERNS", [self.userns])
        if self.seccomp:
            prog = base64.b64encode(self.seccomp_program).decode()
            img("seccomp.img", "SECCOMP", [{"seccomp_filters": [{"filter": prog} for _ in range(self.seccomp)]}])
        return d


def root_all_caps(tmp_path: Path) -> str:
    """The issue's checkpoint: a root process holding every capability, no no_new_privs, no seccomp."""
    return Images(tmp_path / "images").proc(comm="sh").write()


def bundle(tmp_path: Path, *, uid: int = 0, gid: int = 0, caps: list[str] | None = None, nnp: bool = False,
           extra: dict | None = None, linux: dict | None = None, name: str = "bundle",
           mounts: list[dict] | None = None) -> Bundle:
    process: dict = {"user": {"uid": uid, "gid": gid}, "args": ["sh"], "cwd": "/"}
    if caps is not None:
        process["capabilities"] = {k: list(caps) for k in ("bounding", "effective", "permitted")}
    if nnp:
        process["noNewPrivileges"] = True
    process.update(extra or {})
    path = tmp_path / name
    (path / "rootfs").mkdir(parents=True, exist_ok=True)
    config = {"ociVersion": "1.2.0", "process": process, "root": {"path": "rootfs"}, "linux": linux or {}}
    if mounts is not None:
        config["mounts"] = mounts
    (path / "config.json").write_text(json.dumps(config))
    return Bundle.load(str(path))


def restricted(tmp_path: Path, **kw) -> Bundle:
    return bundle(tmp_path, uid=1000, gid=1000, caps=[], nnp=True, name="restricted", **kw)


def refused(images: str, b: Bundle, **kw) -> PreconditionFailed:
    with pytest.raises(PreconditionFailed) as info:
        rp.check(images, b, "ck", lsm=kw.pop("lsm", rp.LSM_NONE), **kw)
    return info.value


def passes(images: str, b: Bundle, **kw) -> rp.Verdict:
    return rp.check(images, b, "ck", lsm=kw.pop("lsm", rp.LSM_NONE), **kw)


# -- the image reader ------------------------------------------------------------------------------------
def test_reader_reads_what_pycriu_wrote(tmp_path):
    im = Images(tmp_path / "images")
    im.proc(1, {1: creds(0, 0, groups=(0, 10), lsm="cri-containerd.apparmor.d", nnp=1),
                7: creds(33, 44, words(["CAP_KILL"]), nnp=None)}, seccomp="filter", comm="nginx")
    im.seccomp = 2
    im.open("/dev/null", O_RDWR, stat.S_IFCHR | 0o666, fd=0).open("/var/log/x", O_WRONLY | 0o2000, 0o100644, fd=4)
    t = criu_tasks.read(im.write())
    main, worker = t.threads
    assert (main.pid, main.tid, main.comm, main.uids, main.groups) == (1, 1, "nginx", (0, 0, 0, 0), (0, 10))
    assert main.caps["effective"] == (1 << len(CAPS)) - 1 and main.caps["ambient"] == 0
    assert (main.no_new_privs, main.lsm_profile, main.seccomp_mode, main.seccomp_filter) == \
        (1, "cri-containerd.apparmor.d", 2, 1)
    assert (worker.tid, worker.uids, worker.gids, worker.no_new_privs) == (7, (33, 33, 33, 33), (44, 44, 44, 44), 0)
    assert worker.caps["permitted"] == 1 << CAPS.index("KILL") and worker.what == "thread 7 of process 1 (nginx)"
    assert [(f.fd, f.path, f.writes, f.mnt_id, criu_tasks.is_device(f)) for f in t.files] == \
        [(0, "/dev/null", True, ROOT_MNT, True), (4, "/var/log/x", True, ROOT_MNT, False)]
    assert t.root_mount.mnt_id == ROOT_MNT and not t.root_mount.read_only and t.seccomp_filters == 2


def test_zombies_are_not_compared_and_missing_credentials_are_refused(tmp_path):
    im = Images(tmp_path / "a").proc(1, {1: creds(1000, 1000, [0, 0])}).proc(5, {5: None}, state=2)
    assert [th.pid for th in criu_tasks.read(im.write()).threads] == [1]  # the zombie never runs again
    im = Images(tmp_path / "b").proc(1, {1: None})
    with pytest.raises(CheckpointInvalid, match="records no credentials"):
        rp.check(im.write(), restricted(tmp_path), "ck", lsm=rp.LSM_NONE)


def test_unreadable_images_are_refused_not_skipped(tmp_path):
    images = root_all_caps(tmp_path)
    os.unlink(os.path.join(images, "core-1.img"))
    with pytest.raises(CheckpointInvalid, match="checkpoint ck: cannot read what its processes hold.*core-1.img"):
        rp.check(images, restricted(tmp_path), "ck", lsm=rp.LSM_NONE)


def test_garbage_images_are_refused_as_invalid(tmp_path):
    images = root_all_caps(tmp_path)
    pstree = os.path.join(images, "pstree.img")
    with open(pstree, "rb") as fh:
        head = fh.read()[:8]  # the magic words
    for entry in (b"\x0a\x02\x01\x02",   # pid (field 1) as bytes, not a varint
                  b"\x08\xff\xff",       # a truncated varint
                  b"\x0b\x00"):           # wire type 3 (groups): not in CRIU's images
        with open(pstree, "wb") as fh:
            fh.write(head + struct.pack("<I", len(entry)) + entry)
        with pytest.raises(CheckpointInvalid, match="checkpoint ck: cannot read what its processes hold"):
            rp.check(images, restricted(tmp_path), "ck", lsm=rp.LSM_NONE)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _encode(fields: list) -> bytes:
    return b"".join(_varint(num << 3 | 2) + _varint(len(v)) + v if isinstance(v, bytes)
                    else _varint(num << 3) + _varint(v) for num, v in fields)


def rewrite(path: str, change) -> None:
    """Rewrite every entry of a CRIU image at the wire level: change(fields) -> fields."""
    with open(path, "rb") as fh:
        head, entries = criu_protobuf.split_entries(fh.read(), path)
    body = b"".join(struct.pack("<I", len(e)) + e for e in (_encode(change(criu_protobuf.fields(x))) for x in entries))
    with open(path, "wb") as fh:
        fh.write(head + body)


def in_sub(fields: list, num: int, change) -> list:
    """fields with each occurrence of the embedded message `num` changed by change(its fields)."""
    return [(n, _encode(change(criu_protobuf.fields(v))) if n == num else v) for n, v in fields]


def test_over_wide_varints_read_as_criu_reads_them(tmp_path):
    """protobuf-c (CRIU) keeps a uint32/int32 varint's low 32 bits: a procfs written as fstype 2**32 + 1
    at a declared bind was taken for a filesystem that is no kernel interface; no_new_privs 2**32 for set;
    oom_score_adj -1000 + 2**33 for a large positive number."""
    bind = {"destination": "/data", "type": "bind", "source": str(tmp_path), "options": ["rbind"]}
    images = runc_images(tmp_path).mount("/data", False, fs=OVERLAY).write()
    passes(images, runc_bundle(tmp_path, mounts=[*RUNC_MOUNTS, bind]))
    rewrite(os.path.join(images, "mountpoints-9.img"),
            lambda f: [(n, v + (1 << 32) if n == 1 and (7, b"/data") in f else v) for n, v in f])
    with open(os.path.join(images, "mountpoints-9.img"), "rb") as fh:  # pycriu's protobuf reads the low bits too
        assert pycriu.images.load(fh)["entries"][-1]["fstype"] == OVERLAY
    assert criu_tasks.read(images).mounts[-1].fstype == OVERLAY
    proc = runc_images(tmp_path, "proc").mount("/data", False, fs=TMPFS).write()
    rewrite(os.path.join(proc, "mountpoints-9.img"),
            lambda f: [(n, PROC + (1 << 32) if n == 1 and (7, b"/data") in f else v) for n, v in f])
    assert "has proc mounted at /data where the container declares bind (mounts)" in \
        str(refused(proc, runc_bundle(tmp_path, "proc", mounts=[*RUNC_MOUNTS, bind])))
    nnp = Images(tmp_path / "nnp").proc(1, {1: creds(1000, 1000, [0, 0], nnp=1)}, oom=0).write()
    passes(nnp, restricted(tmp_path, extra={"oomScoreAdj": 0}))
    rewrite(os.path.join(nnp, "core-1.img"), lambda core: in_sub(core, 5, lambda th: in_sub(
        th, 10, lambda cr: [*cr, (18, 1 << 32)])))
    assert "runs without no_new_privs" in str(refused(nnp, restricted(tmp_path, extra={"oomScoreAdj": 0})))
    oom = Images(tmp_path / "oom").proc(1, {1: creds(1000, 1000, [0, 0], nnp=1)}, oom=0).write()
    rewrite(os.path.join(oom, "core-1.img"), lambda core: in_sub(core, 3, lambda tc: [
        *tc, (14, (1 << 33) + (1 << 32) - 1000)]))
    assert "has oom_score_adj -1000 but the container sets 0" in \
        str(refused(oom, restricted(tmp_path, extra={"oomScoreAdj": 0})))


def test_an_embedded_message_written_twice_is_read_merged_as_criu_reads_it(tmp_path):
    """A core image with two thread_core entries: CRIU (protobuf) merges them, the first one's
    capabilities included; reading only the last passed a process with every capability."""
    images = Images(tmp_path / "images").proc(1, {1: creds(1000, 1000, [0, 0], nnp=1)}).write()
    passes(images, restricted(tmp_path))
    full = _encode([(10, _encode([(n, 0) for n in range(1, 9)] + [(k, w) for k in (9, 10, 11, 12) for w in ALL_WORDS]
                                 + [(13, 0)]))])
    rewrite(os.path.join(images, "core-1.img"), lambda core: [(5, full) if n == 5 else (n, v) for n, v in core]
            + [(n, v) for n, v in core if n == 5])  # the root thread_core first, the original one after
    with open(os.path.join(images, "core-1.img"), "rb") as fh:
        merged = pycriu.images.load(fh)["entries"][0]["thread_core"]["creds"]
    assert (merged["uid"], merged["cap_eff"][:2], merged["no_new_privs"]) == (1000, ALL_WORDS, 1)  # pycriu merges
    th = criu_tasks.read(images).threads[0]
    assert (th.uids[0], th.caps["effective"], th.no_new_privs) == (1000, (1 << len(CAPS)) - 1, 1)
    assert "holds bounding capabilities the container does not grant" in str(refused(images, restricted(tmp_path)))


# -- identity and capabilities (the case) ------------------------------------------------------
def test_root_with_every_capability_is_refused_by_a_restricted_bundle(tmp_path):
    err = refused(root_all_caps(tmp_path), restricted(tmp_path))
    assert str(err).startswith("checkpoint ck: process 1 (sh) runs as uid 0 but the container asks for uid 1000 "
                               "(process.user.uid)")
    text = str(err)
    assert "runs as gid 0 but the container asks for gid 1000 (process.user.gid)" in text
    assert "holds bounding capabilities the container does not grant: CAP_CHOWN" in text
    assert "(process.capabilities.effective)" in text and "(process.capabilities.permitted)" in text
    assert "runs without no_new_privs but the container asks for it (process.noNewPrivileges)" in text
    assert err.exit_code == 8


def test_root_with_every_capability_restores_into_an_equal_or_broader_bundle(tmp_path):
    images = root_all_caps(tmp_path)
    passes(images, bundle(tmp_path, caps=ALL, name="all"))
    passes(images, bundle(tmp_path, caps=None, extra={"noNewPrivileges": False}, linux={"maskedPaths": []},
                          name="nocaps"))  # no capabilities section: runc drops none


def test_a_process_already_unprivileged_restores_into_the_restricted_bundle(tmp_path):
    im = Images(tmp_path / "images").proc(1, {1: creds(1000, 1000, [0, 0], nnp=1)})
    passes(im.write(), restricted(tmp_path))


def test_every_id_of_every_thread_is_compared(tmp_path):
    saved_root = creds(1000, 1000, [0, 0], nnp=1)
    saved_root["suid"] = 0
    im = Images(tmp_path / "images").proc(1, {1: creds(1000, 1000, [0, 0], nnp=1), 2: saved_root}, comm="app")
    err = refused(im.write(), restricted(tmp_path))
    assert "thread 2 of process 1 (app) keeps saved uid 0 but the container asks for uid 1000" in str(err)
    fs = creds(1000, 1000, [0, 0], nnp=1)
    fs["fsgid"] = 0
    im = Images(tmp_path / "fs").proc(1, {1: fs})
    assert "has filesystem gid 0 but the container asks for gid 1000" in str(refused(im.write(), restricted(tmp_path)))


def test_supplementary_groups_must_be_granted(tmp_path):
    im = Images(tmp_path / "images").proc(1, {1: creds(1000, 1000, [0, 0], groups=(1000, 4, 27), nnp=1)})
    b = restricted(tmp_path, extra={"user": {"uid": 1000, "gid": 1000, "additionalGids": [4]}})
    assert "is in supplementary group(s) 27 but the container grants 4, 1000 (process.user.additionalGids)" \
        in str(refused(im.write(), b))
    b = restricted(tmp_path, extra={"user": {"uid": 1000, "gid": 1000, "additionalGids": [4, 27]}})
    passes(im.write(), b)


def test_a_root_bundle_with_setuid_may_receive_a_process_that_changed_its_ids(tmp_path):
    im = Images(tmp_path / "images").proc(1, {1: creds(65534, 65534, [0, 0], groups=(65534,))})
    passes(im.write(), bundle(tmp_path, caps=DEFAULT))  # nginx-style: started as root, now nobody
    b = bundle(tmp_path, caps=[c for c in DEFAULT if c not in ("CAP_SETUID", "CAP_SETGID")], name="nosetid")
    text = str(refused(im.write(), b))
    assert "runs as uid 65534 but the container asks for uid 0" in text and "group(s) 65534" in text


def test_each_capability_set_is_bounded_by_the_bundles(tmp_path):
    amb = creds(1000, 1000, words(["CAP_NET_BIND_SERVICE"]), nnp=1, amb=words(["CAP_NET_BIND_SERVICE"]),
                inh=words(["CAP_NET_BIND_SERVICE"]))
    im = Images(tmp_path / "images").proc(1, {1: amb}).write()
    b = bundle(tmp_path, uid=1000, gid=1000, caps=["CAP_NET_BIND_SERVICE"], nnp=True, name="nbs")
    text = str(refused(im, b))
    assert "holds inheritable capabilities the container does not grant: CAP_NET_BIND_SERVICE" in text
    assert "(process.capabilities.ambient)" in text and "bounding" not in text
    b.config["process"]["capabilities"].update(inheritable=["CAP_NET_BIND_SERVICE"], ambient=["CAP_NET_BIND_SERVICE"])
    passes(im, b)


def test_root_without_no_new_privs_holds_what_exec_gives_root(tmp_path):
    # runc sets permitted, then execs as root: the kernel gives root its bounding set. A checkpoint of
    # that process goes back into the same bundle; with noNewPrivileges exec cannot add, so it may not.
    im = Images(tmp_path / "images").proc(1, {1: creds(0, 0, words(DEFAULT))}).write()
    b = bundle(tmp_path, caps=DEFAULT)
    b.config["process"]["capabilities"].update(permitted=[], effective=[])
    passes(im, b)
    b.config["process"]["noNewPrivileges"] = True
    im_nnp = Images(tmp_path / "nnp").proc(1, {1: creds(0, 0, words(DEFAULT), nnp=1)}).write()
    assert "(process.capabilities.permitted)" in str(refused(im_nnp, b))


def test_no_new_privs_absent_from_the_images_counts_as_unset(tmp_path):
    # CRIU writes no_new_privs only when it is set (a CRIU that predates the field never restores it)
    im = Images(tmp_path / "images").proc(1, {1: creds(1000, 1000, [0, 0], nnp=None)})
    assert "process 1 (app) runs without no_new_privs" in str(refused(im.write(), restricted(tmp_path)))


# -- seccomp -----------------------------------------------------------------------------------------
SECCOMP = {"seccomp": {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}}


def test_seccomp_profile_needs_a_filter_on_every_thread(tmp_path):
    b = bundle(tmp_path, caps=ALL, linux=SECCOMP)
    assert "runs without a seccomp filter but the container asks for one (linux.seccomp)" in \
        str(refused(root_all_caps(tmp_path), b))
    im = Images(tmp_path / "filtered").proc(seccomp="filter")
    im.seccomp, im.seccomp_program = 1, encode(compile_profile(SECCOMP["seccomp"]).program)  # the profile's own program
    verdict = passes(im.write(), b)
    assert any("filters answer at least as strictly as linux.seccomp" in n for n in verdict.notes)
    im = Images(tmp_path / "allowall").proc(seccomp="filter")  # a filter, but one that allows everything
    im.seccomp = 1
    assert "process 1 (app) may call " in str(refused(im.write(), b))
    im = Images(tmp_path / "nofilter").proc(seccomp="filter")  # mode says filter, seccomp.img has none
    assert "seccomp.img holds no filter" in str(refused(im.write(), b))


# -- LSM labels ----------------------------------------------------------------------------------------
def test_a_different_label_is_replaced_by_the_bundles(tmp_path):
    b = bundle(tmp_path, caps=ALL, extra={"apparmorProfile": "cri-containerd.apparmor.d"})
    im = Images(tmp_path / "images").proc(1, {1: creds(lsm="unconfined-by-hand")})
    im.lsmtype = rp.LSM_APPARMOR
    verdict = passes(im.write(), b, lsm=rp.LSM_APPARMOR)
    assert verdict.runc_args == ["--lsm-profile", "apparmor:cri-containerd.apparmor.d"]
    im2 = Images(tmp_path / "same").proc(1, {1: creds(lsm="cri-containerd.apparmor.d")})
    im2.lsmtype = rp.LSM_APPARMOR
    assert passes(im2.write(), b, lsm=rp.LSM_APPARMOR).runc_args == []
    im3 = Images(tmp_path / "nolsm").proc()  # made on a node without AppArmor: CRIU cannot apply a label
    assert "made on a node without apparmor" in str(refused(im3.write(), b, lsm=rp.LSM_APPARMOR))
    sel = bundle(tmp_path, caps=ALL, extra={"selinuxLabel": "system_u:system_r:container_t:s0:c1,c2"}, name="se")
    im4 = Images(tmp_path / "se").proc(1, {1: creds(lsm="system_u:system_r:container_t:s0:c7,c9")})
    im4.lsmtype = rp.LSM_SELINUX
    assert passes(im4.write(), sel, lsm=rp.LSM_SELINUX).runc_args == \
        ["--lsm-profile", "selinux:system_u:system_r:container_t:s0:c1,c2"]


# -- devices ---------------------------------------------------------------------------------------------
DENY_ALL = {"resources": {"devices": [{"allow": False, "access": "rwm"}]}}


def test_devices_held_open_must_be_given_and_allowed(tmp_path):
    b = bundle(tmp_path, caps=ALL, linux=DENY_ALL)
    im = Images(tmp_path / "ok").proc().open("/dev/null", O_RDWR, stat.S_IFCHR | 0o666, fd=0)
    im.open("/dev/pts/3", O_RDWR, stat.S_IFCHR | 0o620, fd=1)
    passes(im.write(), b)  # runc's own devices
    im = Images(tmp_path / "sda").proc().open("/dev/sda", O_RDONLY, stat.S_IFBLK | 0o660)
    assert "process 1 holds /dev/sda open (fd 3), a device the container is not given (linux.devices)" in \
        str(refused(im.write(), b))
    given = {"devices": [{"path": "/dev/sda", "type": "b", "major": 8, "minor": 0}],
             "resources": {"devices": [{"allow": False, "access": "rwm"},
                                       {"allow": True, "type": "b", "major": 8, "minor": 0, "access": "r"}]}}
    passes(im.write(), bundle(tmp_path, caps=ALL, linux=given, name="given"))
    im = Images(tmp_path / "sdaw").proc().open("/dev/sda", O_RDWR, stat.S_IFBLK | 0o660)
    assert "holds device /dev/sda (b 8:0) open for writing, which the container's device rules deny" in \
        str(refused(im.write(), bundle(tmp_path, caps=ALL, linux=given, name="given2")))


def test_a_terminal_is_judged_by_its_device_number(tmp_path):
    b = bundle(tmp_path, caps=ALL, linux=DENY_ALL)
    passes(Images(tmp_path / "pty").proc().tty(os.makedev(136, 2)).write(), b)
    assert "holds device a terminal (c 4:1) open for reading" in \
        str(refused(Images(tmp_path / "vt").proc().tty(os.makedev(4, 1)).write(), b))


# -- read-only root, masked and read-only paths ----------------------------------------------------------
def test_read_only_root(tmp_path):
    b = bundle(tmp_path, caps=ALL, extra={}, name="ro")
    b.config["root"]["readonly"] = True
    rw = Images(tmp_path / "rw").proc()
    assert "root filesystem is mounted read-write in the images" in str(refused(rw.write(), b))
    ro = Images(tmp_path / "ro").proc()
    ro.mounts[0]["flags"] = 1
    passes(ro.write(), b)
    ro.open("/var/lib/app/db", O_RDWR, 0o100644)
    assert "holds /var/lib/app/db open for writing on the root filesystem" in str(refused(ro.write(), b))
    ro = Images(tmp_path / "ro2").proc()
    ro.mounts[0]["flags"] = 1
    images = ro.write()
    assert "writable layer changes the root filesystem (/etc/new.conf, deletes /etc/old.conf)" in \
        str(refused(images, b, rootfs_changes=lambda: ["/etc/new.conf", "deletes /etc/old.conf"]))
    passes(images, b, rootfs_changes=list)


def test_layer_changes_leave_out_directories(tmp_path):
    with tarfile.open(tmp_path / rootfs.DIFF_TAR, "w") as tar:
        for name, kind in (("etc", tarfile.DIRTYPE), ("etc/app.conf", tarfile.REGTYPE),
                           ("run/secrets", tarfile.DIRTYPE)):
            ti = tarfile.TarInfo(name)
            ti.type = kind
            tar.addfile(ti, io.BytesIO(b""))
    (tmp_path / rootfs.DIFF_META).write_text(json.dumps({"deleted": ["tmp/x"], "opaque": []}))
    assert rp.layer_changes(str(tmp_path)) == ["deletes /tmp/x", "/etc/app.conf"]


def test_a_deeply_nested_layer_metadata_is_a_refusal_not_a_recursion_error(tmp_path):
    (tmp_path / rootfs.DIFF_META).write_text("[" * 100_000)  # the checkpoint's: an archive's or a registry's
    with pytest.raises(CheckpointInvalid, match="unreadable rootfs-diff.json: nested deeper than 64"):
        rp.layer_changes(str(tmp_path))


def test_masked_and_read_only_paths_must_be_in_the_mount_table(tmp_path):
    linux = {"maskedPaths": ["/proc/cpuinfo", "/proc/no-such-file-here"], "readonlyPaths": ["/proc/sys"]}
    b = bundle(tmp_path, caps=ALL, linux=linux)
    text = str(refused(root_all_caps(tmp_path), b))
    assert "leaves /proc/cpuinfo unmasked but the container masks it (linux.maskedPaths)" in text
    assert "leaves /proc/sys writable but the container makes it read-only (linux.readonlyPaths)" in text
    assert "no-such-file" not in text  # runc skips a path the container does not have
    im = Images(tmp_path / "masked").proc().mount("/proc/cpuinfo", False, fs=TMPFS, ext_key="/dev/null")
    im.mount("/proc/sys", True)
    passes(im.write(), b)


# -- mounts: the images' mount table against the bundle's (issue 27 item 1) -------------------------------
RO = ["nosuid", "noexec", "nodev", "ro"]
RUNC_MOUNTS = [{"destination": "/proc", "type": "proc", "source": "proc"},
               {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
               {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "newinstance"]},
               {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "nodev"]},
               {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid"]},
               {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": RO},
               {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": [*RO, "relatime"]}]
RUNC_LINUX = {"maskedPaths": ["/proc/kcore", "/sys/firmware"], "readonlyPaths": ["/proc/sys"]}
DEFAULT_ROOT = creds(0, 0, words(DEFAULT))  # runc's default spec: root with runc's default capabilities


def runc_bundle(tmp_path: Path, name: str = "runc", *, mounts: list[dict] | None = None, **linux) -> Bundle:
    """runc's default spec: its mounts (/sys and /sys/fs/cgroup read-only), masked and read-only paths."""
    return bundle(tmp_path, caps=DEFAULT, name=name, mounts=RUNC_MOUNTS if mounts is None else mounts,
                  linux={**RUNC_LINUX, **linux})


def runc_images(tmp_path: Path, name: str = "images", **kw) -> Images:
    return Images(tmp_path / name).proc(1, {1: DEFAULT_ROOT}).runc_mounts(**kw)


def test_runcs_own_mount_table_restores_into_an_equal_or_stricter_but_compatible_bundle(tmp_path):
    images = runc_images(tmp_path).write()
    passes(images, runc_bundle(tmp_path))
    # fewer mounts: no /dev/shm nor /dev/mqueue (CRIU brings back a fresh tmpfs and mqueue holding only
    # the checkpoint's own files, which the process could make itself)
    fewer = [m for m in RUNC_MOUNTS if m["destination"] not in ("/dev/shm", "/dev/mqueue")]
    passes(images, runc_bundle(tmp_path, "fewer", mounts=fewer))


def test_sys_read_write_is_refused_by_a_read_only_sys(tmp_path):
    images = runc_images(tmp_path, sys_ro=False).write()
    assert str(refused(images, runc_bundle(tmp_path))).startswith(
        "checkpoint ck: the mount table in its images has /sys (sysfs) read-write but the container makes it "
        "read-only (mounts)")
    rw = [{**m, "options": ["nosuid"]} if m["destination"] == "/sys" else m for m in RUNC_MOUNTS]
    passes(images, runc_bundle(tmp_path, "sysrw", mounts=rw))  # what the source itself had


def test_cgroup_read_write_is_refused_by_a_read_only_cgroup_mount(tmp_path):
    # cgroup v1: each controller bound from the node, writable: the container could raise its own limits
    text = str(refused(runc_images(tmp_path, cgroup_ro=False).write(), runc_bundle(tmp_path)))
    assert "the mount table in its images has /sys/fs/cgroup/memory (cgroup) read-write but the container makes it " \
           "read-only (mounts) (and 2 more like it)" in text
    v2 = Images(tmp_path / "v2").proc(1, {1: DEFAULT_ROOT}).mount("/sys/fs/cgroup", False, fs=CGROUP2)
    assert "has /sys/fs/cgroup (cgroup2) read-write" in str(refused(v2.write(), runc_bundle(tmp_path, "v2b")))
    # a controller the bundle's cgroup mount does not make (a fresh mount elsewhere, or not a cgroup)
    odd = runc_images(tmp_path, "odd").mount("/sys/fs/cgroup/x", True, fs=PROC)
    assert "has proc mounted at /sys/fs/cgroup/x that the container does not declare (mounts)" in \
        str(refused(odd.write(), runc_bundle(tmp_path, "odd")))


def test_an_extra_procfs_is_refused(tmp_path):
    # /mnt/proc/sys/kernel/core_pattern open for writing while /proc/sys is read-only: root on the node
    images = runc_images(tmp_path).mount("/mnt/proc", False, fs=PROC).write()
    assert str(refused(images, runc_bundle(tmp_path))).startswith(
        "checkpoint ck: the mount table in its images has proc mounted at /mnt/proc that the container does not "
        "declare (mounts)")
    for name, decl in (("tmpfs", {"type": "tmpfs", "source": "tmpfs"}),
                       ("bind", {"type": "bind", "source": str(tmp_path), "options": ["rbind"]})):
        b = runc_bundle(tmp_path, name, mounts=[*RUNC_MOUNTS, {"destination": "/mnt/proc", **decl}])
        assert f"has proc mounted at /mnt/proc where the container declares {name} (mounts)" in str(refused(images, b))
    b = runc_bundle(tmp_path, "proc", mounts=[*RUNC_MOUNTS, {"destination": "/mnt/proc", "type": "proc"}])
    passes(images, b)


def test_binds_come_from_the_bundle_and_keep_its_read_only(tmp_path):
    data = {"destination": "/data", "type": "bind", "source": str(tmp_path), "options": ["rbind", "ro"]}
    images = runc_images(tmp_path).mount("/data", False, fs=0, ext_key="/data").write()
    assert "has /data (fstype 0) read-write but the container makes it read-only (mounts)" in \
        str(refused(images, runc_bundle(tmp_path, mounts=[*RUNC_MOUNTS, data])))
    rw = {**data, "options": ["rbind"]}
    passes(images, runc_bundle(tmp_path, "rw", mounts=[*RUNC_MOUNTS, rw]))
    # a bind whose key is another destination: CRIU would put that source here
    other = runc_images(tmp_path, "other").mount("/data", False, fs=0, ext_key="/etc").write()
    assert "has fstype 0 mounted at /data (a bind of the external mount /etc) where the container declares bind " \
           "(mounts)" in \
        str(refused(other, runc_bundle(tmp_path, "other", mounts=[*RUNC_MOUNTS, rw])))
    # below a recursive bind: what its source brings along, as a bind, never a kernel filesystem
    sub = runc_images(tmp_path, "sub").mount("/data", False, fs=0, ext_key="/data").mount("/data/v", False, fs=0)
    passes(sub.write(), runc_bundle(tmp_path, "sub", mounts=[*RUNC_MOUNTS, rw]))
    flat = {**rw, "options": ["bind"]}
    assert "has fstype 0 mounted at /data/v that the container does not declare (mounts)" in \
        str(refused(sub.write(), runc_bundle(tmp_path, "flat", mounts=[*RUNC_MOUNTS, flat])))
    sub.mount("/data/p", False, fs=PROC)
    b = runc_bundle(tmp_path, "sub2", mounts=[*RUNC_MOUNTS, rw])
    assert "has proc mounted at /data/p that the container does not declare (below the recursive bind at /data, " \
           "not as a bind) (mounts)" in str(refused(sub.write(), b))


def test_a_filesystem_criu_would_mount_afresh_from_what_the_images_name_is_refused(tmp_path):
    """An overlay whose options CRIU passes as recorded (lowerdir=/: the node's root), or fstype auto
    with a block device: at a declared bind, below a declared rbind, as a read-only view or stacked on
    the root, they passed as "no kernel filesystem". Of the device of the root or of an external
    mount, CRIU binds them from it (the new container's own files)."""
    bind = {"destination": "/data", "type": "bind", "source": str(tmp_path), "options": ["rbind"]}
    b = runc_bundle(tmp_path, mounts=[*RUNC_MOUNTS, bind])

    def images(name: str, point: str, fs: int, *, read_only: bool = False, dev: int = 99, parent: int = 1) -> str:
        im = runc_images(tmp_path, name).mount(point, read_only, fs=fs)
        im.mounts[-1].update(root_dev=dev, source="/dev/sda1" if fs == AUTO else "overlay", parent_mnt_id=parent,
                             options="lowerdir=/" if fs == OVERLAY else "", fsname="ext4" if fs == AUTO else "")
        return im.write()

    for name, point, fs, ro, parent in (("at", "/data", OVERLAY, False, 1), ("below", "/data/v", AUTO, False, 1),
                                        ("view", "/etc/x", OVERLAY, True, 1), ("stacked", "/", AUTO, False, ROOT_MNT)):
        want = "a second mount at / over one with mounts below it" if name == "stacked" else \
            "which CRIU would mount as its images describe: the container supplies no such filesystem (mounts)"
        assert want in str(refused(images(name, point, fs, read_only=ro, parent=parent), b)), name
        if name != "stacked":  # of the root's device: a bind of the new root
            passes(images(name + "-root-dev", point, fs, read_only=ro, dev=40, parent=parent), b)


def test_a_mount_whose_root_or_mountpoint_climbs_with_dot_dot_is_refused(tmp_path):
    """CRIU binds a mount from another of its device at that one's path + the root as written: a root of
    /../../.. read-only (a "read-only view") would be the node's / above the new root."""
    b = runc_bundle(tmp_path)
    for name, point, root in (("root", "/etc/x", "/../../../.."), ("point", "/data/../etc/x", "/")):
        im = runc_images(tmp_path, name).mount(point, True, root=root)
        assert "a path with '..' (mounts)" in str(refused(im.write(), b)), name
    passes(runc_images(tmp_path, "ok").mount("/etc/x", True, root="/etc").write(), b)


def test_a_fresh_filesystem_is_bound_from_an_external_mount_only_from_within_its_root(tmp_path):
    """CRIU binds a mount from one of its device whose root holds its root; otherwise it mounts it afresh
    (an overlay with the images' options)."""
    bind = {"destination": "/data", "type": "bind", "source": str(tmp_path), "options": ["rbind"]}
    b = runc_bundle(tmp_path, mounts=[*RUNC_MOUNTS, bind])
    for name, root, ok in (("outside", "/", False), ("within", "/srv/v", True)):
        im = runc_images(tmp_path, name).mount("/data", False, fs=0, ext_key="/data", root="/srv")
        im.mounts[-1]["root_dev"] = 77
        im.mount("/data/v", False, fs=OVERLAY, root=root)
        im.mounts[-1].update(root_dev=77, options="lowerdir=/")
        if ok:
            passes(im.write(), b)
        else:
            assert "which CRIU would mount as its images describe" in str(refused(im.write(), b))


def test_a_huge_mount_table_is_refused_not_compared_for_minutes(tmp_path):
    im = runc_images(tmp_path)
    for i in range(rp.MAX_MOUNTS):
        im.mount(f"/tmp/m{i}", True)
    assert "more than 2048 (mounts)" in str(refused(im.write(), runc_bundle(tmp_path)))


def test_a_read_only_superblock_flag_does_not_make_a_bind_read_only(tmp_path):
    """CRIU remounts a bind with the mount's own flags; sb_flags apply only to a filesystem it mounts
    afresh. A read-write bind with a read-only superblock flag passed a read-only volume."""
    data = {"destination": "/data", "type": "bind", "source": str(tmp_path), "options": ["rbind", "ro"]}
    im = runc_images(tmp_path).mount("/data", False, fs=0, ext_key="/data")
    im.mounts[-1]["sb_flags"] = 1  # MS_RDONLY on the superblock only
    assert "has /data (fstype 0) read-write but the container makes it read-only (mounts)" in \
        str(refused(im.write(), runc_bundle(tmp_path, mounts=[*RUNC_MOUNTS, data])))


def test_a_destination_is_matched_through_the_root_filesystems_symlinks(tmp_path):
    b = runc_bundle(tmp_path, mounts=[*RUNC_MOUNTS, {"destination": "/var/run/secrets", "type": "bind",
                                                     "source": str(tmp_path), "options": ["rbind", "ro"]}])
    (Path(b.rootfs) / "var").mkdir()
    (Path(b.rootfs) / "var" / "run").symlink_to("/run")  # as in many images: runc mounts at /run/secrets
    im = runc_images(tmp_path).mount("/run/secrets", True, fs=0, ext_key="/var/run/secrets")
    passes(im.write(), b)


def test_masked_and_read_only_paths_are_runcs_own_mounts_only(tmp_path):
    b = runc_bundle(tmp_path)
    im = runc_images(tmp_path).mount("/proc/kcore", False, fs=PROC)  # a procfs over the mask
    assert "has proc mounted at /proc/kcore where the container masks the path (linux.maskedPaths)" in \
        str(refused(im.write(), b))
    im = runc_images(tmp_path, "ro").mount("/proc/sys", True, fs=SYSFS)
    assert "has sysfs mounted at /proc/sys where the container only remounts the path read-only " \
           "(linux.readonlyPaths)" in str(refused(im.write(), b))


def test_device_binds_are_runcs_and_the_table_must_exist(tmp_path):
    b = runc_bundle(tmp_path)
    passes(runc_images(tmp_path).mount("/dev/null", False, fs=DEVTMPFS, ext_key="/dev/null").write(), b)
    fresh = runc_images(tmp_path, "fresh").mount("/dev/null", False, fs=DEVTMPFS)  # every device of the node
    assert "has devtmpfs mounted at /dev/null where runc binds the device node (linux.devices)" in \
        str(refused(fresh.write(), b))
    sda = runc_images(tmp_path, "sda").mount("/dev/sda", False, fs=DEVTMPFS, ext_key="/dev/sda")
    assert "has devtmpfs mounted at /dev/sda (a bind of the external mount /dev/sda) that the container does not " \
           "declare (mounts)" in \
        str(refused(sda.write(), b))
    # another engine's mask (podman's /proc/timer_list): /dev/null over a file hides it, gives nothing
    passes(runc_images(tmp_path, "mask").mount("/proc/timer_list", False, fs=TMPFS, ext_key="/dev/null").write(), b)
    # another engine's read-only remount (podman's /proc/bus): a read-only view of the procfs below it
    passes(runc_images(tmp_path, "robus").mount("/proc/bus", True, fs=PROC, root="/bus").write(), b)
    rw = runc_images(tmp_path, "rwbus").mount("/proc/bus", False, fs=PROC, root="/bus")
    assert "has proc mounted at /proc/bus that the container does not declare (mounts)" in str(refused(rw.write(), b))
    none = Images(tmp_path / "none").proc(1, {1: DEFAULT_ROOT})
    none.mounts = []
    assert "its images record no mount table of its own" in str(refused(none.write(), b))


def test_a_nested_mount_namespace_is_compared_too(tmp_path):
    im = runc_images(tmp_path).proc(2, {2: DEFAULT_ROOT}, mnt_ns=10)
    im.nested = [Images._mnt(900, "/", 0), Images._mnt(901, "/mnt/proc", 0, PROC)]
    assert "has proc mounted at /mnt/proc that the container does not declare (mounts)" in \
        str(refused(im.write(), runc_bundle(tmp_path)))


def test_a_process_whose_ids_omit_a_namespace_is_read_as_protobuf_reads_it(tmp_path):
    """A second process whose ids omit mnt_ns_id is in mount namespace 0 to CRIU (mountpoints-0.img,
    unread before); one in another user namespace would be put in a nested one CRIU creates."""
    im = runc_images(tmp_path).proc(2, {2: DEFAULT_ROOT}, mnt_ns=10)
    im.nested = [Images._mnt(900, "/", 0), Images._mnt(901, "/mnt/proc", 0, PROC)]
    images = im.write()
    os.rename(os.path.join(images, "mountpoints-10.img"), os.path.join(images, "mountpoints-0.img"))
    rewrite(os.path.join(images, "core-2.img"), lambda core: in_sub(core, 4, lambda ids: [
        (n, v) for n, v in ids if n != 9]))
    assert "has proc mounted at /mnt/proc that the container does not declare (mounts)" in \
        str(refused(images, runc_bundle(tmp_path)))
    other = runc_images(tmp_path, "userns").proc(2, {2: DEFAULT_ROOT}).write()
    rewrite(os.path.join(other, "core-2.img"), lambda core: in_sub(core, 4, lambda ids: [
        *ids, (10, 99)]))
    with pytest.raises(CheckpointInvalid, match="process 2 is in another user namespace than the tree's first"):
        rp.check(other, runc_bundle(tmp_path, "userns"), "ck", lsm=rp.LSM_NONE)


def test_a_mount_stacked_over_masks_and_a_second_namespace_without_them_are_refused(tmp_path):
    """A second /proc over runc's hides its masks and the read-only /proc/sys (core_pattern writable);
    a tmpfs over the root, everything; a second mount namespace whose /proc has neither was not
    compared with linux.maskedPaths and readonlyPaths at all."""
    over = runc_images(tmp_path, "over").mount("/proc", False, fs=PROC)
    assert "a second mount at /proc over one with mounts below it, which it would hide (mounts)" in \
        str(refused(over.write(), runc_bundle(tmp_path)))
    slashes = runc_images(tmp_path, "slashes").mount("//proc", False, fs=TMPFS)  # '//proc' is /proc to the kernel
    assert "a second mount at /proc over one with mounts below it" in \
        str(refused(slashes.write(), runc_bundle(tmp_path)))
    root = runc_images(tmp_path, "root").mount("/", False, fs=TMPFS)
    assert "a second mount at / over one" in str(refused(root.write(), runc_bundle(tmp_path)))
    im = runc_images(tmp_path, "nested").proc(2, {2: DEFAULT_ROOT}, mnt_ns=10)
    im.nested = [Images._mnt(900, "/", 0), Images._mnt(901, "/proc", 0, PROC)]
    assert "leaves /proc/sys writable but the container makes it read-only (linux.readonlyPaths)" in \
        str(refused(im.write(), runc_bundle(tmp_path)))


def test_a_bundle_that_restricts_nothing_may_receive_any_mount(tmp_path):
    # root with every capability in the node's user namespace, no seccomp, no LSM: it could mount a
    # procfs or remount /sys read-write itself; its images are not read
    images = runc_images(tmp_path, sys_ro=False).mount("/mnt/proc", False, fs=PROC).write()
    assert passes(images, bundle(tmp_path, mounts=RUNC_MOUNTS)).notes == \
        ["the container restricts nothing: nothing compared"]


# -- user namespace (issue 27 item 2) ------------------------------------------------------------------
USERNS = {"namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "user"}],
          "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
          "gidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}]}
MAP = [{"first": 0, "lower_first": 100000, "count": 65536}]


def test_a_user_namespace_bundle_needs_images_with_its_mappings(tmp_path):
    b = runc_bundle(tmp_path, **USERNS)
    assert not rp.unrestricted(Grants.of(bundle(tmp_path, linux=USERNS, name="all")))  # all caps, but mapped
    # the case: a checkpoint from the node's user namespace would run as the node's root
    assert str(refused(runc_images(tmp_path).write(), b)).startswith(
        "checkpoint ck: its processes ran in the node's user namespace (CRIU would restore them there) but the "
        "container asks for a user namespace mapping uids 0->100000 (65536) (linux.namespaces)")
    same = runc_images(tmp_path, "same")
    same.userns = {"uid_map": MAP, "gid_map": MAP}
    assert passes(same.write(), b).userns_root == 100000  # who reads the images in that namespace
    assert criu_tasks.read(same.write()).userns == (((0, 100000, 65536),), ((0, 100000, 65536),))
    other = runc_images(tmp_path, "other")
    other.userns = {"uid_map": MAP, "gid_map": [{"first": 0, "lower_first": 0, "count": 1}]}
    assert "its images record a user namespace mapping gids 0->0 (1) (CRIU recreates it so) but the container " \
           "maps 0->100000 (65536) (linux.gidMappings)" in str(refused(other.write(), b))


def test_a_checkpoint_made_in_a_user_namespace_needs_one_in_the_bundle(tmp_path):
    im = runc_images(tmp_path)
    im.userns = {"uid_map": MAP, "gid_map": MAP}
    assert "its images record a user namespace mapping uids 0->100000 (65536) that the container does not ask " \
           "for" in str(refused(im.write(), runc_bundle(tmp_path)))
    host = [{"first": a, "lower_first": b, "count": c} for a, b, c in rp._host_map("uid_map")]
    im = runc_images(tmp_path, "host")
    im.userns = {"uid_map": host, "gid_map": [{"first": a, "lower_first": b, "count": c}
                                              for a, b, c in rp._host_map("gid_map")]}
    passes(im.write(), runc_bundle(tmp_path, "host"))  # the node's own ids: nothing changes meaning


def test_a_user_namespace_id_missing_on_one_side_is_refused(tmp_path):
    """inventory.img without root_ids.user_ns_id: protobuf reads 0, so CRIU would see the tree's 14 as a
    namespace to create (uid 1000 inside mapped to the node's root) where the reader saw none."""
    im = Images(tmp_path / "images").proc(1, {1: creds(1000, 1000, [0, 0], nnp=1)})
    im.userns = {"uid_map": [{"first": 1000, "lower_first": 0, "count": 1}], "gid_map": MAP}
    images = im.write()
    rewrite(os.path.join(images, "inventory.img"), lambda inv: in_sub(inv, 3, lambda ids: [
        (n, v) for n, v in ids if n != 10]))
    with pytest.raises(CheckpointInvalid, match="inventory.img records no user namespace id while the other does"):
        rp.check(images, restricted(tmp_path), "ck", lsm=rp.LSM_NONE)


def test_the_images_are_shared_with_the_namespaces_root_while_the_restore_runs(tmp_path):
    view = tmp_path / "view"
    view.mkdir(mode=0o700)
    stored = tmp_path / "core-1.img"
    stored.write_bytes(b"x")
    stored.chmod(0o600)
    os.link(stored, view / "core-1.img")  # the store's own file, as restore_view links it
    with rp.shared_with_userns(str(view), rp.Verdict()):
        assert stat.S_IMODE(os.stat(view).st_mode) == 0o700  # no user namespace: nothing changed
    with pytest.raises(OSError), rp.shared_with_userns(str(view), rp.Verdict(userns_root=100000)):
        assert (stat.S_IMODE(os.stat(view).st_mode), stat.S_IMODE(os.stat(stored).st_mode)) == (0o711, 0o644)
        raise OSError("CRIU failed")
    assert (stat.S_IMODE(os.stat(view).st_mode), stat.S_IMODE(os.stat(stored).st_mode)) == (0o700, 0o600)


def test_a_user_namespace_joined_by_path_is_compared_by_its_maps(tmp_path):
    joined = {"namespaces": [{"type": "user", "path": "/proc/self/ns/user"}]}  # this process's: the node's
    im = runc_images(tmp_path)
    im.userns = {"uid_map": MAP, "gid_map": MAP}
    assert "(linux.uidMappings)" in str(refused(im.write(), runc_bundle(tmp_path, **joined)))


# -- rlimits, oom_score_adj, securebits (issue 27 "the rest") -------------------------------------------
NOFILE = 7


def test_rlimits_above_the_bundles_are_refused(tmp_path):
    b = runc_bundle(tmp_path, name="lim")
    b.config["process"]["rlimits"] = [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
    im = Images(tmp_path / "high").proc(1, {1: DEFAULT_ROOT}, rlimits={NOFILE: 1048576}).runc_mounts()
    assert "process 1 (app) has RLIMIT_NOFILE hard limit 1048576 but the container sets 1024 (process.rlimits)" \
        in str(refused(im.write(), b))
    im = Images(tmp_path / "eq").proc(1, {1: DEFAULT_ROOT}, rlimits={NOFILE: 1024}).runc_mounts()
    assert criu_tasks.read(im.write()).threads[0].rlimits_max[NOFILE] == 1024
    passes(im.write(), b)
    none = runc_images(tmp_path, "none")  # no rlimits recorded: CRIU would leave its own
    assert "has RLIMIT_NOFILE no limit recorded" in str(refused(none.write(), b))
    b.config["process"]["capabilities"]["permitted"].append("CAP_SYS_RESOURCE")
    b.config["process"]["capabilities"]["bounding"].append("CAP_SYS_RESOURCE")
    passes(Images(tmp_path / "high2").proc(1, {1: creds(0, 0, words([*DEFAULT, "CAP_SYS_RESOURCE"]))},
                                           rlimits={NOFILE: 1048576}).runc_mounts().write(), b)  # it may raise them


def test_a_lower_oom_score_adj_is_refused(tmp_path):
    b = runc_bundle(tmp_path, name="oom")
    b.config["process"]["oomScoreAdj"] = 0
    im = Images(tmp_path / "low").proc(1, {1: DEFAULT_ROOT}, oom=-999).runc_mounts()
    assert "process 1 (app) has oom_score_adj -999 but the container sets 0 (the OOM killer would spare it at the " \
           "others' expense) (process.oomScoreAdj)" in str(refused(im.write(), b))
    assert criu_tasks.read(im.write()).threads[0].oom_score_adj == -999  # a negative int32, as CRIU writes it
    passes(Images(tmp_path / "high").proc(1, {1: DEFAULT_ROOT}, oom=500).runc_mounts().write(), b)


def test_securebits_that_keep_capabilities_are_refused(tmp_path):
    b = runc_bundle(tmp_path, name="sb", mounts=RUNC_MOUNTS)
    b.config["process"]["capabilities"] = {k: [c for c in DEFAULT if c != "CAP_SETPCAP"]
                                           for k in ("bounding", "effective", "permitted")}
    fixup = creds(0, 0, words([c for c in DEFAULT if c != "CAP_SETPCAP"]))
    fixup["secbits"] = 1 << 2  # SECBIT_NO_SETUID_FIXUP
    im = Images(tmp_path / "fixup").proc(1, {1: fixup}).runc_mounts()
    assert "has securebit SECBIT_NO_SETUID_FIXUP (keeps its capabilities across a change of uid), which runc never " \
           "sets and the container cannot set without CAP_SETPCAP (securebits)" in str(refused(im.write(), b))
    fixup["secbits"] = 0b11 | 1 << 4  # NOROOT and its lock, KEEP_CAPS: take away, or a process sets it itself
    passes(Images(tmp_path / "noroot").proc(1, {1: fixup}).runc_mounts().write(), b)


# -- the restore path: refused before anything is touched ----------------------------------------------
POD = {"io.kubernetes.cri.sandbox-namespace": "team", "io.kubernetes.cri.container-type": "container"}


def _store_checkpoint(store: Store, name: str, images: Images, namespace: str | None) -> None:
    with store.writer(name) as w:
        src = images.write()
        for f in os.listdir(src):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(w.images, f), "wb") as b:
                b.write(a.read())
        source = {"container_id": "old"}
        if namespace:
            source["cri"] = {"pod_namespace": namespace, "pod_name": "p", "container_name": "app"}
        w.commit({"created": "2026-01-01T00:00:00Z", "source": source, "options": {}, "rootfs": {"captured": False}})


def test_restore_refuses_before_runc_runs(tmp_path, migrt_env):
    cfg = Config(path=str(migrt_env.config), runtime=str(migrt_env.fake.path), store=str(migrt_env.store),
                 log_file=str(migrt_env.log_file))
    store = Store(cfg.store)
    _store_checkpoint(store, "ck", Images(tmp_path / "images").proc(comm="sh"), "team")
    b = restricted(tmp_path)
    b.config["annotations"] = POD
    target = ops_restore.RestoreTarget(container_id="c2", bundle=b, root=str(tmp_path / "runroot"))
    with pytest.raises(PreconditionFailed, match=r"process 1 \(sh\) runs as uid 0 but the container asks for uid 1000"):
        ops_restore.restore_checkpoint(cfg, "ck", target)
    assert migrt_env.fake.calls() == []  # runc (and so CRIU) never ran
    assert store.get("ck").manifest["source"]["cri"]["pod_namespace"] == "team"  # the checkpoint stays


def test_a_checkpoint_without_a_namespace_is_refused_for_a_pod_unless_allowed(tmp_path):
    b = bundle(tmp_path, caps=ALL)
    b.config["annotations"] = POD
    with pytest.raises(PreconditionFailed, match="records no Kubernetes namespace .*'allow_unbound_checkpoints: true'"):
        ops_restore.check_target({"source": {"container_id": "x"}}, b, "ck", allow_cross_namespace=False)
    ops_restore.check_target({"source": {}}, b, "ck", allow_cross_namespace=False, allow_unbound=True)
    ops_restore.check_target({"source": {"cri": {"pod_namespace": "team"}}}, b, "ck", allow_cross_namespace=False)
    plain = Bundle.load(str(write_bundle(tmp_path / "plain")))  # not a pod: no binding to check
    ops_restore.check_target({"source": {}}, plain, "ck", allow_cross_namespace=False)


def test_allow_unbound_checkpoints_config_key(tmp_path):
    from migrt import config as config_mod

    p = tmp_path / "c.yaml"
    p.write_text("allow_unbound_checkpoints: true\n")
    assert config_mod.load(str(p)).allow_unbound_checkpoints is True
    assert config_mod.load(str(tmp_path / "missing.yaml")).allow_unbound_checkpoints is False
    p.write_text("allow_unbound_checkpoints: maybe\n")
    with pytest.raises(Exception, match="'allow_unbound_checkpoints' must be true or false"):
        config_mod.load(str(p))


def test_grants_read_like_runc(tmp_path):
    g = Grants.of(bundle(tmp_path, uid=5, caps=["CAP_KILL", "CAP_BOGUS", "NET_RAW"]))
    assert g.caps["bounding"] == 1 << CAPS.index("KILL") | 1 << CAPS.index("NET_RAW") and g.caps["ambient"] == 0
    assert Grants.of(bundle(tmp_path, name="b2")).caps is None
    assert rp.unrestricted(Grants.of(Bundle.load(str(write_bundle(tmp_path / "plain")))))


# -- migrt-runc restore: the lower runtime's own checkpoints (containerd's task or CRI restore) ---------
class _Exec(Exception):
    pass


def _shim_restore(monkeypatch, tmp_path, images: str, b: Bundle) -> tuple[int | list[str], Path]:
    """migrt-runc restore as containerd's runc shim calls it: the exit code, or the lower runtime's argv."""
    from migrt.shim import __main__ as shim

    def fake_execv(path, args):
        raise _Exec(args[1:])

    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # the shim puts migrt's CRIU first: undone after
    monkeypatch.setattr(os, "execv", fake_execv)
    log = tmp_path / "runc-log.json"
    argv = ["--root", str(tmp_path / "root"), "--log", str(log), "--log-format", "json", "restore", "--detach",
            "--image-path", images, "--work-path", str(tmp_path / "work"), "--bundle", b.path, "c1"]
    try:
        return shim.main(argv), log
    except _Exec as exc:
        return exc.args[0], log


def test_migrt_runc_restore_is_refused_when_the_tasks_hold_more(migrt_env, monkeypatch, tmp_path):
    images = root_all_caps(tmp_path)
    rc, log = _shim_restore(monkeypatch, tmp_path, images, restricted(tmp_path))
    assert rc == 8
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert msg.startswith(f"migrt: checkpoint {images}: process 1 (sh) runs as uid 0 but the container asks for "
                          "uid 1000")
    argv, _ = _shim_restore(monkeypatch, tmp_path, images, bundle(tmp_path, caps=ALL, name="broad"))
    assert argv[argv.index("restore"):] == ["restore", "--detach", "--image-path", images, "--work-path",
                                            str(tmp_path / "work"), "--bundle", str(tmp_path / "broad"), "c1"]


def test_migrt_runc_restore_applies_the_bundles_label(migrt_env, monkeypatch, tmp_path):
    monkeypatch.setattr(rp, "host_lsm", lambda: rp.LSM_APPARMOR)
    im = Images(tmp_path / "images").proc(1, {1: creds(lsm="unconfined-by-hand")})
    im.lsmtype = rp.LSM_APPARMOR
    b = bundle(tmp_path, caps=ALL, extra={"apparmorProfile": "cri-containerd.apparmor.d"})
    argv, _ = _shim_restore(monkeypatch, tmp_path, im.write(), b)
    assert argv[argv.index("restore"):][:3] == ["restore", "--lsm-profile", "apparmor:cri-containerd.apparmor.d"]
