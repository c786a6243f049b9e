"""Removing a container whatever state a killed `runc restore` left it in (shared by ops/restore.py,
ops/recover.py and the migration's guards and watchdog).

runc bind-mounts the bundle's rootfs on `<root>/<id>/criu-root` for CRIU and unmounts it when it
returns, which a killed runc never does; `runc delete` of a container without state.json then removes
that directory with RemoveAll, which walks into the bind mount and deletes the bundle's rootfs.
So: unmount first, then delete.
"""

from __future__ import annotations

import os
import shutil
import time

from migrt.errors import RuntimeFailed
from migrt.runtime.runc import LowerRuntime

MNT_DETACH = 2


def unmount_under(path: str) -> list[str]:
    """Detach every mount at or below `path` (deepest first); return them."""
    path = os.path.realpath(path)
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                mnt = line.split()[4].encode().decode("unicode_escape")
                if mnt == path or mnt.startswith(path + "/"):
                    found.append(mnt)
    except OSError:
        return []
    if not found:
        return found
    from migrt.kernel.libc import libc  # ctypes: only where something is mounted there

    for mnt in sorted(found, key=len, reverse=True):
        libc.umount2(mnt.encode(), MNT_DETACH)
    return found


def clear_container(runtime: str, root: str, cid: str) -> None:
    """Remove container `cid` from runtime root `root` whatever state a killed restore left it in.

    First unmount what the killed runc left in its state directory: runc bind-mounts the bundle's
    rootfs on `<root>/<id>/criu-root` for CRIU and unmounts it when it returns, which a killed runc
    never does; and `runc delete` of a container without state.json removes that directory with
    RemoveAll, which walks into the bind mount and deletes the bundle's rootfs. Then `delete
    --force`, then the state directory if runc had not written state.json yet."""
    state_dir = os.path.join(root, cid)
    unmount_under(state_dir)
    LowerRuntime(runtime).delete_force(root, cid, timeout=60)
    deadline = time.monotonic() + 5
    while os.path.isdir(state_dir) and not os.path.exists(os.path.join(state_dir, "state.json")):
        unmount_under(state_dir)
        if not unmount_under(state_dir):  # never remove through a mount that will not go
            shutil.rmtree(state_dir, ignore_errors=True)
        if time.monotonic() > deadline:
            raise RuntimeFailed(f"cannot remove {state_dir} left by a killed restore; unmount what is mounted "
                                "under it and remove it by hand")
        time.sleep(0.05)
