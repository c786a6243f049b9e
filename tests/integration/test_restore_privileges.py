"""A restore never grants more than the new container's config.json (issue 22, harmful item 1), through
a real containerd 2.1, runc and CRIU: bundles from `ctr oci spec` (containerd's defaults: masked and
read-only paths, a deny-all device list, noNewPrivileges) adjusted per test and run with `ctr run
--config`, their root a busybox directory. A root process holding every capability used to be
restored as it was into a pod that asks for uid 1000, no capabilities and noNewPrivileges."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable

import pytest

from migrt.criu import tasks as criu_tasks
from migrt.oci.grants import cap_names
from migrt.seccomp.compare import Comparer
from migrt.seccomp.profile import compile_profile
from tests.helpers.bundles import make_rootfs
from tests.integration.conftest import SHIM, run_cli

pytestmark = pytest.mark.integration


def _host_caps() -> list[str]:
    """Every capability this node has (a sandboxed node may lack some: CAP_SYS_RESOURCE here)."""
    with open("/proc/self/status") as fh:
        bnd = next(line.split()[1] for line in fh if line.startswith("CapBnd:"))
    return [c for c in cap_names(int(bnd, 16)) if c.startswith("CAP_")]


ALL_CAPS = _host_caps()
NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
LOOP = "while true; do sleep 0.2; done"
SECCOMP = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
           "syscalls": [{"names": ["reboot"], "action": "SCMP_ACT_ERRNO"}]}


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _spec(ctd, tmp_path, label: str, *, uid: int = 0, caps: list[str] | None = None, nnp: bool = True,
          namespace: str | None = "team", restore: str | None = None, readonly: bool = False,
          seccomp: dict | None = None, edit: Callable[[dict], None] | None = None) -> str:
    """config.json for `ctr run --config`: containerd's default spec, a fresh busybox root, and the
    identity, capabilities (None: containerd's defaults), noNewPrivileges and annotation asked; `edit`
    changes the spec last."""
    spec = json.loads(ctd.ctr("oci", "spec").stdout)
    spec["root"] = {"path": make_rootfs(str(tmp_path / f"rootfs-{label}")), "readonly": readonly}
    env = ["PATH=/bin"] + ([f"MIGRT_RESTORE={restore}"] if restore else [])
    spec["process"].update(args=["sh", "-c", LOOP], env=env, user={"uid": uid, "gid": uid}, noNewPrivileges=nnp)
    if caps is not None:
        spec["process"]["capabilities"] = {k: list(caps) for k in ("bounding", "effective", "permitted")}
    spec["annotations"] = {NAMESPACE: namespace} if namespace else {}
    if seccomp is not None:
        spec["linux"]["seccomp"] = seccomp
    if edit is not None:
        edit(spec)
    path = tmp_path / f"spec-{label}.json"
    path.write_text(json.dumps(spec))
    return str(path)


def _run(ctd, cid: str, spec: str, check: bool = True):
    return ctd.ctr("run", "-d", "--runc-binary", SHIM, "--config", spec, cid, check=check)


def _status(ctd, cid: str) -> dict[str, str]:
    """The container's pid 1 as /proc/1/status shows it (read by a process exec'd into it)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        res = ctd.ctr("task", "exec", "--exec-id", _id("st"), cid, "cat", "/proc/1/status", check=False)
        if res.returncode == 0:
            return dict(line.split(":\t", 1) for line in res.stdout.splitlines() if ":\t" in line)
        time.sleep(0.2)
    raise AssertionError(f"cannot read /proc/1/status in {cid}: {res.stderr}")


def _remove(ctd, cid: str) -> None:
    ctd.ctr("task", "kill", "-s", "KILL", cid, check=False)
    for _ in range(50):
        res = ctd.ctr("task", "delete", cid, check=False)
        if res.returncode == 0 or "not found" in res.stderr:
            break
        time.sleep(0.1)
    ctd.ctr("containers", "delete", cid, check=False)


def _checkpoint(ctd, tmp_path, label: str, **kw) -> tuple[str, dict]:
    """A container run with _spec(**kw), its pid 1's status, checkpointed into the store and removed."""
    cid = _id(label)
    _run(ctd, cid, _spec(ctd, tmp_path, f"src-{cid}", **kw))
    try:
        status = _status(ctd, cid)
        name = _id(f"{label}-ck")
        run_cli("checkpoint", cid, "--name", name)
    finally:
        _remove(ctd, cid)
    return name, status


