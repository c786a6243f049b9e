"""Lazy restore by reference: a create's `oci:REF` restore whose container runs before its memory
has all come from the registry (docs/registry.md, "Lazy restore from a registry").

The rule it keeps: no restored task ever reads a byte that was not verified against the image's
digests, and nothing is committed to the store before every byte of the image is in and verified.

In the create, under the image lock (registry/pull.py lock_image), into the pull's partial directory
(`<store>/.pulls/<digest>/`, journaled in `<digest>.done`, so that this is also a pull):
  1. the manifest, the config and the namespace check (`admit`), as for a full pull;
  2. every file CRIU reads itself, fetched and verified (all files but the pages images); the pages
     images allocated at their full size;
  3. of the pages images, every 64 MiB chunk holding a byte that is not lazy (CRIU reads those
     itself while it restores: pagefill/verify.py eager_chunks), fetched and verified: where the image
     records the chunk's block digests (registry/blocks.py), only the blocks holding such a byte,
     each verified, the rest of the chunk left to the filler.
The restore then runs from the partial directory (ops/restore.py restore_pulling) with the page
filler, whose Verifier fetches every other chunk from the registry before any page of it is installed
(registry/fill.py: faults first, in ranges, or by the blocks of a chunk the create fetched blocks of;
the sweep's whole chunks by registry_parallel fetching processes, registry/fillwork.py; what is
neither eager nor the GPU host copy once the restore finished) and, once every chunk is in,
commits the directory as the pulled checkpoint. The filler holds the image lock until then. A second
restore of the image on this node while that fill runs joins it (a marker beside the journal says
one runs): it restores from the same partial directory, its filler taking each chunk the other has
journaled from disk (verified) and fetching only chunks no filler holds (a lock per chunk), so no
chunk is fetched twice on a node; the first fill commits.

Falls back to the full pull (`ensure_local`), said once in the node's log (`registry_lazy_fallback`,
with the reason): a `--format cri` or CRI-O image (one archive blob), a registry that answers byte
ranges with the whole blob (faults fetch their chunk in ranges), a node where the filler cannot
run (no usable userfaultfd), restore_pages eager, images the filler cannot plan, or memory the page
mode decides to copy eagerly (`lazy_ok`).

A GPU checkpoint restores lazily too, in the order of lazy GPU migration: the GPU record
(migrt-gpu.json, fetched with the other files CRIU reads) says where each CUDA process's host copy of
its GPU memory lies (`gpu_backing`); the filler's Verifier fetches the chunks holding it right after
the eager ones, whole, by the fetching processes (registry_parallel at once), each verified before any
page of it goes in, and fetches no other chunk in the background until they are all in (faults are still
served); each process's GPU restore starts once its host copy is in (ops/pages.py MemoryReady), the
rest fills behind it. Should the fill fail before then, the GPU restore never starts: the create
fails, the container goes, and the GPU is left unlocked with the process.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from migrt.config import Config
from migrt.registry import blocks, image, pull, transfer
from migrt.registry.blocks import is_pages
from migrt.registry.client import Client, Deadline
from migrt.registry.connect import client_for
from migrt.registry.reference import Reference, parse
from migrt.store import Store, importer, reserve
from migrt.store.manifest import Manifest

EVENT_FALLBACK = "registry_lazy_fallback"
CHUNK_LOCKS = ".chunks"  # <store>/.pulls/<digest>.chunks/: a lock file per chunk (registry/fill.py)
# lazy_ok(images, files, recorded survey): None to fill lazily, else why the memory is copied eagerly
LazyOk = Callable[[str, dict, object], str | None]


class Fallback(Exception):
    """This image is restored after a full pull instead (the reason is the message)."""


@dataclass
class Partial:
    """What a restore reads instead of a committed checkpoint: the pull's partial directory, every
    file but the pages images verified on arrival, the pages images verified chunk by chunk as the
    filler fetches them."""
    name: str
    path: str
    manifest: Manifest

    @property
    def images(self) -> str:
        return os.path.join(self.path, "images")

    def verify_structure(self) -> None:
        """(verified on arrival: the restore is told so and never asks)"""

    def verify_hashes(self, rels: list[str]) -> None:
        """(as verify_structure)"""


@dataclass
class LazyImage:
    """An image ready to be restored lazily: the partial checkpoint, the image lock's descriptor (the
    filler takes it over), the filler's hand-over (verify.json with its "registry" section) and what
    the create did (`summary`: chunks in all, present before the restore, seconds)."""
    ckpt: Partial
    lock_fd: int
    handover: dict
    summary: dict = field(default_factory=dict)
    gate_fd: int = -1  # a restore that joined another's fill: keeps that fill from committing (moving the
    # partial directory) until this create is done with it (commit_gate)

    def release(self) -> None:
        """Our copy of the lock goes (the filler keeps its own), and a joined restore's hold on the commit."""
        for fd in (self.lock_fd, self.gate_fd):
            if fd >= 0:
                os.close(fd)
        self.lock_fd = self.gate_fd = -1


