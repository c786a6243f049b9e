"""`migrt import` of podman's checkpoint archives (`podman container checkpoint --export`), with
synthetic archives shaped like podman 5's: zstd (its default), the libpod config.dump, deleted.files,
devshm-checkpoint.tar, network.status, ctr.log, artifacts/; podman's private /run/.containerenv
mount dropped from the CRIU mount image when nothing lies on it; the root directory's mode aligned
at restore. (tests/integration/test_podman.py runs the real podman.)"""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile

import pytest

from migrt.errors import CheckpointInvalid
from migrt.pods import engines, import_cri, rootfs
from migrt.store import Store
from tests.unit.test_import_cri import _entry, _nothing_left, diff_tar, invoke

pycriu = pytest.importorskip("pycriu")
if os.environ.get("CI") == "true":
    import zstandard  # a declared dependency: CI fails without it
else:  # a venv made before zstandard was a dependency: re-run packaging/setup-host.sh
    zstandard = pytest.importorskip("zstandard")

SPEC = {
    "ociVersion": "1.2.1",
    "process": {"terminal": False, "args": ["sh"], "env": ["PATH=/bin"], "cwd": "/"},
    "root": {"path": "/var/lib/containers/storage/overlay/x/merged"},
    "annotations": {"io.container.manager": "libpod", "org.opencontainers.image.stopSignal": "15"},
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev/shm", "type": "bind", "source": "/var/lib/containers/x/userdata/shm",
         "options": ["bind", "private"]},
        {"destination": "/run/.containerenv", "type": "bind", "source": "/run/containers/x/userdata/.containerenv",
         "options": ["bind", "private"]},
        {"destination": "/etc/hosts", "type": "bind", "source": "/run/containers/x/userdata/hosts",
         "options": ["bind", "private"]},
    ],
}
CONFIG_DUMP = {"id": "51389009ce95" * 5 + "abcd", "name": "web", "rootfsImageName": "docker.io/migrt/busybox:test",
               "rootfsImageID": "b8b088c9", "runtime": "runc", "createdTime": "2026-11-24T06:37:51.001484117Z"}
FOWN = {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0}


def _img(magic: str, entries: list) -> bytes:
    buf = io.BytesIO()
    pycriu.images.dump({"magic": magic, "entries": entries}, buf)
    return buf.getvalue()


def _mnt(mnt_id: int, parent: int, mountpoint: str, ext_key: str | None = None) -> dict:
    e = {"fstype": 0 if ext_key else 17, "mnt_id": mnt_id, "root_dev": 40, "parent_mnt_id": parent,
         "flags": 0, "root": "/", "mountpoint": mountpoint, "source": "overlay", "options": ""}
    if ext_key:
        e["ext_key"] = ext_key
    return e


def _reg(fid: int, name: str, mnt_id: int, mode: int) -> dict:
    return {"type": "REG", "id": fid, "reg": {"id": fid, "flags": 0, "pos": 0, "fown": FOWN, "name": name,
                                              "mnt_id": mnt_id, "mode": mode}}


MOUNTS = [_mnt(105, 61, "/"), _mnt(114, 105, "/run/.containerenv", "/run/.containerenv"),
          _mnt(112, 105, "/etc/hosts", "/etc/hosts")]
FILES = [_reg(1, "/bin/busybox", 105, 0o100755), _reg(5, "/", 105, 0o40555)]
DEVSHM = diff_tar([_entry("./", kind=tarfile.DIRTYPE), _entry("./seg", b"shared-memory")])


