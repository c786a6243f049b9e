"""Lazy restore by reference (issue 30) with the real docker-registry (TLS, basic auth), containerd,
runc and CRIU: memhog (320 MiB it hashes on SIGUSR1) checkpointed and pushed once; each test restores
it by reference through a small HTTPS proxy in front of the registry (tests/helpers/registry_proxy.py,
started and stopped by pid) that can throttle, corrupt one blob, go away, or refuse byte ranges."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.registry import local_registry, missing, write_auth
from tests.integration.conftest import SHIM, run_cli
from tests.integration.test_containerd import _id, _remove

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 320
BIN_DEST = "/opt/migrt-test"
CHUNK = 64 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reg(migrt_config, tmp_path_factory):
    """The registry, and a port for the proxy in front of it; the node may restore from both, with
    the same credentials (passed through by the proxy to the registry, which checks them)."""
    miss = missing()
    if miss:
        pytest.fail(f"registry prerequisites missing: {', '.join(miss)} (run packaging/setup-host.sh)")
    base = tmp_path_factory.mktemp("lazyreg")
    cfg = migrt_config["config"]
    original = Path(cfg).read_text()
    with local_registry(str(base)) as r:
        r.proxy_host = f"127.0.0.1:{_free_port()}"
        auth = str(base / "auth-both.json")
        write_auth(auth, r.host)
        data = json.loads(Path(auth).read_text())
        data["auths"][r.proxy_host] = data["auths"][r.host]
        Path(auth).write_text(json.dumps(data))
        with open(cfg, "a") as fh:
            fh.write(f"registry_auth_file: {auth}\nregistry_ca_file: {r.ca_file}\n"
                     f"restore_registries: ['{r.host}', '{r.proxy_host}']\n")
        try:
            yield r
        finally:
            Path(cfg).write_text(original)


class Proxy:
    """The proxy process (stopped by its pid) and its request log."""

    def __init__(self, reg, log: str, *args: str) -> None:
        base = os.path.dirname(reg.ca_file)
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.registry_proxy", "--port", reg.proxy_host.rsplit(":", 1)[1],
             "--upstream", reg.host, "--cert", os.path.join(base, "server.pem"), "--key",
             os.path.join(base, "server.key"), "--ca", reg.ca_file, "--log", log, *args], cwd=REPO)
        port = int(reg.proxy_host.rsplit(":", 1)[1])
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("the proxy did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def bytes_served(self) -> dict[str, int]:
        """Bytes of each blob served with a body (whole or in ranges; the one-byte range probes not)."""
        out: dict[str, int] = {}
        if os.path.exists(self.log):
            for ln in Path(self.log).read_text().splitlines():
                rec = json.loads(ln)
                if rec["method"] == "GET" and "/blobs/" in rec["path"] and rec["status"] in (200, 206) \
                        and rec["bytes"] > 1:
                    d = rec["path"].rsplit("/", 1)[1]
                    out[d] = out.get(d, 0) + rec["bytes"]
        return out

    def blobs_served(self) -> set[str]:
        """Digests of the blobs served with a body so far (whole or in ranges; the one-byte probe not)."""
        out = set()
        if os.path.exists(self.log):
            for ln in Path(self.log).read_text().splitlines():
                rec = json.loads(ln)
                if rec["method"] == "GET" and "/blobs/" in rec["path"] and rec["status"] in (200, 206) \
                        and rec["bytes"] > 1:
                    out.add(rec["path"].rsplit("/", 1)[1])
        return out


@pytest.fixture(scope="module")
def memhog_image(containerd, reg, migrt_config, tmp_path_factory):
    """memhog (320 MiB) run through containerd, checkpointed, pushed to the registry, its local
    checkpoint removed; its ready hash, the pinned references (direct and through the proxy), layers."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "gcc is needed to build memhog (it is installed on CI)"
    tmp = tmp_path_factory.mktemp("memhog")
    bindir = tmp / "bin"
    bindir.mkdir()
    subprocess.run([gcc, "-static", "-O2", "-o", str(bindir / "memhog"), os.path.join(REPO, "bench", "memhog.c")],
                   check=True)
    mount = f"type=bind,src={bindir},dst={BIN_DEST},options=rbind:ro"
    cid, log = _id("lz-src"), str(tmp / "src.log")
    containerd.ctr("run", "-d", "--runc-binary", SHIM, "--log-uri", f"file://{log}", "--mount", mount,
                   containerd.image, cid, f"{BIN_DEST}/memhog", str(MIB))
    ready = _wait_line(log, "ready", 60)
    name = _id("lz-ck")
    try:
        run_cli("checkpoint", cid, "--name", name)
    finally:
        _remove(containerd, cid)
    pushed = json.loads(run_cli("push", name, reg.ref("team/memhog", "v1"), "--json").stdout)
    run_cli("rm", name)
    digest = pushed["digest"]
    layers = json.loads(subprocess.run(
        ["curl", "-sf", "--cacert", reg.ca_file, "-u", "migrt-test:s3cret-registry-pass", "-H",
         "Accept: application/vnd.oci.image.manifest.v1+json",
         f"https://{reg.host}/v2/team/memhog/manifests/{digest}"], capture_output=True, check=True).stdout)["layers"]
    return {"ready": ready.split()[1], "digest": digest, "mount": mount, "layers": layers,
            "direct": f"{reg.host}/team/memhog@{digest}", "proxied": f"{reg.proxy_host}/team/memhog@{digest}",
            "name": "oci-memhog-" + digest.split(":", 1)[1][:16]}


