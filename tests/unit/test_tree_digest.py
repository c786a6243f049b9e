"""The manifest digest: plain sha256 up to 64 MiB, a tree of 64 MiB chunk digests above; the
parallel (hash_tree) and streaming (TreeHasher) forms agree, and one flipped byte is caught."""

import hashlib
import os

import pytest

from migrt.errors import CheckpointInvalid
from migrt.store import manifest as mf
from migrt.store.fsutil import TREE_CHUNK, TreeHasher, digest_of, hash_tree


def _write(path, size, seed=7):
    block = hashlib.sha256(str(seed).encode()).digest() * (1 << 15)  # 1 MiB pattern
    with open(path, "wb") as fh:
        left = size
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n


@pytest.mark.parametrize("size", [0, 1, TREE_CHUNK - 1, TREE_CHUNK, TREE_CHUNK + 1, 2 * TREE_CHUNK + 12345])
def test_parallel_and_streaming_digests_agree(tmp_path, size):
    path = tmp_path / "f.img"
    _write(path, size)
    entry = hash_tree(str(tmp_path), ["f.img"], workers=3)["f.img"]
    assert entry["size"] == size
    data = path.read_bytes()
    if size <= TREE_CHUNK:
        assert entry == {"size": size, "sha256": hashlib.sha256(data).hexdigest()}
    else:
        chunks = [hashlib.sha256(data[o:o + TREE_CHUNK]).digest() for o in range(0, size, TREE_CHUNK)]
        assert entry == {"size": size, "sha256_tree": hashlib.sha256(b"".join(chunks)).hexdigest()}
    h = TreeHasher()
    for off in range(0, size, 3_000_001):  # odd piece sizes cross chunk boundaries
        h.update(data[off:off + 3_000_001])
    assert h.hexdigest() == digest_of(entry)


def test_flipped_byte_in_second_chunk_is_caught(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    _write(images / "pages-1.img", TREE_CHUNK + 4096)
    files = hash_tree(str(tmp_path), ["images/pages-1.img"])
    data = mf.Manifest.from_dict({"schema": 1, "name": "big", "created": "x", "files": files})
    mf.verify(str(tmp_path), data, "big")
    with open(images / "pages-1.img", "r+b") as fh:
        fh.seek(TREE_CHUNK + 100)
        b = fh.read(1)
        fh.seek(TREE_CHUNK + 100)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointInvalid, match="sha256 mismatch in images/pages-1.img"):
        mf.verify(str(tmp_path), data, "big")
    os.unlink(images / "pages-1.img")


def test_parallel_hashing_imports_no_fork_hooks(tmp_path):
    """A restore hashes large files in a thread while its main thread forks (pods/forked.py): the
    hashing must not import concurrent.futures or logging there, whose first import registers at-fork
    hooks that lock and unlock a lock of theirs (a fork in between broke the hashing thread's
    ThreadPoolExecutor.submit with "release unlocked lock"). Also: an error in one thread is raised."""
    import json
    import subprocess
    import sys

    for name in ("a.img", "b.img"):
        _write(tmp_path / name, 5 << 20)
    (tmp_path / "d.img").mkdir()  # has a size; reading it fails (EISDIR) in a hashing thread
    probe = (
        "import json, sys\n"
        "from migrt.store.fsutil import hash_tree\n"
        f"out = hash_tree({str(tmp_path)!r}, ['a.img', 'b.img'], workers=2)\n"
        "try:\n"
        f"    hash_tree({str(tmp_path)!r}, ['a.img', 'd.img', 'b.img'], workers=2)\n"
        "    err = None\n"
        "except IsADirectoryError as exc:\n"
        "    err = exc.filename or str(exc)\n"
        "print(json.dumps([sorted(m for m in ('concurrent.futures', 'logging') if m in sys.modules), err,"
        " out['a.img'] == out['b.img']]))\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    imported, err, same = json.loads(res.stdout)
    assert imported == [] and same
    assert err, res.stdout


def test_commit_takes_the_digests_its_writer_computed(tmp_path, monkeypatch):
    """Staging.commit(known=...): a pages file hashed as it was written is not read again (the commit of a
    32 GiB checkpoint was a second pass over all its memory); a known entry whose size is not the file's
    is ignored and the file hashed; the manifest verifies either way."""
    from migrt.store import Store, fsutil

    store = Store(str(tmp_path / "store"))
    store.ensure()
    read = []
    real = fsutil.hash_range
    monkeypatch.setattr(fsutil, "hash_range", lambda path, off, n: read.append(os.path.basename(path)) or
                        real(path, off, n))
    with store.writer("ck") as staging:
        _write(os.path.join(staging.images, "pages-1.img"), 3 * 1024 * 1024, seed=1)
        _write(os.path.join(staging.images, "pages-2.img"), 1024 * 1024, seed=2)
        _write(os.path.join(staging.images, "core-1.img"), 100, seed=3)
        known = hash_tree(staging.images, ["pages-1.img", "pages-2.img"])
        known = {"images/pages-1.img": known["pages-1.img"],
                 "images/pages-2.img": {**known["pages-2.img"], "size": 5}}  # stale: hashed again
        seen = []
        read.clear()
        data = staging.commit({"created": "x", "source": {}}, known=known, progress=seen.append)
    assert sorted(read) == ["core-1.img", "pages-2.img"]
    assert data["files"]["images/pages-1.img"] == known["images/pages-1.img"]
    assert sum(seen) == data["size_bytes"]
    store.get("ck").verify()
