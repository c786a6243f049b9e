"""`migrt push`: a store checkpoint to a registry as an OCI image (format: migrt.registry.image).

Order: the checkpoint is locked for reading and every file hashed in 64 MiB chunks (which also
verifies it against its manifest: a corrupted checkpoint is never pushed); the registry is asked
which blobs it already has (HEAD, in parallel); only the missing blobs are uploaded, several at a
time, each streamed from its file range; the config blob and then the manifest come last, so a
reference never names an image whose blobs are missing. A push cut off midway leaves blobs behind
that the next push finds and skips.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from migrt import log as log_mod
from migrt import names
from migrt.config import Config
from migrt.errors import CheckpointInvalid, UsageError
from migrt.progress import Progress, null_progress
from migrt.registry import blocks, image
from migrt.registry.client import Client, Deadline, sha256_bytes
from migrt.registry.connect import client_for, deadline_for
from migrt.registry.reference import Reference, parse
from migrt.store import Store
from migrt.store.fsutil import digest_of, fold_chunks, hash_chunks


def push(cfg: Config, name: str, reference: str, *, fmt: str = "migrt", progress: Progress = null_progress,
         deadline: Deadline | None = None) -> dict:
    """deadline: the end of the whole push, hashing included (None: connect.deadline_for's default)."""
    deadline = deadline or deadline_for(cfg, "migrt push")
    names.validate(name)
    ref = parse(reference)
    if not ref.tag or ref.digest:
        raise UsageError(f"push needs a tag to write (registry/repository:tag), got {reference!r}")
    if fmt not in ("migrt", "cri"):
        raise UsageError(f"--format must be migrt or cri, got {fmt!r}")
    store = Store(cfg.store)
    t_start = time.monotonic()
    with store.reading(name) as ckpt:
        deadline.allow(ckpt.manifest.size_bytes or 0)  # our own checkpoint: its size is known
        client = client_for(cfg, ref, push=True, deadline=deadline)
        try:
            if fmt == "migrt":
                result = _push_chunked(cfg, client, ckpt, ref, progress)
            else:
                result = _push_archive(cfg, client, store, ckpt, ref, progress)
        finally:
            client.close()
    st = client.stats
    result.update(checkpoint=name, reference=str(ref), format=fmt, bytes_sent=st.sent, bytes_skipped=st.skipped,
                  requests=st.requests, retries=st.retries, seconds=round(time.monotonic() - t_start, 3))
    return result


def _upload(cfg: Config, client: Client, blobs: dict[str, tuple[str, int, int]], progress: Progress) -> int:
    """blobs: {digest: (path, offset, size)}; HEAD each, upload the missing. Returns bytes skipped."""
    total = sum(b[2] for b in blobs.values())
    progress("phase", name="upload", total_bytes=total)
    t0 = time.monotonic()

    def one(digest: str) -> tuple[int, bool]:
        path, off, size = blobs[digest]
        if client.blob_exists(digest, size):
            client.stats.add(skipped=size)
            return size, False
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            client.upload_blob(digest, fd, off, size)
        finally:
            os.close(fd)
        return size, True

    skipped = 0
    with ThreadPoolExecutor(max_workers=cfg.registry_parallel) as pool:
        futures = [pool.submit(one, d) for d in blobs]
        try:
            for fut in as_completed(futures):
                size, sent = fut.result()
                skipped += 0 if sent else size
                progress("bytes", name="upload", bytes=size)
        except BaseException:
            for f in futures:  # the first failure stops the push: blobs not started are not tried
                f.cancel()
            raise
    progress("done", name="upload", seconds=round(time.monotonic() - t0, 3))
    return skipped


def _push_chunked(cfg: Config, client: Client, ckpt, ref: Reference, progress: Progress) -> dict:
    manifest = ckpt.manifest
    files = manifest.files
    progress("phase", name="hash", total_bytes=manifest.size_bytes or 0)
    t0 = time.monotonic()
    chunks = hash_chunks(ckpt.path, sorted(files), progress=lambda n: progress("bytes", name="hash", bytes=n))
    progress("done", name="hash", seconds=round(time.monotonic() - t0, 3))
    layers: list[dict] = []
    blobs: dict[str, tuple[str, int, int]] = {}
    for rel in sorted(files):
        if fold_chunks([c[2] for c in chunks[rel]]) != digest_of(files[rel]):
            raise CheckpointInvalid(f"checkpoint {ckpt.name}: sha256 mismatch in {rel}; not pushing a corrupted "
                                    f"checkpoint (run 'migrt inspect --verify {ckpt.name}')")
    # the eager chunks' block digests: a lazy restore by reference fetches only the blocks CRIU reads
    def said(event: str, **kw) -> None:
        log_mod.get().info(event, checkpoint=ckpt.name, **kw)
    records = blocks.for_push(ckpt.path, chunks, said)
    for rel in sorted(files):
        for off, length, raw in chunks[rel]:
            digest = "sha256:" + raw.hex()
            extra = {blocks.A_BLOCKS: records[(rel, off)]} if (rel, off) in records else {}
            layers.append(image.descriptor(image.FILE_TYPE, digest, length,
                                           {image.A_PATH: rel, image.A_OFFSET: str(off), **extra}))
            blobs.setdefault(digest, (os.path.join(ckpt.path, rel), off, length))
    _upload(cfg, client, blobs, progress)
    config_bytes = image.dumps(manifest.raw)
    config = image.descriptor(image.CONFIG_TYPE, client.put_blob_bytes(config_bytes), len(config_bytes))
    raw = image.dumps(image.migrt_manifest(config, layers, ckpt.name, manifest.created or ""))
    digest = client.put_manifest(raw, image.MANIFEST_TYPE, ref.tag or "")  # (push() refused a reference without)
    return {"digest": digest, "size_bytes": manifest.size_bytes, "layers": len(layers), "blobs": len(blobs),
            "block_records": len(records)}


def _push_archive(cfg: Config, client: Client, store: Store, ckpt, ref: Reference, progress: Progress) -> dict:
    from migrt.pods.export_cri import export

    store.ensure()
    with tempfile.TemporaryDirectory(dir=os.path.join(store.root, ".tmp"), prefix=f"push.{os.getpid()}.") as tmp:
        tar = os.path.join(tmp, "checkpoint.tar")
        progress("phase", name="archive", total_bytes=ckpt.manifest.size_bytes or 0)
        t0 = time.monotonic()
        info = export(ckpt, tar, verify=True,  # its bytes are this phase's; its own phase events are not
                      progress=lambda event, **f: progress("bytes", name="archive", bytes=f["bytes"])
                      if event == "bytes" else None)
        progress("done", name="archive", seconds=round(time.monotonic() - t0, 3))
        digest, size = info["sha256"], info["size"]
        _upload(cfg, client, {digest: (tar, 0, size)}, progress)
    layer = image.descriptor(image.TAR_TYPES[0], digest, size)
    created = ckpt.manifest.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    config_bytes = image.dumps(image.cri_config(digest, created))
    config = image.descriptor(image.OCI_CONFIG_TYPE, client.put_blob_bytes(config_bytes), len(config_bytes))
    raw = image.dumps(image.cri_manifest(config, layer, ckpt.manifest))
    mdigest = client.put_manifest(raw, image.MANIFEST_TYPE, ref.tag or "")
    return {"digest": mdigest, "size_bytes": size, "layers": 1, "blobs": 1, "config_digest": sha256_bytes(config_bytes)}
