"""store/hugetmpfs.py and the doctor's `store pages` check, against a fake /proc/self/mountinfo and
shmem_enabled; then a real receive (migration/bulk.py into `migrt receive`'s store) on a tmpfs mounted
here with huge=within_size: odd-sized files arrive byte for byte, take no more than their size, and
verify, over 1 and 4 streams (pwrite, and writes through mappings advised for huge pages)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from migrt import config
from migrt.node import doctor
from migrt.store import Store, fsutil, hugetmpfs
from tests.unit.test_transfer_bulk import KEY, _finish, _offer, _send, _serve_once

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
40 22 0:30 / /var/lib/migrt rw,relatime - tmpfs tmpfs rw,size=8g,huge=within_size,mode=700
41 22 0:31 / /srv/big\\040store rw,relatime - tmpfs tmpfs rw,size=8g,huge=always
42 41 0:32 / /srv/big\\040store rw,relatime - tmpfs tmpfs rw,size=8g
"""


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    """The mount table above; shmem_enabled `never` unless a test writes another."""
    info, shmem = tmp_path / "mountinfo", tmp_path / "shmem_enabled"
    info.write_text(MOUNTINFO)
    shmem.write_text("always within_size advise [never] deny force\n")
    monkeypatch.setattr(hugetmpfs, "MOUNTINFO", str(info))
    monkeypatch.setattr(hugetmpfs, "SHMEM_ENABLED", str(shmem))
    return shmem


def test_the_mount_holding_a_path_is_found(fake_proc, tmp_path, monkeypatch):
    # a store not made yet: its nearest existing parent's real location
    assert hugetmpfs._existing(str(tmp_path / "store" / "ckpt")) == os.path.realpath(tmp_path)
    monkeypatch.setattr(hugetmpfs, "_existing", lambda p: p)  # paths of the fake table, not of this machine
    m = hugetmpfs.mount_of("/var/lib/migrt/ckpt-1/images")
    assert (m.point, m.huge, m.huge_pages) == ("/var/lib/migrt", "within_size", True)
    assert hugetmpfs.mount_of("/var/lib/migrtx").point == "/"  # a prefix of the name is not a parent
    m = hugetmpfs.mount_of("/dev/shm/migrt")
    assert (m.point, m.tmpfs, m.huge, m.huge_pages) == ("/dev/shm", True, "never", False)
    # stacked on one point (an escaped space in it): the last mount shows
    m = hugetmpfs.mount_of("/srv/big store/x")
    assert m.point == "/srv/big store" and m.huge == "never"


def test_shmem_enabled_force_and_deny_override_every_mount(fake_proc):
    fake_proc.write_text("always within_size advise never deny [force]\n")
    assert hugetmpfs.mount_of("/dev/shm/migrt").huge_pages
    fake_proc.write_text("always within_size advise never [deny] force\n")
    assert not hugetmpfs.small_pages("/") and hugetmpfs.small_pages("/dev/shm/migrt")
    fake_proc.write_text("[always] within_size advise never deny force\n")  # the internal mount's, not /dev/shm's
    assert hugetmpfs.small_pages("/dev/shm/migrt")


def test_footprint_rounds_up_only_where_every_page_is_huge(fake_proc):
    sizes = [0, 1, (2 << 20) + 1]
    in_blocks = 0 + 4096 + (2 << 20) + 4096  # whole blocks; an empty file has none
    assert hugetmpfs.footprint("/dev/shm/x", sizes) == in_blocks
    fake_proc.write_text("always within_size advise never deny [force]\n")  # every tmpfs as huge=always
    assert hugetmpfs.footprint("/dev/shm/x", sizes) == 0 + (2 << 20) + (4 << 20)
    assert hugetmpfs.footprint("/", sizes) == in_blocks  # not a tmpfs


def test_doctor_warns_about_a_tmpfs_store_in_small_pages(fake_proc, tmp_path):
    c = doctor._store_pages_check("/dev/shm/migrt")
    assert c["status"] == "warn" and "4 KiB pages" in c["detail"] and "huge=never" in c["detail"]
    assert "mount -t tmpfs -o huge=within_size,size=<size>,mode=0700 tmpfs /dev/shm/migrt" in c["fix"]
    c = doctor._store_pages_check("/dev/shm")  # the mount itself: remount it (that mount only)
    assert c["status"] == "warn" and c["fix"].startswith("mount -o remount,huge=within_size /dev/shm")
    fake_proc.write_text("always within_size advise never [deny] force\n")
    c = doctor._store_pages_check("/dev/shm/migrt")
    assert c["status"] == "warn" and "shmem_enabled=deny" in c["detail"] and "says deny" in c["fix"]


