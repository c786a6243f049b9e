"""The checkpoint store under a temp dir: atomic commit (crash at every step), permissions, locks,
verification, restore views, gc."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest

from migrt.errors import CheckpointInvalid, Conflict, InvalidName, NotFound
from migrt.store import Staging, Store, journal
from migrt.store import manifest as mf
from tests.unit.support import is_private_dir

STEPS = ["hashed", "manifest-written", "synced", "renamed"]
PAYLOAD = {
    "images/pages-1.img": os.urandom(70_000),
    "images/core-1.img": b"core",
    "images/sub/dir/inventory.img": b"inv" * 10,
    "images/descriptors.json": b'["pipe:[1]","pipe:[2]","pipe:[3]"]',
    "images/empty.img": b"",
    "rootfs-diff.tar": b"tar" * 100,
}


class Crash(Exception):
    pass


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(str(tmp_path / "store"))


def fill(staging: Staging, payload: dict[str, bytes] = PAYLOAD) -> None:
    for rel, data in payload.items():
        full = os.path.join(staging.path, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as fh:
            fh.write(data)
    # CRIU leaves logs in the work directory; they are not part of the checkpoint.
    with open(os.path.join(staging.work, "dump.log"), "w") as fh:
        fh.write("log")


def make(store: Store, name: str = "ck", fields: dict | None = None) -> dict:
    with store.writer(name) as w:
        fill(w)
        return w.commit({"created": "2025-01-01T00:00:00Z", **(fields or {})})


def staging_entries(store: Store) -> list[str]:
    try:
        return os.listdir(os.path.join(store.root, ".staging"))
    except FileNotFoundError:
        return []


def assert_complete(store: Store, name: str) -> None:
    ckpt = store.get(name)
    ckpt.verify()
    assert set(ckpt.manifest["files"]) == set(PAYLOAD)
    for rel, data in PAYLOAD.items():
        with open(os.path.join(ckpt.path, rel), "rb") as fh:
            assert fh.read() == data


# -- commit and visibility ------------------------------------------------------------------------
def test_checkpoint_is_visible_only_after_commit(store):
    with store.writer("ck") as w:
        fill(w)
        assert store.list() == []
        assert not store.exists("ck")
        with pytest.raises(NotFound):
            store.get("ck")
        w.commit({"created": "now"})
        assert [c.name for c in store.list()] == ["ck"]
    assert store.exists("ck")
    assert staging_entries(store) == []
    assert_complete(store, "ck")


def test_writer_without_commit_leaves_nothing(store):
    with store.writer("ck") as w:
        fill(w)
        staging_path = w.path
    assert not os.path.exists(staging_path)
    assert store.list() == []
    assert staging_entries(store) == []


def test_exception_in_writer_discards_staging(store):
    with pytest.raises(RuntimeError):
        with store.writer("ck") as w:
            fill(w)
            raise RuntimeError("dump failed")
    assert store.list() == []
    assert staging_entries(store) == []
    make(store, "ck")  # the name is free again
    assert_complete(store, "ck")


def test_manifest_contents(store):
    data = make(store, "ck", {"source": {"container_id": "abc"}, "name": "evil", "schema": 99})
    ckpt = store.get("ck")
    assert ckpt.manifest.raw == data and ckpt.manifest.source.container_id == "abc"
    assert data["name"] == "ck" and data["schema"] == mf.SCHEMA  # fields cannot override these
    assert data["source"] == {"container_id": "abc"}
    assert data["size_bytes"] == sum(len(v) for v in PAYLOAD.values())
    assert data["files"] == {
        rel: {"size": len(v), "sha256": hashlib.sha256(v).hexdigest()} for rel, v in PAYLOAD.items()
    }
    assert "checksum_s" in data["timings"]
    assert not os.path.exists(os.path.join(ckpt.path, "work"))
    assert "manifest.json" not in data["files"]


def test_commit_reports_progress_in_bytes(store):
    seen = []
    with store.writer("ck") as w:
        fill(w)
        data = w.commit({"created": "now"}, progress=seen.append)
    assert sum(seen) == data["size_bytes"]
    assert len(seen) == len(PAYLOAD)


def test_permissions(store, tmp_path):
    old = os.umask(0o022)
    try:
        make(store, "ck")
    finally:
        os.umask(old)
    for d in (store.root, *(os.path.join(store.root, h) for h in (".staging", ".locks", ".tmp"))):
        assert is_private_dir(d), d
    ckpt = store.get("ck")
    for dirpath, dirnames, filenames in os.walk(ckpt.path):
        assert is_private_dir(dirpath), dirpath
        for f in filenames:
            full = os.path.join(dirpath, f)
            assert stat.S_IMODE(os.stat(full).st_mode) == 0o600, full
            if os.geteuid() == 0:
                assert (os.stat(full).st_uid, os.stat(full).st_gid) == (0, 0)
    assert stat.S_IMODE(os.stat(os.path.join(store.root, ".locks", "ck.lock")).st_mode) == 0o600


def test_staging_directory_is_private_while_written(store):
    with store.writer("ck") as w:
        assert is_private_dir(w.path)
        assert is_private_dir(w.images)
        assert is_private_dir(w.work)
        assert os.path.dirname(w.path) == os.path.join(store.root, ".staging")


def test_duplicate_name_is_a_conflict(store):
    make(store, "ck")
    with pytest.raises(Conflict, match="ck already exists") as info:
        with store.writer("ck"):
            pytest.fail("writer must refuse an existing name")
    assert info.value.exit_code == 6
    assert_complete(store, "ck")


def test_name_taken_during_write_is_a_conflict_at_commit(store):
    with store.writer("ck") as w:
        fill(w)
        os.makedirs(os.path.join(store.root, "ck", "other"))  # e.g. an import that bypassed the lock
        with pytest.raises(Conflict, match="already exists"):
            w.commit({"created": "now"})
    assert os.listdir(os.path.join(store.root, "ck")) == ["other"]
    assert staging_entries(store) == []


@pytest.mark.parametrize("name", ["../x", "a/b", "UP", "", ".staging"])
def test_writer_refuses_invalid_names(store, name):
    with pytest.raises(InvalidName):
        with store.writer(name):
            pass
    assert not os.path.exists(os.path.join(os.path.dirname(store.root), "x"))


def test_list_ignores_hidden_and_invalid_entries(store):
    make(store, "b")
    make(store, "a")
    os.makedirs(os.path.join(store.root, "lost+found"))
    os.makedirs(os.path.join(store.root, "UPPER"))
    with open(os.path.join(store.root, "c"), "w"):
        pass
    assert [c.name for c in store.list()] == ["a", "b"]


def test_list_of_missing_root_is_empty(tmp_path):
    assert Store(str(tmp_path / "nope")).list() == []


# -- crashes between commit steps ----------------------------------------------------------------
@pytest.mark.parametrize("step", STEPS)
def test_crash_between_commit_steps(store, monkeypatch, step):
    # The crashed process never runs discard(): make it a no-op for the crashing writer only.
    monkeypatch.setattr(Staging, "discard", lambda self: None)

    def fault(s: str) -> None:
        if s == step:
            raise Crash(s)

    with pytest.raises(Crash):
        with store.writer("ck") as w:
            fill(w)
            w.commit({"created": "now"}, fault=fault)
    monkeypatch.undo()

    if step == "renamed":
        assert [c.name for c in store.list()] == ["ck"]
        assert_complete(store, "ck")
        assert staging_entries(store) == []
        assert store.gc() == []
        assert_complete(store, "ck")
        with pytest.raises(Conflict):
            with store.writer("ck"):
                pass
        return

    assert store.list() == []
    assert not store.exists("ck")
    leftover = staging_entries(store)
    assert len(leftover) == 1 and leftover[0].startswith("ck.")
    # no journal entry names it (the writer ended its record): gc never deletes images, it keeps them
    removed = store.gc()
    assert removed == [os.path.join(".incomplete", leftover[0])]
    assert staging_entries(store) == []
    kept = store.incomplete()
    assert [k["entry"] for k in kept] == leftover and "interrupted" in kept[0]["reason"]
    with open(os.path.join(kept[0]["path"], "images", "pages-1.img"), "rb") as fh:
        assert fh.read() == PAYLOAD["images/pages-1.img"]
    assert store.list() == []  # kept, but never listed as a checkpoint
    make(store, "ck")
    assert_complete(store, "ck")


@pytest.mark.parametrize("step", STEPS)
def test_process_killed_between_commit_steps(store, step):
    """A real crash: the writer's process exits at the step (no finally, no discard); the kernel
    releases its lock."""
    store.ensure()
    pid = os.fork()
    if pid == 0:  # child
        code = 3
        try:
            def fault(s: str) -> None:
                if s == step:
                    os._exit(17)

            with store.writer("ck") as w:
                fill(w)
                w.commit({"created": "now"}, fault=fault)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 17
    # the killed writer's journal record stays, stale (its lock went with the process), naming the
    # staging directory: gc leaves that to recovery (ops/recover.py), which knows the workload
    stale = [e for e in journal.entries(store.root) if e["stale"]]
    assert len(stale) == 1 and stale[0]["op"] == "checkpoint" and stale[0]["name"] == "ck"
    if step == "renamed":
        assert_complete(store, "ck")
        assert staging_entries(store) == []
    else:
        assert store.list() == []
        assert [os.path.join(store.root, ".staging", e) for e in staging_entries(store)] == [stale[0]["staging"]]
    store.gc()
    assert [os.path.join(store.root, ".staging", e) for e in staging_entries(store)] == (
        [] if step == "renamed" else [stale[0]["staging"]])
    if step != "renamed":
        make(store, "ck")  # the name is free again: a new writer gets its own staging directory
    assert_complete(store, "ck")


def test_gc_keeps_staging_of_a_live_writer(store):
    with store.writer("my.name") as w:
        fill(w)
        assert store.gc() == []
        assert os.path.isdir(w.path)
        w.commit({"created": "now"})
    store.get("my.name").verify()


def test_gc_removes_tmp_entries_of_dead_processes_only(store):
    store.ensure()
    tmp = os.path.join(store.root, ".tmp")
    dead = os.path.join(tmp, "view.999999999.1")
    alive = os.path.join(tmp, f"view.{os.getpid()}.1")
    os.makedirs(dead)
    os.makedirs(alive)
    removed = store.gc()
    assert removed == [os.path.join(".tmp", "view.999999999.1")]
    assert not os.path.exists(dead)
    assert os.path.isdir(alive)


# -- locks -----------------------------------------------------------------------------------------
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_lock_held_by_another_process_is_a_conflict(store):
    store.ensure()
    lock = os.path.join(store.root, ".locks", "ck.lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(Conflict, match="ck is being written by another process") as info:
            with store.writer("ck"):
                pytest.fail("writer must not get the lock")
        assert info.value.exit_code == 6
        assert store._locked("ck")
        assert staging_entries(store) == []
    finally:
        holder.communicate("", timeout=10)
    assert not store._locked("ck")
    make(store, "ck")
    assert_complete(store, "ck")


def test_second_writer_in_another_thread_is_a_conflict(store):
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with store.writer("ck") as w:
                fill(w)
                inside.set()
                assert release.wait(10)
                w.commit({"created": "now"})
        except BaseException as exc:  # reported below
            errors.append(exc)
            inside.set()

    t = threading.Thread(target=first)
    t.start()
    try:
        assert inside.wait(10)
        with pytest.raises(Conflict, match="being written"):
            with store.writer("ck"):
                pass
        with pytest.raises(Conflict, match="being read or written"):
            store.remove("ck", wait=0)
    finally:
        release.set()
        t.join(10)
    assert errors == []
    assert_complete(store, "ck")


def test_different_names_do_not_conflict(store):
    with store.writer("a") as wa, store.writer("b") as wb:
        fill(wa)
        fill(wb)
        wa.commit({"created": "now"})
        wb.commit({"created": "now"})
    assert [c.name for c in store.list()] == ["a", "b"]


READER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("reading", flush=True)
sys.stdin.read()
"""


