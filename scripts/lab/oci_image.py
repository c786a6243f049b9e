"""A root directory as a one-layer OCI image layout in a tar, for `ctr images import` and `podman load`."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile


def _blob(tar: tarfile.TarFile, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest.split(':')[1]}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return {"digest": digest, "size": len(data)}


def _layer(rootfs: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as lt:
        for entry in sorted(os.listdir(rootfs)):
            lt.add(os.path.join(rootfs, entry), arcname=entry)
    return buf.getvalue()


def write_image_tar(rootfs: str, out_path: str, ref: str, config: dict) -> str:
    """rootfs as the one layer of image `ref` (config: the image config's "config" object: Env, Cmd...)."""
    with tarfile.open(out_path, "w") as tar:
        layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_blob(tar, _layer(rootfs))}
        image_config = {
            "architecture": "amd64", "os": "linux", "config": config,
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
        }
        config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json",
                       **_blob(tar, json.dumps(image_config).encode())}
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