def test_doctor_is_content_with_huge_pages_or_a_disk(fake_proc, monkeypatch):
    monkeypatch.setattr(hugetmpfs, "_existing", lambda p: p)  # paths of the fake table, not of this machine
    c = doctor._store_pages_check("/var/lib/migrt")
    assert c["status"] == "ok" and "huge=within_size" in c["detail"]
    c = doctor._store_pages_check("/srv/data/migrt")
    assert c["status"] == "ok" and "ext4" in c["detail"]
    fake_proc.write_text("always within_size advise never deny [force]\n")
    c = doctor._store_pages_check("/dev/shm/migrt")
    assert c["status"] == "ok" and "shmem_enabled=force" in c["detail"]
    (Path(hugetmpfs.MOUNTINFO)).write_text("")
    assert doctor._store_pages_check("/dev/shm/migrt")["status"] == "warn"  # unreadable: not checked


# -- a real receive into a huge=within_size tmpfs -------------------------------------------------

SIZES = {"images/pages-1.img": (65 << 20) + 3, "images/pages-2.img": (2 << 20) + 1, "images/core-1.img": 1,
         "images/empty.img": 0}


@pytest.fixture
def huge_store(tmp_path, fake_runtime, monkeypatch):
    """A receiver's config whose store lives in a tmpfs mounted here with huge=within_size (unmounted
    at the end, whichever way the test ends)."""
    point = tmp_path / "huge"
    point.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=512m,mode=0700", "migrt-test", str(point)],
                   check=True)
    try:
        key = tmp_path / "migration.key"
        key.write_text(KEY)
        key.chmod(0o600)
        cfg = tmp_path / "config.yaml"
        cfg.write_text(textwrap.dedent(f"""\
            runtime: {fake_runtime.path}
            store: {point / 'store'}
            log_file: {tmp_path / 'migrt.log'}
            migration_key_file: {key}
            """))
        monkeypatch.setenv("MIGRT_CONFIG", str(cfg))
        yield point / "store"
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("streams", [1, 4])
def test_odd_sized_files_arrive_whole_in_a_huge_page_store(huge_store, tmp_path, streams):
    from migrt.migration.wire import connect

    m = hugetmpfs.mount_of(str(huge_store))
    assert m.point == str(huge_store.parent) and m.huge == "within_size" and m.huge_pages
    blobs = {rel: os.urandom(n) for rel, n in SIZES.items()}
    for rel, data in blobs.items():
        (tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / rel).write_bytes(data)
    cfg = config.load()
    address, box = _serve_once(cfg, streams=streams)
    ch = connect(address, KEY.encode())
    ready = _offer(ch, "huge")
    files = _send(ch, ready, tmp_path, blobs, streams)
    assert files == fsutil.hash_tree(str(tmp_path / "src"), list(blobs))  # 64 MiB chunks: pages-1 has two
    ch.send({"type": "commit", "manifest": {"created": "x", "source": {"container_id": "c1"}, "files": files}})
    ch.recv("committed")
    ch.send({"type": "bye"})
    ch.close()
    result = _finish(box)
    assert result["error"] is None and result["streams"] == streams
    ckpt = Store(cfg.store).get("huge")
    ckpt.verify()
    for rel, data in blobs.items():
        path = Path(ckpt.path) / rel
        assert path.read_bytes() == data, rel
        # within_size: the tail of a file stays in small pages, so no file takes a whole extra 2 MiB
        assert path.stat().st_blocks * 512 <= -(-len(data) // 4096) * 4096, rel


# -- a real huge=always tmpfs: what a file takes is counted --------------------------------------

TINY = 100  # one-byte files: 100 x 2 MiB on huge=always


@pytest.fixture
def always_store(tmp_path, fake_runtime, monkeypatch):
    """A store on a tmpfs mounted here with huge=always, 240 MiB (unmounted at the end)."""
    point = tmp_path / "always"
    point.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=240m,mode=0700", "migrt-test", str(point)],
                   check=True)
    try:
        cfg = tmp_path / "config.yaml"
        cfg.write_text(f"runtime: {fake_runtime.path}\nstore: {point / 'store'}\nlog_file: {tmp_path / 'migrt.log'}\n")
        monkeypatch.setenv("MIGRT_CONFIG", str(cfg))
        yield point / "store"
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_an_archive_of_tiny_files_is_counted_in_huge_pages(always_store, tmp_path):
    """200 one-byte files of a 450 KB archive once took 400 MiB of a huge=always store where ~1 MiB was
    reserved, and ate its 64 MiB margin. Counted as 2 MiB each, 100 of them (200 MiB) do not fit in
    240 MiB beside the margin: refused, nothing kept, the margin intact."""
    from click.testing import CliRunner

    import migrt.cli.import_cmd  # noqa: F401 - registers `migrt import`
    from migrt.cli.main import cli
    from tests.unit.test_import_cri import _entry, base_entries, write_archive

    archive = write_archive(tmp_path / "tiny.tar", base_entries() + [_entry(f"checkpoint/tiny-{i}.img", b"x")
                                                                     for i in range(TINY)])
    assert os.path.getsize(archive) < 500_000
    Store(str(always_store)).ensure()
    before = _free(always_store)
    res = CliRunner().invoke(cli, ["import", archive, "--name", "tiny", "--json"])
    assert res.exit_code == 8, res.output
    assert "huge=always: every file takes whole 2 MiB pages" in res.output, res.output
    assert Store(str(always_store)).list() == []
    assert _free(always_store) >= before - (4 << 20)  # nothing kept (a lock and the reservation list)
    assert _free(always_store) > 64 << 20
    alloc = hugetmpfs.alloc_of(str(always_store))
    assert alloc.unit == hugetmpfs.HUGE_PAGE and alloc.file(1) == 2 << 20 and alloc.file(0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_what_fits_in_huge_pages_is_imported_and_leaves_the_margin(always_store, tmp_path):
    from click.testing import CliRunner

    import migrt.cli.import_cmd  # noqa: F401 - registers `migrt import`
    from migrt.cli.main import cli
    from tests.unit.test_import_cri import _entry, base_entries, write_archive

    archive = write_archive(tmp_path / "few.tar", base_entries() + [_entry(f"checkpoint/tiny-{i}.img", b"x")
                                                                    for i in range(20)])
    res = CliRunner().invoke(cli, ["import", archive, "--name", "few"])
    assert res.exit_code == 0, res.output
    assert [c.name for c in Store(str(always_store)).list()] == ["few"]
    assert _free(always_store) >= 64 << 20


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_pull_of_tiny_files_is_counted_in_huge_pages(always_store, tmp_path):
    """The same through a registry: the pull reserves what its files take on this store before any
    layer is fetched, and refuses with the store's rule named; nothing is left in the store."""
    from migrt.errors import StoreFull
    from migrt.registry import pull
    from tests.helpers.fake_registry import Registry, migrt_image, serve, tls_files

    ca, cert, key = tls_files(str(tmp_path / "tls"))
    registry = Registry()
    migrt_image(registry, "v1", {f"images/tiny-{i}.img": b"x" for i in range(TINY)})
    cfg = config.load()
    cfg.registry_ca_file = ca
    with serve(registry, cert, key) as host:
        Store(cfg.store).ensure()
        before = _free(always_store)
        with pytest.raises(StoreFull, match="huge=always: every file takes whole 2 MiB pages"):
            pull.pull(cfg, f"{host}/team/ckpt:v1")
    assert len(registry.blob_paths()) == 1  # the image config; no layer was fetched
    assert Store(cfg.store).list() == [] and not os.listdir(os.path.join(cfg.store, ".pulls"))
    assert _free(always_store) >= before - (4 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_checkpoints_estimate_counts_its_files_in_huge_pages(always_store):
    """CRIU writes a few dozen small image files per checkpoint, each a whole 2 MiB page here."""
    from migrt.errors import PreconditionFailed
    from migrt.ops import space

    Store(str(always_store)).ensure()
    est = space.Estimate(memory=100 << 20, processes=3)  # 126 MiB with its margins: fits in 240 MiB alone
    with pytest.raises(PreconditionFailed, match=r"\d+ MiB for its files in whole pages: tmpfs .* huge=always"):
        space.reserve(str(always_store), est, "checkpoint of container c1")
    space.reserve(str(always_store), space.Estimate(memory=10 << 20, processes=1), "checkpoint of c2").release()