def _wait_line(path: str, prefix: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path):
            for ln in Path(path).read_text(errors="replace").splitlines():
                if ln.startswith(prefix):
                    return ln.strip()
        time.sleep(0.1)
    raise AssertionError(f"no '{prefix}' line in {path} after {timeout} s")


def _events(log: str, event: str, cid: str | None = None) -> list[dict]:
    out = []
    for ln in Path(log).read_text(errors="replace").splitlines():
        if f'"{event}"' not in ln:
            continue
        rec = json.loads(ln)
        if rec.get("event") == event and cid in (None, rec.get("container"), rec.get("container_id")):
            out.append(rec)
    return out


def _wait_event(log: str, event: str, cid: str, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = _events(log, event, cid)
        if got:
            return got[-1]
        time.sleep(0.2)
    raise AssertionError(f"no {event} event for {cid} in {log} after {timeout} s")


def _restore(ctd, cid: str, ref: str, log: str, image: dict) -> subprocess.CompletedProcess:
    return ctd.ctr("run", "-d", "--runc-binary", SHIM, "--log-uri", f"file://{log}", "--env",
                   f"MIGRT_RESTORE=oci:{ref}", "--mount", image["mount"], ctd.image, cid, f"{BIN_DEST}/memhog",
                   str(MIB), check=False)


def _sum(ctd, cid: str, log: str) -> str:
    ctd.ctr("task", "kill", "-s", "SIGUSR1", cid)
    return _wait_line(log, "sum", 120).split()[1]


def _running(ctd, cid: str) -> bool:
    for ln in ctd.ctr("task", "ls").stdout.splitlines():
        if ln.split() and ln.split()[0] == cid:
            return "RUNNING" in ln
    return False


def _forget(store: str, image: dict) -> None:
    """The pulled checkpoint and any partial pull of the image go (no pull of it runs now)."""
    run_cli("rm", image["name"], check=False)
    hexd = image["digest"].split(":", 1)[1]
    shutil.rmtree(os.path.join(store, ".pulls", hexd), ignore_errors=True)
    shutil.rmtree(os.path.join(store, ".pulls", hexd + ".chunks"), ignore_errors=True)
    for tail in (".done", ".lazy.json"):
        if os.path.exists(os.path.join(store, ".pulls", hexd + tail)):
            os.unlink(os.path.join(store, ".pulls", hexd + tail))


def _pages_blobs(image: dict) -> list[str]:
    return [d["digest"] for d in image["layers"] if "/pages-" in d["annotations"]["io.migrt.checkpoint.path"]]


def test_lazy_restore_runs_before_the_pages_arrive_and_commits_the_image(memhog_image, reg, containerd,
                                                                        migrt_config, tmp_path):
    """Through the proxy at 48 MiB/s: the container runs while most pages blobs are still to come,
    memhog's hash of its memory checks out, and once the fill is done the image is a verified
    checkpoint in the store (a pull), nothing partial left."""
    image, store, node_log = memhog_image, migrt_config["store"], migrt_config["log"]
    _forget(store, image)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"), "--rate", str(48 << 20))
    cid, log = _id("lz-a"), str(tmp_path / "a.log")
    try:
        res = _restore(containerd, cid, image["proxied"], log, image)
        assert res.returncode == 0, res.stderr
        served_at_start = proxy.blobs_served() & set(_pages_blobs(image))
        assert _running(containerd, cid)
        restored = _wait_event(node_log, "restored", cid, 10)
        pages = restored["pages"]
        assert pages["mode"] == "lazy" and pages["source"] == "registry", pages
        assert pages["registry"]["present"] < pages["registry"]["chunks"] == len(_pages_blobs(image))
        assert len(served_at_start) < len(_pages_blobs(image)), served_at_start  # ran before they all came
        ready = _wait_event(node_log, "restore_image_ready", cid, 1)
        assert ready["lazy"] is True and ready["pulled"] is False
        assert _sum(containerd, cid, log) == image["ready"]       # every page verified and in place
        done = _wait_event(node_log, "registry_fill_done", cid, 120)
        assert done["fetched_chunks"] == pages["registry"]["chunks"] - pages["registry"]["present"]
        assert proxy.blobs_served() >= set(_pages_blobs(image))
        manifest = json.loads(Path(store, image["name"], "manifest.json").read_text())
        assert manifest["pulled"]["manifest_digest"] == image["digest"] and manifest["pulled"]["lazy"] is True
        run_cli("inspect", image["name"], "--verify")
        assert os.listdir(os.path.join(store, ".pulls")) == []
        assert not _events(node_log, "registry_lazy_fallback", cid)
    finally:
        _remove(containerd, cid)
        proxy.stop()
        _forget(store, image)


def _block_records(image: dict) -> dict[str, tuple[int, int, str]]:
    """{digest: (offset, size, record)} of the pages layers that carry block digests."""
    return {d["digest"]: (int(d["annotations"].get("io.migrt.checkpoint.offset", "0")), d["size"],
                          d["annotations"]["io.migrt.checkpoint.blocks"])
            for d in image["layers"] if "io.migrt.checkpoint.blocks" in d["annotations"]}


def test_the_create_fetches_only_the_blocks_criu_reads(memhog_image, reg, containerd, migrt_config, tmp_path):
    """A freshly pushed image records its eager chunks' block digests: the create fetches only the
    blocks holding bytes CRIU reads (far less than those whole chunks), the container runs with its
    memory intact, and the filler fetches the rest of those chunks, so each blob's bytes come once."""
    image, store, node_log = memhog_image, migrt_config["store"], migrt_config["log"]
    records = _block_records(image)
    assert records and all(r[2].startswith(f"{1 << 20}:") for r in records.values()), image["layers"]
    _forget(store, image)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"))
    cid, log = _id("lz-b"), str(tmp_path / "b.log")
    try:
        res = _restore(containerd, cid, image["proxied"], log, image)
        assert res.returncode == 0, res.stderr
        ready = _wait_event(node_log, "restore_image_ready", cid, 1)
        chunks = ready["chunks"]
        assert ready["lazy"] is True and chunks["partly"] == len(records), ready
        whole = len(records) * CHUNK
        assert chunks["bytes_received"] < whole // 8, (chunks, whole)   # a few MiB, not whole 64 MiB chunks
        assert _sum(containerd, cid, log) == image["ready"]
        done = _wait_event(node_log, "registry_fill_done", cid, 120)
        assert done["fetched_chunks"] == chunks["chunks"] - chunks["present"]
        sizes = {d["digest"]: d["size"] for d in image["layers"]}
        served = proxy.bytes_served()
        assert {d: served.get(d, 0) for d in records} == {d: sizes[d] for d in records}  # each byte once
        run_cli("inspect", image["name"], "--verify")
    finally:
        _remove(containerd, cid)
        proxy.stop()
        _forget(store, image)


def _criu_block(image: dict, store: str) -> tuple[str, int]:
    """(digest, offset in the blob) of a byte CRIU reads itself, inside a blob with block digests:
    planned from a copy pulled here, as the create plans it."""
    from migrt.registry import blocks

    records = _block_records(image)
    run_cli("pull", image["direct"], "--name", "lz-probe2")
    try:
        top = os.path.join(store, "lz-probe2")
        sizes = {"images/pages-1.img": os.path.getsize(os.path.join(top, "images", "pages-1.img"))}
        lazy = blocks.eager_plan(os.path.join(top, "images"), sizes)["images/pages-1.img"].lazy
    finally:
        run_cli("rm", "lz-probe2")
    for digest, (off, size, _rec) in sorted(records.items(), key=lambda r: r[1][0]):
        want = blocks.needed(off, off + size, 1 << 20, lazy)
        if want:
            return digest, want[-1] * (1 << 20) + 100
    raise AssertionError(f"no block CRIU reads in {records}")


def test_a_corrupted_block_is_refused_before_criu_runs(memhog_image, reg, containerd, migrt_config, tmp_path):
    """A byte of a block CRIU reads, altered in the registry's storage: the create fails with the
    block's mismatch before CRIU runs, no container, nothing committed or journaled of that chunk."""
    image, store, node_log = memhog_image, migrt_config["store"], migrt_config["log"]
    _forget(store, image)
    digest, at = _criu_block(image, store)
    blob = reg.blob_path(digest)
    with open(blob, "r+b") as fh:
        fh.seek(at)
        old = fh.read(1)
        fh.seek(at)
        fh.write(bytes([old[0] ^ 0xFF]))
    cid, log = _id("lz-x"), str(tmp_path / "x.log")
    try:
        res = _restore(containerd, cid, image["direct"], log, image)
        assert res.returncode != 0
        failed = _wait_event(node_log, "restore_pull_failed", cid, 10)["error"]
        assert f"blob {digest}" in failed and "the data received has sha256" in failed, failed
        assert f"block {at >> 20} of" in failed, failed
        assert not _events(node_log, "restored", cid)                    # CRIU never ran
        assert not _running(containerd, cid)
        assert not os.path.exists(os.path.join(store, image["name"]))
        journal = os.path.join(store, ".pulls", image["digest"].split(":", 1)[1] + ".done")
        assert digest not in (Path(journal).read_text() if os.path.exists(journal) else "")
    finally:
        with open(blob, "r+b") as fh:
            fh.seek(at)
            fh.write(old)
        _remove(containerd, cid)
        _forget(store, image)
    for d in image["layers"]:                                           # the image as pushed
        assert "sha256:" + hashlib.sha256(Path(reg.blob_path(d["digest"])).read_bytes()).hexdigest() == d["digest"]


def _lazy_only_blob(image: dict, store: str) -> str:
    """A pages blob no byte of which CRIU reads itself (only the filler does): planned from a copy
    pulled here."""
    from migrt.pagefill import images as images_mod
    from migrt.pagefill import verify as verify_mod

    run_cli("pull", image["direct"], "--name", "lz-probe")
    try:
        top = os.path.join(store, "lz-probe")
        plan = images_mod.plan(os.path.join(top, "images"))
        lazy = [(s.offset, s.offset + s.length) for p in plan.processes.values() for s in p.segments
                if p.pages_file.endswith("/pages-1.img")]
        size = os.path.getsize(os.path.join(top, "images", "pages-1.img"))
        eager = set(verify_mod.eager_chunks(size, lazy))
    finally:
        run_cli("rm", "lz-probe")
    chunks = sorted((int(d["annotations"].get("io.migrt.checkpoint.offset", "0")), d["digest"])
                    for d in image["layers"] if d["annotations"]["io.migrt.checkpoint.path"] == "images/pages-1.img")
    return next(d for off, d in chunks if off // CHUNK not in eager)


def test_a_corrupted_blob_range_is_refused_before_any_process_reads_it(memhog_image, reg, containerd,
                                                                      migrt_config, tmp_path):
    image, store, node_log = memhog_image, migrt_config["store"], migrt_config["log"]
    _forget(store, image)
    bad = _lazy_only_blob(image, store)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"), "--flip", bad)
    cid, log = _id("lz-c"), str(tmp_path / "c.log")
    try:
        res = _restore(containerd, cid, image["proxied"], log, image)
        if res.returncode == 0:  # (else the filler found it while CRIU restored: the create failed)
            containerd.ctr("task", "kill", "-s", "SIGUSR1", cid, check=False)  # memhog reads all it has
        end = time.monotonic() + 60
        why = None
        while time.monotonic() < end and why is None:
            why = next((e.get("error") for ev in ("page_fill_failed", "restore_failed")
                        for e in _events(node_log, ev, cid) if bad in (e.get("error") or "")), None)
            time.sleep(0.2)
        assert why and "does not match its digest" in why, (res.stderr, _events(node_log, "page_fill_failed", cid))
        assert "no restored process ran on it" in why
        time.sleep(1)
        assert not _running(containerd, cid)
        assert "sum" not in Path(log).read_text(errors="replace") if os.path.exists(log) else True
        assert not os.path.exists(os.path.join(store, image["name"]))           # nothing committed
        journal = os.path.join(store, ".pulls", image["digest"].split(":", 1)[1] + ".done")
        assert bad not in (Path(journal).read_text() if os.path.exists(journal) else "")
    finally:
        _remove(containerd, cid)
        proxy.stop()
        _forget(store, image)


def test_registry_gone_mid_fill_stops_the_container_and_a_retry_restores(memhog_image, reg, containerd,
                                                                        migrt_config, tmp_path):
    image, store, node_log = memhog_image, migrt_config["store"], migrt_config["log"]
    _forget(store, image)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"), "--rate", str(16 << 20))
    cid, log = _id("lz-k"), str(tmp_path / "k.log")
    cid2, log2 = _id("lz-r"), str(tmp_path / "r.log")
    try:
        res = _restore(containerd, cid, image["proxied"], log, image)
        assert res.returncode == 0, res.stderr
        time.sleep(1.0)
        proxy.stop()                                                    # the registry goes away mid-fill
        failed = _wait_event(node_log, "page_fill_failed", cid, 90)
        assert f"registry {reg.proxy_host} went away while filling container {cid}'s memory" in failed["error"]
        assert "the container was stopped; restore again" in failed["error"]
        runc_log = os.path.join(containerd.state, "io.containerd.runtime.v2.task", containerd.namespace, cid,
                                "log.json")
        assert "went away while filling container" in Path(runc_log).read_text()
        time.sleep(1)
        assert not _running(containerd, cid)
        assert not os.path.exists(os.path.join(store, image["name"]))
        for d in image["layers"]:                                       # the image in the registry: intact
            assert "sha256:" + hashlib.sha256(Path(reg.blob_path(d["digest"])).read_bytes()).hexdigest() == d["digest"]
        proxy = Proxy(reg, str(tmp_path / "proxy2.log"))                # back: a retry restores, lazily again
        res = _restore(containerd, cid2, image["proxied"], log2, image)
        assert res.returncode == 0, res.stderr
        pages = _wait_event(node_log, "restored", cid2, 10)["pages"]
        assert pages["source"] == "registry" and pages["registry"]["present"] > 0   # resumed from the journal
        assert _sum(containerd, cid2, log2) == image["ready"]
        _wait_event(node_log, "registry_fill_done", cid2, 120)
        run_cli("inspect", image["name"], "--verify")
    finally:
        _remove(containerd, cid)
        _remove(containerd, cid2)
        proxy.stop()
        _forget(store, image)


def test_a_registry_without_ranges_falls_back_to_the_full_pull(memhog_image, reg, containerd, migrt_config,
                                                               tmp_path):
    image, store, node_log = memhog_image, migrt_config["store"], migrt_config["log"]
    _forget(store, image)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"), "--no-ranges")
    cid, log = _id("lz-n"), str(tmp_path / "n.log")
    try:
        res = _restore(containerd, cid, image["proxied"], log, image)
        assert res.returncode == 0, res.stderr
        falls = _events(node_log, "registry_lazy_fallback", cid)
        assert len(falls) == 1 and "answers byte ranges with the whole blob" in falls[0]["reason"], falls
        ready = _wait_event(node_log, "restore_image_ready", cid, 1)
        assert ready["lazy"] is False and ready["pulled"] is True
        assert _wait_event(node_log, "restored", cid, 1)["pages"].get("source") != "registry"
        assert _sum(containerd, cid, log) == image["ready"]
        assert os.path.isdir(os.path.join(store, image["name"]))
        assert os.listdir(os.path.join(store, ".pulls")) == []
    finally:
        _remove(containerd, cid)
        proxy.stop()
        _forget(store, image)


def test_four_restores_of_one_image_at_once_fetch_each_blob_once(memhog_image, reg, containerd, migrt_config,
                                                                 tmp_path):
    """Four creates restoring one reference at once on a node without it: one takes the image lock and
    fills lazily, the others join its fill (same partial directory, each chunk fetched by one filler,
    per-chunk locks); every blob's bytes come from the registry once, every memory checks out, the
    image is committed once."""
    image, store, node_log = memhog_image, migrt_config["store"], migrt_config["log"]
    _forget(store, image)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"), "--rate", str(64 << 20))
    cids = [_id(f"lz-4{i}") for i in range(4)]
    logs = {cid: str(tmp_path / f"{cid}.log") for cid in cids}
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda c: _restore(containerd, c, image["proxied"], logs[c], image), cids))
        assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
        ready = {c: _wait_event(node_log, "restore_image_ready", c, 5) for c in cids}
        assert all(r["lazy"] for r in ready.values()), ready
        assert sorted(bool(r["chunks"].get("joined")) for r in ready.values()) == [False, True, True, True]
        for c in cids:
            assert _sum(containerd, c, logs[c]) == image["ready"]
        done = [_wait_event(node_log, "registry_fill_done", c, 120) for c in cids]
        assert sorted(d["joined"] for d in done) == [False, True, True, True]
        sizes = {d["digest"]: d["size"] for d in image["layers"]}
        served = proxy.bytes_served()
        assert {d: served.get(d, 0) for d in sizes} == sizes           # each blob's bytes once, for all four
        run_cli("inspect", image["name"], "--verify")
        assert os.listdir(os.path.join(store, ".pulls")) == []
    finally:
        for c in cids:
            _remove(containerd, c)
        proxy.stop()
        _forget(store, image)
