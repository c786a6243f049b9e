"""How a checkpoint is laid out as an OCI image (docs/registry.md).

Format "migrt" (the default; large checkpoints):
  config  application/vnd.migrt.checkpoint.config.v1+json: migrt's manifest.json (files with their
          digests, CRIU options, the GPU section, source, versions)
  layers  application/vnd.migrt.checkpoint.file.v1: raw bytes, one blob per file of at most 64 MiB,
          and one blob per 64 MiB chunk of larger files (CRIU page images), annotated with the file's
          path in the checkpoint and the chunk's offset. 64 MiB is the store's digest tree chunk: a
          chunk's blob digest IS the leaf of the file's sha256_tree, so a pulled file's manifest
          digest follows from the blobs verified on arrival, with no second pass; unchanged chunks
          have unchanged digests, so a second push sends only what changed. A pages image's chunk
          that CRIU reads a few bytes of itself also carries its 1 MiB blocks' digests
          (io.migrt.checkpoint.blocks, registry/blocks.py): a lazy restore fetches only those blocks.

Format "cri" (`--format cri`; what CRI-O, Podman and checkpointctl use): one
application/vnd.oci.image.layer.v1.tar layer holding the checkpoint archive layout (`migrt export`),
the CRI-O checkpoint annotations on the manifest, an ordinary OCI image config. migrt's manifest
(GPU section included) travels inside as migrt-manifest.json.
"""

from __future__ import annotations

import json
import re

from migrt import jsonsafe
from migrt.errors import CheckpointInvalid
from migrt.store.fsutil import TREE_CHUNK
from migrt.store.manifest import Manifest, Source
from migrt.text import printable

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
ARTIFACT_TYPE = "application/vnd.migrt.checkpoint.v1"
CONFIG_TYPE = "application/vnd.migrt.checkpoint.config.v1+json"
FILE_TYPE = "application/vnd.migrt.checkpoint.file.v1"
OCI_CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
TAR_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
             "application/vnd.docker.image.rootfs.diff.tar.gzip", "application/vnd.oci.image.layer.v1.tar+zstd")
A_PATH = "io.migrt.checkpoint.path"
A_OFFSET = "io.migrt.checkpoint.offset"
A_NAME = "io.migrt.checkpoint.name"
A_CHUNK = "io.migrt.checkpoint.chunk-size"
CHUNK = TREE_CHUNK
MAX_LAYERS = 100_000
# Nesting a manifest or config may have (migrt's own manifest nests about 6 deep): deeper JSON from a
# registry is refused, not handed to code that walks it recursively.
MAX_JSON_DEPTH = 64
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
# Where CRI-O's checkpoint images say the Kubernetes namespace of the pod they were taken in.
CRIO_NAMESPACE = "io.kubernetes.cri-o.annotations.checkpoint.namespace"
# What CRI-O (and Podman, containerd) write on a checkpoint image; any of them marks one.
CRIO_NAME = "io.kubernetes.cri-o.annotations.checkpoint.name"
CHECKPOINT_NAME_KEYS = (CRIO_NAME, "io.podman.annotations.checkpoint.name",
                        "io.kubernetes.containerd.annotations.checkpoint.name", "org.criu.checkpoint.container.name")


def descriptor(media_type: str, digest: str, size: int, annotations: dict | None = None) -> dict:
    out = {"mediaType": media_type, "digest": digest, "size": size}
    if annotations:
        out["annotations"] = annotations
    return out


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def migrt_manifest(config: dict, layers: list[dict], name: str, created: str) -> dict:
    """Deterministic: the same checkpoint gives the same manifest digest (created = the checkpoint's)."""
    return {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": config,
        "layers": layers,
        "annotations": {A_NAME: name, A_CHUNK: str(CHUNK),
                        "org.opencontainers.image.created": created},
    }


def cri_annotations(manifest: Manifest) -> dict:
    """The CRI-O checkpoint annotations from a migrt manifest (what `checkpointctl build` sets)."""
    src, cri = manifest.source, manifest.source.cri
    out = {
        CRIO_NAME: cri.container_name or src.container_id or manifest.name,
        "io.kubernetes.cri-o.annotations.checkpoint.rootfsImageName": src.image or cri.image_name or "",
        "io.kubernetes.cri-o.annotations.checkpoint.criu.version": str(manifest.versions.get("criu") or ""),
        "io.kubernetes.cri-o.annotations.checkpoint.runtime.name": "migrt-runc",
        A_NAME: manifest.name,
    }
    # Podman reads its own keys (podman container restore IMAGE)
    out["io.podman.annotations.checkpoint.name"] = out[CRIO_NAME]
    crio = out["io.kubernetes.cri-o.annotations.checkpoint.rootfsImageName"]
    out["io.podman.annotations.checkpoint.rootfsImageName"] = crio
    out["io.podman.annotations.checkpoint.runtime.name"] = "runc"
    if cri.pod_name:
        out["io.kubernetes.cri-o.annotations.checkpoint.pod"] = cri.pod_name
    if cri.pod_namespace:
        out["io.kubernetes.cri-o.annotations.checkpoint.namespace"] = cri.pod_namespace
    return {k: v for k, v in out.items() if isinstance(v, str)}


