"""Verify as filled, with the real runc and CRIU: a lazy restore from the store does not hold the
restored tree for a hash of the whole pages image (the gate waits only for the chunks CRIU reads
itself; the filler verifies every other chunk before it copies a page of it), and the memory is
identical; one corrupted byte in a chunk the process only touches later fails the restore (the
container removed, never run on it), one in a part CRIU reads eagerly is caught before the tree runs;
the checkpoint stays as it was in both cases."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from migrt.pagefill import images as images_mod
from migrt.pagefill import verify as verify_mod
from migrt.store import manifest as mf
from tests.integration.conftest import SHIM, run_cli
from tests.integration.test_pagefill import Lines, _bundle, _gone, binaries, runc_root  # noqa: F401 (fixtures)
from tests.integration.test_pagefill_record import _checkpoint, _digests, _env, _sum_after_usr1

pytestmark = pytest.mark.integration


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _verifier(store: str, name: str) -> verify_mod.Verifier:
    """What the filler of a restore of `name` checks: its plan and the manifest's chunk digests."""
    top = os.path.join(store, name)
    data = mf.load(top, name)
    files = {}
    for rel, entry in data["files"].items():
        base = rel.rsplit("/", 1)[-1]
        if rel.startswith("images/pages-") and entry["size"] >= 1 << 20:
            chunks = mf.file_chunks(data, rel)
            assert chunks is not None, f"{rel}: the manifest gives no usable chunk digests"
            files[base] = {"rel": rel, "size": entry["size"], "chunks": "".join(c.hex() for c in chunks)}
    v = verify_mod.build(images_mod.plan(os.path.join(top, "images")), {"checkpoint": name, "files": files})
    assert v is not None
    return v


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def _restore(name: str, did: str, dst: str, runc_root: str, out: str) -> subprocess.CompletedProcess:
    return run_cli("restore", name, did, "--bundle", dst, "--root", runc_root, "--output", out, "--pages", "lazy",
                   "--wait-pages", "--json", check=False, env=_env())


def test_lazy_restore_verifies_as_it_fills_and_the_tree_waits_for_the_eager_chunks_only(
        runc_root, migrt_config, binaries, tmp_path):
    name = _uid("vf")
    want = _checkpoint(runc_root, binaries, tmp_path, name)  # memhog 320 MiB: 5+ chunks
    data = mf.load(os.path.join(migrt_config["store"], name), name)
    big = [rel for rel, e in data["files"].items() if rel.startswith("images/pages-") and e["size"] > 64 << 20]
    assert big and all(rel in data[mf.CHUNKS] for rel in big)  # recorded at the commit
    v = _verifier(migrt_config["store"], name)
    assert 0 < len(v.eager) < len(v.order)  # the gate's share is a part of the image

    did = _uid("vf-d")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries)
    out = tmp_path / "out"
    res = _restore(name, did, dst, runc_root, str(out))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["pages"]["mode"] == "lazy" and r["restore_gate"] == "held"
    assert set(big) <= set(r["pages"]["verify"]["as_filled"])
    assert not [rel for rel in r["pages"]["verify"]["before_run"] if rel.startswith("images/pages-")]
    # which checks held the tree: the eager chunks' verification and the plan, no whole-file hash
    assert "pages_verify_eager_s" in r["timings"] and "pages_plan_s" in r["timings"]
    assert "verify_background_s" not in r["timings"]
    fill = r["pages"]["fill"]["verify"]
    assert fill["eager_done"] and "error" not in fill
    assert fill["eager"] == len(v.eager) and fill["chunks"] == len(v.order)
    assert fill["verified"] == fill["chunks"]  # every chunk once (the sweep and the copies share them)
    assert fill["by_sweep"] + fill["by_copy"] == fill["chunks"]
    st = json.loads(subprocess.run(["runc", "--root", runc_root, "state", did], capture_output=True, text=True,
                                   check=True).stdout)
    os.kill(st["pid"], 10)  # SIGUSR1: memhog hashes its memory again
    end = time.monotonic() + 30
    while time.monotonic() < end and "sum " not in out.read_text():
        time.sleep(0.1)
    assert f"sum {want}" in out.read_text()
    subprocess.run(["runc", "--root", runc_root, "delete", "--force", did], check=True, timeout=60)
    run_cli("rm", name)


