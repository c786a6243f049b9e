"""Build a tiny OCI image (busybox-static) as an OCI layout tar, for `ctr images import` (the layout:
scripts/lab/oci_image.py, shared with the demo)."""

from __future__ import annotations

import os
import tempfile

from scripts.lab.oci_image import write_image_tar
from tests.helpers.bundles import make_rootfs

IMAGE_REF = "docker.io/migrt/busybox:test"


# A pod sandbox ("pause") image from the same busybox: the shell waits forever and exits on TERM/INT.
# (As pid 1 of the pod's pid namespace it would otherwise ignore signals it has no handler for.)
PAUSE_REF = "docker.io/migrt/pause:test"
PAUSE_ENTRYPOINT = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]


def _image_config(entrypoint: list[str] | None, cmd: list[str] | None, env: list[str] | None) -> dict:
    out: dict = {"Env": env or ["PATH=/bin"]}
    if entrypoint:
        out["Entrypoint"] = entrypoint
    if cmd or not entrypoint:
        out["Cmd"] = cmd or ["sh"]
    return out


def build_image_tar(out_path: str, ref: str = IMAGE_REF, *, entrypoint: list[str] | None = None,
                    cmd: list[str] | None = None, env: list[str] | None = None) -> str:
    """busybox-static as a one-layer OCI image (default: Cmd ["sh"], Env PATH=/bin)."""
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = make_rootfs(os.path.join(tmp, "rootfs"))
        return write_image_tar(rootfs, out_path, ref, _image_config(entrypoint, cmd, env))