def cri_manifest(config: dict, layer: dict, manifest: Manifest) -> dict:
    return {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config, "layers": [layer],
            "annotations": cri_annotations(manifest)}


def cri_config(layer_digest: str, created: str) -> dict:
    return {"architecture": "amd64", "os": "linux", "created": created, "config": {},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created": created, "created_by": "migrt push --format cri"}]}


# -- reading a pulled manifest ------------------------------------------------------------------

def load_json(raw: bytes, where: str, what: str):
    """JSON from a registry, nested at most MAX_JSON_DEPTH deep (migrt.jsonsafe); CheckpointInvalid
    otherwise (never a RecursionError from the parser or from code that walks the result later)."""
    try:
        data = jsonsafe.loads(raw, max_depth=MAX_JSON_DEPTH)
    except jsonsafe.JSONRejected as exc:
        raise CheckpointInvalid(f"{where}: {what} is {exc.msg}; not read") from exc
    except ValueError as exc:
        raise CheckpointInvalid(f"{where}: {what} is not JSON ({printable(exc, 120)})") from exc
    return data


def namespace(manifest: dict, config: dict | None = None) -> str | None:
    """The Kubernetes namespace an image says its checkpoint was taken in (None: it does not say):
    a migrt image's config (its checkpoint manifest), or a CRI-O checkpoint image's annotation."""
    ns = Source.from_dict(config.get("source")).cri.pod_namespace if isinstance(config, dict) else None
    if ns is None:
        ann = manifest.get("annotations")
        ns = ann.get(CRIO_NAMESPACE) if isinstance(ann, dict) else None
    return ns if isinstance(ns, str) and ns else None


def parse(raw: bytes, where: str) -> dict:
    data = load_json(raw, where, "the image manifest")
    if not isinstance(data, dict) or data.get("schemaVersion") != 2:
        raise CheckpointInvalid(f"{where}: not an OCI image manifest (schemaVersion 2)")
    return data


def kind(manifest: dict) -> str:
    """'migrt' (chunked checkpoint), 'archive' (a CRI-O/Podman/`--format cri` checkpoint image) or
    'index' (a list of manifests); CheckpointInvalid for an image that holds no checkpoint."""
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
        return "index"
    cfg = manifest.get("config")
    if isinstance(cfg, dict) and cfg.get("mediaType") == CONFIG_TYPE:
        return "migrt"
    ann = manifest.get("annotations")
    layers = manifest.get("layers")
    if isinstance(ann, dict) and any(k in ann for k in CHECKPOINT_NAME_KEYS) and isinstance(layers, list) \
            and len(layers) == 1 and isinstance(layers[0], dict) and layers[0].get("mediaType") in TAR_TYPES:
        return "archive"
    raise CheckpointInvalid("the image is not a checkpoint: neither a migrt checkpoint image nor a single-layer "
                            f"checkpoint image with the CRI-O annotation {CRIO_NAME}")


def check_descriptor(d: object, where: str) -> dict:
    if not isinstance(d, dict) or not isinstance(d.get("digest"), str) or not _SHA256.fullmatch(d["digest"]) \
            or not isinstance(d.get("size"), int) or isinstance(d.get("size"), bool) or d["size"] < 0:
        raise CheckpointInvalid(f"{where}: a descriptor without a sha256 digest and size")
    return d


def plan_files(manifest: dict, files: dict, where: str) -> dict[str, list[tuple[int, int, str]]]:
    """{rel: [(offset, size, digest)]} from a migrt image's layers, checked against the files of the
    config's manifest: every file covered exactly, in 64 MiB chunks (the tree digest's), nothing else."""
    from migrt.store.importer import check_relpath

    layers = manifest.get("layers")
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
        raise CheckpointInvalid(f"{where}: the image manifest has no usable layer list")
    plan: dict[str, list[tuple[int, int, str]]] = {}
    for d in layers:
        check_descriptor(d, where)
        ann = d.get("annotations") or {}
        rel, off = ann.get(A_PATH), ann.get(A_OFFSET, "0")
        if d.get("mediaType") != FILE_TYPE or not isinstance(rel, str) or not isinstance(off, str) or not off.isdigit():
            raise CheckpointInvalid(f"{where}: layer {d.get('digest')} is not a migrt checkpoint file blob")
        check_relpath(rel)
        plan.setdefault(rel, []).append((int(off), d["size"], d["digest"]))
    if set(plan) != set(files):
        extra = sorted(set(plan) ^ set(files))
        raise CheckpointInvalid(f"{where}: file '{printable(extra[0], 200)}' is in the image's layers or its "
                                "manifest, not in both")
    for rel, chunks in plan.items():
        chunks.sort()
        size = files[rel].get("size") if isinstance(files[rel], dict) else None
        pos = 0
        for off, length, _ in chunks:
            if off != pos or (length != CHUNK and off + length != size) or length > CHUNK:
                raise CheckpointInvalid(f"{where}: the blobs of {rel} do not cover it in {CHUNK >> 20} MiB chunks")
            pos += length
        if pos != size or (size == 0 and len(chunks) != 1):
            raise CheckpointInvalid(f"{where}: the blobs of {rel} add up to {pos} bytes, its manifest says {size}")
    return plan