def test_readers_share_a_checkpoint(store):
    make(store, "ck")
    with store.reading("ck") as a, store.reading("ck", wait=0) as b:  # a second reader, no waiting
        assert a.path == b.path
        a.verify()
        b.verify()
        with pytest.raises(Conflict, match="being written"):  # a writer of the name is refused
            with store.lock("ck", wait=0):
                pass


def test_rm_waits_for_a_reader_then_names_it(store):
    make(store, "ck")
    lock = os.path.join(store.root, ".locks", "ck.lock")
    reader = subprocess.Popen([sys.executable, "-c", READER, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert reader.stdout.readline().strip() == "reading"
        t0 = time.monotonic()
        with pytest.raises(Conflict, match=rf"being read or written by another process \(held by pid {reader.pid} "
                                           r".*after waiting 0.3 s") as info:
            store.remove("ck", wait=0.3)
        assert time.monotonic() - t0 >= 0.3 and info.value.exit_code == 6
        assert_complete(store, "ck")  # nothing deleted under the reader
    finally:
        reader.stdin.close()
        reader.wait(10)
    store.remove("ck", wait=0)
    assert store.list() == []


def test_rm_waiting_for_a_reader_goes_ahead_when_it_ends(store):
    make(store, "ck")
    done = threading.Event()

    def read_briefly() -> None:
        with store.reading("ck"):
            done.set()
            time.sleep(0.3)

    t = threading.Thread(target=read_briefly)
    t.start()
    assert done.wait(5)
    store.remove("ck", wait=5)  # flock is per open file: the thread's shared lock blocks us
    t.join(5)
    assert store.list() == []


@pytest.mark.parametrize("target", ["dir", "images", "file"])
def test_unsafe_modes_are_refused_naming_the_path(store, target):
    make(store, "ck")
    ckpt = store.get("ck")
    path = {"dir": ckpt.path, "images": ckpt.images, "file": os.path.join(ckpt.images, "core-1.img")}[target]
    os.chmod(path, 0o777 if target != "file" else 0o666)
    with pytest.raises(CheckpointInvalid, match=rf"{path} is writable by group or others \(mode (777|666)\)") as info:
        with store.reading("ck"):
            pass
    assert info.value.exit_code == 4
    os.chmod(path, 0o700 if target != "file" else 0o600)
    with store.reading("ck") as c:
        c.verify()


def test_foreign_owner_is_refused(store):
    make(store, "ck")
    victim = os.path.join(store.get("ck").images, "core-1.img")
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(victim, 12345, 12345)
    with pytest.raises(CheckpointInvalid, match=rf"{victim} is owned by uid 12345"):
        with store.reading("ck"):
            pass


# -- remove ----------------------------------------------------------------------------------------
def test_remove(store):
    make(store, "ck")
    make(store, "keep")
    store.remove("ck")
    assert [c.name for c in store.list()] == ["keep"]
    with pytest.raises(NotFound):
        store.get("ck")
    assert os.listdir(os.path.join(store.root, ".tmp")) == []
    make(store, "ck")
    assert_complete(store, "ck")


def test_lock_files_do_not_pile_up(store):
    for i in range(5):
        make(store, f"ck{i}")
        with store.reading(f"ck{i}"):
            pass
        store.remove(f"ck{i}")
    assert os.listdir(os.path.join(store.root, ".locks")) == []


def test_container_lock_excludes_and_leaves_no_file(store):
    with store.container_lock("/run/r", "c1"):
        with pytest.raises(Conflict, match=rf"container c1 is being checkpointed by another process \(pid {os.getpid()} "):
            with store.container_lock("/run/r", "c1"):
                pass
        with store.container_lock("/run/r", "c2"):  # another container: no conflict
            pass
    with store.container_lock("/run/r", "c1"):
        pass
    assert os.listdir(os.path.join(store.root, ".locks")) == []


def test_lock_file_replaced_under_a_waiter_is_taken_anew(store):
    """A reader that opened the lock file just before `rm` unlinked it must not lock the dead inode
    while a new writer locks the new file."""
    make(store, "ck")
    opened = threading.Event()
    go = threading.Event()
    got = []
    real_open = os.open

    def slow_open(path, *a, **k):
        fd = real_open(path, *a, **k)
        if str(path).endswith("ck.lock") and threading.current_thread().name == "reader" and not opened.is_set():
            opened.set()
            go.wait(5)
        return fd

    def reader():
        try:
            with store.reading("ck", wait=0):
                got.append("read")
        except Exception as exc:  # noqa: BLE001 - reported below
            got.append(type(exc).__name__)

    import unittest.mock as um

    with um.patch("migrt.store.store.os.open", side_effect=slow_open):
        t = threading.Thread(target=reader, name="reader")
        t.start()
        assert opened.wait(5)
        store.remove("ck", wait=0)  # unlinks the lock file the reader holds open
        make(store, "ck")  # the name again, and a remover holding its new lock file
        with store.lock("ck", "removed"):
            go.set()
            t.join(5)
    assert got == ["Conflict"]  # it retried on the new lock file, so it never read under the remover


def test_remove_missing_is_not_found(store):
    with pytest.raises(NotFound, match="migrt ls") as info:
        store.remove("ck")
    assert info.value.exit_code == 3


# -- verification ----------------------------------------------------------------------------------
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("rel", ["images/pages-1.img", "images/sub/dir/inventory.img", "rootfs-diff.tar"])
def test_one_flipped_byte_is_detected(store, rel):
    make(store, "ck")
    ckpt = store.get("ck")
    _flip(os.path.join(ckpt.path, rel), len(PAYLOAD[rel]) // 2)
    with pytest.raises(CheckpointInvalid) as info:
        store.get("ck").verify()
    assert f"sha256 mismatch in {rel}" in str(info.value)
    assert "migrt inspect --verify ck" in str(info.value)
    assert info.value.exit_code == 4


def test_resized_file_is_detected(store):
    make(store, "ck")
    with open(os.path.join(store.root, "ck", "images", "core-1.img"), "ab") as fh:
        fh.write(b"x")
    with pytest.raises(CheckpointInvalid, match=r"size mismatch in images/core-1.img \(5 bytes, manifest says 4\)"):
        store.get("ck").verify()


def test_extra_file_is_detected(store):
    make(store, "ck")
    with open(os.path.join(store.root, "ck", "images", "extra.img"), "wb") as fh:
        fh.write(b"x")
    with pytest.raises(CheckpointInvalid, match="unexpected file images/extra.img"):
        store.get("ck").verify()


def test_missing_file_is_detected(store):
    make(store, "ck")
    os.unlink(os.path.join(store.root, "ck", "images", "empty.img"))
    with pytest.raises(CheckpointInvalid, match="file images/empty.img is missing"):
        store.get("ck").verify()


def test_symlink_in_checkpoint_is_refused(store):
    make(store, "ck")
    os.symlink("/etc/passwd", os.path.join(store.root, "ck", "images", "link.img"))
    with pytest.raises(CheckpointInvalid, match="not a regular file"):
        store.get("ck").verify()


def _rewrite_manifest(store: Store, ckpt_name: str, changes: dict) -> None:
    path = os.path.join(store.root, ckpt_name, "manifest.json")
    with open(path) as fh:
        data = json.load(fh)
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    with open(path, "w") as fh:
        json.dump(data, fh)


def test_future_schema_is_refused(store):
    make(store, "ck")
    _rewrite_manifest(store, "ck", {"schema": mf.SCHEMA + 1})
    with pytest.raises(CheckpointInvalid, match="newer than this migrt understands.*upgrade migrt"):
        store.get("ck").manifest


@pytest.mark.parametrize("schema", [0, -1, "1", 1.0, True])
def test_invalid_schema_is_refused(store, schema):
    make(store, "ck")
    _rewrite_manifest(store, "ck", {"schema": schema})
    with pytest.raises(CheckpointInvalid, match="schema"):
        store.get("ck").manifest


def test_renamed_checkpoint_is_refused(store):
    make(store, "ck")
    os.rename(os.path.join(store.root, "ck"), os.path.join(store.root, "other"))
    assert [c.name for c in store.list()] == ["other"]
    with pytest.raises(CheckpointInvalid, match="manifest names 'ck'; it was renamed"):
        store.get("other").verify()


@pytest.mark.parametrize("field", ["schema", "name", "created", "files"])
def test_missing_required_field_is_refused(store, field):
    make(store, "ck")
    _rewrite_manifest(store, "ck", {field: None})
    with pytest.raises(CheckpointInvalid, match=rf"lacks required field\(s\) {field}$"):  # only what is missing
        store.get("ck").manifest


def test_future_schema_is_named_before_missing_fields(store):
    make(store, "ck")  # a newer migrt's manifest may have other fields: "upgrade migrt" is the useful message
    _rewrite_manifest(store, "ck", {"schema": mf.SCHEMA + 1, "files": None, "created": None})
    with pytest.raises(CheckpointInvalid, match="newer than this migrt understands"):
        store.get("ck").manifest


def test_a_manifest_that_is_not_an_object(store):
    make(store, "ck")
    with open(os.path.join(store.root, "ck", "manifest.json"), "w") as fh:
        fh.write("[1, 2]")
    with pytest.raises(CheckpointInvalid, match="not a JSON object"):
        store.get("ck").manifest


def test_missing_or_broken_manifest(store):
    make(store, "ck")
    path = os.path.join(store.root, "ck", "manifest.json")
    with open(path, "w") as fh:
        fh.write("{not json")
    with pytest.raises(CheckpointInvalid, match="unreadable"):
        store.get("ck").manifest
    os.unlink(path)
    with pytest.raises(CheckpointInvalid, match="manifest.json is missing"):
        store.get("ck").manifest


def test_files_not_an_object_is_refused(store):
    make(store, "ck")
    _rewrite_manifest(store, "ck", {"files": ["images/core-1.img"]})
    with pytest.raises(CheckpointInvalid, match="'files' is not an object"):
        store.get("ck").manifest


def test_check_images_dir(store):
    make(store, "ck")
    ckpt = store.get("ck")
    store.check_images_dir(ckpt)
    os.rename(ckpt.images, ckpt.images + ".gone")
    with pytest.raises(CheckpointInvalid, match="images/ directory is missing"):
        store.check_images_dir(ckpt)


# -- restore view ----------------------------------------------------------------------------------
def test_restore_view_hard_links_images_and_leaves_checkpoint_untouched(store):
    make(store, "ck")
    ckpt = store.get("ck")
    images = {rel: data for rel, data in PAYLOAD.items() if rel.startswith("images/")}
    with store.restore_view(ckpt) as view:
        assert os.path.dirname(view) == os.path.join(store.root, ".tmp")
        assert is_private_dir(view)
        seen = {os.path.relpath(os.path.join(d, f), view) for d, _, fs in os.walk(view) for f in fs}
        assert seen == {os.path.relpath(rel, "images") for rel in images}
        for rel in images:
            src = os.stat(os.path.join(ckpt.path, rel))
            dst = os.stat(os.path.join(view, os.path.relpath(rel, "images")))
            assert (src.st_ino, src.st_dev) == (dst.st_ino, dst.st_dev), rel
        # CRIU writes stats-restore (and restore.log) into the image directory.
        with open(os.path.join(view, "stats-restore"), "wb") as fh:
            fh.write(b"stats")
        os.makedirs(os.path.join(view, "sub", "new"))
        # Removing a link in the view does not remove the checkpoint's file.
        os.unlink(os.path.join(view, "core-1.img"))
    assert not os.path.exists(view)
    assert not os.path.exists(os.path.join(ckpt.images, "stats-restore"))
    assert not os.path.exists(os.path.join(ckpt.images, "sub", "new"))
    store.get("ck").verify()
    assert_complete(store, "ck")
    assert os.listdir(os.path.join(store.root, ".tmp")) == []


def test_restore_view_is_removed_after_an_error(store):
    make(store, "ck")
    with pytest.raises(Crash):
        with store.restore_view(store.get("ck")) as view:
            raise Crash("restore failed")
    assert not os.path.exists(view)
    store.get("ck").verify()


def test_atomic_file_all_or_nothing(tmp_path):
    from migrt.store.fsutil import atomic_file

    path = tmp_path / "f.conf"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(str(path), 0o644, text=True) as fh:
            fh.write("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.conf"]   # untouched, no temporary left
    with atomic_file(str(path), 0o640) as fh:
        fh.write(b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.conf"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_lock_is_free_probes_without_taking_the_lock(tmp_path):
    import fcntl

    from migrt.store.fsutil import lock_is_free

    path = str(tmp_path / "x.lock")
    assert lock_is_free(path)                       # no file: nobody holds it
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    assert lock_is_free(path)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        # flock locks belong to the open file description: a probe from this process opens its own
        assert not lock_is_free(path)
    finally:
        os.close(fd)
    assert lock_is_free(path)


def test_list_of_a_store_that_is_not_a_directory_is_a_store_error(tmp_path):
    from migrt.store.store import StoreError

    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(StoreError, match=r"store .*/file cannot be read: Not a directory"):
        Store(str(not_dir)).list()
    assert Store(str(tmp_path / "absent")).list() == []  # absent: empty, as before


def test_payload_bytes_is_what_commit_hashes(store):
    progressed = []
    with store.writer("pb") as w:
        for rel, n in (("images/pages-1.img", 5000), ("logs/dump.log", 300), ("rootfs-diff.tar", 1024),
                       ("work/scratch", 777)):
            os.makedirs(os.path.dirname(os.path.join(w.path, rel)), exist_ok=True)
            with open(os.path.join(w.path, rel), "wb") as fh:
                fh.write(b"x" * n)
        total = w.payload_bytes()
        data = w.commit({"created": "2026-11-24T08:00:00Z"}, progress=progressed.append)
    assert total == 5000 + 300 + 1024 == data["size_bytes"] == sum(progressed)   # work/ is not part of it