def _refused(ctd, tmp_path, name: str, migrt_config, **kw) -> str:
    dst = _id("dst")
    res = _run(ctd, dst, _spec(ctd, tmp_path, f"dst-{dst}", restore=name, **kw), check=False)
    try:
        assert res.returncode != 0, "the restore was not refused"
        assert "OCI runtime create failed: migrt: " in res.stderr, res.stderr
        assert not os.path.exists(f"/run/containerd/runc/{ctd.namespace}/{dst}")  # nothing restored
        assert os.listdir(os.path.join(migrt_config["store"], ".tmp")) == []
        run_cli("inspect", name, "--verify")  # the checkpoint is kept, intact
    finally:
        _remove(ctd, dst)
    return res.stderr


def _restored(ctd, tmp_path, name: str, **kw) -> tuple[str, dict]:
    dst = _id("dst")
    res = _run(ctd, dst, _spec(ctd, tmp_path, f"dst-{dst}", restore=name, **kw), check=False)
    assert res.returncode == 0, res.stderr
    return dst, _status(ctd, dst)


def test_a_root_process_with_every_capability_is_refused_by_a_restricted_pod(containerd, migrt_config, tmp_path):
    name, before = _checkpoint(containerd, tmp_path, "root", uid=0, caps=ALL_CAPS, nnp=False)
    assert before["Uid"].split() == ["0"] * 4 and before["NoNewPrivs"] == "0"  # the process
    err = _refused(containerd, tmp_path, name, migrt_config, uid=1000, caps=[], nnp=True)
    assert f"migrt: checkpoint {name}: process 1 (sh) runs as uid 0 but the container asks for uid 1000 " \
           "(process.user.uid)" in err, err
    assert "holds bounding capabilities the container does not grant: CAP_CHOWN" in err
    assert "runs without no_new_privs but the container asks for it (process.noNewPrivileges)" in err

    # the same checkpoint into a pod that grants what it holds: restored, as it was
    dst, after = _restored(containerd, tmp_path, name, uid=0, caps=ALL_CAPS, nnp=False)
    try:
        assert (after["Uid"], after["CapEff"], after["NoNewPrivs"]) == (before["Uid"], before["CapEff"], "0")
    finally:
        _remove(containerd, dst)


@pytest.mark.parametrize("uid", [0, 1000])
def test_an_unprivileged_process_restores_into_the_restricted_pod(containerd, migrt_config, tmp_path, uid):
    if uid and "CAP_SYS_RESOURCE" not in ALL_CAPS:
        # CRIU reads a task's rlimits with prlimit(), which a non-root task allows only to a caller
        # holding CAP_SYS_RESOURCE; uid 0 without capabilities stands in for it here
        pytest.skip("this node lacks CAP_SYS_RESOURCE: CRIU cannot dump a non-root process here")
    name, before = _checkpoint(containerd, tmp_path, "user", uid=uid, caps=[], nnp=True)
    dst, after = _restored(containerd, tmp_path, name, uid=uid, caps=[], nnp=True)
    try:
        assert after["Uid"].split() == [str(uid)] * 4 and after["Gid"].split() == [str(uid)] * 4
        assert (after["CapEff"], after["CapPrm"], after["CapBnd"], after["NoNewPrivs"]) == \
            ("0000000000000000", "0000000000000000", "0000000000000000", "1")
    finally:
        _remove(containerd, dst)


