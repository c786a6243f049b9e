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
"""

from __future__ import annotations

import errno
import os
import stat

from migrt import jsonsafe
from migrt.errors import CheckpointInvalid
from migrt.store.fsutil import chunk_digests, chunk_record, digest_of, hash_tree, walk_files, write_json_atomic
from migrt.text import printable

SCHEMA = 1
MANIFEST = "manifest.json"
REQUIRED = ("schema", "name", "created", "files")
CHUNKS = "chunks"
MAX_BYTES = 64 << 20  # manifest.json read back (bounded JSON): 100,000 files take ~15 MB


def chunk_records(files: dict, chunks: dict[str, list[bytes]]) -> dict[str, str]:
    """The manifest's `chunks` field: the chunk digests of every file of more than one 64 MiB chunk."""
    return {rel: chunk_record(chunks[rel]) for rel in sorted(files) if len(chunks.get(rel) or ()) > 1}


def file_chunks(data: dict, rel: str) -> list[bytes] | None:
    """The 64 MiB chunk digests of file `rel` as the manifest `data` records them (fsutil.chunk_digests),
    or None when they are not known."""
    entry = (data.get("files") or {}).get(rel)
    record = data.get(CHUNKS)
    return chunk_digests(entry, record.get(rel) if isinstance(record, dict) else None) if isinstance(entry, dict) else None


def load(path: str, name: str) -> dict:
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
        raise CheckpointInvalid(f"checkpoint {name}: manifest names {data.get('name')!r}; it was renamed or tampered with")
    if not isinstance(data["files"], dict):
        raise CheckpointInvalid(f"checkpoint {name}: manifest 'files' is not an object")
    return data


def write(path: str, data: dict) -> None:
    write_json_atomic(os.path.join(path, MANIFEST), data)


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


def verify(path: str, data: dict, name: str, *, progress=None) -> None:
    """Raise CheckpointInvalid naming the first problem: missing, extra, resized or altered file."""
    verify_structure(path, data, name)
    verify_hashes(path, data, name, sorted(data["files"]), progress=progress)


def verify_structure(path: str, data: dict, name: str) -> None:
    """The cheap part of verify: every file listed is there with its size, nothing else is."""
    listed: dict = data["files"]
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


def verify_hashes(path: str, data: dict, name: str, rels: list[str], *, progress=None) -> None:
    """The sha256 of the files `rels` (listed in the manifest) against the manifest."""
    listed: dict = data["files"]
    hint = f"; run 'migrt inspect --verify {name}'"
    hashed = hash_tree(path, rels, progress=progress)
    for rel in rels:
        if digest_of(hashed[rel]) != digest_of(listed[rel]):
            raise CheckpointInvalid(f"checkpoint {name}: sha256 mismatch in {rel}{hint}")
