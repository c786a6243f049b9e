"""Live migration between two "hosts" on one machine: network namespaces joined by a veth pair
(198.51.100.1 <-> 198.51.100.2), each host with its own config, key, store and runc root. The receiver
runs in host B's network namespace, `migrt migrate` in host A's; the source container is a busybox
counter holding random data in memory (its hash is printed with every tick).

Processes enter the namespaces with `nsenter --net` (tests/helpers/twohosts.py says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.migration import (Receiver, assert_continues, env_of, hosts, lazy_capable, migrate, nodes,  # noqa: F401
                                     staged_bytes, staging_entries, start_source, target_cli, visible, wait_ticks)
from tests.helpers.twohosts import ADDR_A, ADDR_B, in_ns
from tests.integration.conftest import CLI

pytestmark = pytest.mark.integration


def _copy_continues(nodes, hosts, port: int, tag: str, *, send_streams: int, recv_streams: int,
                    tmp_path=None, a_config: str = "", b_config: str = "") -> tuple[dict, dict, str]:
    """A stop-and-copy migration of a fresh counter from A into B's restore bundle (a_config / b_config:
    lines added to that node's config); asserts it succeeded, the source is gone and the copy counts on
    where it stopped. Returns (migrate's JSON, the receiver's record, the source's container id)."""
    def with_lines(side: str, lines: str) -> dict:
        if not lines:
            return nodes[side]
        cfg = tmp_path / f"{side}-{tag}.yaml"
        cfg.write_text(open(nodes[side]["config"]).read() + lines)
        return {**nodes[side], "config": str(cfg)}

    anodes = {**nodes, "a": with_lines("a", a_config)}
    bnodes = {**nodes, "b": with_lines("b", b_config)}
    src, cid = start_source(nodes, tag)
    out = nodes["base"] / f"{cid}.out"
    recv = Receiver(bnodes, hosts, port, "--restore", nodes["b"]["bundle"], "--root", nodes["b"]["root"],
                    "--container-id", f"{cid}-b", "--output", str(out), "--streams", str(recv_streams))
    try:
        res = migrate(anodes, hosts, port, cid, "--name", f"{cid}-ck", "--streams", str(send_streams))
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        assert recv.wait() == 0
    finally:
        recv.stop()
    before = src.read_for(0.5)
    src.close()
    assert src.status() is None  # the source is gone once the target runs
    assert_continues(before, wait_ticks(out))
    return data, recv.results()[0], cid


def test_stop_and_copy_continues_on_target(nodes, hosts):
    # the images over 3 connections at once (migration/bulk.py), the receiver taking up to 4
    data, rec, cid = _copy_continues(nodes, hosts, 7901, "sc", send_streams=3, recv_streams=4)
    assert data["mode"] == "stop-and-copy" and data["restored"] is True
    assert data["target"]["container_id"] == f"{cid}-b"
    assert set(data["phases"]) >= {"connect_s", "dump_s", "transfer_s", "commit_s", "restore_s"}
    assert data["bytes"] > 100_000 and data["files"] > 5 and data["streams"] == 3
    assert 0 < data["downtime_s"] <= data["total_s"]
    assert data["pre_dump"]["requested"] == "auto"
    if not data["pre_dump"]["available"]:  # kernels without soft-dirty: skipped, and said so
        assert "soft-dirty" in data["pre_dump"]["note"].lower() or "dirty" in data["pre_dump"]["note"]
    # the checkpoint stays in the target's store, verified and attributed
    ins = json.loads(target_cli(nodes, "inspect", f"{cid}-ck", "--verify", "--json").stdout)
    assert ins["verified"] is True
    assert ins["manifest"]["migration"]["from"].startswith(ADDR_A + ":")
    assert staging_entries(nodes) == []
    assert rec["restored"] and rec["committed"] and rec["bytes"] == data["bytes"] and rec["streams"] == 3


def test_stop_and_copy_with_the_parallel_dump(nodes, hosts, tmp_path):
    """dump_pages: parallel on the source: migrt writes the frozen container's memory with its own threads,
    which hash each 64 MiB chunk as they write it; the transfer sends those digests (the pages are not
    read again to hash them) and the receiver checks every chunk against them as it arrives: a wrong
    digest would fail the migration. The container continues on the target, the checkpoint verifies."""
    data, _, cid = _copy_continues(nodes, hosts, 7913, "pdump", send_streams=2, recv_streams=2, tmp_path=tmp_path,
                                   a_config="dump_pages: parallel\ndump_threads: 2\n")
    assert data["streams"] == 2 and data["phases"]["pages_s"] >= 0 and data["phases"]["lazy_dump_s"] > 0
    ins = json.loads(target_cli(nodes, "inspect", f"{cid}-ck", "--verify", "--json").stdout)
    assert ins["verified"] is True and ins["manifest"]["dump_pages"]["mode"] == "parallel", ins["manifest"]["dump_pages"]
    subprocess.run(["runc", "--root", nodes["b"]["root"], "delete", "--force", f"{cid}-b"], capture_output=True)


def test_stop_and_copy_target_restores_through_the_page_filler(nodes, hosts, tmp_path):
    """The target restores a received checkpoint as any local one: through the page filler from its
    store when restore_pages asks for it (the default `auto` does from fill_min_mib on), so the copy
    runs before all of its memory is copied in (a 16 GiB GPU container spent 12 s in CRIU's eager
    restore here before); the checkpoint stays in the target's store whatever the filler does."""
    _, rec, cid = _copy_continues(nodes, hosts, 7914, "scfill", send_streams=2, recv_streams=2, tmp_path=tmp_path,
                                  b_config="restore_pages: lazy\nfill_min_mib: 1\n")
    assert rec["restored"] and rec["restore_pages"]["mode"] == "lazy", rec.get("restore_pages")
    ins = json.loads(target_cli(nodes, "inspect", f"{cid}-ck", "--verify", "--json").stdout)
    assert ins["verified"] is True
    subprocess.run(["runc", "--root", nodes["b"]["root"], "delete", "--force", f"{cid}-b"], capture_output=True)


def test_received_checkpoint_restores_later(nodes, hosts):
    """Without --restore the receiver only stores; `migrt restore` brings it up later on host B."""
    src, cid = start_source(nodes, "later")
    recv = Receiver(nodes, hosts, 7902)
    try:
        res = migrate(nodes, hosts, 7902, cid, "--name", f"{cid}-ck", "--pre-dump", "0")
        assert res.returncode == 0, res.stderr
        assert recv.wait() == 0
    finally:
        recv.stop()
    data = json.loads(res.stdout)
    assert data["restored"] is False and data["downtime_s"] is None and data["frozen_s"] > 0
    assert data["pre_dump"]["note"] == "off"
    before = src.read_for(0.5)
    src.close()
    assert src.status() is None
    assert f"{cid}-ck" in visible(nodes)
    out = nodes["base"] / f"{cid}.out"
    res = target_cli(nodes, "restore", f"{cid}-ck", f"{cid}-b", "--bundle", nodes["b"]["bundle"],
                     "--root", nodes["b"]["root"], "--output", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert_continues(before, wait_ticks(out))


def lazy_migration(cfg_nodes, nodes, hosts, port: int, tag: str) -> dict:
    """A counter migrated lazily with cfg_nodes' configs: it must continue on the target, the source
    gone. Returns migrate's JSON."""
    src, cid = start_source(nodes, tag)
    out = nodes["base"] / f"{cid}.out"
    recv = Receiver(cfg_nodes, hosts, port, "--restore", nodes["b"]["bundle"], "--root", nodes["b"]["root"],
                    "--container-id", f"{cid}-b", "--output", str(out))
    try:
        res = migrate(cfg_nodes, hosts, port, cid, "--lazy")
        assert res.returncode == 0, res.stderr
        assert recv.wait() == 0
    finally:
        recv.stop()
    before = src.read_for(0.5)
    src.close()
    assert src.status() is None
    assert_continues(before, wait_ticks(out))
    return json.loads(res.stdout)


def test_lazy_migration_continues_on_target(nodes, hosts, lazy_capable):
    data = lazy_migration(nodes, nodes, hosts, 7903, "lazy")
    assert data["mode"] == "lazy" and data["restored"] is True
    assert 0 < data["downtime_s"] < data["total_s"]
    assert data["phases"]["pages_s"] >= 0 and data["lazy_pages_s"] is not None
    # the pages came from migrt's page server over several streams, into the target's page filler
    assert data["pages"]["streams"] >= 2 and data["pages"]["bytes"] > 0
    assert data["pages"]["fill"]["copied_bytes"] > 0
    # a checkpoint without its pages is not left behind on the target
    assert data["name"] not in visible(nodes)
    assert staging_entries(nodes) == []


def test_direct_migration_runs_the_target_only_with_all_of_its_memory(nodes, hosts, lazy_capable):
    """--direct: stop-and-copy without images. CRIU's lazy dump leaves the memory in the frozen source,
    the target's page filler fetches it over several streams from migrt's page server there, and the
    restored tree waits at CRIU's post-restore until every page is in (the restore's `pages_in` check
    spans the whole fill); downtime runs until then, and no image of the memory is written anywhere.
    Then the same with the target's filler killed half-way: the restored tree never ran (not one tick
    on the target), the source resumes where it stopped."""
    src, cid = start_source(nodes, "direct")
    out = nodes["base"] / f"{cid}.out"
    recv = Receiver(nodes, hosts, 7911, "--restore", nodes["b"]["bundle"], "--root", nodes["b"]["root"],
                    "--container-id", f"{cid}-b", "--output", str(out))
    try:
        res = migrate(nodes, hosts, 7911, cid, "--direct")
        assert res.returncode == 0, res.stderr
        assert recv.wait() == 0
    finally:
        recv.stop()
    before = src.read_for(0.5)
    src.close()
    assert src.status() is None
    assert_continues(before, wait_ticks(out))
    data, rec = json.loads(res.stdout), recv.results()[0]
    assert data["mode"] == "direct" and data["restored"] is True and rec["mode"] == "direct"
    fill = data["pages"]["fill"]
    assert fill["copied_bytes"] > 0 and data["pages"]["streams"] >= 2
    held = rec["timings"]["restore"]["pages_in_s"]  # the tree held at post-restore while the pages came
    assert held >= fill["fill_s"] and data["downtime_s"] > held, (held, fill, data["downtime_s"])
    assert data["bytes"] < fill["copied_bytes"]  # what travelled as files: everything but the memory
    assert data["name"] not in visible(nodes) and staging_entries(nodes) == []
    subprocess.run(["runc", "--root", nodes["b"]["root"], "delete", "--force", f"{cid}-b"], capture_output=True)

    src, cid = start_source(nodes, "directcut")
    out = nodes["base"] / f"{cid}.out"
    recv = Receiver(nodes, hosts, 7912, "--restore", nodes["b"]["bundle"], "--root", nodes["b"]["root"],
                    "--container-id", f"{cid}-b", "--output", str(out),
                    env={**env_of(nodes["b"]), "MIGRT_FILL_FAULT": "after_bytes:65536"})  # the filler dies
    t_cut = time.monotonic()
    try:
        res = migrate(nodes, hosts, 7912, cid, "--direct")
        took = time.monotonic() - t_cut
    finally:
        recv.stop()
    print(f"[direct, filler killed mid-fill] migrate ended after {took:.2f} s, exit {res.returncode}")
    assert res.returncode != 0 and "resumed on this node" in res.stderr, res.stderr
    assert src.status() == "running"
    after = src.read_for(1.0)
    assert len(after) >= 3 and after[-1][1] == after[-1][2]  # counting on here, data intact
    assert not (out.exists() and "tick" in out.read_text()), out.read_text()  # nothing ran on the target
    assert not os.path.exists(os.path.join(nodes["b"]["root"], f"{cid}-b"))
    subprocess.run(["runc", "--root", nodes["a"]["root"], "delete", "--force", cid], capture_output=True)
    src.close()


def test_wrong_key_is_refused_and_receiver_keeps_serving(nodes, hosts):
    src, cid = start_source(nodes, "key")
    recv = Receiver(nodes, hosts, 7904, once=False)
    try:
        res = migrate(nodes, hosts, 7904, cid, node="intruder")
        assert res.returncode == 9, res.stderr
        assert "authentication failed" in res.stderr and "keys" in res.stderr
        time.sleep(0.3)
        assert recv.proc.poll() is None  # still serving
        rec = recv.results()[-1]
        assert rec["refused"] is True and rec["name"] is None
    finally:
        recv.stop()
    # the source was never touched: still running, still counting
    assert src.status() == "running"
    assert len(src.read_for(0.6)) >= 2
    subprocess.run(["runc", "--root", nodes["a"]["root"], "delete", "--force", cid], capture_output=True)
    src.close()
    assert staging_entries(nodes) == []


def test_sender_closing_midway_leaves_target_clean(nodes, hosts):
    recv = Receiver(nodes, hosts, 7905)
    script = (
        "import sys; from migrt.migration.wire import connect, load_key\n"
        "ch = connect(sys.argv[1], load_key(sys.argv[2]))\n"
        "ch.send({'type': 'offer', 'name': 'half-sent', 'mode': 'stop-and-copy', 'container_id': 'x', 'schema': 1})\n"
        "ch.recv('ready')\n"
        "ch.send({'type': 'file', 'path': 'images/pages-1.img', 'size': 8 << 20})\n"
        "ch.sock.sendall(b'x' * (3 << 20))\n"
        "ch.close()\n"
    )
    py = sys.executable  # this venv: migrt/bin/migrt is a launcher script now, not a link into the venv
    key = os.path.join(os.path.dirname(nodes["a"]["config"]), "key")
    res = subprocess.run(in_ns(hosts["a"], py, "-c", script, f"{ADDR_B}:7905", key), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    try:
        assert recv.wait() == 9
    finally:
        recv.stop()
    rec = recv.results()[0]
    assert "closed the connection in the middle of a file" in rec["error"]
    assert "half-sent" not in visible(nodes)
    assert staging_entries(nodes) == []  # discarded at once, not left for gc


def test_receiver_killed_during_transfer_source_keeps_running(nodes, hosts):
    """A throttled link (tc tbf, 1 Mbit/s) stretches the transfer; the receiver dies with SIGKILL in the
    middle of it. The source container is resumed with its state; the target shows nothing, and the
    receiver's guard has removed the orphaned staging directory."""
    src, cid = start_source(nodes, "cut")
    subprocess.run(in_ns(hosts["a"], "tc", "qdisc", "add", "dev", hosts["veth_a"], "root", "tbf", "rate", "1mbit",
               "burst", "32kbit", "latency", "400ms"), check=True)
    recv = Receiver(nodes, hosts, 7906)
    try:
        proc = subprocess.Popen(in_ns(hosts["a"], CLI, "migrate", cid, "--to", f"{ADDR_B}:7906", "--root",
                                      nodes["a"]["root"], "--name", f"{cid}-ck"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_of(nodes["a"]))
        deadline = time.monotonic() + 30
        while not staged_bytes(nodes) > 100_000:  # data is arriving
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "transfer never started"
            time.sleep(0.02)
        recv.proc.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        recv.stop()
        subprocess.run(in_ns(hosts["a"], "tc", "qdisc", "del", "dev", hosts["veth_a"], "root"), capture_output=True)
    assert proc.returncode == 9, err
    assert "was resumed on this node" in err
    assert src.status() == "running"
    before = src.read_for(1.0)
    assert len(before) >= 3 and before[-1][1] == before[-1][2]  # counting on, data intact
    subprocess.run(["runc", "--root", nodes["a"]["root"], "delete", "--force", cid], capture_output=True)
    src.close()
    assert f"{cid}-ck" not in visible(nodes)  # never visible on the target
    assert os.listdir(os.path.join(nodes["a"]["store"], ".staging")) == []  # nor left on the source
    # the killed receiver's guard removed its staging directory at once; had it not, the next start would
    assert staging_entries(nodes) == []
    Receiver(nodes, hosts, 7907, once=False).stop()
    assert staging_entries(nodes) == []


def test_tls_migration(nodes, hosts, tmp_path):
    """With migration_tls on both nodes the same migration runs inside mutual TLS."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
            "-subj", "/CN=migrt-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    for node in ("a", "b"):
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN=node-{node}",
                "-keyout", f"{node}.key", "-out", f"{node}.csr")
        openssl("x509", "-req", "-in", f"{node}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-out", f"{node}.crt")
        cfg = tmp_path / f"{node}.yaml"
        cfg.write_text(open(nodes[node]["config"]).read() + f"migration_tls:\n  cert: {tmp_path}/{node}.crt\n"
                       f"  key: {tmp_path}/{node}.key\n  ca: {tmp_path}/ca.crt\n")
    tls = {n: {**nodes[n], "config": str(tmp_path / f"{n}.yaml")} for n in ("a", "b")}
    tls["base"] = nodes["base"]
    src, cid = start_source(nodes, "tls")
    recv = Receiver(tls, hosts, 7908, "--streams", "2")
    try:  # the data streams inside mutual TLS too
        res = migrate(tls, hosts, 7908, cid, "--name", f"{cid}-ck", "--streams", "2", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["streams"] == 2
        assert recv.wait() == 0
    finally:
        recv.stop()
    src.close()
    assert f"{cid}-ck" in visible(nodes)
    # lazy: the page streams run inside mutual TLS too (the receiver restores; pages come from the source)
    data = lazy_migration(tls, nodes, hosts, 7910, "tlslazy")
    assert data["pages"]["streams"] >= 2 and data["pages"]["bytes"] > 0
    subprocess.run(["runc", "--root", nodes["b"]["root"], "delete", "--force", f"{data['container_id']}-b"],
                   capture_output=True)
    # a node without TLS cannot talk to it
    recv = Receiver(tls, hosts, 7909)
    try:
        src2, cid2 = start_source(nodes, "notls")
        res = migrate(nodes, hosts, 7909, cid2)
        assert res.returncode == 9 and "requires TLS" in res.stderr
        assert src2.status() == "running"
    finally:
        recv.stop()
        subprocess.run(["runc", "--root", nodes["a"]["root"], "delete", "--force", cid2], capture_output=True)
        src2.close()