def test_the_reader_agrees_with_pycriu_on_images_criu_made(containerd, migrt_config, tmp_path):
    pycriu = pytest.importorskip("pycriu")
    name, _ = _checkpoint(containerd, tmp_path, "read", caps=ALL_CAPS, nnp=True, seccomp=SECCOMP)
    images = os.path.join(migrt_config["store"], name, "images")
    ours = criu_tasks.read(images)
    for th in ours.threads:
        with open(os.path.join(images, f"core-{th.tid}.img"), "rb") as fh:
            core = pycriu.images.load(fh)["entries"][0]["thread_core"]
        c = core["creds"]
        assert th.uids == (c["uid"], c["euid"], c["suid"], c["fsuid"])
        assert th.gids == (c["gid"], c["egid"], c["sgid"], c["fsgid"])
        for key, which in (("cap_eff", "effective"), ("cap_prm", "permitted"), ("cap_bnd", "bounding"),
                           ("cap_inh", "inheritable"), ("cap_amb", "ambient")):
            assert th.caps[which] == sum(w << (32 * i) for i, w in enumerate(c.get(key, []))), which
        assert th.no_new_privs == c.get("no_new_privs", 0) == 1
        assert (th.seccomp_mode, th.seccomp_filter) == (2, core["seccomp_filter"])
    assert cap_names(ours.threads[0].caps["effective"]) == ALL_CAPS
    with open(os.path.join(images, "seccomp.img"), "rb") as fh:
        assert ours.seccomp_filters == len(pycriu.images.load(fh)["entries"][0]["seccomp_filters"])
    mounts = {m.mountpoint: m for m in ours.mounts}
    assert not mounts["/"].read_only and mounts["/proc/sys"].read_only  # containerd's readonlyPaths
    with open(os.path.join(images, f"core-{ours.threads[0].pid}.img"), "rb") as fh:
        tc = pycriu.images.load(fh)["entries"][0]["tc"]
    assert ours.threads[0].rlimits_max == tuple(r["max"] for r in tc["rlimits"]["rlimits"])
    assert ours.threads[0].oom_score_adj == tc["oom_score_adj"] and ours.userns is None
    mnt = next(f for f in os.listdir(images) if f.startswith("mountpoints-"))
    with open(os.path.join(images, mnt), "rb") as fh:
        theirs = pycriu.images.load(fh)["entries"]
    def num(v) -> int:  # pycriu shows the fields CRIU marks hex as "0x..." strings
        return int(v, 16) if isinstance(v, str) else v
    assert [(m.mountpoint, m.fstype, m.flags, m.sb_flags, m.root, m.ext_key) for m in ours.mounts] == \
        [(e["mountpoint"], e["fstype"], num(e["flags"]), num(e.get("sb_flags", 0)), e["root"], e.get("ext_key"))
         for e in theirs]


def test_a_checkpoint_without_a_namespace_is_refused_for_a_pod(containerd, migrt_config, tmp_path):
    name, _ = _checkpoint(containerd, tmp_path, "unbound", caps=[], namespace=None)
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[])
    assert f"checkpoint {name} records no Kubernetes namespace" in err and "allow_unbound_checkpoints" in err


def test_a_writable_root_is_refused_by_a_read_only_pod(containerd, migrt_config, tmp_path):
    # CRIU mounts the root as its images record it; runc restore applies no root.readonly
    name, _ = _checkpoint(containerd, tmp_path, "rw", caps=[])
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], readonly=True)
    assert "root filesystem is mounted read-write in the images" in err and "(root.readonly)" in err
    name, _ = _checkpoint(containerd, tmp_path, "ro", caps=[], readonly=True)
    dst, _ = _restored(containerd, tmp_path, name, caps=[], readonly=True)
    try:
        res = containerd.ctr("task", "exec", "--exec-id", _id("w"), dst, "sh", "-c", "touch /x", check=False)
        assert res.returncode != 0 and "Read-only file system" in res.stdout + res.stderr
    finally:
        _remove(containerd, dst)


def test_a_seccomp_profile_needs_a_filtered_process(containerd, migrt_config, tmp_path):
    name, _ = _checkpoint(containerd, tmp_path, "nofilter", caps=[])
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], seccomp=SECCOMP)
    assert "process 1 (sh) runs without a seccomp filter but the container asks for one (linux.seccomp)" in err
    name, before = _checkpoint(containerd, tmp_path, "filter", caps=[], seccomp=SECCOMP)
    assert before["Seccomp"] == "2"
    dst, after = _restored(containerd, tmp_path, name, caps=[], seccomp=SECCOMP)
    try:
        assert after["Seccomp"] == "2" and after["Seccomp_filters"] == before["Seccomp_filters"]
    finally:
        _remove(containerd, dst)


# -- seccomp filters compared with the profile (issue 27 item 3) ---------------------------------------
ARCHES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
ALLOW_ALL = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ARCHES}
NO_MKDIR = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ARCHES,
            "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO"}]}


def _default_profile(ctd) -> dict:
    """containerd's default seccomp profile, as `ctr --seccomp` writes it into a container's spec."""
    cid = _id("profile")
    ctd.ctr("containers", "create", "--seccomp", ctd.image, cid)
    try:
        return json.loads(ctd.ctr("containers", "info", cid).stdout)["Spec"]["linux"]["seccomp"]
    finally:
        ctd.ctr("containers", "delete", cid, check=False)


