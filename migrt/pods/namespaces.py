"""Namespaces of the new container. runc joins the namespaces whose paths config.json gives (a pod's
sandbox), but CRIU then writes the checkpoint's UTS image into the joined namespace: the whole new
pod would take the OLD pod's hostname. So the UTS image of the restore view is rewritten to the new
container's hostname (read from the namespace it joins, or config.json's `hostname`) before CRIU runs.
"""

from __future__ import annotations

import ctypes
import glob
import os

from migrt.pods.forked import run_forked
from migrt.oci.bundle import Bundle

CLONE_NEWUTS = 0x04000000


def ns_uname(ns_path: str) -> tuple[str, str]:
    """(nodename, domainname) seen inside the UTS namespace at ns_path (forked child + setns)."""
    fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)

    def child() -> bytes:
        libc = ctypes.CDLL(None, use_errno=True)
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


def retarget_uts(view: str, bundle: Bundle) -> str | None:
    """Rewrite the view's utsns image to the new container's hostname. Returns the hostname set."""
    images = glob.glob(os.path.join(view, "utsns-*.img"))
    if not images:
        return None
    target = target_uts(bundle)
    if target is None:
        return None
    import pycriu

    node, domain = target
    for path in images:
        with open(path, "rb") as fh:
            img = pycriu.images.load(fh)
        entry = img["entries"][0]
        if entry.get("nodename") == node and (domain is None or entry.get("domainname") == domain):
            continue
        entry["nodename"] = node
        if domain is not None:
            entry["domainname"] = domain
        tmp = path + ".new"
        with open(tmp, "wb") as fh:
            pycriu.images.dump(img, fh)
        os.replace(tmp, path)  # replaces the hard link: the checkpoint's own file is untouched
    return node
