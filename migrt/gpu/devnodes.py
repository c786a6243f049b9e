"""NVIDIA device nodes inside a restored container.

runc leaves a tmpfs /dev to CRIU, which restores it from the checkpoint: the restored container has
the OLD node's /dev/nvidia* nodes, not those of its new config.json. On another GPU (another minor)
or another node (nvidia-uvm's major is dynamic) the driver's restore, which reopens the device
files inside the process, would find the wrong ones. So before the GPU restore, the container's
/dev gets: a /dev/nvidia<minor> node for each of its GPUs, control nodes with this host's numbers,
and no nodes of GPUs it was not given. Done from the host through /proc/<pid>/root.
"""

from __future__ import annotations

import os
import re
import stat

CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
REQUIRED_CONTROL = ("nvidiactl", "nvidia-uvm")
NVIDIA_MAJOR = 195


def _host_rdev(name: str) -> int | None:
    try:
        st = os.stat(f"/dev/{name}")
    except OSError:
        return None
    return st.st_rdev if stat.S_ISCHR(st.st_mode) else None


def desired(minors: list[int]) -> dict[str, int]:
    """node name -> device number: the GPUs' nodes and the control nodes, as this host numbers them."""
    out: dict[str, int] = {}
    for name in CONTROL:
        rdev = _host_rdev(name)
        if rdev is not None:
            out[name] = rdev
    for m in minors:
        out[f"nvidia{m}"] = _host_rdev(f"nvidia{m}") or os.makedev(NVIDIA_MAJOR, m)
    return out


def sync(pid: int, minors: list[int], *, dev_dir: str | None = None) -> list[str]:
    """Make pid's /dev match `desired(minors)`; returns what was changed (for the log)."""
    dev = dev_dir or f"/proc/{pid}/root/dev"
    want = desired(minors)
    changes = []
    try:
        present = set(os.listdir(dev))
    except OSError as exc:
        raise OSError(f"cannot read {dev}: {exc}") from exc
    for name in sorted(present):
        if re.fullmatch(r"nvidia\d+", name) and name not in want:
            os.unlink(os.path.join(dev, name))
            changes.append(f"removed {name}")
    for name, rdev in want.items():
        path = os.path.join(dev, name)
        if name in present:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev:
                continue
            if st is not None:
                os.unlink(path)
        elif name in CONTROL and name not in REQUIRED_CONTROL:
            continue  # optional control nodes stay absent if the container had none
        os.mknod(path, 0o666 | stat.S_IFCHR, rdev)
        os.chmod(path, 0o666)
        changes.append(f"{'recreated' if name in present else 'created'} {name} "
                       f"({os.major(rdev)}:{os.minor(rdev)})")
    return changes