def podman_entries(*, files: list = FILES, devshm: bytes = DEVSHM) -> list:
    return [
        _entry("artifacts/", kind=tarfile.DIRTYPE),
        _entry("devshm-checkpoint.tar", devshm),
        _entry("config.dump", json.dumps(CONFIG_DUMP).encode()),
        _entry("spec.dump", json.dumps(SPEC).encode()),
        _entry("network.status", b"null"),
        _entry("stats-dump", b"stats"),
        _entry("ctr.log", b"2026-11-24T06:37:51Z stdout F 1\n"),
        _entry("checkpoint/", kind=tarfile.DIRTYPE),
        _entry("checkpoint/inventory.img", b"inventory"),
        _entry("checkpoint/pages-1.img", b"p" * 4096),
        _entry("checkpoint/mountpoints-13.img", _img("MNTS", MOUNTS)),
        _entry("checkpoint/files.img", _img("FILES", files)),
        _entry("rootfs-diff.tar", diff_tar([_entry("etc/marker", b"podman-change\n")])),
        _entry("deleted.files", b'[\n  "/bin/wc"\n]'),
    ]


def write_zst(path, entries) -> str:
    path.write_bytes(zstandard.ZstdCompressor().compress(diff_tar(entries)))
    return str(path)


def test_podman_zstd_archive_imports(migrt_env, tmp_path):
    archive = write_zst(tmp_path / "web.tar.zst", podman_entries())
    res = invoke(archive, "--name", "web", "--json")
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)
    assert m["imported"]["producer"] == "podman"
    assert m["imported"]["engine_mounts_dropped"] == ["/run/.containerenv"]
    assert sorted(m["imported"]["ignored"]) == ["ctr.log", "network.status"]
    assert m["source"]["container_name"] == "web" and m["source"]["image"] == CONFIG_DUMP["rootfsImageName"]
    assert m["source"]["cri"] == {}  # not a pod: no namespace binding
    assert m["rootfs"]["captured"] is True and m["rootfs"]["deleted"] == 1
    assert m["devshm"] == {"entries": 1, "bytes": len(b"shared-memory")}
    ckpt = Store(str(migrt_env.store)).get("web")
    ckpt.verify()
    assert ckpt.manifest["root_mode"] == 0o40555  # podman's root, as CRIU recorded it
    assert "/run/.containerenv" not in [x["destination"] for x in ckpt.manifest["mounts"]]
    with open(os.path.join(ckpt.images, "mountpoints-13.img"), "rb") as fh:
        assert [e["mountpoint"] for e in pycriu.images.load(fh)["entries"]] == ["/", "/etc/hosts"]
    with tarfile.open(os.path.join(ckpt.path, engines.DEVSHM_TAR)) as tar:
        assert [(x.name, tar.extractfile(x).read()) for x in tar if x.isreg()] == [("seg", b"shared-memory")]


def test_engine_mount_kept_when_a_file_lies_on_it(migrt_env, tmp_path):
    files = [*FILES, _reg(7, "/run/.containerenv", 114, 0o100644)]
    archive = write_zst(tmp_path / "held.tar.zst", podman_entries(files=files))
    res = invoke(archive, "--json")
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)
    assert m["imported"]["engine_mounts_kept"] == ["/run/.containerenv"]
    assert "engine_mounts_dropped" not in m["imported"]


@pytest.mark.parametrize("entry,msg", [
    (_entry("../escape", b"x"), "leaves /dev/shm"),
    (_entry("/abs", b"x"), "leaves /dev/shm"),
    (_entry("fifo", kind=tarfile.FIFOTYPE), "not a file, directory or symlink"),
    (_entry("hard", kind=tarfile.LNKTYPE, link="seg"), "not a file, directory or symlink"),
])
def test_bad_devshm_refused(migrt_env, tmp_path, entry, msg):
    archive = write_zst(tmp_path / "bad.tar.zst", podman_entries(devshm=diff_tar([entry])))
    res = invoke(archive)
    assert res.exit_code == 4 and msg in res.stderr, res.output
    _nothing_left(migrt_env.store)