def test_an_allow_all_filter_is_refused_by_a_pod_that_denies_mkdir(containerd, migrt_config, tmp_path):
    fresh = _id("fresh")  # what the pod's profile does to a process it starts itself
    _run(containerd, fresh, _spec(containerd, tmp_path, f"fresh-{fresh}", caps=[], seccomp=NO_MKDIR))
    try:
        res = containerd.ctr("task", "exec", "--exec-id", _id("m"), fresh, "mkdir", "/made", check=False)
        assert res.returncode != 0 and "Operation not permitted" in res.stdout + res.stderr, res
    finally:
        _remove(containerd, fresh)
    # the checkpoint: a filter, so filter mode alone let it through, but one that allows everything
    name, before = _checkpoint(containerd, tmp_path, "allowall", caps=[], seccomp=ALLOW_ALL)
    assert before["Seccomp"] == "2"
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], seccomp=NO_MKDIR)
    assert f"migrt: checkpoint {name}: process 1 (sh) may call mkdir, which the container's seccomp profile " \
           "denies (linux.seccomp)" in err, err


def test_the_same_profile_and_a_laxer_one_restore(containerd, migrt_config, tmp_path):
    name, before = _checkpoint(containerd, tmp_path, "nomkdir", caps=[], seccomp=NO_MKDIR)
    for profile in (NO_MKDIR, ALLOW_ALL):  # the same restrictions, then a subset of them
        dst, after = _restored(containerd, tmp_path, name, caps=[], seccomp=profile)
        try:
            assert after["Seccomp"] == "2" and after["Seccomp_filters"] == before["Seccomp_filters"]
        finally:
            _remove(containerd, dst)
    # a pod that denies more than the checkpoint's filter does (reboot as well) is refused
    stricter = {**NO_MKDIR, "syscalls": NO_MKDIR["syscalls"] + [{"names": ["reboot"], "action": "SCMP_ACT_ERRNO"}]}
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], seccomp=stricter)
    assert "process 1 (sh) may call reboot, which the container's seccomp profile denies (linux.seccomp)" in err


def test_containerds_default_profile_restores_into_the_same_profile(containerd, migrt_config, tmp_path):
    profile = _default_profile(containerd)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and len(profile["syscalls"]) > 5  # the real one
    name, before = _checkpoint(containerd, tmp_path, "default", seccomp=profile)
    images = criu_tasks.read(os.path.join(migrt_config["store"], name, "images"))
    comparer = Comparer(compile_profile(profile))  # runc's program: libseccomp's bytes after runc's own stub
    assert all(comparer.runs_profile(images.seccomp_chain(th)[0].program) for th in images.threads)
    dst, after = _restored(containerd, tmp_path, name, seccomp=profile)
    try:
        assert after["Seccomp"] == "2" and after["Seccomp_filters"] == before["Seccomp_filters"]
    finally:
        _remove(containerd, dst)
    err = _refused(containerd, tmp_path, name, migrt_config, seccomp=NO_MKDIR)  # allows mkdir: refused
    assert "may call mkdir, which the container's seccomp profile denies (linux.seccomp)" in err, err


THREADS_C = """#include <pthread.h>
#include <unistd.h>
static void *spin(void *arg) { for (;;) sleep(1); return arg; }
int main(void) { pthread_t t; for (int i = 0; i < 3; i++) pthread_create(&t, 0, spin, 0); for (;;) sleep(1); }
"""


def _threaded_spec(ctd, tmp_path, label: str, **kw) -> str:
    """_spec's bundle running a static program of four threads (/bin/threads in its root)."""
    binary = tmp_path / "threads"
    if not binary.exists():
        (tmp_path / "threads.c").write_text(THREADS_C)
        subprocess.run(["gcc", "-static", "-O2", "-pthread", "-o", str(binary), str(tmp_path / "threads.c")],
                       check=True, capture_output=True)
    path = _spec(ctd, tmp_path, label, **kw)
    with open(path) as fh:
        spec = json.load(fh)
    shutil.copy(binary, os.path.join(spec["root"]["path"], "bin", "threads"))
    spec["process"]["args"] = ["/bin/threads"]
    with open(path, "w") as fh:
        json.dump(spec, fh)
    return path