def test_a_corrupt_byte_in_a_lazy_chunk_fails_the_restore_before_any_process_reads_it(
        runc_root, migrt_config, binaries, tmp_path):
    """memhog touches its buffer only when asked (SIGUSR1), so the chunk is read by the filler alone:
    the filler's verification fails before a page of it is copied, the --wait-pages restore fails
    with the file and bytes (exit 4, whether the verdict came after runc restore returned or while CRIU
    was restoring, its tasks then killed by the filler's guard: ops/pages.failed), the container is
    removed, and the checkpoint is left as it is."""
    name = _uid("vl")
    _checkpoint(runc_root, binaries, tmp_path, name)
    v = _verifier(migrt_config["store"], name)
    eager = {(f.path, i) for f, i in v.eager}
    f, i = next((f, i) for f, i in v.order if (f.path, i) not in eager)
    a, b = f.span(i)
    top = os.path.join(migrt_config["store"], name)
    _flip(os.path.join(top, f.rel), (a + b) // 2)
    before = _digests(top)

    did = _uid("vl-d")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries)
    res = _restore(name, did, dst, runc_root, str(tmp_path / "out"))
    assert res.returncode == 4, res.stderr
    assert f"checkpoint {name}: sha256 mismatch in {f.rel} at bytes {a}-{b - 1}" in res.stderr, res.stderr
    assert f"migrt inspect --verify {name}" in res.stderr
    assert _gone(runc_root, did) and not os.path.exists(os.path.join(runc_root, did))
    assert not [x for x in os.listdir(dst) if x.startswith(".migrt")]
    assert _digests(top) == before  # the checkpoint stays, untouched by the restore
    assert run_cli("inspect", name, "--verify", check=False).returncode == 4
    _flip(os.path.join(top, f.rel), (a + b) // 2)  # repaired: it verifies again
    run_cli("inspect", name, "--verify")
    run_cli("rm", name)


def test_a_corrupt_byte_that_criu_reads_itself_is_caught_before_the_tree_runs(
        runc_root, migrt_config, binaries, tmp_path):
    """A byte of a non-lazy page (CRIU copies those into the tasks while it restores): the gate holds
    the tree until the chunks holding such pages are verified, so the create fails (exit 4) naming the
    file and bytes, and the restored memhog never ticked."""
    name = _uid("ve")
    _checkpoint(runc_root, binaries, tmp_path, name)
    top = os.path.join(migrt_config["store"], name)
    plan = images_mod.plan(os.path.join(top, "images"))
    proc = next(p for p in plan.processes.values() if p.segments)
    lazy = sorted((s.offset, s.offset + s.length) for s in proc.segments)
    size = os.path.getsize(proc.pages_file)
    at, pos = None, 0  # the first byte of the pages image outside every lazy range
    for lo, hi in lazy:
        if lo > pos:
            at = pos
            break
        pos = max(pos, hi)
    at = at if at is not None else pos
    assert at < size, "no eager page in the image"
    rel = f"images/{os.path.basename(proc.pages_file)}"
    _flip(os.path.join(top, rel), at)
    before = _digests(top)
    chunk = at // verify_mod.TREE_CHUNK
    a = chunk * verify_mod.TREE_CHUNK

    did = _uid("ve-d")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries, env=[f"MIGRT_RESTORE={name}"])
    log = str(tmp_path / "log.json")
    r, w = os.pipe()
    res = subprocess.run([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle",
                          dst, did], cwd=dst, stdin=subprocess.DEVNULL, stdout=w, stderr=w, timeout=120,
                         env={**_env(), "MIGRT_RESTORE_PAGES": "lazy"})
    os.close(w)
    errors = [json.loads(ln)["msg"] for ln in open(log) if '"error"' in ln]
    assert res.returncode == 4, errors
    assert any(f"sha256 mismatch in {rel} at bytes {a}-" in m for m in errors), errors
    assert _gone(runc_root, did) and not os.path.exists(os.path.join(runc_root, did))
    time.sleep(0.5)
    lines = Lines(r).wait_for(lambda ls: True, timeout=1)
    assert not [ln for ln in lines if ln.startswith("tick")], "the restored memhog ran"
    assert _digests(top) == before
    _flip(os.path.join(top, rel), at)
    run_cli("rm", name)


def test_a_restore_without_the_chunk_record_hashes_the_pages_before_the_tree_runs(
        runc_root, migrt_config, binaries, tmp_path):
    """A checkpoint whose manifest has no chunk digests (an older migrt): the whole pages image is
    hashed in the background check, as before, and the restore is still lazy and intact."""
    name = _uid("vo")
    want = _checkpoint(runc_root, binaries, tmp_path, name)
    path = os.path.join(migrt_config["store"], name, "manifest.json")
    with open(path) as fh:
        data = json.load(fh)
    del data[mf.CHUNKS]
    with open(path, "w") as fh:
        json.dump(data, fh)
    did = _uid("vo-d")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries)
    out = tmp_path / "out"
    res = _restore(name, did, dst, runc_root, str(out))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    big = [rel for rel, e in data["files"].items() if rel.startswith("images/pages-") and e["size"] > 64 << 20]
    assert big and set(big) <= set(r["pages"]["verify"]["before_run"])
    assert not set(big) & set(r["pages"]["verify"]["as_filled"])
    assert "verify_background_s" in r["timings"]
    st = json.loads(subprocess.run(["runc", "--root", runc_root, "state", did], capture_output=True, text=True,
                                   check=True).stdout)
    os.kill(st["pid"], 10)
    end = time.monotonic() + 30
    while time.monotonic() < end and "sum " not in out.read_text():
        time.sleep(0.1)
    assert f"sum {want}" in out.read_text()
    subprocess.run(["runc", "--root", runc_root, "delete", "--force", did], check=True, timeout=60)
    run_cli("rm", name)