def test_truncated_zstd_refused(migrt_env, tmp_path):
    good = zstandard.ZstdCompressor().compress(diff_tar(podman_entries()))
    (tmp_path / "cut.tar.zst").write_bytes(good[: len(good) // 2])
    res = invoke(str(tmp_path / "cut.tar.zst"))
    assert res.exit_code == 4 and "truncated" in res.stderr, res.output
    _nothing_left(migrt_env.store)


def test_producer():
    assert engines.producer(SPEC["annotations"]) == "podman"
    assert engines.producer({"io.kubernetes.cri.container-type": "container"}) == "containerd"
    assert engines.producer({"io.kubernetes.cri-o.Annotations": "{}"}) == "cri-o"
    assert engines.producer({}) == "unknown"


def test_root_mode_aligned_in_the_view_only(tmp_path):
    ckpt_img = tmp_path / "files.img"
    ckpt_img.write_bytes(_img("FILES", FILES))
    view = tmp_path / "view"
    view.mkdir()
    os.link(ckpt_img, view / "files.img")
    new_root = tmp_path / "rootfs"
    new_root.mkdir(mode=0o755)
    os.chmod(new_root, 0o755)
    assert rootfs.align_root_mode(str(view), str(new_root)) == stat.S_IFDIR | 0o755
    with open(view / "files.img", "rb") as fh:
        modes = {e["reg"]["name"]: e["reg"]["mode"] for e in pycriu.images.load(fh)["entries"]}
    assert modes == {"/bin/busybox": 0o100755, "/": 0o40755}
    with open(ckpt_img, "rb") as fh:  # the checkpoint's own file (the hard link's source) is untouched
        assert pycriu.images.load(fh)["entries"][1]["reg"]["mode"] == 0o40555
    assert rootfs.align_root_mode(str(view), str(new_root)) is None  # already aligned


@pytest.mark.skipif(os.geteuid() != 0, reason="apply_devshm chroots (root only)")
def test_devshm_restored_into_the_new_shm_source(tmp_path):
    tar = tmp_path / "devshm.tar"
    tar.write_bytes(diff_tar([_entry("seg", b"shared-memory"), _entry("dir/", kind=tarfile.DIRTYPE)]))
    shm = tmp_path / "sandbox-shm"
    shm.mkdir()
    mounts = [{"destination": "/dev/shm", "type": "bind", "source": str(shm), "options": ["rbind", "rw"]}]
    assert rootfs.apply_devshm(str(tar), mounts) == 2
    assert (shm / "seg").read_bytes() == b"shared-memory" and (shm / "dir").is_dir()
    # /dev/shm as the runtime's own tmpfs: nothing to write into (the restore refuses such a target earlier)
    assert rootfs.apply_devshm(str(tar), [{"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}]) == 0


def test_convert_devshm_skips_the_root(tmp_path):
    src = tmp_path / "src.tar"
    src.write_bytes(DEVSHM)
    assert engines.convert_devshm(str(src), str(tmp_path / "out.tar")) == {"entries": 1, "bytes": 13}
    with pytest.raises(CheckpointInvalid):
        (tmp_path / "junk.tar").write_bytes(b"not a tar" * 100)
        engines.convert_devshm(str(tmp_path / "junk.tar"), str(tmp_path / "out2.tar"))


def test_align_root_mode_trusts_a_recorded_equal_mode_without_reading_files_img(tmp_path):
    """The manifest's root_mode equal to the new root's: nothing to align, files.img not even parsed
    (garbage here would make pycriu fail), so the restore path does not import pycriu."""
    view, new_root = tmp_path / "view", tmp_path / "root"
    view.mkdir()
    new_root.mkdir(mode=0o755)
    (view / "files.img").write_bytes(b"not an image")
    mode = os.stat(new_root).st_mode
    assert rootfs.align_root_mode(str(view), str(new_root), recorded=mode) is None
    assert (view / "files.img").read_bytes() == b"not an image"


def test_default_import_name_strips_compression_suffixes():
    for archive in ("/tmp/web.tar.zst", "/tmp/web.tar.zstd", "/tmp/web.tar.gz", "/tmp/web.tgz", "/tmp/web.tar.bz2",
                    "/tmp/web.tar.xz", "/tmp/web.tar"):
        assert import_cri.default_import_name(archive) == "web", archive
