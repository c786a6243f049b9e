"""Two migrt "nodes" on the GPU machine for GPU migrations: network namespaces A and B
(tests/helpers/twohosts.py), each with its own config, migration key, store (on /dev/shm) and runc
root. Node A's container gets GPU 0, node B's restore bundle GPU 1 (where there is one; else GPU 0,
and the test says it moved onto the same GPU). The GPU rig's containers share the host's network
namespace (tests/gpu/rig.py); `migrt migrate` runs in A's namespace and `migrt receive` in B's, so
the images cross the veth pair. `--free-source-early`: the rig's containers share one network namespace,
so the frozen source's abstract unix sockets would clash with the restored copy's (CRIU: "Can't bind
... Address already in use", seen on the H200 pair); the source is destroyed once the target has
committed the checkpoint, before the restore (downtime is measured the same way). Where the machine has no `ip` (iproute2), both run in the host's
namespace over loopback (`hosts()` yields {"netns": False}), and the figures say so."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

from tests.gpu.harness import Container, Node
import contextlib
import shutil

from tests.helpers.twohosts import ADDR_B, in_ns, two_hosts


@contextlib.contextmanager
def hosts(prefix: str):
    if shutil.which("ip"):
        with two_hosts(prefix) as h:
            yield {**h, "netns": True, "addr_b": ADDR_B}
    else:
        yield {"netns": False, "addr_b": "127.0.0.1"}


def _in(h: dict, side: str, *argv: str) -> list[str]:
    return in_ns(h[side], *argv) if h["netns"] else list(argv)

GIB = 1 << 30


def make(node: Node, base: Path) -> dict:
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
        out[name] = {"dir": d, "config": str(d / "config.yaml"), "root": str(d / "root"),
                     "env": {**node.env, "MIGRT_CONFIG": str(d / "config.yaml")}}
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


def migrate(node: Node, hosts: dict, nodes: dict, src: Container, target_bundle: str, port: int, *,
            target_cid: str, timeout: int = 900) -> tuple[dict, dict, subprocess.CompletedProcess]:
    """`migrt receive --once --restore` in B, `migrt migrate --json` in A: (migrate's JSON, the
    receiver's JSON line, migrate's process)."""
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
    try:
        res = subprocess.run(_in(hosts, "a", node.migrt, "migrate", src.cid, "--to", f"{hosts['addr_b']}:{port}", "--root",
                                   a["root"], "--json", "--free-source-early"), capture_output=True, text=True,
                             env=a["env"], timeout=timeout)
        recv.wait(120)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    data = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
    return data, (lines[0] if lines else {}), res


def start_source(node: Node, nodes: dict, tag: str, gb: float, gpu: int = 0) -> tuple[Container, Path]:
    data = node.data_dir(tag)
    bundle = node.bundle(f"{tag}-a", node.workload_args("w", str(gb)), data, [gpu])
    cid = f"{tag}-{uuid.uuid4().hex[:4]}"
    c = Container(node, cid, ["runc", "--root", nodes["a"]["root"], "create", "--bundle", bundle, cid], bundle)
    assert c.rc == 0, c.output()
    subprocess.run(["runc", "--root", nodes["a"]["root"], "start", cid], check=True, env=node.env)
    c.root = nodes["a"]["root"]
    return c, data


def remove(root: str, cid: str) -> None:
    subprocess.run(["runc", "--root", root, "delete", "--force", cid], capture_output=True)
