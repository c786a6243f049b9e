"""The fill's fetching processes (registry/fillwork.py) against the fake TLS registry of
tests/helpers/fake_registry.py: a chunk the sweep fetches comes through a process of its own (the
filler's interpreter receives none of it), verified; a process that dies fails the fetch with its
pid and how it ended; the processes end when their pipes close, and when the filler dies while they
wait on the network."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from migrt.errors import CheckpointInvalid
from migrt.pagefill.verify import Verifier
from migrt.registry import pull
from migrt.registry.fillwork import FetchFailed, Workers, fill_deadline
from migrt.store import Store
from tests.helpers.fake_registry import migrt_image
from tests.unit.test_registry_lazy import FILES, PAGES, REF, _prepare, _source, no_eager  # noqa: F401 - fixture
from tests.unit.test_registry_pull import Log, _pulls_left, cfg, reg, tls  # noqa: F401 - fixtures


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def _wait_gone(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _filling(cfg, reg, tmp_path):  # noqa: F811
    """The fake registry serving FILES with ranges, the create's part done: (registry, the filler's
    source, the pages image's FileChunks)."""
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    src, f = _source(_prepare(cfg, host, Log()), tmp_path)
    return registry, src, f


def test_the_sweep_fetches_a_chunk_through_a_fetching_process_verified(cfg, reg, no_eager, tmp_path):  # noqa: F811
    registry, src, f = _filling(cfg, reg, tmp_path)
    v = Verifier([f], what="checkpoint x")
    v.source = src
    try:
        assert v.sweep_one() and v.snapshot()["verified"] == 1
        assert Path(f.path).read_bytes() == PAGES
        procs = [p.popen for p in src.workers()._all]
        assert len(procs) == src.parallel and os.getpid() not in [p.pid for p in procs]
        assert src._client is None  # the filler's own client never fetched a byte of it
        assert Path(src.spec["journal"]).read_text().splitlines()[-1].endswith(" 0 images/pages-1.img")
    finally:
        src.close()
    assert [p.returncode for p in procs] == [0] * len(procs)  # ended at the end of their pipes, none killed


def test_a_fetching_process_that_dies_fails_the_fetch_with_its_pid_and_signal(cfg, reg, no_eager,  # noqa: F811
                                                                              tmp_path):
    registry, src, f = _filling(cfg, reg, tmp_path)
    try:
        workers = Workers(src.spec, fill_deadline(src.spec, len(PAGES)), 1)
        pid = workers._all[0].popen.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(FetchFailed, match=rf"a fetching process of the fill \(pid {pid}\) ended \(signal 9\)"):
            workers.fetch(registry.add_blob(PAGES), len(PAGES), f.path, 0)
        with pytest.raises(FetchFailed, match=rf"pid {pid}"):  # and every later fetch on it
            workers.fetch(registry.add_blob(PAGES), len(PAGES), f.path, 0)
        workers.close()
        assert Path(f.path).read_bytes() == bytes(len(PAGES))
    finally:
        src.close()


_ORPHAN = """
import json, sys
from migrt.registry.fillwork import fill_deadline
from migrt.registry.fillwork import Workers
spec, path, digest, size = json.loads(sys.argv[1])
w = Workers(spec, fill_deadline(spec, size), 1)
print(w._all[0].popen.pid, flush=True)
w.fetch(digest, size, path, 0)
"""


