"""What a writer may put into the store (issue 22, items 3 and 4): decompression bombs (a sparse
member, a compressed inner tar) are refused at what they would WRITE, before it is written; writers
reserve space (migrt/store/reserve.py), so that two imports that each fit alone do not fill the disk
together, and a dead reserver holds nothing; a CRI-O-style pull is checked before its download, and
a full disk met while downloading is refused at once rather than retried as a network error.

The bombs are generated here; the small stores are tmpfs mounts made (and unmounted) by the test,
or the reservation's free-space seam (reserve.free_bytes)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import lzma
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tarfile
import threading

import pytest
from click.testing import CliRunner

import migrt.cli.import_cmd  # noqa: F401 - registers `migrt import`
from migrt import config as config_mod
from migrt.cli.main import cli
from migrt.errors import CheckpointInvalid, PreconditionFailed
from migrt.ops import space
from migrt.pods import import_cri, rootfs
from migrt.registry import image, pull
from migrt.store import Store, reserve
from tests.unit.test_import_cri import _entry, base_entries, diff_tar, write_archive

MiB = 1 << 20
GiB = 1 << 30
MARGIN = 4 * MiB  # the import's margin in these tests (64 MiB by default): small tmpfs stores will do


# -- generated bombs ----------------------------------------------------------------------------------

def sparse_pax_diff(apparent: int, data: bytes = b"x" * 4096) -> bytes:
    """rootfs-diff.tar holding one PAX (GNU.sparse 0.1) sparse member: `apparent` bytes once written,
    4 KiB of data stored."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("big")
        info.size = len(data)
        info.pax_headers = {"GNU.sparse.size": str(apparent), "GNU.sparse.map": f"{apparent - len(data)},{len(data)}",
                            "GNU.sparse.name": "big"}
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sparse_gnu_diff(tmp_path, apparent: int) -> bytes:
    """rootfs-diff.tar written by GNU tar --sparse (old GNU format, type 'S') from a sparse file."""
    src = tmp_path / "sparse-src"
    src.mkdir()
    with open(src / "big", "wb") as fh:
        fh.truncate(apparent)
        fh.seek(apparent - 4096)
        fh.write(b"x" * 4096)
    out = tmp_path / "gnu-sparse.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-C", str(src), "-cf", str(out), "big"], check=True)
    return out.read_bytes()


