"""`migrate()` end to end against an in-process receiver, with a fake runc that simulates state, pause,
checkpoint, resume, delete and restore: what happens to the source container on each failure."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from migrt import config, names
from migrt.criu import lazy as lazy_mod
from migrt.errors import MigrtError
from migrt.migration.migrate import MigrateRequest, MigrationFailed, migrate, staging_name
from migrt.migration.receive import ReceiveOptions, Receiver
from migrt.migration.wire import accept, load_key
from migrt.store import Store
from tests.unit.support import make_executable, write_bundle

FAKE_RUNC = """\
#!{python} -S
# A fake runc: records each call, simulates what migrate/receive need. FAKE_FAIL names one subcommand
# that fails (exit 1, a runc-style error on stderr).
import json, os, sys
args = sys.argv[1:]
root = args[args.index("--root") + 1] if "--root" in args else "/run/runc"
i = 0
while i < len(args) and args[i].startswith("-"):
    i += 1 if args[i] in ("--debug",) else 2
cmd, rest = args[i], args[i + 1:]
with open({record!r}, "a") as fh:
    fh.write(json.dumps([cmd] + rest) + "\\n")
if os.environ.get("FAKE_FAIL") == cmd:
    sys.stderr.write("time=now level=error msg=\\"fake %s failure\\"\\n" % cmd)
    sys.exit(1)
def opt(name):
    return rest[rest.index(name) + 1] if name in rest else None
if cmd == "state":
    print(json.dumps({{"id": rest[-1], "status": "running", "pid": 4242, "bundle": os.environ["FAKE_BUNDLE"]}}))
elif cmd == "checkpoint":
    images = opt("--image-path")
    for name, size in (("inventory.img", 40), ("pstree.img", 60), ("pages-1.img", 3 << 20)):
        with open(os.path.join(images, name), "wb") as fh:
            fh.write(os.urandom(size))
    with open(os.path.join(opt("--work-path"), "dump.log"), "w") as fh:
        fh.write("(00.1) Dumping finished successfully\\n")
elif cmd == "restore":
    os.makedirs(os.path.join(root, rest[-1]), exist_ok=True)
    with open(opt("--pid-file"), "w") as fh:
        fh.write("5151")