def commit_gate(chunk_locks: str, shared: bool) -> int:
    """The lock the creates that joined a fill hold shared while they restore from its partial directory,
    and that fill's commit takes exclusive before it renames that directory into the store."""
    os.makedirs(chunk_locks, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(chunk_locks, "commit"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def prepare(cfg: Config, reference: str, *, admit: pull.Admit, lazy_ok: LazyOk, container_id: str,
            log, refusal: str | None = None, deadline: Deadline | None = None,
            any_registry: bool = False) -> LazyImage | None:
    """The image of a create's request ready to be restored lazily, or None: restore it after the full
    pull (already in the store, or a fallback, said once in `log`). refusal: why this node restores
    after a full pull whatever the image (restore_pages eager, no filler here). deadline: the create's
    whole one (registry_timeout; a full pull after a fallback shares it). any_registry: the operator's
    `migrt restore oci:REF`, not bound by restore_registries (as `migrt pull`). Errors are MigrtErrors."""
    ref = parse(reference) if any_registry else pull.check_allowed(cfg, reference)
    t0 = time.monotonic()
    try:
        if refusal:
            raise Fallback(refusal)
        return _prepare(cfg, ref, admit, lazy_ok, container_id, t0, deadline or pull.create_deadline(cfg))
    except Fallback as exc:
        log.info(EVENT_FALLBACK, container=container_id, reference=reference, reason=str(exc),
                 detail="the image is pulled whole before the restore")
        return None


def _prepare(cfg: Config, ref: Reference, admit: pull.Admit, lazy_ok: LazyOk, cid: str,
             t0: float, deadline: Deadline) -> LazyImage | None:
    store = Store(cfg.store)
    store.ensure()
    if ref.digest and pull.present_as(store, pull.default_name(ref, ref.digest), ref.digest):
        return None
    client = client_for(cfg, ref, deadline=deadline)
    fd = -1
    try:
        raw, _ctype, mdigest = client.get_manifest()
        manifest = image.parse(raw, str(ref))
        if image.kind(manifest) == "index":
            raw, mdigest, manifest = pull.from_index(client, manifest, ref)
        if image.kind(manifest) != "migrt":
            raise Fallback("a --format cri or CRI-O image (one archive blob) cannot be read at an offset")
        name = pull.default_name(ref, mdigest)
        deadline.allow(pull.layer_bytes(manifest))
        got = pull.lock_image(store, mdigest, deadline, meanwhile=lambda: _fill_in_progress(store, mdigest))
        if isinstance(got, dict):  # another restore of it fills it lazily: fill beside it
            return _join(store, mdigest, got, admit, cid, t0)
        assert isinstance(got, int)
        fd = got
        _drop_marker(store, mdigest)  # (a fill that failed left it: ours now)
        if store.exists(name):  # pulled meanwhile (or another checkpoint: the full pull says so)
            return None
        t_open = time.monotonic()  # the registry's manifest read and the image locked
        out = _fetch_eager(cfg, client, store, manifest, mdigest, name, admit, lazy_ok, cid)
        out.lock_fd, fd = fd, -1
        out.summary["open_s"] = round(t_open - t0, 3)
        out.summary["seconds"] = round(time.monotonic() - t0, 3)
        _write_marker(store, mdigest, out)
        return out
    finally:
        client.close()
        if fd >= 0:
            os.close(fd)


def _fetch_eager(cfg: Config, client: Client, store: Store, manifest: dict, mdigest: str, name: str,
                 admit: pull.Admit, lazy_ok: LazyOk, cid: str) -> LazyImage:
    """Steps 1-3 of the module's doc; the partial directory stays for the filler (or a full pull)."""
    t_start = time.monotonic()
    where = str(client.ref)
    config = pull.fetch_config(client, manifest, where)
    admit(image.namespace(manifest, config))
    if isinstance(config.get("pod"), dict):  # ops/pod_restore.py: every container restores its part of it
        raise Fallback("a pod checkpoint (each container's create restores its own part from the store)")
    plan = image.plan_files(manifest, config["files"], where)
    records = blocks.records(manifest, where)
    pages = {rel: chunks for rel, chunks in plan.items() if is_pages(rel)}
    if not pages:
        raise Fallback("the image has no pages images to fill")
    big = max((c for chunks in pages.values() for c in chunks), key=lambda c: c[1])
    if not client.serves_ranges(big[2], big[1]):
        raise Fallback(f"registry {client.host} answers byte ranges with the whole blob")
    hexd = mdigest.split(":", 1)[1]
    partial = os.path.dirname(store.private_dir(f"{pull.PULLS}/{hexd}/images"))
    journal = pull.Journal(os.path.join(store.root, pull.PULLS, hexd + ".done"))
    with importer.importing(store, name, adopt=partial) as imp:
        have = pull.resume_from(partial, plan, journal)
        files = config["files"]
        imp.ensure_space(imp.space.alloc.files(f.get("size", 0) for f in files.values()) - sum(have.values()))
        client.deadline.allow(sum(f.get("size", 0) for f in files.values()) - sum(have.values()))
        pull.allocate_files(partial, plan, sparse=_sparse_pages(partial, pages))
        imp.space.settle()
        fetch = _fetcher(cfg, client, store, partial, journal, have)
        marks = [time.monotonic()]  # what the create's part spent: the other files, the plan, the eager chunks
        fetch([(rel, c) for rel, chunks in plan.items() if rel not in pages for c in chunks])
        marks.append(time.monotonic())
        why = lazy_ok(imp.images, files, config.get("pagefill"))
        if why:
            raise Fallback(why)
        eager = _eager_chunks(imp.images, pages)
        marks.append(time.monotonic())
        partly = _fetch_eager_chunks(cfg, client, store, partial, pages, eager, records, have, fetch)
        marks.append(time.monotonic())
    t_end = time.monotonic()
    present = {rel: [i for i, (off, _s, d) in enumerate(chunks) if (d, off, rel) in have]
               for rel, chunks in pages.items()}
    pulled = {"reference": str(client.ref), "registry": client.ref.registry, "repository": client.ref.repository,
              "manifest_digest": mdigest, "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "lazy": True}
    handover = _handover(cfg, client, name, cid, partial, journal.path, pages, present,
                         {"store": store.root, "name": name, "plan": plan, "config": config, "pulled": pulled},
                         partly, records)
    total = sum(len(c) for c in pages.values())
    summary = {"chunks": total, "present": sum(len(p) for p in present.values()),
               "partly": sum(len(p) for p in partly.values()), "bytes_received": client.stats.received,
               "setup_s": round(marks[0] - t_start, 3), "close_s": round(t_end - marks[-1], 3),
               **{f"{k}_s": round(b - a, 3)
                  for k, a, b in zip(("files", "plan", "eager"), marks[:-1], marks[1:], strict=True)}}
    # as the commit will write it: our name, and `pulled` (a pulled layer is applied without setuid bits)
    view = Manifest.from_dict({**config, "name": name, "pulled": pulled})
    return LazyImage(Partial(name, partial, view), -1, handover, summary)


def _sparse_pages(partial: str, pages: dict) -> frozenset[str]:
    """On a tmpfs store the pages images are not fallocated before the restore: there it takes the
    memory and zeroes it (0.8 s for a 4 GiB GPU checkpoint on an H200 host, most of the create's part);
    the room was reserved already (ensure_space), and a write that still finds none fails the fill with
    its reason, the container stopped (registry/fill.py). Elsewhere fallocate only marks the blocks."""
    from migrt.store import hugetmpfs

    mount = hugetmpfs.mount_of(partial)
    return frozenset(pages) if mount is not None and mount.tmpfs else frozenset()


def _fetcher(cfg: Config, client: Client, store: Store, partial: str, journal, have: dict):
    """fetch([(rel, (offset, size, digest))]): those not in `have` into the partial directory, verified
    and journaled (`have` gains them)."""
    def fetch(chunks: list[tuple[str, tuple[int, int, str]]]) -> None:
        todo = [(rel, c) for rel, c in chunks if (c[2], c[0], rel) not in have]
        jobs = [transfer.Blob(d, s, os.path.join(partial, rel), off) for rel, (off, s, d) in todo]

        def landed(b: transfer.Blob) -> None:
            rel = os.path.relpath(b.path, partial)
            journal.add(b.digest, b.offset, rel)
            have[(b.digest, b.offset, rel)] = b.size
        transfer.fetch(client, jobs, cfg.registry_parallel, on_blob=landed,
                       write_error=lambda exc: reserve.enospc(exc, f"pulling {client.ref}", store.root))
    return fetch


def _eager_chunks(images: str, pages: dict[str, list]) -> dict[str, blocks.Eager]:
    """Per pages image, the lazy ranges and the chunks holding a byte that is not lazy (CRIU reads them
    itself): blocks.eager_plan, as the push plans them."""
    from migrt.pagefill import ImageError

    try:
        return blocks.eager_plan(images, {rel: sum(c[1] for c in chunks) for rel, chunks in pages.items()})
    except ImageError as exc:
        raise Fallback(f"the page filler cannot plan the images ({exc})") from exc


def _fetch_eager_chunks(cfg: Config, client: Client, store: Store, partial: str, pages: dict,
                        eager: dict[str, blocks.Eager], records: dict, have: dict, fetch) -> dict:
    """The eager chunks: of those the image has block digests for (and not in yet), only the blocks
    holding an eager byte, verified; the others whole. Returns {rel: {chunk index: verified ranges}}."""
    jobs, whole = [], []
    for rel, e in eager.items():
        for i in e.chunks:
            off, size, digest = pages[rel][i]
            rec = records.get((rel, off))
            want = blocks.needed(off, off + size, rec.size, e.lazy) if rec is not None else []
            if rec is None or (digest, off, rel) in have or len(want) == len(rec.digests):
                whole.append((rel, pages[rel][i]))
            else:
                jobs.append(blocks.Job(rel, i, off, size, digest, rec, want))
    partly, refused = blocks.fetch_blocks(client, partial, jobs, cfg.registry_parallel,
                                          lambda exc: reserve.enospc(exc, f"pulling {client.ref}", store.root))
    fetch(whole + [(j.rel, pages[j.rel][j.index]) for j in refused])
    return partly


def _handover(cfg: Config, client: Client, name: str, cid: str, partial: str, journal: str, pages: dict,
              present: dict, commit: dict, partly: dict, records: dict) -> dict:
    """The filler's verify.json (pagefill/verify.py build) with what it fetches from and commits to;
    "partly": the ranges of eager chunks the create fetched only the blocks of (registry/blocks.py), and
    "blocks": their block digests (a fault there takes its blocks only)."""
    files = {rel.rsplit("/", 1)[1]: {"rel": rel, "size": sum(c[1] for c in chunks),
                                    "chunks": "".join(d.split(":", 1)[1] for _o, _s, d in chunks),
                                    **({"partly": {str(i): r for i, r in sorted(partly[rel].items())},
                                        "blocks": {str(i): records[(rel, chunks[i][0])].value() for i in partly[rel]}}
                                       if partly.get(rel) else {})}
             for rel, chunks in pages.items()}
    registry = {"registry": client.ref.registry, "repository": client.ref.repository,
                "digest": commit["pulled"]["manifest_digest"], "auth_file": cfg.registry_auth_file,
                "ca_file": cfg.registry_ca_file, "parallel": cfg.registry_parallel, "timeout": cfg.registry_timeout,
                "container_id": cid, "partial": partial, "journal": journal, "log_file": cfg.log_file,
                "chunk_locks": journal[:-len(".done")] + CHUNK_LOCKS,
                "present": {rel.rsplit("/", 1)[1]: idx for rel, idx in present.items()}, "commit": commit}
    return {"checkpoint": name, "files": files, "registry": registry}


# -- restores of one image at once on a node -------------------------------------------------------

def _write_marker(store: Store, mdigest: str, out: LazyImage) -> None:
    """Said once the create's part is in: restores of the image that come while its fill runs join it."""
    from migrt.store.fsutil import write_json_atomic

    write_json_atomic(pull.fill_marker(store, mdigest), {"name": out.ckpt.name, "partial": out.ckpt.path,
                                                     "handover": out.handover})


def _drop_marker(store: Store, mdigest: str) -> None:
    try:
        os.unlink(pull.fill_marker(store, mdigest))
    except FileNotFoundError:
        pass


def _fill_in_progress(store: Store, mdigest: str) -> dict | None:
    """The marker of a lazy fill of the image, read while its lock is held (by that fill: whoever takes
    the lock removes an old marker first, and only a lazy restore writes one, once its eager part is in)."""
    from migrt import jsonsafe

    try:
        with open(pull.fill_marker(store, mdigest), encoding="utf-8") as fh:
            data = jsonsafe.load(fh, max_bytes=64 << 20)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("handover"), dict) else None


def _join(store: Store, mdigest: str, marker: dict, admit: pull.Admit, cid: str, t0: float) -> LazyImage | None:
    """A restore of an image another restore is filling lazily: from the same partial directory, its
    filler taking each chunk another has fetched (journaled) from disk, verified, and fetching itself
    only a chunk no one holds (a lock per chunk: registry/fill.py); the first fill commits the image,
    not before this create is done with the directory (commit_gate). None: committed meanwhile (restore
    it from the store)."""
    handover = marker["handover"]
    reg = dict(handover["registry"])
    config, pulled = reg["commit"]["config"], reg["commit"]["pulled"]
    admit(image.namespace({}, config))
    gate = commit_gate(reg["chunk_locks"], shared=True)
    if not os.path.exists(pull.fill_marker(store, mdigest)):  # the fill committed (or failed) meanwhile
        os.close(gate)
        return None
    journal = pull.Journal(reg["journal"])
    present = {}
    for base, f in handover["files"].items():
        digests = ["sha256:" + f["chunks"][k:k + 64] for k in range(0, len(f["chunks"]), 64)]
        present[base] = [i for i, d in enumerate(digests) if (d, i * image.CHUNK, f["rel"]) in journal.done]
    reg.update(present=present, container_id=cid, join=True)
    summary = {"chunks": sum(len(f["chunks"]) // 64 for f in handover["files"].values()),
               "present": sum(len(p) for p in present.values()), "joined": True,
               "seconds": round(time.monotonic() - t0, 3)}
    view = Manifest.from_dict({**config, "name": marker["name"], "pulled": pulled})
    return LazyImage(Partial(marker["name"], marker["partial"], view), -1, {**handover, "registry": reg}, summary,
                     gate_fd=gate)
