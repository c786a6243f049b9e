"""Tiny OCI bundles from busybox-static, made with `runc spec` and adjusted (no terminal)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

BUSYBOX = shutil.which("busybox") or "/bin/busybox"


def make_rootfs(path: str) -> str:
    os.makedirs(os.path.join(path, "bin"), exist_ok=True)
    for d in ("proc", "sys", "dev", "tmp", "etc", "data", "run"):
        os.makedirs(os.path.join(path, d), exist_ok=True)
    shutil.copy2(BUSYBOX, os.path.join(path, "bin", "busybox"))
    for applet in ("sh", "sleep", "echo", "cat", "ls", "sha256sum", "head", "dd", "true", "wc", "kill", "od", "tr",
                   "cut", "touch", "ps", "grep", "mkdir", "rm", "env", "hostname"):
        link = os.path.join(path, "bin", applet)
        if not os.path.lexists(link):
            os.symlink("busybox", link)
    return path


def make_bundle(path: str, args: list[str], env: list[str] | None = None, annotations: dict | None = None,
                runc: str = "runc", extra_mounts: list[dict] | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    make_rootfs(os.path.join(path, "rootfs"))
    if os.path.exists(os.path.join(path, "config.json")):
        os.unlink(os.path.join(path, "config.json"))
    subprocess.run([runc, "spec"], cwd=path, check=True)
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = args
    cfg["process"]["env"] = ["PATH=/bin"] + list(env or [])
    cfg["root"]["readonly"] = False
    if annotations:
        cfg["annotations"] = annotations
    if extra_mounts:
        cfg["mounts"].extend(extra_mounts)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path


COUNTER = (
    "i=0; head -c 8388608 /dev/urandom > /dev/shm/blob 2>/dev/null || dd if=/dev/urandom of=/dev/shm/blob bs=1M count=8; "
    "while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done"
)