def test_a_threaded_process_restores_with_its_filters_on_every_thread(containerd, migrt_config, tmp_path):
    # CRIU records the shared chain on the leader only, with TSYNC, and no filter on the other threads
    src = _id("threads")
    _run(containerd, src, _threaded_spec(containerd, tmp_path, f"src-{src}", caps=[], seccomp=NO_MKDIR))
    try:
        before = _status(containerd, src)
        name = _id("threads-ck")
        run_cli("checkpoint", src, "--name", name)
    finally:
        _remove(containerd, src)
    assert before["Threads"] == "4" and before["Seccomp"] == "2"
    images = criu_tasks.read(os.path.join(migrt_config["store"], name, "images"))
    assert [th.seccomp_mode for th in images.threads] == [2, 0, 0, 0]  # what CRIU wrote
    dst = _id("dst")
    res = _run(containerd, dst, _threaded_spec(containerd, tmp_path, f"dst-{dst}", caps=[], seccomp=NO_MKDIR,
                                               restore=name), check=False)
    try:
        assert res.returncode == 0, res.stderr
        assert _status(containerd, dst)["Threads"] == "4"
        tasks = containerd.ctr("task", "exec", "--exec-id", _id("t"), dst, "sh", "-c",
                               "grep -h Seccomp: /proc/1/task/*/status")
        assert tasks.stdout.split() == ["Seccomp:", "2"] * 4, tasks.stdout  # every thread filtered again
    finally:
        _remove(containerd, dst)
    stricter = {**NO_MKDIR, "syscalls": NO_MKDIR["syscalls"] + [{"names": ["reboot"], "action": "SCMP_ACT_ERRNO"}]}
    dst = _id("dst")
    res = _run(containerd, dst, _threaded_spec(containerd, tmp_path, f"dst-{dst}", caps=[], seccomp=stricter,
                                               restore=name), check=False)
    try:
        assert res.returncode != 0 and f"checkpoint {name}: process 1 (threads) may call reboot, which the " \
            "container's seccomp profile denies (linux.seccomp)" in res.stderr, res.stderr
    finally:
        _remove(containerd, dst)


# -- mounts and the user namespace come from the bundle (issue 27 items 1 and 2) -------------------------
CGROUP = {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
          "options": ["nosuid", "noexec", "nodev", "relatime"]}


def _mounts(*, sys_rw: bool = False, cgroup: str | None = None, extra: list[dict] | None = None,
            drop: tuple[str, ...] = (), mkdir: str | None = None) -> Callable[[dict], None]:
    """An edit of containerd's default mounts: /sys read-write, a cgroup mount ("ro"/"rw", as runc's
    default spec has it read-only), more mounts, fewer; `mkdir`: a directory made in the root."""
    def edit(spec: dict) -> None:
        if mkdir:
            os.makedirs(os.path.join(spec["root"]["path"], mkdir.lstrip("/")), exist_ok=True)
        mounts = [m for m in spec["mounts"] if m["destination"] not in drop]
        for m in mounts:
            if m["destination"] == "/sys" and sys_rw:
                m["options"] = [o for o in m["options"] if o != "ro"]
        if cgroup:
            mounts.append({**CGROUP, "options": CGROUP["options"] + ([cgroup] if cgroup == "ro" else [])})
        spec["mounts"] = mounts + list(extra or [])
    return edit


def _exec(ctd, cid: str, script: str):
    return ctd.ctr("task", "exec", "--exec-id", _id("x"), cid, "sh", "-c", script, check=False)


def test_sys_read_write_comes_back_only_into_a_bundle_that_mounts_it_so(containerd, migrt_config, tmp_path):
    name, _ = _checkpoint(containerd, tmp_path, "sysrw", caps=[], edit=_mounts(sys_rw=True))
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[])  # containerd's default: /sys read-only
    assert f"migrt: checkpoint {name}: the mount table in its images has /sys (sysfs) read-write but the container " \
           "makes it read-only (mounts)" in err, err
    dst, _ = _restored(containerd, tmp_path, name, caps=[], edit=_mounts(sys_rw=True))  # what it had
    try:
        assert "rw" in _exec(containerd, dst, "grep ' /sys ' /proc/mounts").stdout.split()[3].split(",")
    finally:
        _remove(containerd, dst)


def test_a_writable_cgroup_mount_is_refused_by_a_read_only_one(containerd, migrt_config, tmp_path):
    # cgroup v1: the container's own memory.limit_in_bytes and cpu.cfs_quota_us writable by it
    name, _ = _checkpoint(containerd, tmp_path, "cgrw", caps=[], edit=_mounts(cgroup="rw"))
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], edit=_mounts(cgroup="ro"))
    assert f"migrt: checkpoint {name}: the mount table in its images has /sys/fs/cgroup" in err and \
        "read-write but the container makes it read-only (mounts)" in err, err
    # runc's default: read-only, restored into the same
    name, _ = _checkpoint(containerd, tmp_path, "cgro", caps=[], edit=_mounts(cgroup="ro"))
    dst, _ = _restored(containerd, tmp_path, name, caps=[], edit=_mounts(cgroup="ro"))
    try:
        res = _exec(containerd, dst, "grep ' /sys/fs/cgroup/' /proc/mounts | grep -c ' rw,'")
        assert res.stdout.strip() == "0", res.stdout  # no controller writable
    finally:
        _remove(containerd, dst)


