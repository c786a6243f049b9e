"""Two "hosts" on one machine for migration tests and benchmarks: network namespaces A and B joined
by a veth pair (198.51.100.1 <-> 198.51.100.2, TEST-NET-2), loopback up in both (CRIU's feature
probes bind 127.0.0.1). Everything is created and removed by name.

Enter a namespace with `nsenter --net` (`in_ns`), not `ip netns exec`: the latter also remounts /sys,
which hides /sys/fs/cgroup from runc (pause, restore) and breaks them.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator

ADDR_A, ADDR_B = "198.51.100.1", "198.51.100.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{ns}", *argv]


@contextlib.contextmanager
def two_hosts(prefix: str = "migrt") -> Iterator[dict]:
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"{prefix}-a-{tag}", f"{prefix}-b-{tag}"
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        with linked(ns_a, ns_b, tag) as link:
            yield {"a": ns_a, "b": ns_b, **link}
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its veth end along


@contextlib.contextmanager
def linked(ns_a: str, ns_b: str, tag: str) -> Iterator[dict]:
    """A veth pair between two existing network namespaces: ADDR_A in ns_a, ADDR_B in ns_b, loopback up."""
    veth_a, veth_b = f"mva{tag}"[:15], f"mvb{tag}"[:15]
    try:
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, ADDR_A), (ns_b, veth_b, ADDR_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {"veth_a": veth_a, "veth_b": veth_b, "addr_a": ADDR_A, "addr_b": ADDR_B}
    finally:
        subprocess.run(["ip", "-n", ns_a, "link", "del", veth_a], capture_output=True)
        subprocess.run(["ip", "link", "del", veth_a], capture_output=True)


PIPE_MAX = "/proc/sys/fs/pipe-max-size"


@contextlib.contextmanager
def lazy_pipe_limit(value: int = 1 << 20) -> Iterator[None]:
    """fs.pipe-max-size at the kernel's default (1 MiB) for the duration, then the old value back:
    CRIU's own page server needs 3.2 MiB pipes (CAP_SYS_RESOURCE or a raised limit, docs/migration.md);
    migrt's lazy migration must not, and the tests keep it so."""
    with open(PIPE_MAX) as fh:
        old = fh.read().strip()
    with open(PIPE_MAX, "w") as fh:
        fh.write(str(value))
    try:
        yield
    finally:
        with open(PIPE_MAX, "w") as fh:
            fh.write(old)