def xz_diff(nbytes: int) -> bytes:
    """rootfs-diff.tar that is an xz stream: a tar holding `nbytes` of zeros (a few KiB compressed)."""
    info = tarfile.TarInfo("zeros")
    info.size = nbytes
    comp = lzma.LZMACompressor(preset=0)
    out = [comp.compress(info.tobuf(tarfile.GNU_FORMAT))]
    chunk = bytes(MiB)
    for _ in range(nbytes // MiB):
        out.append(comp.compress(chunk))
    out.append(comp.compress(bytes(2 * tarfile.RECORDSIZE)))
    out.append(comp.flush())
    return b"".join(out)


def bomb_archive(path, diff: bytes) -> str:
    return write_archive(path, base_entries(diff=diff))


def big_archive(path, pages: int) -> str:
    """A valid archive whose CRIU pages image is `pages` bytes (zeros: the file is that size on disk)."""
    entries = [e for e in base_entries(diff=None) if e[0].name != "checkpoint/pages-1.img"]
    info = tarfile.TarInfo("checkpoint/pages-1.img")
    info.size = pages
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for i, d in entries:
            tar.addfile(i, io.BytesIO(d) if d is not None else None)
        tar.addfile(info, io.BytesIO(bytes(pages)))
    return str(path)


# -- a small store -----------------------------------------------------------------------------------

@pytest.fixture
def small_store(migrt_env, monkeypatch):
    """mount(size_mib): migrt_env's store on a tmpfs of that size (unmounted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    monkeypatch.setattr(import_cri, "SPACE_MARGIN", MARGIN)
    mounted = []

    def mount(size_mib: int) -> str:
        os.makedirs(migrt_env.store, mode=0o700, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(migrt_env.store)],
                       check=True)
        mounted.append(str(migrt_env.store))
        return str(migrt_env.store)

    yield mount
    for m in mounted:
        subprocess.run(["umount", m], check=True)


def used(root: str) -> int:
    st = os.statvfs(root)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def disk_usage(top: str) -> int:
    """What a tree takes on a disk file system (ext4: a directory is a 4 KiB block too); the free-space
    seam of a store smaller than the test machine's disk."""
    total = 0
    for dirpath, _dirs, files in os.walk(top):
        total += 4096
        total += sum(os.lstat(os.path.join(dirpath, f)).st_blocks * 512 for f in files)
    return total


def assert_nothing_kept(root: str) -> None:
    assert Store(root).list() == []
    for d in (".staging", ".tmp", ".incomplete"):
        assert os.listdir(os.path.join(root, d)) == [], d
    assert used(root) < MiB, used(root)


def cli_import(*args: str):
    return CliRunner().invoke(cli, ["import", *args])


# -- item 3: bombs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["pax-sparse", "gnu-sparse", "xz-inner-tar"])
def test_a_decompression_bomb_is_refused_before_it_fills_the_store(small_store, migrt_env, tmp_path, kind):
    """A 1 GiB sparse file (or 200 MiB in an xz inner tar) in a tiny archive, into a 48 MiB store: the
    import stops at the member that would pass the budget, says so, and leaves nothing behind."""
    root = small_store(48)
    diff = {"pax-sparse": lambda: sparse_pax_diff(GiB), "gnu-sparse": lambda: sparse_gnu_diff(tmp_path, GiB),
            "xz-inner-tar": lambda: xz_diff(200 * MiB)}[kind]()
    archive = bomb_archive(tmp_path / "bomb.tar", diff)
    assert os.path.getsize(archive) < MiB
    res = cli_import(archive, "--name", "bomb")
    assert res.exit_code == 8, res.output
    entry = "'zeros'" if kind == "xz-inner-tar" else "'big' (sparse)"
    assert f"refused at rootfs-diff.tar entry {entry}" in res.stderr, res.stderr
    assert ("1.0 GiB once written" if "sparse" in kind else "200 MiB once written") in res.stderr, res.stderr
    assert_nothing_kept(root)


def test_a_sparse_member_within_the_budget_is_written_out_whole(migrt_env, tmp_path):
    cfg = config_mod.load(str(migrt_env.config))
    data = os.urandom(4096)
    archive = bomb_archive(tmp_path / "small.tar", sparse_pax_diff(2 * MiB, data))
    out = import_cri.import_archive(cfg, archive, name="sparse")
    assert out["rootfs"]["bytes"] == 2 * MiB
    with tarfile.open(os.path.join(Store(cfg.store).get("sparse").path, rootfs.DIFF_TAR)) as tar:
        [member] = tar.getmembers()
        assert member.isreg() and not member.issparse() and member.size == 2 * MiB
        assert not any(k.startswith("GNU.sparse") for k in member.pax_headers)
        body = tar.extractfile(member).read()
    assert body == bytes(2 * MiB - 4096) + data


def test_many_tiny_nested_members_count_their_blocks_and_directories(migrt_env, tmp_path, monkeypatch):
    """2000 one-byte images 14 directories deep: ~2 KB of data, over 100 MiB of blocks and directories
    once written (a gzip archive of a few hundred KiB)."""
    cfg = config_mod.load(str(migrt_env.config))
    Store(cfg.store).ensure()
    monkeypatch.setattr(import_cri, "SPACE_MARGIN", MARGIN)
    monkeypatch.setattr(reserve, "free_bytes", lambda _path: MARGIN + 20 * MiB - disk_usage(cfg.store))
    deep = [_entry("checkpoint/" + "/".join(f"d{i}x{j}" for j in range(13)) + "/f.img", b"x") for i in range(2000)]
    archive = write_archive(tmp_path / "deep.tar.gz", base_entries() + deep, gz=True)
    with pytest.raises(PreconditionFailed, match=r"refused at member 'checkpoint/d\d+x0/"):
        import_cri.import_archive(cfg, archive, name="deep")
    assert Store(cfg.store).list() == [] and os.listdir(os.path.join(cfg.store, ".staging")) == []


def test_a_whiteout_bomb_is_refused(migrt_env, tmp_path, monkeypatch):
    """An xz inner tar of whiteouts with long names: the deletions list (kept in memory, then written
    as rootfs-diff.json) is capped like a deleted.files list."""
    cfg = config_mod.load(str(migrt_env.config))
    monkeypatch.setattr(import_cri, "MAX_META_BYTES", 64 << 10)
    long = "/".join(["n" * 200] * 5)
    inner = diff_tar([_entry(f"{long}/{i}/.wh.gone", b"") for i in range(400)])
    archive = bomb_archive(tmp_path / "wh.tar", lzma.compress(inner, preset=0))
    with pytest.raises(CheckpointInvalid, match=r"deletions and opaque directories list more than 65536 bytes"):
        import_cri.import_archive(cfg, archive, name="wh")
    assert Store(cfg.store).list() == []


# -- item 4: reservations -------------------------------------------------------------------------------

def test_two_concurrent_imports_cannot_fill_the_store_together(small_store, migrt_env, tmp_path, monkeypatch):
    """Each fits alone (36 MiB into 64 MiB); while the first is writing, the second is refused, naming
    the first; the first completes."""
    root = small_store(64)
    cfg = config_mod.load(str(migrt_env.config))
    first, second = big_archive(tmp_path / "first.tar", 36 * MiB), big_archive(tmp_path / "second.tar", 36 * MiB)
    real = import_cri._write_member
    reserved, go = threading.Event(), threading.Event()

    def paused(tar, member, dest, raw_fd):  # the first import, between its reservation and its write
        if threading.current_thread().name == "first" and member.name.endswith("pages-1.img"):
            reserved.set()
            assert go.wait(30)
        return real(tar, member, dest, raw_fd)

    monkeypatch.setattr(import_cri, "_write_member", paused)
    result = {}

    def run_first():
        try:
            result["first"] = import_cri.import_archive(cfg, first, name="first")
        except BaseException as exc:  # noqa: BLE001 - examined below
            result["first"] = exc

    t = threading.Thread(target=run_first, name="first")
    t.start()
    try:
        assert reserved.wait(30)
        with pytest.raises(PreconditionFailed, match=r"reserved by other writers \(importing .*first\.tar \(pid "
                                                     rf"{os.getpid()}\) 36 MiB\)") as info:
            import_cri.import_archive(cfg, second, name="second")
        assert "refused at member 'checkpoint/pages-1.img'" in str(info.value)
    finally:
        go.set()
        t.join(60)
    assert isinstance(result["first"], dict), result["first"]
    assert [c.name for c in Store(root).list()] == ["first"]
    Store(root).get("first").verify()


_HOLDER = """
import sys, time
from migrt.store import reserve
res = reserve.Reservation(sys.argv[1], "a writer killed later")
res.reserve(int(sys.argv[2]), check=False)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_dead_reserver_holds_nothing(migrt_env, tmp_path, monkeypatch):
    cfg = config_mod.load(str(migrt_env.config))
    Store(cfg.store).ensure()
    monkeypatch.setattr(reserve, "free_bytes", lambda _path: 100 * MiB)
    monkeypatch.setattr(import_cri, "SPACE_MARGIN", MARGIN)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, cfg.store, str(97 * MiB)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "ready"
        archive = write_archive(tmp_path / "a.tar", base_entries())
        with pytest.raises(PreconditionFailed, match=rf"a writer killed later \(pid {holder.pid}\) 97 MiB"):
            import_cri.import_archive(cfg, archive, name="a")
    finally:
        holder.send_signal(signal.SIGKILL)  # no release: its entry stays in the file, for a dead pid
        holder.wait()
    assert import_cri.import_archive(cfg, archive, name="a")["name"] == "a"


def test_a_checkpoint_reserves_its_estimate_beside_other_writers(tmp_path, monkeypatch):
    """ops/space.reserve (what `migrt checkpoint` holds from before the freeze to the end)."""
    root = str(tmp_path / "store")
    Store(root).ensure()
    monkeypatch.setattr(reserve, "free_bytes", lambda _path: GiB)
    other = reserve.Reservation(root, "importing x.tar")
    other.reserve(900 * MiB)
    est = space.Estimate(memory=100 * MiB)
    with pytest.raises(PreconditionFailed, match=r"checkpoint of container c: the store .* has 1024 MiB free, 900 MiB "
                                                 r"of it reserved by other writers \(importing x\.tar .*nothing was "
                                                 r"frozen"):
        space.reserve(root, est, "checkpoint of container c")
    other.release()
    mine = space.reserve(root, est, "checkpoint of container c")
    with pytest.raises(PreconditionFailed, match=r"reserved by other writers \(checkpoint of container c"):
        reserve.Reservation(root, "importing y.tar").reserve(900 * MiB)
    mine.release()
    space.reserve(root, space.Estimate(memory=1), "off", check=False).release()  # check off: recorded, never refused


# -- `migrt pull` of a CRI-O-style image ---------------------------------------------------------------

class _Registry(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    blobs: dict = {}
    manifest: bytes = b""
    gets: list = []

    def log_message(self, *a):
        pass

    def _send(self, code, body=b"", headers=None):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass

    def do_GET(self):  # noqa: N802
        if self.path == "/v2/":
            return self._send(200, b"{}")
        if self.path.startswith("/v2/team/ckpt/manifests/"):
            return self._send(200, self.manifest, {"Content-Type": image.MANIFEST_TYPE,
                                                   "Docker-Content-Digest": _digest(self.manifest)})
        for digest, body in self.blobs.items():
            if self.path == f"/v2/team/ckpt/blobs/{digest}":
                self.gets.append(digest)
                return self._send(200, body)
        return self._send(404, b'{"errors":[{"code":"NOT_FOUND","message":"nope"}]}')


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def registry(tmp_path, migrt_env):
    """serve(layer bytes) -> reference of a CRI-O-style checkpoint image holding that layer."""
    from tests.helpers.registry import make_tls

    if not shutil.which("openssl"):
        pytest.fail("the openssl CLI is needed for the fake registry's certificate")
    (tmp_path / "tls").mkdir()
    ca, cert, key = make_tls(str(tmp_path / "tls"))
    with open(migrt_env.config, "a") as fh:
        fh.write(f"registry_ca_file: {ca}\n")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()

    def serve(layer: bytes) -> str:
        config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})
        _Registry.blobs = {_digest(layer): layer, _digest(config.encode()): config.encode()}
        _Registry.gets = []
        _Registry.manifest = json.dumps({
            "schemaVersion": 2, "mediaType": image.MANIFEST_TYPE,
            "config": image.descriptor(image.OCI_CONFIG_TYPE, _digest(config.encode()), len(config)),
            "layers": [image.descriptor(image.TAR_TYPES[0], _digest(layer), len(layer))],
            "annotations": {image.CRIO_NAME: "app"},
        }).encode()
        return f"127.0.0.1:{srv.server_address[1]}/team/ckpt:v1"

    yield serve
    srv.shutdown()
    srv.server_close()


def test_pull_of_a_cri_o_image_carrying_a_bomb_is_refused(small_store, migrt_env, registry, tmp_path):
    root = small_store(48)
    with open(bomb_archive(tmp_path / "b.tar", sparse_pax_diff(GiB)), "rb") as fh:
        ref = registry(fh.read())
    cfg = config_mod.load(str(migrt_env.config))
    with pytest.raises(PreconditionFailed, match=r"refused at rootfs-diff\.tar entry 'big' \(sparse\): 1\.0 GiB"):
        pull.pull(cfg, ref, name="bomb")
    assert_nothing_kept(root)


def test_an_archive_pull_that_cannot_fit_is_refused_before_its_download(migrt_env, registry, tmp_path,
                                                                         monkeypatch):
    with open(big_archive(tmp_path / "a.tar", 2 * MiB), "rb") as fh:
        layer = fh.read()
    ref = registry(layer)
    cfg = config_mod.load(str(migrt_env.config))
    Store(cfg.store).ensure()
    monkeypatch.setattr(reserve, "free_bytes", lambda _path: 65 * MiB)  # less than the layer + 64 MiB margin
    with pytest.raises(PreconditionFailed, match=r"pulling .*team/ckpt:v1: the store .* has 65 MiB free"):
        pull.pull(cfg, ref, name="big")
    assert _Registry.gets == []  # nothing downloaded
    assert Store(cfg.store).list() == [] and os.listdir(os.path.join(cfg.store, ".tmp")) == []


def test_a_full_store_during_an_archive_pull_is_not_retried(small_store, migrt_env, registry, tmp_path,
                                                            monkeypatch):
    """The reservation's seam says there is room; the 8 MiB tmpfs fills during the download: ENOSPC
    ends the pull at once (one GET), not retried as a network error."""
    root = small_store(8)
    with open(big_archive(tmp_path / "a.tar", 12 * MiB), "rb") as fh:
        layer = fh.read()
    ref = registry(layer)
    cfg = config_mod.load(str(migrt_env.config))
    monkeypatch.setattr(reserve, "free_bytes", lambda _path: GiB)
    with pytest.raises(PreconditionFailed, match=r"pulling .*: the store .* is full \(No space left on device\)"):
        pull.pull(cfg, ref, name="full")
    assert _Registry.gets == [_digest(layer)]
    assert_nothing_kept(root)


# -- `migrt checkpoint` holds its estimate from before the freeze to the end --------------------------

def test_a_checkpoint_is_refused_before_freezing_when_other_writers_hold_the_space(tmp_path, monkeypatch):
    """On the GPU ops harness (fake lower runtime and GPU backend; the estimate is the CUDA
    processes' 8 GiB): an import holding most of a 10 GiB store refuses the checkpoint before
    anything is frozen; once it ends, the checkpoint runs and leaves no reservation behind."""
    from tests.unit import test_gpu_ops as harness
    from tests.unit.support import make_fake_runtime

    node = harness.Node(monkeypatch)
    harness.FakeLower.calls, harness.FakeLower.fail, harness.FakeLower.node = [], set(), node
    harness.FakeLower.status = "running"
    monkeypatch.setattr(harness.ops_checkpoint, "LowerRuntime", harness.FakeLower)
    cfg = harness.Config(path=str(tmp_path / "none.yaml"), runtime=str(make_fake_runtime(tmp_path / "bin").path),
                         store=str(tmp_path / "store"), log_file=str(tmp_path / "migrt.log"))
    Store(cfg.store).ensure()
    monkeypatch.setattr(reserve, "free_bytes", lambda _path: 10 * GiB)
    importing = reserve.Reservation(cfg.store, "importing big.tar")
    importing.reserve(3 * GiB)
    with pytest.raises(PreconditionFailed, match=r"checkpoint of container c1: the store .* has 10240 MiB free, "
                                                 r"3072 MiB of it reserved by other writers \(importing big\.tar .*"
                                                 r"GPU 8192 MiB.*nothing was frozen"):
        harness.take_checkpoint(cfg)
    assert harness.FakeLower.calls == []  # neither paused nor dumped
    importing.release()
    assert harness.take_checkpoint(cfg)["name"] == "ck1"
    assert reserve.Reservation._read(os.path.join(cfg.store, ".locks", reserve.DATA)) == {}