def test_fetching_processes_end_when_the_filler_dies_while_they_wait_on_the_registry(cfg, reg, no_eager,  # noqa: F811
                                                                                    tmp_path):
    registry, src, f = _filling(cfg, reg, tmp_path)
    blob = registry.add_blob(PAGES)
    asked, release = threading.Event(), threading.Event()

    def stall(h) -> None:  # the registry never answers this blob (until the test ends)
        asked.set()
        release.wait(30)
        h.connection.close()
    registry.hooks[f"/v2/team/ckpt/blobs/{blob}"] = stall
    filler = subprocess.Popen([sys.executable, "-c", _ORPHAN, json.dumps([src.spec, f.path, blob, len(PAGES)])],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(filler.stdout.readline())
        assert asked.wait(20)                           # the process waits on the registry now
        filler.kill()
        filler.wait()
        assert _wait_gone(pid, 5), f"fetching process {pid} outlived its filler"
    finally:
        release.set()
        if filler.poll() is None:
            filler.kill()
            filler.wait()
        src.close()


def _big_pull_image(registry) -> dict[str, bytes]:
    blobs = {f"images/pages-{i}.img": os.urandom(256 << 10) for i in range(3)}  # one blob each
    migrt_image(registry, "v1", {"images/inventory.img": b"inventory", **blobs})
    return blobs


def _count_workers(monkeypatch) -> list[list[int]]:
    made: list[list[int]] = []
    real = Workers.__init__

    def init(self, *a, **kw) -> None:
        real(self, *a, **kw)
        made.append([p.popen.pid for p in self._all])
    monkeypatch.setattr(Workers, "__init__", init)
    return made


def test_a_big_pull_fetches_its_blobs_through_fetching_processes(cfg, reg, monkeypatch):  # noqa: F811
    registry, host, _ca = reg
    blobs = _big_pull_image(registry)
    monkeypatch.setattr(pull, "REMOTE_MIN", 1)
    made = _count_workers(monkeypatch)
    out = pull.pull(cfg, f"{host}/team/ckpt:v1")
    Store(cfg.store).get(out["name"]).verify()                    # every file against the checkpoint's manifest
    assert len(made) == 1 and len(made[0]) == cfg.registry_parallel
    assert all(_wait_gone(pid, 5) for pid in made[0])             # gone with the pull
    assert out["bytes_received"] >= sum(len(b) for b in blobs.values())  # what they received is counted


def test_a_blob_altered_in_the_registry_fails_a_pull_through_fetching_processes(cfg, reg, monkeypatch):  # noqa: F811
    registry, host, _ca = reg
    blobs = _big_pull_image(registry)
    monkeypatch.setattr(pull, "REMOTE_MIN", 1)
    made = _count_workers(monkeypatch)
    digest = registry.add_blob(blobs["images/pages-1.img"])
    registry.blobs[digest] = b"\0" + registry.blobs[digest][1:]
    with pytest.raises(CheckpointInvalid, match=f"blob {digest} from .*: the data received has sha256 .*altered"):
        pull.pull(cfg, f"{host}/team/ckpt:v1")
    assert made and Store(cfg.store).list() == []
    journal = [f for f in _pulls_left(cfg.store) if f.endswith(".done")]
    assert not journal or digest not in (Path(cfg.store) / pull.PULLS / journal[0]).read_text()


def test_a_small_pull_stays_in_threads(cfg, reg, monkeypatch):  # noqa: F811
    registry, host, _ca = reg
    _big_pull_image(registry)
    made = _count_workers(monkeypatch)
    pull.pull(cfg, f"{host}/team/ckpt:v1")
    assert made == []                                            # (768 KiB < REMOTE_MIN)


def _nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_fetching_processes_run_at_the_fills_nice_whoever_starts_them(cfg, reg, no_eager, tmp_path):  # noqa: F811
    """A lazy fill's fetching processes run at nice 10 (the copy threads'), also when the thread that
    starts them has niced itself already (a sweep thread does once the host copy is in)."""
    registry, src, _f = _filling(cfg, reg, tmp_path)
    got: list[Workers] = []

    def start() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        got.append(Workers(src.spec, fill_deadline(src.spec, len(PAGES)), 2, nice=10))
    t = threading.Thread(target=start)
    t.start()
    t.join()
    try:
        pids = [p.popen.pid for p in got[0]._all]
        end = time.monotonic() + 10
        while time.monotonic() < end and any(_nice_of(pid) != 10 for pid in pids):
            time.sleep(0.05)                                        # (each sets it as it starts)
        assert [_nice_of(pid) for pid in pids] == [10, 10]
    finally:
        got[0].close()
        src.close()


def test_what_else_a_fetching_process_prints_never_mixes_with_its_answers(cfg, reg, no_eager, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    """A line printed to stdout in a fetching process (a log line, a warning) goes to stderr, not into
    the answer the fill reads."""
    registry, src, f = _filling(cfg, reg, tmp_path)
    hook = tmp_path / "sitecustomize.py"  # runs in each fetching process as Python starts
    hook.write_text("import atexit, sys\nsys.stdout.write('noise on stdout\\\\n'); sys.stdout.flush()\n"
                    "import migrt.registry.transfer as t\n_f = t.fetch\n"
                    "def fetch(*a, **k):\n    print('noise during a fetch', flush=True)\n    return _f(*a, **k)\n"
                    "t.fetch = fetch\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        workers = Workers(src.spec, fill_deadline(src.spec, len(PAGES)), 1)
        assert workers.fetch(registry.add_blob(PAGES), len(PAGES), f.path, 0) >= len(PAGES)
        assert Path(f.path).read_bytes() == PAGES
        workers.close()
    finally:
        src.close()


def test_fetching_processes_never_import_from_the_working_directory(cfg, reg, no_eager, tmp_path, monkeypatch):  # noqa: F811
    """containerd runs the runtime in the bundle's directory: a `migrt` package there is never imported
    by a fetching process (python -P), only the one the fill itself runs."""
    registry, src, f = _filling(cfg, reg, tmp_path)
    decoy = tmp_path / "cwd" / "migrt" / "registry"
    decoy.mkdir(parents=True)
    for d in (decoy.parent, decoy):
        (d / "__init__.py").write_text("")
    (decoy / "fillwork.py").write_text("import sys\nsys.exit(42)\n")
    monkeypatch.chdir(tmp_path / "cwd")
    try:
        workers = Workers(src.spec, fill_deadline(src.spec, len(PAGES)), 1)
        workers.fetch(registry.add_blob(PAGES), len(PAGES), f.path, 0)
        assert Path(f.path).read_bytes() == PAGES
        workers.close()
    finally:
        src.close()