def test_an_extra_procfs_is_refused_and_fewer_unused_mounts_restore(containerd, migrt_config, tmp_path):
    # a procfs at /mnt/proc while /proc/sys is read-only: /mnt/proc/sys/kernel/core_pattern, root on the node
    proc = {"destination": "/mnt/proc", "type": "proc", "source": "proc"}
    name, _ = _checkpoint(containerd, tmp_path, "mntproc", caps=[], edit=_mounts(extra=[proc]))
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], edit=_mounts(mkdir="/mnt/proc"))
    assert f"migrt: checkpoint {name}: the mount table in its images has proc mounted at /mnt/proc that the " \
           "container does not declare (mounts)" in err, err
    # stricter but compatible: no /run tmpfs nor /dev/mqueue, which the process does not use
    name, _ = _checkpoint(containerd, tmp_path, "fewer", caps=[])
    dst, after = _restored(containerd, tmp_path, name, caps=[], edit=_mounts(drop=("/run", "/dev/mqueue")))
    try:
        assert after["NoNewPrivs"] == "1"
    finally:
        _remove(containerd, dst)


USERNS_MAP = [{"containerID": 0, "hostID": 100000, "size": 65536}]


@pytest.fixture
def open_dir():
    """A directory the container's mapped root (uid 100000) can reach: a user namespace's root
    filesystem cannot live below pytest's 0700 directories."""
    path = tempfile.mkdtemp(prefix="migrt-userns-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _userns(root_dir: str, mapping: list[dict] = USERNS_MAP) -> Callable[[dict], None]:
    """A hostUsers:false pod's user namespace: uid and gid 0 -> 100000, 65536 of them."""
    def edit(spec: dict) -> None:
        spec["linux"]["namespaces"] = [*spec["linux"]["namespaces"], {"type": "user"}]
        spec["linux"]["uidMappings"] = spec["linux"]["gidMappings"] = mapping
        root = os.path.join(root_dir, os.path.basename(spec["root"]["path"]))
        if not os.path.exists(root):
            shutil.copytree(spec["root"]["path"], root, symlinks=True)
        spec["root"]["path"] = root
    return edit


def test_a_user_namespace_pod_refuses_a_checkpoint_of_the_nodes_user_namespace(containerd, migrt_config, tmp_path,
                                                                               open_dir):
    name, before = _checkpoint(containerd, tmp_path, "hostns", caps=[])
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], edit=_userns(open_dir))
    assert f"migrt: checkpoint {name}: its processes ran in the node's user namespace (CRIU would restore them " \
           "there) but the container asks for a user namespace mapping uids 0->100000 (65536) (linux.namespaces)" \
           in err, err


def test_a_user_namespace_checkpoint_restores_only_into_the_same_mappings(containerd, migrt_config, tmp_path,
                                                                          open_dir):
    name, before = _checkpoint(containerd, tmp_path, "userns", caps=[], edit=_userns(open_dir))
    assert before["Uid"].split() == ["0"] * 4
    images = criu_tasks.read(os.path.join(migrt_config["store"], name, "images"))
    assert images.userns == (((0, 100000, 65536),), ((0, 100000, 65536),))  # userns-<id>.img, as CRIU wrote it
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[])
    assert f"migrt: checkpoint {name}: its images record a user namespace mapping uids 0->100000 (65536) that " \
           "the container does not ask for" in err, err
    other = [{"containerID": 0, "hostID": 200000, "size": 65536}]
    err = _refused(containerd, tmp_path, name, migrt_config, caps=[], edit=_userns(open_dir, other))
    assert "its images record a user namespace mapping uids 0->100000 (65536) (CRIU recreates it so) but the " \
           "container maps 0->200000 (65536) (linux.uidMappings)" in err, err
    dst, after = _restored(containerd, tmp_path, name, caps=[], edit=_userns(open_dir))
    try:
        assert _exec(containerd, dst, "cat /proc/1/uid_map").stdout.split() == ["0", "100000", "65536"]
        assert after["Uid"] == before["Uid"]
    finally:
        _remove(containerd, dst)
