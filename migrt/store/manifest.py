"""manifest.json: what a checkpoint holds and how to check it.

Schema 1:
  schema, name, created (ISO 8601 UTC), source {container_id, runtime_root, bundle, pid, status,
  cri {pod_namespace, pod_name, container_name, ...}}, versions {migrt, runc, criu, kernel},
  options {leave_running, tcp_established, ext_unix_sk, shell_job, file_locks, ...},
  size_bytes, files {relpath: {size, sha256 (files up to 64 MiB) or sha256_tree (sha256 over the
  sha256 of each 64 MiB chunk)}}, timings {phase: seconds}, gpu (GPU issue; optional),
  root_mode (st_mode of the container's root directory at checkpoint; optional: a restore whose new
  root has the same mode leaves CRIU's files.img as it is),
  pagefill (optional: the page filler's survey of the images, {rules, fillable, lazy_bytes | reason},
  taken beside the commit's hashing; a restore under restore_pages auto chooses eager or lazy from it
  without reading the images, and plans them when it is absent, malformed or of other rules:
  migrt/pagefill/images.py survey, migrt/ops/pages.py decide),
  chunks (optional: {relpath: the sha256 of each 64 MiB chunk, hex, concatenated} for every file of
  more than one chunk, written at commit from the hashing that made its sha256_tree; used only when it
  folds into that digest: a restore through the page filler verifies each chunk of a pages image
  before it installs a page from it, docs/restore-pages.md; fsutil.chunk_digests).
Optional fields are added within a schema: readers ignore fields they do not know, so an older migrt
reads a newer manifest of the same schema. A manifest from a newer schema is refused rather than misread.

Read here into a `Manifest` (typed fields; a field of the wrong JSON type reads as absent, as an older
checkpoint's missing one does) that keeps the object as read (`raw`): written back, a manifest is the
same JSON, its unknown fields included. Written here too (`write`, `assemble`).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field

from migrt import jsonsafe
from migrt.errors import CheckpointInvalid
from migrt.store.fsutil import chunk_digests, chunk_record, digest_of, hash_tree, walk_files, write_json_atomic
from migrt.text import printable

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

SCHEMA = 1
MANIFEST = "manifest.json"
REQUIRED = ("schema", "name", "created", "files")
CHUNKS = "chunks"
MAX_BYTES = 64 << 20  # manifest.json read back (bounded JSON): 100,000 files take ~15 MB
OWN_FIELDS = ("schema", "name", "files", "size_bytes")  # what the store writes itself at a commit


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Cri:
    """Who the container was in Kubernetes (`source.cri`: CRI annotations of its bundle)."""
    pod_namespace: str | None = None
    pod_name: str | None = None
    pod_uid: str | None = None
    container_name: str | None = None
    image_name: str | None = None
    sandbox_id: str | None = None

    @classmethod
    def from_dict(cls, data: object) -> Cri:
        d = _dict(data)
        return cls(**{k: _str(d.get(k)) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Source:
    """The container checkpointed (`source`); an import's or a pull's has no runtime root or bundle."""
    container_id: str | None = None
    cri: Cri = field(default_factory=Cri)
    cri_fields: dict[str, Any] = field(default_factory=dict)  # `cri` as written (any keys), for display
    annotations: dict[str, Any] = field(default_factory=dict)  # its config.json's
    runtime_root: str | None = None
    bundle: str | None = None
    pid: int | None = None
    status: str | None = None  # runc's, at the checkpoint: running or paused
    container_name: str | None = None  # an import's: containerd's name for it
    image: str | None = None
    image_ref: str | None = None  # an import's: the image's digest reference (containerd's config.dump)
    runtime: str | None = None  # an import's: the runtime that ran it

    @classmethod
    def from_dict(cls, data: object) -> Source:
        d = _dict(data)
        return cls(container_id=_str(d.get("container_id")), container_name=_str(d.get("container_name")),
                   runtime_root=_str(d.get("runtime_root")), bundle=_str(d.get("bundle")), pid=_int(d.get("pid")),
                   status=_str(d.get("status")), image=_str(d.get("image")), image_ref=_str(d.get("image_ref")),
                   runtime=_str(d.get("runtime")), cri=Cri.from_dict(d.get("cri")),
                   cri_fields=_dict(d.get("cri")), annotations=_dict(d.get("annotations")))


@dataclass(frozen=True)
class Mount:
    """A mount of the checkpointed container's config.json (`mounts`)."""
    destination: str | None
    type: str | None
    source: str | None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Mount:
        return cls(_str(data.get("destination")), _str(data.get("type")), _str(data.get("source")))


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest.json, typed (the schema in the module docstring). `raw`: the object as
    read, what `write` puts back and what is shown or pushed as the checkpoint's manifest."""
    schema: int
    name: str
    files: dict[str, dict[str, Any]]
    raw: dict[str, Any]
    created: str | None = None
    size_bytes: int | None = None
    source: Source = field(default_factory=Source)
    versions: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    rootfs: dict[str, Any] = field(default_factory=dict)  # the writable layer's capture (`captured`, ...)
    timings: dict[str, Any] = field(default_factory=dict)
    gpu: dict[str, Any] | None = None  # the GPU section (gpu/records.py); None: no CUDA process
    devshm: dict[str, Any] | None = None  # an imported /dev/shm (pods/engines.py)
    root_mode: int | None = None
    pagefill: dict[str, Any] | None = None  # the page filler's survey (pagefill/images.py)
    imported: dict[str, Any] | None = None  # from an archive (pods/import_cri.py)
    pulled: dict[str, Any] | None = None  # from a registry (registry/pull.py)
    op_id: str | None = None  # the journal entry of the commit (ops/recover.py)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """The typed view of a manifest that passed `load`'s checks (schema, name, files)."""
        def section(key: str) -> dict[str, Any] | None:
            value = data.get(key)
            return value if isinstance(value, dict) and value else None

        mounts = data.get("mounts")
        mounts = mounts if isinstance(mounts, list) else []
        return cls(schema=data["schema"], name=data["name"], files=data["files"], raw=data,
                   created=_str(data.get("created")), size_bytes=_int(data.get("size_bytes")),
                   source=Source.from_dict(data.get("source")), versions=_dict(data.get("versions")),
                   options=_dict(data.get("options")),
                   mounts=[Mount.from_dict(m) for m in mounts if isinstance(m, dict)],
                   rootfs=_dict(data.get("rootfs")), timings=_dict(data.get("timings")), gpu=section("gpu"),
                   devshm=section("devshm"), root_mode=_int(data.get("root_mode")), pagefill=section("pagefill"),
                   imported=section("imported"), pulled=section("pulled"), op_id=_str(data.get("op_id")))

    @property
    def captured(self) -> bool:
        """Whether the checkpoint carries the container's writable layer (a restore applies it)."""
        return bool(self.rootfs.get("captured"))

    @property
    def from_registry(self) -> bool:
        """Pulled from a registry (any `pulled` record): its writable layer is applied without setuid/setgid."""
        return bool(self.raw.get("pulled"))

    # The mapping of the manifest as read, for the readers not yet moved to the fields above.
    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)


