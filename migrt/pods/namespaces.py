"""Namespaces of the new container. runc joins the namespaces whose paths config.json gives (a pod's
sandbox), but CRIU then writes the checkpoint's UTS image into the joined namespace: the whole new
pod would take the OLD pod's hostname. So the UTS image of the restore view is rewritten to the new
container's hostname (read from the namespace it joins, or config.json's `hostname`) before CRIU runs.
"""

from __future__ import annotations

import glob
import os

from migrt.kernel.files import atomic_file
from migrt.oci.bundle import Bundle
from migrt.pods.forked import run_forked

CLONE_NEWUTS = 0x04000000


def ns_uname(ns_path: str) -> tuple[str, str]:
    """(nodename, domainname) seen inside the UTS namespace at ns_path (forked child + setns)."""
    fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)

    def child() -> bytes:
        import ctypes  # setns: only when a namespace is joined (not on the restore's path to CRIU)

        from migrt.kernel.libc import libc

        if libc.setns(fd, CLONE_NEWUTS) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns_path})")
        return f"{os.uname().nodename}\n{_domainname()}".encode()

    try:
        data = run_forked(child, f"reading the hostname of UTS namespace {ns_path}")
    finally:
        os.close(fd)
    node, _, domain = data.decode().partition("\n")
    return node, domain


def _domainname() -> str:
    try:
        with open("/proc/sys/kernel/domainname") as fh:
            return fh.read().strip()
    except OSError:
        return "(none)"


def target_uts(bundle: Bundle) -> tuple[str, str | None] | None:
    for ns in bundle.namespaces:
        if ns.get("type") != "uts":
            continue
        if ns.get("path"):
            node, domain = ns_uname(ns["path"])
            return node, domain
        host = bundle.config.get("hostname")
        return (host, bundle.config.get("domainname")) if host else None
    return None  # the container shares the host's UTS namespace: CRIU does not restore one


_UTSNS_MAGICS = bytes.fromhex("19435654" "03324754")  # CRIU's common image magic, then UTSNS's (little endian)


def _uts_names(path: str) -> tuple[str, str] | None:
    """(nodename, domainname) of a utsns image read without pycriu: two magics, one entry (u32 size,
    then protobuf fields 1 and 2, both strings). None for anything else (the caller uses pycriu)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(4096)
        if data[:8] != _UTSNS_MAGICS or len(data) < 12:
            return None
        size = int.from_bytes(data[8:12], "little")
        msg, pos, fields = data[12:12 + size], 0, {}
        if len(msg) != size:
            return None
        while pos < len(msg):
            tag, length = msg[pos], msg[pos + 1]
            if tag not in (0x0A, 0x12) or length > 0x7F:
                return None
            fields[tag] = msg[pos + 2:pos + 2 + length].decode()
            pos += 2 + length
        if pos != len(msg) or set(fields) != {0x0A, 0x12}:
            return None
        return fields[0x0A], fields[0x12]
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _uts_current(path: str, node: str, domain: str | None) -> bool:
    names = _uts_names(path)
    return names is not None and names[0] == node and (domain is None or names[1] == domain)


def retarget_uts(view: str, bundle: Bundle) -> str | None:
    """Rewrite the view's utsns image to the new container's hostname. Returns the hostname set."""
    images = glob.glob(os.path.join(view, "utsns-*.img"))
    if not images:
        return None
    target = target_uts(bundle)
    if target is None:
        return None
    node, domain = target
    if all(_uts_current(p, node, domain) for p in images):
        return node  # already this hostname: no rewrite (and no pycriu/protobuf import on the restore path)
    import pycriu

    for path in images:
        with open(path, "rb") as fh:
            img = pycriu.images.load(fh)
        entry = img["entries"][0]
        if entry.get("nodename") == node and (domain is None or entry.get("domainname") == domain):
            continue
        entry["nodename"] = node
        if domain is not None:
            entry["domainname"] = domain
        with atomic_file(path, 0o644, durable=False) as fh:  # replaces the hard link: the checkpoint's stays
            pycriu.images.dump(img, fh)
    return node
