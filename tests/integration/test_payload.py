"""The DaemonSet's installer image, built here without a registry (packaging/build-payload.sh image:
Debian 12 packages through mmdebstrap, one OCI layer), imported into a private containerd and run the
way packaging/daemonset.yaml runs its init container (privileged, the host's / at /host):

1. into a scratch host root that holds nothing but busybox (static) and /proc, no C library at all: the
   payload (its own C library, Python, venv, CRIU) lands in /opt/migrt, the links, config, store and
   containerd drop-in where the README says, and the installed migrt, python and CRIU run there (chroot);
2. into a private prefix and bindir on this very host (the system's /opt/migrt and /usr/local/bin are
   left as they were), whose migrt then checkpoints a container and restores it through containerd,
   with its own CRIU;
3. from the payload unpacked elsewhere, straight on this host (--root /, no container);
4. by its own installer into a fresh Debian 11 root (glibc 2.31, older than the payload's 2.36), where it
   checkpoints and restores a runc container (packaging/check-old-node.sh).

The build (minutes: CRIU and a Debian root) is cached under $MIGRT_DEPS/payload by the hash of its
inputs; later runs reuse it in seconds.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from migrt.node import launchers
from tests.helpers.bundles import make_rootfs
from tests.helpers.containerd import DEPS, Containerd
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "packaging" / "build-payload.sh"
CACHE = os.environ.get("MIGRT_PAYLOAD_CACHE") or os.path.join(DEPS, "payload")  # CI's one build
REF = "ghcr.io/migrt/migrt-installer:0.1.0"  # packaging/daemonset.yaml's image
INSTALLER = "/opt/migrt/share/install-host.sh"


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


class _Containerd(Containerd):
    def __init__(self, *a, env: dict, **kw) -> None:
        super().__init__(*a, **kw)
        self._extra_env = env

    def env(self) -> dict:
        return {**super().env(), **self._extra_env}  # MIGRT_CONFIG reaches migrt-runc through the shim


@pytest.fixture(scope="module")
def image_tar(stack) -> str:
    t0 = time.monotonic()
    r = subprocess.run(["sh", str(BUILD), "image", "--cache", CACHE], capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-4000:]
    tar = r.stdout.strip().splitlines()[-1]
    print(f"payload image {tar}: {time.monotonic() - t0:.0f} s ({r.stderr.strip().splitlines()[-1]})")
    return tar


@pytest.fixture(scope="module")
def ctd(image_tar, tmp_path_factory):
    base = tmp_path_factory.mktemp("payload")
    cfg = base / "config.yaml"
    cfg.write_text(f"runtime: runc\nstore: {base / 'store'}\nrestore_failure_policy: fail\n"
                   f"log_file: {base / 'migrt.log'}\nlog_level: debug\n")
    c = _Containerd(str(base / "containerd"), namespace=_id("migrt-payload"), env={"MIGRT_CONFIG": str(cfg)}).start()
    try:
        c.ctr("images", "import", image_tar, timeout=600)
        c.image = c.import_busybox()
        c.migrt_config = str(cfg)
        c.store = str(base / "store")
        yield c
    finally:
        c.stop()
        shutil.rmtree(os.path.join(c.base, "root"), ignore_errors=True)  # the image's 200 MB, twice


def run_installer(ctd, host: str, *args: str) -> subprocess.CompletedProcess:
    """The init container: the image's install-host.sh with `host` as the host's / at /host."""
    r = ctd.ctr("run", "--rm", "--privileged", "--mount", f"type=bind,src={host},dst=/host,options=rbind:rw",
                REF, _id("install"), INSTALLER, "--root", "/host", "--source", "/opt/migrt", *args,
                check=False, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture
def scratch_host(tmp_path):
    """A host root with a static busybox (sh) and /proc, nothing else: no C library, no dynamic loader, no
    python3, no criu, no /lib or /usr/lib."""
    path = tmp_path / "host"
    make_rootfs(str(path))
    assert not [p for p in path.rglob("*") if p.name.startswith(("libc.so", "ld-linux"))]
    (path / "etc" / "containerd").mkdir(parents=True)
    (path / "etc" / "containerd" / "config.toml").write_text("version = 2\n")
    subprocess.run(["mknod", "-m", "666", str(path / "dev" / "null"), "c", "1", "3"], check=True)
    subprocess.run(["mount", "-t", "proc", "proc", str(path / "proc")], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path / "proc")], check=False)


def in_root(root: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("chroot") or "/usr/sbin/chroot", str(root), *argv], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/local/bin:/bin", "LANG": "C.UTF-8"})


def tree_state(*paths: str) -> dict:
    """path -> (kind, link target or content hash, mode) for everything under paths (the system's install)."""
    out = {}
    for top in paths:
        for p in [top, *glob.glob(os.path.join(top, "**"), recursive=True)]:
            if not os.path.lexists(p) or "__pycache__" in p:
                continue
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[p] = ("link", os.readlink(p), 0)
            elif stat.S_ISREG(st.st_mode):
                out[p] = ("file", hashlib.sha256(Path(p).read_bytes()).hexdigest(), st.st_mode)
            else:
                out[p] = ("dir", "", st.st_mode)
    return out


def test_init_container_installs_a_self_contained_migrt_into_a_bare_host_root(ctd, scratch_host):
    root = scratch_host
    r = run_installer(ctd, str(root))
    assert "installed /opt/migrt" in r.stderr and "warning: no iptables-restore" in r.stderr, r.stderr
    opt = root / "opt" / "migrt"
    for d in ("python/bin", "venv/bin", "criu/sbin", "criu/lib", "bin", "libexec", "share"):
        assert (opt / d).is_dir(), d
    payload = (opt / "PAYLOAD").read_text()
    assert "criu: 4.2.1" in payload and "glibc 2.36 (its own" in payload, payload
    assert f"needs: {os.uname().machine}, Linux >= " in payload, payload
    interp = subprocess.run(["readelf", "-l", str(opt / "python/bin/python3.11")], capture_output=True, text=True)
    assert "interpreter: /opt/migrt/libc/ld-linux-x86-64.so.2]" in interp.stdout, interp.stdout
    # links, config, store, containerd's handler
    assert os.readlink(root / "usr/local/bin/migrt") == "/opt/migrt/bin/migrt"
    assert os.readlink(root / "usr/local/bin/migrt-runc") == "/opt/migrt/bin/migrt-runc"
    assert (root / "etc/migrt/config.yaml").read_text() == (opt / "share/config.yaml").read_text()
    assert stat.S_IMODE(os.stat(root / "var/lib/migrt").st_mode) == 0o700
    ctd_files = "".join(p.read_text() for p in (root / "etc/containerd").rglob("*.toml"))
    assert 'BinaryName = "/usr/local/bin/migrt-runc"' in ctd_files, ctd_files
    # the launchers name the payload's venv; the venv names the payload's interpreter (host paths)
    for name in ("migrt", "migrt-runc"):
        assert launchers.read_installed(str(opt / "bin" / name))["python"] == "/opt/migrt/venv/bin/python"
    assert "HOOK='/opt/migrt/libexec/cuda-criu-action.py'" in (opt / "libexec/cuda-criu-action").read_text()
    assert (opt / "interpreter").read_text().strip() == "/opt/migrt/python/bin/python3.11"
    assert "home = /opt/migrt/python/bin" in (opt / "venv/pyvenv.cfg").read_text()

    # it runs there: the root has busybox and nothing else (the payload's own C library)
    r = in_root(root, "/usr/local/bin/migrt", "--version")
    assert r.returncode == 0 and "migrt, version" in r.stdout, r.stderr
    r = in_root(root, "/opt/migrt/venv/bin/python", "-P", "-c",
                "import json, sys, ssl, sqlite3, ctypes, lzma, pycriu, migrt.shim.__main__, migrt.cli.main; "
                "print(json.dumps(sys.path))")
    assert r.returncode == 0, r.stderr
    assert all(p.startswith("/opt/migrt/") for p in json.loads(r.stdout) if p), r.stdout
    r = in_root(root, "/opt/migrt/criu/sbin/criu", "--version")
    assert r.returncode == 0 and "Version: 4.2.1" in r.stdout, r.stdout + r.stderr

    # the DaemonSet's pod restarts: nothing changes (bytecode the node's Python wrote since does not count)
    cache = opt / "venv/lib/python3.11/site-packages/migrt/__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "written-on-the-node.cpython-311.pyc").write_bytes(b"\0")
    before = tree_state(str(opt), str(root / "usr/local/bin"))
    r = run_installer(ctd, str(root))
    assert "/opt/migrt is up to date" in r.stderr and "linked" not in r.stderr, r.stderr
    assert tree_state(str(opt), str(root / "usr/local/bin")) == before


def _wait_ticks(path: str, n: int, timeout: float = 30) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(open(path).read()) if os.path.exists(path) else []
        if len(ticks) >= n:
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} ticks in {path}")