"""


@pytest.fixture
def lab(tmp_path, monkeypatch):
    record = tmp_path / "calls.jsonl"
    runc = make_executable(tmp_path / "bin" / "runc", FAKE_RUNC.format(python=sys.executable, record=str(record)))
    key = tmp_path / "key"
    key.write_text("unit-test-shared-secret-0123456789")
    key.chmod(0o600)
    bundle = write_bundle(tmp_path / "bundle")
    (bundle / "rootfs").mkdir()
    cfgs = {}
    for node in ("a", "b"):
        cfg = tmp_path / f"{node}.yaml"
        cfg.write_text(textwrap.dedent(f"""\
            runtime: {runc}
            store: {tmp_path / node / 'store'}
            log_file: {tmp_path / node / 'migrt.log'}
            migration_key_file: {key}
            """))
        cfgs[node] = config.load(str(cfg))
    (tmp_path / "root-a").mkdir()
    (tmp_path / "root-b").mkdir()
    monkeypatch.setenv("FAKE_BUNDLE", str(bundle))
    monkeypatch.delenv("FAKE_FAIL", raising=False)

    class Lab:
        a, b = cfgs["a"], cfgs["b"]
        root_a, root_b = str(tmp_path / "root-a"), str(tmp_path / "root-b")

        @staticmethod
        def calls() -> list[list[str]]:
            return [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []

        @staticmethod
        def subcommands() -> list[str]:
            return [c[0] for c in Lab.calls()]

    Lab.bundle = str(bundle)
    return Lab


def _receiver(cfg, **opts) -> tuple[str, threading.Thread, list]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    reports: list[dict] = []
    recv = Receiver(cfg, ReceiveOptions(listen=address, once=True, **opts), reports.append)
    server = recv.bind()

    def run() -> None:
        try:
            recv.serve(server)
        finally:
            server.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return address, t, reports


def test_stop_and_copy_success_destroys_the_frozen_source(lab):
    address, t, reports = _receiver(lab.b)
    res = migrate(lab.a, MigrateRequest(container_id="c1", to=address, root=lab.root_a, name="moved", pre_dump="0"))
    t.join(10)
    assert lab.subcommands() == ["state", "pause", "checkpoint", "state", "delete"]
    checkpoint = lab.calls()[2]
    assert "--leave-running" in checkpoint  # frozen by pause, resumable until the target holds the state
    assert res["restored"] is False and res["downtime_s"] is None and res["frozen_s"] > 0
    assert res["bytes"] == 40 + 60 + (3 << 20) + len("(00.1) Dumping finished successfully\n")
    ckpt = Store(lab.b.store).get("moved")
    ckpt.verify()
    assert sorted(ckpt.manifest["files"]) == ["images/inventory.img", "images/pages-1.img", "images/pstree.img",
                                              "logs/dump.log"]
    assert os.listdir(Path(lab.a.store) / ".staging") == []  # the source keeps no copy
    assert reports[0]["committed"] is True


def test_restore_on_target_then_source_destroyed(lab):
    address, t, reports = _receiver(lab.b, restore_bundle=lab.bundle, root=lab.root_b, container_id="c1-b")
    res = migrate(lab.a, MigrateRequest(container_id="c1", to=address, root=lab.root_a, name="up", pre_dump="0"))
    t.join(10)
    subs = lab.subcommands()
    assert subs == ["state", "pause", "checkpoint", "restore", "state", "delete"]  # target runs before the source goes
    assert res["restored"] is True and res["target"] == {"container_id": "c1-b", "pid": 5151}
    assert 0 < res["downtime_s"] <= res["total_s"]
    assert os.path.isfile(os.path.join(lab.root_b, "c1-b", "migrt-restored"))


def test_target_sharing_the_sources_store_receives_the_offered_name(lab):
    """A pod pulling from its own node's agent: sender and receiver write one store. The source's
    staging goes under a name of its own, so the receiver's import of the offered name (locked for
    the whole transfer) is not refused as 'being written by another process'."""
    shared = dataclasses.replace(lab.b, store=lab.a.store)
    address, t, reports = _receiver(shared, restore_bundle=lab.bundle, root=lab.root_b, container_id="c1-b")
    res = migrate(lab.a, MigrateRequest(container_id="c1", to=address, root=lab.root_a, name="web-0", pre_dump="0"))
    t.join(10)
    assert not reports[0].get("error") and res["restored"] is True and res["name"] == "web-0"
    assert lab.subcommands() == ["state", "pause", "checkpoint", "restore", "state", "delete"]
    store = Store(lab.a.store)
    assert [c.name for c in store.list()] == ["web-0"]  # the target's one copy; the source keeps none
    store.get("web-0").verify()
    assert os.listdir(Path(lab.a.store) / ".staging") == []


def test_staging_name_is_never_the_offered_name():
    longest = "a" * 109 + ".b" + "c" * 17  # 128 characters, cut right after a '.'
    for name in ("web-0", longest, longest[:-1] + "d"):
        assert staging_name(name) != name and names.validate(staging_name(name)) == staging_name(name)
    assert staging_name(longest) != staging_name(longest[:-1] + "d")  # one prefix, two names


def test_failed_restore_on_target_resumes_the_source(lab, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "restore")
    address, t, _ = _receiver(lab.b, restore_bundle=lab.bundle, root=lab.root_b, container_id="c1-b")
    with pytest.raises(MigrationFailed) as info:
        migrate(lab.a, MigrateRequest(container_id="c1", to=address, root=lab.root_a, name="kept", pre_dump="0"))
    t.join(10)
    msg = str(info.value)
    assert "committed in the target's store" in msg and "was resumed on this node" in msg
    assert "target kept nothing" not in msg
    assert info.value.exit_code == 5  # the target's RuntimeFailed, carried across
    # the target removes whatever its failed restore left ("delete") before the source resumes
    assert lab.subcommands() == ["state", "pause", "checkpoint", "restore", "delete", "resume"]
    assert Store(lab.b.store).exists("kept")


def test_failed_dump_resumes_and_target_keeps_nothing(lab, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "checkpoint")
    address, t, reports = _receiver(lab.b)
    with pytest.raises(MigrationFailed, match="was resumed on this node; the target kept nothing") as info:
        migrate(lab.a, MigrateRequest(container_id="c1", to=address, root=lab.root_a, name="never", pre_dump="0"))
    t.join(10)
    assert info.value.exit_code == 5
    assert lab.subcommands() == ["state", "pause", "checkpoint", "resume"]
    assert Store(lab.b.store).list() == [] and os.listdir(Path(lab.b.store) / ".staging") == []
    assert "source aborted" in reports[0]["error"]


def test_receiver_vanishing_midway_resumes_the_source(lab):
    """A receiver that accepts the offer, then drops the connection as the first file arrives."""
    key = load_key(lab.a.migration_key_file)
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"

    def vanish() -> None:
        conn, _ = server.accept()
        ch = accept(conn, key)
        ch.recv("offer")
        ch.send({"type": "ready", "restore": False, "container_id": "c1"})
        ch.recv("file")
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()

    t = threading.Thread(target=vanish, daemon=True)
    t.start()
    with pytest.raises(MigrationFailed, match="was resumed on this node") as info:
        migrate(lab.a, MigrateRequest(container_id="c1", to=address, root=lab.root_a, name="cut", pre_dump="0"))
    t.join(10)
    server.close()
    assert info.value.exit_code == 9
    assert lab.subcommands() == ["state", "pause", "checkpoint", "resume"]
    assert os.listdir(Path(lab.a.store) / ".staging") == []


def test_refusal_before_anything_is_touched(lab, monkeypatch):
    """The receiver refuses the offer (lazy without --restore): the container is never paused."""
    monkeypatch.setattr(lazy_mod, "lazy_preflight", lambda role: None)  # this node's own check passes
    address, t, _ = _receiver(lab.b)
    with pytest.raises(MigrtError, match="needs a target that restores at once"):
        migrate(lab.a, MigrateRequest(container_id="c1", to=address, root=lab.root_a, pre_dump="0", lazy=True))
    t.join(10)
    assert lab.subcommands() == ["state"]
