"""Build a tiny OCI image (busybox-static) as an OCI layout tar, for `ctr images import`."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile

from tests.helpers.bundles import make_rootfs

IMAGE_REF = "docker.io/migrt/busybox:test"


def _blob(tar: tarfile.TarFile, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest.split(':')[1]}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return {"digest": digest, "size": len(data)}


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
        layer_buf = io.BytesIO()
        with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as lt:
            for entry in sorted(os.listdir(rootfs)):
                lt.add(os.path.join(rootfs, entry), arcname=entry)
        layer = layer_buf.getvalue()
    with tarfile.open(out_path, "w") as tar:
        layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_blob(tar, layer)}
        config = {
            "architecture": "amd64", "os": "linux",
            "config": _image_config(entrypoint, cmd, env),
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
        }
        config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json",
                       **_blob(tar, json.dumps(config).encode())}
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": config_desc, "layers": [layer_desc]}
        manifest_desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                         **_blob(tar, json.dumps(manifest).encode()),
                         "annotations": {"io.containerd.image.name": ref,
                                         "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}
        for name, data in (("oci-layout", {"imageLayoutVersion": "1.0.0"}),
                           ("index.json", {"schemaVersion": 2, "manifests": [manifest_desc]})):
            raw = json.dumps(data).encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return out_path
