"""The demo's container root, made of this host's own programs: nothing to install or download, on any
Linux with a C library (the node set-up leaves the host's userland alone, so the demo must too).

The root holds /bin/sh (the host's: dash on Debian) and the few tools the counter workload runs
(workloads.py), each copied with every shared library and the dynamic loader that `ldd` says it loads,
at the paths the loader looks for them (/lib64/ld-linux-x86-64.so.2, /lib/x86_64-linux-gnu/...). A
statically linked tool needs none. PATH=/bin in the image's config."""

from __future__ import annotations

import os
import shutil
import subprocess

TOOLS = ("sh", "head", "od", "tr", "sha256sum", "cut", "sleep", "cat", "ls")
HOST_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def libraries(binary: str) -> list[str]:
    """The absolute paths of the shared objects (loader included) that `binary` loads here."""
    res = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:  # "not a dynamic executable": a static one
        return []
    out = []
    for line in res.stdout.splitlines():
        parts = line.split()
        if "=>" in parts:
            path = parts[parts.index("=>") + 1]
        else:
            path = parts[0] if parts else ""
        if path.startswith("/"):
            out.append(path)
    return out


def _copy(src: str, root: str, at: str) -> None:
    dest = root + at
    if not os.path.exists(dest):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(os.path.realpath(src), dest)


def make_host_rootfs(path: str, tools: tuple[str, ...] = TOOLS) -> str:
    """A root directory at path with the host's `tools` in /bin and what they load; returns path."""
    for d in ("bin", "proc", "sys", "dev", "tmp", "etc", "run"):
        os.makedirs(os.path.join(path, d), exist_ok=True)
    for name in tools:
        src = shutil.which(name, path=HOST_PATH)
        if src is None:
            raise FileNotFoundError(f"the demo's container image needs the host's {name!r} (not found in {HOST_PATH})")
        _copy(src, path, f"/bin/{name}")
        for lib in libraries(src):
            _copy(lib, path, lib)
    return path
