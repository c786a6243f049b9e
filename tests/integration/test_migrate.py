"""Live migration between two "hosts" on one machine: network namespaces joined by a veth pair
(198.51.100.1 <-> 198.51.100.2), each host with its own config, key, store and runc root. The receiver
runs in host B's network namespace, `migrt migrate` in host A's; the source container is a busybox
counter holding random data in memory (its hash is printed with every tick).

Processes enter the namespaces with `nsenter --net` (tests/helpers/twohosts.py says why).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers.bundles import make_bundle
from tests.helpers.twohosts import ADDR_A, ADDR_B, in_ns, lazy_pipe_limit, two_hosts
from tests.integration.conftest import CLI
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts(stack):
    with two_hosts() as h:
        yield h


@pytest.fixture(scope="module")
def nodes(stack, tmp_path_factory):
    """Configs for host A (source), host B (target) and an intruder whose key differs."""
    base = tmp_path_factory.mktemp("migrate")
    out = {"base": base}
    secret, other = os.urandom(32).hex(), os.urandom(32).hex()
    for node, key in (("a", secret), ("b", secret), ("intruder", other)):
        d = base / node
        d.mkdir()
        (d / "key").write_text(key + "\n")
        (d / "key").chmod(0o600)
        (d / "root").mkdir()
        (d / "config.yaml").write_text(
            f"runtime: runc\nstore: {d / 'store'}\nlog_file: {d / 'migrt.log'}\nlog_level: debug\n"
            f"migration_key_file: {d / 'key'}\n")
        out[node] = {"config": str(d / "config.yaml"), "store": str(d / "store"), "root": str(d / "root")}
    out["b"]["bundle"] = make_bundle(str(base / "b" / "bundle"), ["sh", "-c", "echo fresh; exit 3"])
    yield out
    for node in ("a", "b"):
        root = out[node]["root"]
        for cid in os.listdir(root):
            subprocess.run(["runc", "--root", root, "delete", "--force", cid], capture_output=True)


@pytest.fixture(scope="module")
def lazy_capable():
    with lazy_pipe_limit():
        yield


def _env(node: dict) -> dict:
    return {**os.environ, "MIGRT_CONFIG": node["config"]}


class Counter:
    """The busybox counter under runc with pipes as stdio; the test keeps the read end."""

    def __init__(self, root: str, bundle: str, cid: str) -> None:
        self.root, self.cid = root, cid
        r_in, w_in = os.pipe()
        self.r_out, w_out = os.pipe()
        rc = subprocess.run(["runc", "--root", root, "run", "-d", "--bundle", bundle, cid], stdin=r_in,
                            stdout=w_out, stderr=w_out, timeout=60).returncode
        for fd in (r_in, w_in, w_out):
            os.close(fd)
        assert rc == 0
        self.buf = b""

    def read_for(self, seconds: float) -> list[tuple[int, str, str]]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.r_out], [], [], 0.05)
            if ready:
                chunk = os.read(self.r_out, 65536)
                if not chunk:
                    break
                self.buf += chunk
        return parse_ticks(self.buf.decode(errors="replace"))

    def status(self) -> str | None:
        res = subprocess.run(["runc", "--root", self.root, "state", self.cid], capture_output=True, text=True)
        return json.loads(res.stdout)["status"] if res.returncode == 0 else None

    def close(self) -> None:
        os.close(self.r_out)


class Receiver:
    """`migrt receive` in host B's network namespace."""

    def __init__(self, nodes, hosts, port: int, *args: str, once: bool = True) -> None:
        self.port = port
        self.dir = nodes["base"] / f"recv-{port}-{uuid.uuid4().hex[:4]}"
        self.dir.mkdir()
        self.stdout, self.stderr = self.dir / "stdout", self.dir / "stderr"
        argv = in_ns(hosts["b"], CLI, "receive", "--listen", f"{ADDR_B}:{port}", "--json", *args)
        if once:
            argv.append("--once")
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=_env(nodes["b"]))
        deadline = time.monotonic() + 20
        while b"listening on" not in self.stderr.read_bytes():
            assert self.proc.poll() is None, self.stderr.read_text()
            assert time.monotonic() < deadline, "receiver did not start"
            time.sleep(0.05)

    def results(self) -> list[dict]:
        return [json.loads(line) for line in self.stdout.read_text().splitlines() if line.startswith("{")]

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def migrate(nodes, hosts, port: int, cid: str, *args: str, node: str = "a") -> subprocess.CompletedProcess:
    argv = in_ns(hosts["a"], CLI, "migrate", cid, "--to", f"{ADDR_B}:{port}", "--root", nodes["a"]["root"],
                 "--json", *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=_env(nodes[node]))


def target_cli(nodes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, env=_env(nodes["b"]))


def staging_entries(nodes) -> list[str]:
    path = os.path.join(nodes["b"]["store"], ".staging")
    return os.listdir(path) if os.path.isdir(path) else []


def visible(nodes) -> list[str]:
    return [c["name"] for c in json.loads(target_cli(nodes, "ls", "--json").stdout)]


def _wait_ticks(path, n: int = 3, timeout: float = 10) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(path.read_text()) if path.exists() else []
        if len(ticks) >= n:
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"no ticks in {path}: {path.read_text() if path.exists() else 'missing'}")


def _assert_continues(before: list, after: list) -> None:
    assert before and after
    last = before[-1]
    assert after[0][0] == last[0] + 1, (before[-3:], after[:3])  # the very next tick: no step lost or repeated
    assert all(t[1] == last[1] and t[2] == last[1] for t in after)  # the in-memory data came along intact


