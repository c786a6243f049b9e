"""The pieces of a lazy restore by reference (registry/lazy.py, registry/fill.py, the Verifier's
source) against the fake registry of tests/helpers/fake_registry.py: what the create fetches before
the restore and what it leaves to the filler, the image lock handed over, the fallbacks said once,
a chunk fetched verified and journaled, a corrupted one refused and zeroed, a registry gone, and
the commit of the filled image. The whole path with CRIU and containerd:
tests/integration/test_registry_lazy.py."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from migrt.pagefill.verify import FileChunks, Verifier, VerifyError
from migrt.registry import lazy, pull
from migrt.registry.blocks import Eager
from migrt.registry.fill import RegistrySource
from migrt.store import Store
from migrt.store.fsutil import lock_is_free
from tests.helpers.fake_registry import archive_image, migrt_image
from tests.unit.test_registry_pull import Log, cfg, reg, tls  # noqa: F401 - fixtures

PAGES = os.urandom(1 << 20)
FILES = {"images/inventory.img": b"inventory", "images/core-1.img": b"core" * 100, "images/pages-1.img": PAGES}
REF = "{host}/team/ckpt:v1"
CHUNK = 64 << 20


def _prepare(cfg, host: str, log: Log, **kw):  # noqa: F811 - the fixture's value
    return lazy.prepare(cfg, REF.format(host=host), admit=lambda ns: None, lazy_ok=kw.pop("lazy_ok", lambda *a: None),
                        container_id="c1", log=log, **kw)


def _locked(store: str, digest: str) -> bool:
    path = os.path.join(store, ".locks", f".pull-{digest.split(':', 1)[1]}.lock")
    assert os.path.exists(path), path  # the image's lock file is there, held or not
    return not lock_is_free(path)


@pytest.fixture()
def no_eager(monkeypatch):
    """No CRIU images to plan here: every pages chunk counts as lazy (the filler fetches it)."""
    monkeypatch.setattr(lazy, "_eager_chunks", lambda images, pages: {rel: Eager([], []) for rel in pages})


# -- the create's part ---------------------------------------------------------------------------

def test_the_create_fetches_what_criu_reads_and_leaves_the_pages_to_the_filler(cfg, reg, no_eager):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    digest = migrt_image(registry, "v1", FILES)
    log = Log()
    out = _prepare(cfg, host, log)
    try:
        assert out is not None and not [e for e in log.events if e[1] == lazy.EVENT_FALLBACK]
        pages_blob = "/v2/team/ckpt/blobs/" + registry.add_blob(PAGES)
        assert registry.requests.count(("GET", pages_blob)) == 1      # only the one-byte range probe
        part = out.ckpt.path
        assert Path(part, "images", "inventory.img").read_bytes() == b"inventory"
        assert os.path.getsize(os.path.join(part, "images", "pages-1.img")) == len(PAGES)  # allocated, not filled
        assert (out.summary["chunks"], out.summary["present"]) == (1, 0)
        assert out.ckpt.manifest.from_registry and out.ckpt.name == pull.default_name(pull.parse(REF.format(
            host=host)), digest)
        f = out.handover["files"]["pages-1.img"]
        assert f == {"rel": "images/pages-1.img", "size": len(PAGES), "chunks": hashlib.sha256(PAGES).hexdigest()}
        assert _locked(cfg.store, digest)                              # held for the filler
        assert Store(cfg.store).list() == []                           # nothing committed yet
    finally:
        if out is not None:
            out.release()
    assert not _locked(cfg.store, digest)


@pytest.mark.parametrize("case,reason", [
    ("refusal", "restore_pages is eager"),
    ("archive", "cannot be read at an offset"),
    ("no-ranges", "answers byte ranges with the whole blob"),
    ("eager", "copied eagerly"),
])
def test_fallbacks_are_said_once_and_leave_the_full_pull_to_do(cfg, reg, no_eager, case, reason):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = case != "no-ranges"
    if case == "archive":
        archive_image(registry, "v1", b"not read")
    else:
        migrt_image(registry, "v1", FILES)
    log = Log()
    kw = {"refusal": reason} if case == "refusal" else {}
    if case == "eager":
        kw["lazy_ok"] = lambda *a: "the memory is copied eagerly (below fill_min_mib)"
    assert _prepare(cfg, host, log, **kw) is None
    said = [e for e in log.events if e[1] == lazy.EVENT_FALLBACK]
    assert len(said) == 1 and reason in said[0][2]["reason"] and said[0][2]["container"] == "c1"
    if case == "archive":
        return
    # what arrived is journaled: the full pull resumes it, and commits the image
    got = pull.ensure_local(cfg, REF.format(host=host))
    assert got[1] is True and Store(cfg.store).get(got[0]).manifest.pulled


# -- the filler's source -------------------------------------------------------------------------

def _source(out, tmp_path, **spec) -> tuple[RegistrySource, FileChunks]:
    handover = json.loads(json.dumps(out.handover))  # as the filler reads it
    handover["registry"].update(spec)
    src = RegistrySource.from_handover(handover, os.path.join(out.ckpt.path, "images"), out.lock_fd)
    out.lock_fd = -1  # the source's now
    f = handover["files"]["pages-1.img"]
    chunks = FileChunks(path=os.path.join(out.ckpt.path, "images", "pages-1.img"), rel=f["rel"], size=f["size"],
                        digests=[bytes.fromhex(f["chunks"])])
    return src, chunks


def test_the_source_fetches_a_chunk_verified_journals_it_and_commits_the_image(cfg, reg, no_eager,  # noqa: F811
                                                                              tmp_path):
    registry, host, _ca = reg
    registry.ranges = True
    digest = migrt_image(registry, "v1", FILES)
    out = _prepare(cfg, host, Log())
    src, f = _source(out, tmp_path)
    v = Verifier([f], what="checkpoint x")
    v.source = src
    v.ensure(f.path, 4096, 4096)                                       # a fault: fetched in ranges
    assert Path(f.path).read_bytes() == PAGES and v.snapshot()["verified"] == 1
    journal = Path(src.spec["journal"]).read_text()
    assert journal.splitlines()[-1] == f"{registry.add_blob(PAGES)} 0 images/pages-1.img"  # after the create's
    committed = src.commit()
    ck = Store(cfg.store).get(committed["name"])
    ck.verify()                                                        # every file's digest checks out
    assert ck.manifest.pulled["manifest_digest"] == digest and ck.manifest.pulled["lazy"] is True
    assert not os.path.exists(src.spec["journal"]) and not _locked(cfg.store, digest)


def test_a_chunk_that_does_not_match_is_refused_zeroed_and_not_journaled(cfg, reg, no_eager, tmp_path):  # noqa: F811
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    out = _prepare(cfg, host, Log())
    src, f = _source(out, tmp_path)
    blob = registry.add_blob(PAGES)
    registry.blobs[blob] = bytes([PAGES[0] ^ 0xFF]) + PAGES[1:]        # the registry serves other bytes
    v = Verifier([f], what="checkpoint x")
    v.source = src
    with pytest.raises(VerifyError, match=f"blob {blob}.* does not match its digest"):
        v.sweep_one()
    with pytest.raises(VerifyError):                                   # final: every later ensure fails
        v.ensure(f.path, 0, 4096)
    assert Path(f.path).read_bytes() == bytes(len(PAGES))             # nothing of it left on disk
    assert blob not in (Path(src.spec["journal"]).read_text() if os.path.exists(src.spec["journal"]) else "")
    src.close()


def test_a_registry_gone_mid_fill_names_the_host_the_container_and_what_is_in(cfg, reg, no_eager,  # noqa: F811
                                                                              tmp_path):
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    out = _prepare(cfg, host, Log())
    src, f = _source(out, tmp_path, timeout=1)
    registry.hooks["/v2/team/ckpt/blobs/" + registry.add_blob(PAGES)] = lambda h: h.connection.close()
    v = Verifier([f], what="checkpoint x")
    v.source = src
    with pytest.raises(VerifyError, match=rf"registry {host} went away while filling container c1's memory "
                                          r"\(0 of 1 MiB in\); the container was stopped; restore again"):
        v.ensure(f.path, 0, 4096)
    src.close()


def test_a_second_restore_joins_the_fill_in_progress_and_fetches_nothing_fetched(cfg, reg, no_eager,  # noqa: F811
                                                                                  tmp_path):
    registry, host, _ca = reg
    registry.ranges = True
    digest = migrt_image(registry, "v1", FILES)
    first = _prepare(cfg, host, Log())
    assert os.path.exists(pull.fill_marker(Store(cfg.store), digest))  # says that a lazy fill runs
    second = _prepare(cfg, host, Log())                                # the lock is busy: joins it
    assert second.summary["joined"] is True and second.lock_fd == -1 and second.ckpt.path == first.ckpt.path
    assert second.handover["registry"]["join"] is True and second.handover["registry"]["container_id"] == "c1"
    src1, f1 = _source(first, tmp_path)
    src2, f2 = _source(second, tmp_path)
    v1, v2 = Verifier([f1]), Verifier([f2])
    v1.source, v2.source = src1, src2
    v1.ensure(f1.path, 0, 1)                                           # the first fetches it
    blob = "/v2/team/ckpt/blobs/" + registry.add_blob(PAGES)
    gets = registry.requests.count(("GET", blob))
    v2.ensure(f2.path, 0, 1)                                           # the second takes it from disk
    assert registry.requests.count(("GET", blob)) == gets
    assert src2.summary()["taken_chunks"] == 1 and src2.summary()["fetched_chunks"] == 0
    assert src2.commit() == {"name": second.ckpt.name, "joined": True}  # only the first commits
    assert Store(cfg.store).list() == []
    committing = threading.Thread(target=src1.commit, daemon=True)
    committing.start()
    committing.join(0.5)
    assert committing.is_alive() and Store(cfg.store).list() == []     # the joined create still restores
    second.release()                                                   # (its create is done)
    committing.join(10)
    assert [c.name for c in Store(cfg.store).list()] == [first.ckpt.name]
    assert not os.path.exists(pull.fill_marker(Store(cfg.store), digest))


def _filler_holding(spec: dict, f: FileChunks, mine: int, theirs: int) -> int:
    """A filler process: one thread holds chunk `mine` a while, another then waits for `theirs`; 0 when
    both got their lock."""
    src = RegistrySource(spec, spec["partial"])
    errors: list[BaseException] = []

    def hold() -> None:
        with src._chunk_locked(f, mine):
            time.sleep(0.5)

    def wait() -> None:
        time.sleep(0.2)
        try:
            with src._chunk_locked(f, theirs):
                pass
        except BaseException as exc:  # noqa: BLE001 - reported by the exit code
            errors.append(exc)
    ts = [threading.Thread(target=hold), threading.Thread(target=wait)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    return 0 if not errors and not any(t.is_alive() for t in ts) else 3


def test_chunk_locks_of_two_fillers_waiting_on_each_other_are_no_deadlock(tmp_path):
    """Two fillers (processes), each with a thread holding one chunk and another waiting for the chunk
    the other process holds: a wait, not EDEADLK (POSIX record locks belong to a whole process, so the
    kernel took this for a deadlock and the fill failed in the benchmark's four restores at once)."""
    spec = {"partial": str(tmp_path), "present": {}, "files": {"pages-1.img": {"rel": "images/pages-1.img",
            "size": 2 * CHUNK}}, "chunk_locks": str(tmp_path / "x.chunks"), "journal": str(tmp_path / "j")}
    f = FileChunks(path="p", rel="images/pages-1.img", size=2 * CHUNK, digests=[b"\0" * 32, b"\0" * 32])
    pids = []
    for mine, theirs in ((0, 1), (1, 0)):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _filler_holding(spec, f, mine, theirs)
            finally:
                os._exit(code)
        pids.append(pid)
    assert [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids] == [0, 0]


# -- the Verifier's source seam ------------------------------------------------------------------

class _Source:
    def __init__(self, have: set[int], fail: str | None = None) -> None:
        self.have, self.fail, self.calls = have, fail, []
        self.lock = threading.Lock()

    def has(self, path: str, i: int) -> bool:
        return i in self.have

    def fetch(self, f: FileChunks, i: int, *, fault: bool = False) -> None:
        with self.lock:
            self.calls.append((i, fault))
        if self.fail:
            raise VerifyError(self.fail)
        with open(f.path, "r+b") as fh:
            fh.seek(f.span(i)[0])
            fh.write(b"x")


def test_the_verifier_asks_its_source_for_chunks_not_on_disk_only(tmp_path):
    path = tmp_path / "pages-1.img"
    data = b"a" * 100
    path.write_bytes(data)
    f = FileChunks(path=str(path), rel="images/pages-1.img", size=100, digests=[hashlib.sha256(data).digest()])
    v = Verifier([f])
    v.source = _Source(have={0})
    v.ensure(str(path), 0, 10)                                         # on disk: hashed from it
    assert v.source.calls == [] and v.snapshot()["verified"] == 1
    g = FileChunks(path=str(path), rel="images/pages-1.img", size=100, digests=[b"\0" * 32])
    w = Verifier([g])
    w.source = _Source(have=set())
    w.sweep_one()                                                      # the sweep: a whole blob
    w2 = Verifier([FileChunks(path=str(path), rel="r", size=100, digests=[b"\0" * 32])])
    w2.source = _Source(have=set())
    w2.ensure(str(path), 0, 1)                                         # a copy or a fault: ranges
    assert w.source.calls == [(0, False)] and w2.source.calls == [(0, True)]
    assert w.snapshot()["verified"] == 1                               # the source verified it


def test_a_source_failure_is_the_verifiers_error_and_final(tmp_path):
    path = tmp_path / "pages-1.img"
    path.write_bytes(b"a" * 100)
    f = FileChunks(path=str(path), rel="images/pages-1.img", size=100, digests=[b"\0" * 32])
    v = Verifier([f])
    v.source = _Source(have=set(), fail="registry r went away while filling container c's memory")
    with pytest.raises(VerifyError, match="went away"):
        v.ensure(str(path), 0, 1)
    with pytest.raises(VerifyError, match="went away"):
        v.ensure(str(path), 50, 1)
    assert v.snapshot()["error"] == "registry r went away while filling container c's memory"
    assert v.source.calls == [(0, True)]                               # not asked twice


@pytest.mark.parametrize("fstype", ["tmpfs", "ext4"])
def test_the_pages_images_are_not_fallocated_on_a_tmpfs_store(cfg, reg, no_eager, monkeypatch, fstype):  # noqa: F811
    """On a tmpfs, fallocate takes and zeroes the memory (0.8 s of a 4 GiB create's 1.2 s on a GPU host):
    the pages images stay sparse there, the room checked first; elsewhere their blocks are reserved."""
    from migrt.store import hugetmpfs

    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    monkeypatch.setattr(hugetmpfs, "mount_of", lambda path: hugetmpfs.Mount("/x", fstype, {}, ""))
    out = _prepare(cfg, host, Log())
    try:
        st = os.stat(os.path.join(out.ckpt.path, "images", "pages-1.img"))
        assert st.st_size == len(PAGES)
        assert (st.st_blocks * 512 < len(PAGES)) == (fstype == "tmpfs")
    finally:
        out.release()


def test_a_chunk_whose_digest_is_in_already_is_copied_not_fetched_again(cfg, reg, no_eager, tmp_path):  # noqa: F811
    """Identical chunks (zero pages, a model's repeated tensors) come from the registry once: the others
    are copied from the first where they land, hashed again there before they count, and journaled."""
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", {**FILES, "images/pages-2.img": PAGES})
    out = _prepare(cfg, host, Log())
    handover = json.loads(json.dumps(out.handover))
    images = os.path.join(out.ckpt.path, "images")
    src = RegistrySource.from_handover(handover, images, out.lock_fd)
    out.lock_fd = -1
    chunks = [FileChunks(path=os.path.join(images, base), rel=f"images/{base}", size=len(PAGES),
                         digests=[hashlib.sha256(PAGES).digest()]) for base in ("pages-1.img", "pages-2.img")]
    v = Verifier(chunks, what="checkpoint x")
    v.source = src
    blob = "/v2/team/ckpt/blobs/" + registry.add_blob(PAGES)
    before = len(registry.requests)
    while v.sweep_one():
        pass
    assert [r for r in registry.requests[before:] if r[1] == blob] == [("GET", blob)]    # fetched once
    assert all(Path(f.path).read_bytes() == PAGES for f in chunks) and v.snapshot()["verified"] == 2
    assert src.summary()["copied_chunks"] == 1 and src.summary()["fetched_chunks"] == 1
    done = pull.Journal(src.spec["journal"]).done
    assert {(k[1], k[2]) for k in done if k[0] == registry.add_blob(PAGES)} == {(0, "images/pages-1.img"),
                                                                                (0, "images/pages-2.img")}
    committed = src.commit()
    Store(cfg.store).get(committed["name"]).verify()