def assemble(fields: dict[str, Any], name: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A manifest to commit: the writer's `fields` (its own schema, name, files and size dropped), then
    the store's: schema, name, the files' entries and their total size."""
    data = {k: v for k, v in fields.items() if k not in OWN_FIELDS}
    data.update(schema=SCHEMA, name=name, files=files, size_bytes=sum(f["size"] for f in files.values()))
    return data


def chunk_records(files: dict, chunks: dict[str, list[bytes]]) -> dict[str, str]:
    """The manifest's `chunks` field: the chunk digests of every file of more than one 64 MiB chunk."""
    return {rel: chunk_record(chunks[rel]) for rel in sorted(files) if len(chunks.get(rel) or ()) > 1}


def file_chunks(data: Manifest | dict[str, Any], rel: str) -> list[bytes] | None:
    """The 64 MiB chunk digests of file `rel` as the manifest `data` records them (fsutil.chunk_digests),
    or None when they are not known."""
    entry = (data.get("files") or {}).get(rel)
    record = data.get(CHUNKS)
    if not isinstance(entry, dict):
        return None
    return chunk_digests(entry, record.get(rel) if isinstance(record, dict) else None)


def load(path: str, name: str) -> Manifest:
    full = os.path.join(path, MANIFEST)
    try:  # never through a link; O_NONBLOCK: a fifo planted there must not hang the reader
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise CheckpointInvalid(f"checkpoint {name}: manifest.json is missing") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointInvalid(f"checkpoint {name}: manifest.json is a symbolic link; a checkpoint's manifest is "
                                    "a plain file (it was altered after its commit: remove the checkpoint)") from exc
        raise CheckpointInvalid(f"checkpoint {name}: manifest.json is unreadable: {exc}") from exc
    try:
        with open(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise CheckpointInvalid(f"checkpoint {name}: manifest.json is not a regular file")
            data = jsonsafe.load(fh, max_bytes=MAX_BYTES)
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(f"checkpoint {name}: manifest.json is unreadable: {printable(exc, 200)}") from exc
    if not isinstance(data, dict):
        raise CheckpointInvalid(f"checkpoint {name}: manifest.json is not a JSON object")
    schema = data.get("schema")
    # a schema from the future first: its fields may differ, and "upgrade migrt" is the fix
    if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA:
        raise CheckpointInvalid(
            f"checkpoint {name}: manifest schema {schema} is newer than this migrt understands ({SCHEMA}); "
            "upgrade migrt"
        )
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise CheckpointInvalid(f"checkpoint {name}: manifest.json lacks required field(s) {', '.join(missing)}")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:  # JSON true is not 1
        raise CheckpointInvalid(f"checkpoint {name}: manifest schema {schema!r} is invalid")
    if data.get("name") != name:
        raise CheckpointInvalid(f"checkpoint {name}: manifest names {data.get('name')!r}; it was renamed or tampered "
                                "with")
    if not isinstance(data["files"], dict):
        raise CheckpointInvalid(f"checkpoint {name}: manifest 'files' is not an object")
    return Manifest.from_dict(data)


def write(path: str, data: Manifest | dict[str, Any]) -> None:
    """manifest.json written atomically (temp file, fsync, rename, fsync the directory)."""
    write_json_atomic(os.path.join(path, MANIFEST), data.raw if isinstance(data, Manifest) else data)


def list_payload(path: str) -> list[str]:
    """Every file of a checkpoint directory except the manifest itself; refuses links and oddities."""
    rels = []
    for rel in walk_files(path):
        if rel == MANIFEST:
            continue
        full = os.path.join(path, rel)
        if os.path.islink(full):
            raise CheckpointInvalid(f"{full}: not a regular file but a symbolic link (to {os.readlink(full)!r}); a "
                                    "checkpoint holds none (it was altered after its commit)")
        if not os.path.isfile(full):
            raise CheckpointInvalid(f"{full}: not a regular file")
        rels.append(rel)
    return rels


def verify(path: str, data: Manifest, name: str, *, progress=None) -> None:
    """Raise CheckpointInvalid naming the first problem: missing, extra, resized or altered file."""
    verify_structure(path, data, name)
    verify_hashes(path, data, name, sorted(data.files), progress=progress)


def verify_structure(path: str, data: Manifest, name: str) -> None:
    """The cheap part of verify: every file listed is there with its size, nothing else is."""
    listed = data.files
    hint = f"; run 'migrt inspect --verify {name}'"
    present = set(list_payload(path))
    for rel in sorted(listed):
        if rel not in present:
            raise CheckpointInvalid(f"checkpoint {name}: file {rel} is missing{hint}")
    extra = sorted(present - set(listed))
    if extra:
        raise CheckpointInvalid(f"checkpoint {name}: unexpected file {extra[0]} (not in the manifest){hint}")
    for rel, meta in listed.items():
        actual = os.path.getsize(os.path.join(path, rel))
        if actual != meta.get("size"):
            raise CheckpointInvalid(
                f"checkpoint {name}: size mismatch in {rel} ({actual} bytes, manifest says {meta.get('size')}){hint}"
            )


def verify_hashes(path: str, data: Manifest, name: str, rels: list[str], *, progress=None) -> None:
    """The sha256 of the files `rels` (listed in the manifest) against the manifest."""
    listed = data.files
    hint = f"; run 'migrt inspect --verify {name}'"
    hashed = hash_tree(path, rels, progress=progress)
    for rel in rels:
        if digest_of(hashed[rel]) != digest_of(listed[rel]):
            raise CheckpointInvalid(f"checkpoint {name}: sha256 mismatch in {rel}{hint}")
