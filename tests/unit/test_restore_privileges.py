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

    @staticmethod
    def _mnt(mnt_id: int, point: str, flags: int) -> dict:
        return {"fstype": 17, "mnt_id": mnt_id, "root_dev": 40, "parent_mnt_id": 1, "flags": flags, "root": "/",
                "mountpoint": point, "source": "overlay", "options": ""}

    def proc(self, pid: int = 1, threads: dict[int, dict] | None = None, *, seccomp: str = "disabled",
             comm: str = "app", state: int = 1) -> "Images":
        self.procs.append({"pid": pid, "threads": threads or {pid: creds()}, "seccomp": seccomp, "comm": comm,
                           "state": state})
        return self

    def open(self, path: str, flags: int, mode: int, fd: int = 3, mnt_id: int = ROOT_MNT) -> "Images":
        fid = len(self.files) + 1
        self.files.append({"type": "REG", "id": fid, "reg": {
            "id": fid, "flags": flags, "pos": 0, "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0},
            "name": path, "mnt_id": mnt_id, "mode": mode}})
        self.fdinfo.append({"id": fid, "flags": 0, "type": "REG", "fd": fd})
        return self

    def tty(self, rdev: int, fd: int = 0) -> "Images":
        fid = len(self.files) + 1
        self.files.append({"type": "TTY", "id": fid, "tty": {
            "id": fid, "tty_info_id": fid, "flags": O_RDWR,
            "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0}}})
        self.fdinfo.append({"id": fid, "flags": 0, "type": "TTY", "fd": fd})
        self._ttys = getattr(self, "_ttys", []) + [{"id": fid, "type": "VT", "locked": False, "exclusive": False,
                                                     "packet_mode": False, "sid": 0, "pgrp": 0, "rdev": rdev}]
        return self

    def mount(self, point: str, read_only: bool, mnt_id: int | None = None) -> "Images":
        self.mounts.append(self._mnt(mnt_id or 200 + len(self.mounts), point, 1 if read_only else 0))
        return self

    def write(self) -> str:
        d = str(self.path)

        def img(name: str, magic: str, entries: list) -> None:
            with open(os.path.join(d, name), "wb") as fh:
                pycriu.images.dump({"magic": magic, "entries": entries}, fh)

        lsm = ("NO_LSM", "SELINUX", "APPARMOR")[self.lsmtype]
        img("inventory.img", "INVENTORY", [{"img_version": 2, "fdinfo_per_id": True, "lsmtype": lsm}])
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
                    core["ids"] = {"vm_id": 1, "files_id": 1, "fs_id": 1, "sighand_id": 1, "mnt_ns_id": 9}
                img(f"core-{tid}.img", "CORE", [core])
        img("files.img", "FILES", self.files)
        img("fdinfo-1.img", "FDINFO", self.fdinfo)
        if getattr(self, "_ttys", None):
            img("tty-info.img", "TTY_INFO", self._ttys)
        img("mountpoints-9.img", "MNTS", self.mounts)
        if self.seccomp:
            prog = base64.b64encode(self.seccomp_program).decode()
            img("seccomp.img", "SECCOMP", [{"seccomp_filters": [{"filter": prog} for _ in range(self.seccomp)]}])
        return d


def root_all_caps(tmp_path: Path) -> str:
    """The issue's checkpoint: a root process holding every capability, no no_new_privs, no seccomp."""
    return Images(tmp_path / "images").proc(comm="sh").write()


def bundle(tmp_path: Path, *, uid: int = 0, gid: int = 0, caps: list[str] | None = None, nnp: bool = False,
           extra: dict | None = None, linux: dict | None = None, name: str = "bundle") -> Bundle:
    process: dict = {"user": {"uid": uid, "gid": gid}, "args": ["sh"], "cwd": "/"}
    if caps is not None:
        process["capabilities"] = {k: list(caps) for k in ("bounding", "effective", "permitted")}
    if nnp:
        process["noNewPrivileges"] = True
    process.update(extra or {})
    path = tmp_path / name
    (path / "rootfs").mkdir(parents=True, exist_ok=True)
    config = {"ociVersion": "1.2.0", "process": process, "root": {"path": "rootfs"}, "linux": linux or {}}
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
    head = open(pstree, "rb").read()[:8]  # the magic words
    for entry in (b"\x0a\x02\x01\x02",   # pid (field 1) as bytes, not a varint
                  b"\x08\xff\xff",       # a truncated varint
                  b"\x0b\x00"):           # wire type 3 (groups): not in CRIU's images
        with open(pstree, "wb") as fh:
            fh.write(head + struct.pack("<I", len(entry)) + entry)
        with pytest.raises(CheckpointInvalid, match="checkpoint ck: cannot read what its processes hold"):
            rp.check(images, restricted(tmp_path), "ck", lsm=rp.LSM_NONE)


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
    passes(images, b, rootfs_changes=lambda: [])


def test_layer_changes_leave_out_directories(tmp_path):
    with tarfile.open(tmp_path / rootfs.DIFF_TAR, "w") as tar:
        for name, kind in (("etc", tarfile.DIRTYPE), ("etc/app.conf", tarfile.REGTYPE), ("run/secrets", tarfile.DIRTYPE)):
            ti = tarfile.TarInfo(name)
            ti.type = kind
            tar.addfile(ti, io.BytesIO(b""))
    (tmp_path / rootfs.DIFF_META).write_text(json.dumps({"deleted": ["tmp/x"], "opaque": []}))
    assert rp.layer_changes(str(tmp_path)) == ["deletes /tmp/x", "/etc/app.conf"]


def test_masked_and_read_only_paths_must_be_in_the_mount_table(tmp_path):
    linux = {"maskedPaths": ["/proc/cpuinfo", "/proc/no-such-file-here"], "readonlyPaths": ["/proc/sys"]}
    b = bundle(tmp_path, caps=ALL, linux=linux)
    text = str(refused(root_all_caps(tmp_path), b))
    assert "leaves /proc/cpuinfo unmasked but the container masks it (linux.maskedPaths)" in text
    assert "leaves /proc/sys writable but the container makes it read-only (linux.readonlyPaths)" in text
    assert "no-such-file" not in text  # runc skips a path the container does not have
    im = Images(tmp_path / "masked").proc().mount("/proc/cpuinfo", False).mount("/proc/sys", True)
    passes(im.write(), b)


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
    assert msg.startswith(f"migrt: checkpoint {images}: process 1 (sh) runs as uid 0 but the container asks for uid 1000")
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