def _remove(ctd, cid: str) -> None:
    ctd.ctr("task", "kill", "-s", "KILL", cid, check=False)
    for _ in range(50):
        r = ctd.ctr("task", "delete", cid, check=False)
        if r.returncode == 0 or "not found" in r.stderr:
            break
        time.sleep(0.1)
    ctd.ctr("containers", "delete", cid, check=False)


def test_init_container_installs_into_a_private_prefix_on_this_host_and_that_migrt_checkpoints_and_restores(
        ctd, tmp_path):
    system = tree_state("/opt/migrt/bin", "/opt/migrt/venv/bin", "/opt/migrt/criu", "/opt/migrt/interpreter",
                        "/usr/local/bin/migrt", "/usr/local/bin/migrt-runc")
    prefix, bindir = tmp_path / "opt" / "migrt", tmp_path / "bin"
    ctd_config = tmp_path / "containerd.toml"
    ctd_config.write_text("version = 3\n")
    r = run_installer(ctd, "/", "--prefix", str(prefix), "--bindir", str(bindir),
                      "--containerd-config", str(ctd_config))
    assert f"installed {prefix} (from a payload built for /opt/migrt)" in r.stderr, r.stderr
    assert tree_state("/opt/migrt/bin", "/opt/migrt/venv/bin", "/opt/migrt/criu", "/opt/migrt/interpreter",
                      "/usr/local/bin/migrt", "/usr/local/bin/migrt-runc") == system  # the system's install untouched

    # relocated: every path names the private prefix
    shim, cli = str(bindir / "migrt-runc"), str(bindir / "migrt")
    assert os.readlink(shim) == f"{prefix}/bin/migrt-runc"
    assert launchers.read_installed(shim)["python"] == f"{prefix}/venv/bin/python"
    assert os.path.realpath(prefix / "venv/bin/python") == f"{prefix}/python/bin/python3.11"
    assert (prefix / "venv/bin/migrt").read_text().startswith(f"#!{prefix}/venv/bin/python")
    assert f"home = {prefix}/python/bin" in (prefix / "venv/pyvenv.cfg").read_text()
    dump = subprocess.run([ctd.binary("containerd"), "--config", str(ctd_config), "config", "dump"],
                          capture_output=True, text=True, timeout=60)
    assert f"BinaryName = '{shim}'" in dump.stdout or f'BinaryName = "{shim}"' in dump.stdout, dump.stdout[-3000:]

    env = {**os.environ, "MIGRT_CONFIG": ctd.migrt_config}
    env.pop("MIGRT_CRIU", None)
    doctor = subprocess.run([cli, "doctor", "--json"], capture_output=True, text=True, timeout=120, env=env)
    criu = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "criu")
    assert criu["status"] == "ok" and criu["detail"].startswith(f"{prefix}/criu/sbin/criu version 4.2.1"), criu
    assert "migrt's own build beside its venv" in criu["detail"], criu

    # a checkpoint and a restore through containerd with that migrt
    src, log = _id("psrc"), str(tmp_path / "src.log")
    ctd.ctr("run", "-d", "--runc-binary", shim, "--log-uri", f"file://{log}", ctd.image, src, "sh", "-c", COUNTER)
    try:
        _wait_ticks(log, 5)
        name = _id("pck")
        r = subprocess.run([cli, "checkpoint", src, "--name", name], capture_output=True, text=True, timeout=300,
                           env=env)
        assert r.returncode == 0 and r.stdout.strip() == name, r.stderr
        before = parse_ticks(open(log).read())
    finally:
        _remove(ctd, src)
    last = before[-1]
    dst = _id("pdst")
    proc = subprocess.Popen([ctd.binary("ctr"), "--address", ctd.sock, "--namespace", ctd.namespace, "run",
                             "--runc-binary", shim, "--env", f"MIGRT_RESTORE={name}", ctd.image, dst, "sh", "-c",
                             "echo started-fresh; exit 9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "RUNNING" not in ctd.ctr("task", "ls").stdout:
            time.sleep(0.2)
        ctd.ctr("task", "exec", "--exec-id", "stop", dst, "sh", "-c", "touch /tmp/stop")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        _remove(ctd, dst)
    assert proc.returncode == 7, (out, err)  # the restored counter's own exit, not the fresh command's
    after = parse_ticks(out)
    assert "started-fresh" not in out and after and after[0][0] > last[0], out
    assert all(t[1] == last[1] == t[2] for t in after), out  # its memory came back intact
    r = subprocess.run([cli, "inspect", name, "--verify"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr


def test_install_host_run_on_this_host_from_an_unpacked_payload(image_tar, tmp_path):
    """install-host.sh --root / straight from the payload unpacked elsewhere (no container): the copy is
    relocated and checked here, and containerd's drop-in is written by the installed migrt (the
    unpacked one cannot run away from the prefix it was built for)."""
    with tarfile.open(image_tar) as oci:
        index = json.load(oci.extractfile("index.json"))
        manifest = json.load(oci.extractfile(f"blobs/sha256/{index['manifests'][0]['digest'].split(':')[1]}"))
        layer = f"blobs/sha256/{manifest['layers'][0]['digest'].split(':')[1]}"
        oci.extract(layer, tmp_path)
    unpacked = tmp_path / "image"
    unpacked.mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / layer), "-C", str(unpacked), "./opt/migrt"], check=True, timeout=300)
    (tmp_path / layer).unlink()
    source = unpacked / "opt" / "migrt"
    prefix, bindir, ctd_config = tmp_path / "p" / "migrt", tmp_path / "bin", tmp_path / "containerd.toml"
    ctd_config.write_text("version = 3\n")
    argv = ["sh", str(source / "share" / "install-host.sh"), "--root", "/", "--source", str(source),
            "--prefix", str(prefix), "--bindir", str(bindir), "--containerd-config", str(ctd_config)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"installed {prefix}" in r.stderr, r.stderr
    assert f"{bindir}/migrt-runc" in "".join(p.read_text() for p in tmp_path.rglob("*.toml"))
    r = subprocess.run([str(bindir / "migrt"), "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "migrt, version" in r.stdout, r.stderr
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    again = time.monotonic() - t0
    assert r.returncode == 0 and f"{prefix} is up to date" in r.stderr, r.stderr
    assert again < 5, f"an install over the installed payload took {again:.1f} s"
    print(f"install-host.sh over the installed payload: {again:.2f} s")
    # relocated, python's ELF interpreter names the prefix's own loader, and it runs through it here
    interp = subprocess.run(["readelf", "-l", str(prefix / "python/bin/python3.11")], capture_output=True, text=True)
    assert f"interpreter: {prefix}/libc/ld-linux-x86-64.so.2]" in interp.stdout, interp.stdout
    r = subprocess.run([str(prefix / "venv/bin/python"), "-P", "-c", "print(open('/proc/self/maps').read())"],
                       capture_output=True, text=True, timeout=60)
    libc = {line.split()[-1] for line in r.stdout.splitlines() if "/libc.so" in line or "/ld-linux" in line}
    assert libc == {f"{prefix}/libc/libc.so.6", f"{prefix}/libc/ld-linux-x86-64.so.2"}, libc

    # a prefix the launchers could not carry is refused before anything is written
    r = subprocess.run([*argv[:-6], "--prefix", str(tmp_path / "it's"), "--no-containerd"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "only letters, digits" in r.stderr and not (tmp_path / "it's").exists(), r.stderr


def test_the_payload_checkpoints_and_restores_in_a_debian_11_root(image_tar):
    """packaging/check-old-node.sh: a fresh Debian 11 root (glibc 2.31, mmdebstrap minbase), the payload
    installed there by its own installer (a second run up to date in < 5 s), then in that root: migrt
    doctor, criu check, the payload's python (its libraries, a node library through ctypes, names, locale,
    TLS with the node's CA store, children on the node's C library) and a runc container checkpointed and
    restored by the installed migrt, its memory intact."""
    r = subprocess.run(["sh", str(REPO / "packaging" / "check-old-node.sh"), "--image", image_tar],
                       capture_output=True, text=True, timeout=900)
    print(r.stdout + r.stderr)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for line in ("criu check: Looks good", "names: localhost", "tls: https://localhost verified",
                 "children: the node's sh on the node's C library", "the count went on from",
                 "ok: the payload (its own glibc) runs in a bullseye root (glibc 2.31)"):
        assert line in r.stdout + r.stderr, line
