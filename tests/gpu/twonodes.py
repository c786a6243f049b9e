"""Two migrt "nodes" on the GPU machine for GPU migrations: network namespaces A and B
(tests/helpers/twohosts.py), each with its own config, migration key, store (on /dev/shm) and runc
root. Node A's container gets GPU 0, node B's restore bundle GPU 1 (where there is one; else GPU 0,
and the figures say it moved onto the same GPU). `migrt migrate` runs in A's namespace and `migrt
receive` in B's, so the images and the pages cross the veth pair.

Where the containers live: with `netns` (bench/gpu_migration.py), each node's container joins its
node's namespace by path (tests/gpu/rig.py): the source in A, the restored copy in B. So the frozen
source and its copy never share abstract unix sockets, and the source can stay frozen while the
copy runs: what lazy migration needs (the source serves its pages until the last one is in). runc
and CRIU run in the container's own namespace then (CRIU takes it as its own: nothing of it is
dumped or locked), and the copy lands in B because the receiver and its CRIU run there.

Without (the GPU tests, tests/gpu/test_gpu_migrate.py), the containers share the host's network
namespace; stop-and-copy then passes `--free-source-early`: the frozen source's abstract unix
sockets would clash with the restored copy's (CRIU: "Can't bind ... Address already in use", seen
on the H200 pair), so the source is destroyed once the target has committed the checkpoint, before
the restore (downtime is measured the same way); lazy mode is impossible there. Where the machine
has no `ip` (iproute2), both nodes use the host's namespace over loopback (`hosts()` yields
{"netns": False}), and the figures say so.

A node object may add environment of its own per node (`node_env(name)`: the simulated GPU node of
tests/gpu/simnode.py names each node's simulated driver there)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

from tests.gpu.harness import Container
from tests.helpers.twohosts import ADDR_B, in_ns, two_hosts

GIB = 1 << 30


@contextlib.contextmanager
def hosts(prefix: str):
    if shutil.which("ip"):
        with two_hosts(prefix) as h:
            yield {**h, "netns": True, "addr_b": ADDR_B}
    else:
        yield {"netns": False, "addr_b": "127.0.0.1"}


def _in(h: dict, side: str, *argv: str) -> list[str]:
    return in_ns(h[side], *argv) if h["netns"] else list(argv)


def make(node, base: Path) -> dict:
    secret = os.urandom(32).hex()
    out = {}
    for name in ("a", "b"):
        d = base / f"node-{name}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "key").write_text(secret + "\n")
        (d / "key").chmod(0o600)
        (d / "root").mkdir(exist_ok=True)
        (d / "config.yaml").write_text(
            f"runtime: runc\nstore: {d / 'store'}\nlog_file: {d / 'migrt.log'}\n"
            f"log_level: debug\nmigration_key_file: {d / 'key'}\n")
        extra = node.node_env(name) if hasattr(node, "node_env") else {}
        out[name] = {"dir": d, "config": str(d / "config.yaml"), "root": str(d / "root"),
                     "env": {**node.env, **extra, "MIGRT_CONFIG": str(d / "config.yaml")}}
    return out


class Progress:
    """Samples the workload's status file every 20 ms: the application's own view of the gap."""

    def __init__(self, path: Path) -> None:
        self.path, self.samples, self._stop = path, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            try:
                s = json.loads(self.path.read_text())
                if s["count"] != last:
                    last = s["count"]
                    self.samples.append((s["count"], s["t"]))
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.02)

    def stop(self) -> float | None:
        """The longest time between two consecutive counts (seconds), the app's gap."""
        self._stop.set()
        self.thread.join(5)
        gaps = [b[1] - a[1] for a, b in zip(self.samples, self.samples[1:])]
        return round(max(gaps), 3) if gaps else None


def migrate(node, hosts: dict, nodes: dict, src: Container, target_bundle: str, port: int, *,
            target_cid: str, timeout: int = 900, lazy: bool = False,
            free_source_early: bool | None = None) -> tuple[dict, dict, subprocess.CompletedProcess]:
    """`migrt receive --once --restore` in B, `migrt migrate --json [--lazy]` in A: (migrate's JSON,
    the receiver's JSON line, migrate's process). free_source_early (stop-and-copy only): None means
    when the containers share a network namespace (see the module doc)."""
    if free_source_early is None:
        free_source_early = not lazy and not getattr(src, "netns", None)
    if lazy and free_source_early:
        raise ValueError("a lazy migration's source serves its pages until the end: it cannot go early")
    b, a = nodes["b"], nodes["a"]
    log = b["dir"] / f"recv-{port}.out"
    with open(log, "wb") as out, open(b["dir"] / f"recv-{port}.err", "wb") as err:
        recv = subprocess.Popen(_in(hosts, "b", node.migrt, "receive", "--listen", f"{hosts['addr_b']}:{port}", "--once",
                                      "--json", "--restore", target_bundle, "--root", b["root"], "--container-id",
                                      target_cid), stdout=out, stderr=err, env=b["env"])
    deadline = time.monotonic() + 60
    while b"listening on" not in (b["dir"] / f"recv-{port}.err").read_bytes():
        assert recv.poll() is None, (b["dir"] / f"recv-{port}.err").read_text()
        assert time.monotonic() < deadline, "receiver did not start"
        time.sleep(0.05)
    flags = ["--lazy"] if lazy else (["--free-source-early"] if free_source_early else [])
    try:
        res = subprocess.run(_in(hosts, "a", node.migrt, "migrate", src.cid, "--to", f"{hosts['addr_b']}:{port}", "--root",
                                   a["root"], "--json", *flags), capture_output=True, text=True,
                             env=a["env"], timeout=timeout)
        recv.wait(120)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    data = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
    return data, (lines[0] if lines else {}), res


def start_source(node, nodes: dict, tag: str, gb: float, gpu: int = 0, *, netns: str | None = None,
                 criu_config: str | None = None) -> tuple[Container, Path]:
    """The workload in node A's runc root; netns: the network namespace its container joins (A's),
    criu_config: the rig's CRIU configuration file (tests/gpu/rig.py criu_config_file)."""
    data = node.data_dir(tag)
    bundle = node.bundle(f"{tag}-a", node.workload_args("w", str(gb)), data, [gpu], netns=netns,
                         criu_config=criu_config)
    cid = f"{tag}-{uuid.uuid4().hex[:4]}"
    c = Container(node, cid, ["runc", "--root", nodes["a"]["root"], "create", "--bundle", bundle, cid], bundle)
    assert c.rc == 0, c.output()
    subprocess.run(["runc", "--root", nodes["a"]["root"], "start", cid], check=True, env=node.env)
    c.root = nodes["a"]["root"]
    c.netns = netns
    return c, data


def remove(root: str, cid: str) -> None:
    subprocess.run(["runc", "--root", root, "delete", "--force", cid], capture_output=True)
