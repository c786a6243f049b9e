"""Two-node migration fixtures and helpers shared by tests/integration/test_migrate.py and
tests/faults/test_migration_faults.py: per-node configs, keys, stores and runc roots; the busybox
counter under runc; `migrt receive` in host B's network namespace; `migrt migrate` in host A's.

Processes enter the namespaces with `nsenter --net` (tests/helpers/twohosts.py says why).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
import uuid

import pytest

from tests.helpers.bundles import make_bundle
from tests.helpers.twohosts import ADDR_B, in_ns, lazy_pipe_limit, two_hosts
from tests.integration.conftest import CLI
from tests.integration.workloads import COUNTER, parse_ticks


@pytest.fixture(scope="module")
def hosts(stack):
    with two_hosts() as h:
        yield h


def setup_nodes(base, extra_config: str = "") -> dict:
    """Configs for host A (source), host B (target) and an intruder whose key differs."""
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
            f"migration_key_file: {d / 'key'}\n{extra_config}")
        out[node] = {"config": str(d / "config.yaml"), "store": str(d / "store"), "root": str(d / "root")}
    out["b"]["bundle"] = make_bundle(str(base / "b" / "bundle"), ["sh", "-c", "echo fresh; exit 3"])
    return out


def teardown_nodes(out: dict) -> None:
    for node in ("a", "b"):
        root = out[node]["root"]
        for cid in os.listdir(root):
            subprocess.run(["runc", "--root", root, "delete", "--force", cid], capture_output=True)


@pytest.fixture(scope="module")
def nodes(stack, tmp_path_factory):
    out = setup_nodes(tmp_path_factory.mktemp("migrate"))
    yield out
    teardown_nodes(out)


@pytest.fixture(scope="module")
def lazy_capable():
    with lazy_pipe_limit():
        yield


def env_of(node: dict) -> dict:
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

    def __init__(self, nodes, hosts, port: int, *args: str, once: bool = True, env: dict | None = None) -> None:
        self.port = port
        self.dir = nodes["base"] / f"recv-{port}-{uuid.uuid4().hex[:4]}"
        self.dir.mkdir()
        self.stdout, self.stderr = self.dir / "stdout", self.dir / "stderr"
        argv = in_ns(hosts["b"], CLI, "receive", "--listen", f"{ADDR_B}:{port}", "--json", *args)
        if once:
            argv.append("--once")
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env or env_of(nodes["b"]))
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
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env_of(nodes[node]))


def target_cli(nodes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, env=env_of(nodes["b"]))


def staging_entries(nodes) -> list[str]:
    path = os.path.join(nodes["b"]["store"], ".staging")
    return os.listdir(path) if os.path.isdir(path) else []


def visible(nodes) -> list[str]:
    return [c["name"] for c in json.loads(target_cli(nodes, "ls", "--json").stdout)]


def wait_ticks(path, n: int = 3, timeout: float = 10) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(path.read_text()) if path.exists() else []
        if len(ticks) >= n:
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"no ticks in {path}: {path.read_text() if path.exists() else 'missing'}")


def assert_continues(before: list, after: list) -> None:
    assert before and after
    last = before[-1]
    assert after[0][0] == last[0] + 1, (before[-3:], after[:3])  # the very next tick: no step lost or repeated
    assert all(t[1] == last[1] and t[2] == last[1] for t in after)  # the in-memory data came along intact


def start_source(nodes, tag: str) -> tuple[Counter, str]:
    cid = f"mig-{tag}-{uuid.uuid4().hex[:6]}"
    bundle = make_bundle(str(nodes["base"] / "a" / f"bundle-{cid}"), ["sh", "-c", COUNTER])
    src = Counter(nodes["a"]["root"], bundle, cid)
    assert len(src.read_for(1.2)) >= 3
    return src, cid


def staged_bytes(nodes) -> int:
    top = os.path.join(nodes["b"]["store"], ".staging")
    total = 0
    for dirpath, _, files in os.walk(top):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total