def _source(nodes, tag: str) -> tuple[Counter, str]:
    cid = f"mig-{tag}-{uuid.uuid4().hex[:6]}"
    bundle = make_bundle(str(nodes["base"] / "a" / f"bundle-{cid}"), ["sh", "-c", COUNTER])
    src = Counter(nodes["a"]["root"], bundle, cid)
    assert len(src.read_for(1.2)) >= 3
    return src, cid


def test_stop_and_copy_continues_on_target(nodes, hosts):
    src, cid = _source(nodes, "sc")
    out = nodes["base"] / f"{cid}.out"
    recv = Receiver(nodes, hosts, 7901, "--restore", nodes["b"]["bundle"], "--root", nodes["b"]["root"],
                    "--container-id", f"{cid}-b", "--output", str(out))
    try:
        res = migrate(nodes, hosts, 7901, cid, "--name", f"{cid}-ck")
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        assert recv.wait() == 0
    finally:
        recv.stop()
    before = src.read_for(0.5)
    src.close()
    assert src.status() is None  # the source is gone once the target runs
    _assert_continues(before, _wait_ticks(out))
    assert data["mode"] == "stop-and-copy" and data["restored"] is True
    assert data["target"]["container_id"] == f"{cid}-b"
    assert set(data["phases"]) >= {"connect_s", "dump_s", "transfer_s", "commit_s", "restore_s"}
    assert data["bytes"] > 100_000 and data["files"] > 5
    assert 0 < data["downtime_s"] <= data["total_s"]
    assert data["pre_dump"]["requested"] == "auto"
    if not data["pre_dump"]["available"]:  # kernels without soft-dirty: skipped, and said so
        assert "soft-dirty" in data["pre_dump"]["note"].lower() or "dirty" in data["pre_dump"]["note"]
    # the checkpoint stays in the target's store, verified and attributed
    ins = json.loads(target_cli(nodes, "inspect", f"{cid}-ck", "--verify", "--json").stdout)
    assert ins["verified"] is True
    assert ins["manifest"]["migration"]["from"].startswith(ADDR_A + ":")
    assert staging_entries(nodes) == []
    rec = recv.results()[0]
    assert rec["restored"] and rec["committed"] and rec["bytes"] == data["bytes"]


def test_received_checkpoint_restores_later(nodes, hosts):
    """Without --restore the receiver only stores; `migrt restore` brings it up later on host B."""
    src, cid = _source(nodes, "later")
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
    _assert_continues(before, _wait_ticks(out))


def test_lazy_migration_continues_on_target(nodes, hosts, lazy_capable):
    src, cid = _source(nodes, "lazy")
    out = nodes["base"] / f"{cid}.out"
    recv = Receiver(nodes, hosts, 7903, "--restore", nodes["b"]["bundle"], "--root", nodes["b"]["root"],
                    "--container-id", f"{cid}-b", "--output", str(out))
    try:
        res = migrate(nodes, hosts, 7903, cid, "--lazy")
        assert res.returncode == 0, res.stderr
        assert recv.wait() == 0
    finally:
        recv.stop()
    data = json.loads(res.stdout)
    before = src.read_for(0.5)
    src.close()
    assert src.status() is None
    _assert_continues(before, _wait_ticks(out))
    assert data["mode"] == "lazy" and data["restored"] is True
    assert 0 < data["downtime_s"] < data["total_s"]
    assert data["phases"]["pages_s"] >= 0 and data["lazy_pages_s"] is not None
    # a checkpoint without its pages is not left behind on the target
    assert data["name"] not in visible(nodes)
    assert staging_entries(nodes) == []


def test_wrong_key_is_refused_and_receiver_keeps_serving(nodes, hosts):
    src, cid = _source(nodes, "key")
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
    middle of it. The source container is resumed with its state; the target shows nothing, and its
    next start sweeps the orphaned staging directory."""
    src, cid = _source(nodes, "cut")
    subprocess.run(in_ns(hosts["a"], "tc", "qdisc", "add", "dev", hosts["veth_a"], "root", "tbf", "rate", "1mbit",
               "burst", "32kbit", "latency", "400ms"), check=True)
    recv = Receiver(nodes, hosts, 7906)
    try:
        proc = subprocess.Popen(in_ns(hosts["a"], CLI, "migrate", cid, "--to", f"{ADDR_B}:7906", "--root",
                                      nodes["a"]["root"], "--name", f"{cid}-ck"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(nodes["a"]))
        deadline = time.monotonic() + 30
        while not _staged_bytes(nodes) > 100_000:  # data is arriving
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
    # SIGKILL left the staging directory; the next receiver start removes it (its lock is free)
    Receiver(nodes, hosts, 7907, once=False).stop()
    assert staging_entries(nodes) == []


def _staged_bytes(nodes) -> int:
    top = os.path.join(nodes["b"]["store"], ".staging")
    total = 0
    for dirpath, _, files in os.walk(top):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


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
    src, cid = _source(nodes, "tls")
    recv = Receiver(tls, hosts, 7908)
    try:
        res = migrate(tls, hosts, 7908, cid, "--name", f"{cid}-ck")
        assert res.returncode == 0, res.stderr
        assert recv.wait() == 0
    finally:
        recv.stop()
    src.close()
    assert f"{cid}-ck" in visible(nodes)
    # a node without TLS cannot talk to it
    recv = Receiver(tls, hosts, 7909)
    try:
        src2, cid2 = _source(nodes, "notls")
        res = migrate(nodes, hosts, 7909, cid2)
        assert res.returncode == 9 and "requires TLS" in res.stderr
        assert src2.status() == "running"
    finally:
        recv.stop()
        subprocess.run(["runc", "--root", nodes["a"]["root"], "delete", "--force", cid2], capture_output=True)
        src2.close()
