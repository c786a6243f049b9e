"""The pod's loopback held with its parts: TCP over `lo` in the new pod's network namespace is dropped
from before its first part is restored until the hold releases them all (pods/hold.py).

Why freezing the parts' tasks is not enough: a restored TCP socket is live in the kernel as soon as
CRIU takes it out of repair mode, whatever its tasks do. Leaving repair mode sends a window probe;
for a connection whose other end is a container of the same pod not restored yet, that segment finds
no socket, the kernel answers with a RST, and the restored end is reset before its peer arrives
(seen here: the sidecar's connection to the app was gone after a pod restore without this lock).
With every TCP segment on `lo` dropped meanwhile, the sockets retransmit instead and the connection
goes on once the peer is there and the lock goes.

The lock is a chain of ours (MIGRT-POD-HOLD, jumped to first from OUTPUT) in the pod's own network
namespace, set and removed with the node's iptables through nsenter; nothing outside that namespace is
touched. The new pod runs nothing but the held parts meanwhile.
"""

from __future__ import annotations

import shutil
import subprocess

from migrt.errors import PreconditionFailed
from migrt.oci.bundle import Bundle

CHAIN = "MIGRT-POD-HOLD"


def netns_path(bundle: Bundle) -> str | None:
    """The network namespace the new container joins (the pod sandbox's), None when it has its own."""
    for ns in bundle.namespaces:
        if ns.get("type") == "network" and isinstance(ns.get("path"), str) and ns["path"]:
            return ns["path"]
    return None


def _iptables(netns: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    iptables, nsenter = shutil.which("iptables"), shutil.which("nsenter")
    if not iptables or not nsenter:
        raise PreconditionFailed("a pod restore holds the pod's loopback with iptables in its network namespace: "
                                 "iptables and nsenter must be on the node's PATH")
    return subprocess.run([nsenter, f"--net={netns}", iptables, "-w", *args], capture_output=True, text=True,
                          timeout=30, check=False)


def lock(netns: str) -> None:
    """Drop TCP on lo in `netns` (idempotent: a second part finding the lock leaves it)."""
    if _iptables(netns, ["-C", "OUTPUT", "-j", CHAIN]).returncode == 0:
        return
    _iptables(netns, ["-N", CHAIN])  # exists already after an interrupted lock: fine
    _iptables(netns, ["-F", CHAIN])
    for args in (["-A", CHAIN, "-o", "lo", "-p", "tcp", "-j", "DROP"], ["-I", "OUTPUT", "1", "-j", CHAIN]):
        out = _iptables(netns, args)
        if out.returncode != 0:
            raise PreconditionFailed(f"cannot hold the pod's loopback in {netns} (iptables {' '.join(args)}): "
                                     f"{out.stderr.strip() or out.returncode}")


def unlock(netns: str) -> None:
    """Remove the lock (whatever of it is there)."""
    while _iptables(netns, ["-D", "OUTPUT", "-j", CHAIN]).returncode == 0:
        pass
    _iptables(netns, ["-F", CHAIN])
    _iptables(netns, ["-X", CHAIN])
