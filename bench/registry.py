#!/usr/bin/env python3
"""Checkpoints through a local OCI registry: push and pull MB/s against `cp`, the second push, and
pull + restore against a restore from the local store.

    python bench/registry.py [--sizes 1,4,8] [--runs 1] [--parallel N] [--json-out PATH]

Per size (GiB of anonymous memory held by bench/memhog.c under plain runc), per run:
 1. `migrt checkpoint --leave-running` (A), 2 s later `migrt checkpoint` (B: the same workload a
    little later, memhog's counters moved).
 2. baseline: `cp -r` of A's directory to the registry's disk, timed (no fsync: like the registry).
 3. `migrt push A REG/bench:a` (cold registry), again to `:a2` (unchanged: bytes sent), `migrt push B
    REG/bench:b` (the small change: bytes sent).
 4. restore from the local store: `migrt-runc create` with MIGRT_RESTORE=A (what containerd calls),
    the restored memory re-hashed to memhog's checksum, then deleted.
 5. restore by reference: the raw GET pump of the image, then `migrt-runc create` with
    MIGRT_RESTORE=oci:REG/bench:a on a node store that does not have it (lazily from the registry,
    or pull + restore in the create), checksum again; then four such creates at once on a store
    without it (one fetches, the others join its fill or wait for it: each against the single one);
    then `migrt pull` alone into a fresh name, timed (pull MB/s).
 6. the wire: push and pull beside a raw HTTP pump (plain http.client GET/PUT of the same blobs,
    same registry, same four connections), and four `migrt pull` processes of one image at once.
The registry is Debian's docker-registry on 127.0.0.1 with TLS (CA made here) and htpasswd basic
auth (tests/helpers/registry.py); its storage and the store are on the same file system (/var/tmp,
or /dev/shm for the store with --shm when memory allows). Prints a table of medians and writes JSON
(default bench/results/registry.json); the last line is

    registry gb=<largest size> push_mbps=<..> pull_mbps=<..> cp_mbps=<..> pull_restore_ratio=<..> second_push_pct=<..>
             running_ratio=<..> fill_vs_pump=<..> four_running_ratio=<..>

Above it, issue 30's targets side by side (TARGETS): a restore by reference until the workload runs
(memhog's first tick, stamped by memhog) against the local restore of the same checkpoint (<= 2x);
its full fill (every page in: the page filler's guard gone, the image committed; for a restore that
pulled first, the pull is in it) in MB/s against the raw GET pump of the same image run just before
it (>= 0.8); push and pull against the raw pump (>= 0.8);
four restores by reference at once, the slowest until running against one alone (<= 3x). How each
restore got its pages is read from its own records in migrt's log (restore_path): a full pull and
then a restore from the store, or a lazy restore from the registry.

Run as root (runc, CRIU 4.2+, gcc, docker-registry, htpasswd, openssl, migrt and migrt-runc on PATH
or MIGRT_BINDIR). Everything it starts is removed. To measure one commit of a checkout that holds
uncommitted edits: `git archive COMMIT migrt | tar -x -C DIR`, the node's two launchers copied into
DIR/bin, then MIGRT_BINDIR=DIR/bin PYTHONPATH=DIR, started outside the checkout (the page filler is
started with `python -m`, which puts its working directory first on its path).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import log, machine, meminfo  # noqa: E402
from bench.restore_size import Lab, Reader, restored_timings, runc, wait_line  # noqa: E402
from tests.helpers.registry import PASSWORD, USER, local_registry, missing  # noqa: E402

BINDIR = os.environ.get("MIGRT_BINDIR", "/usr/local/bin")
CLI, SHIM = f"{BINDIR}/migrt", f"{BINDIR}/migrt-runc"
GIB = 1 << 30
PARALLEL = 4  # registry_parallel's default: the pump gets as many connections as migrt
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "registry.json")


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def cli(lab: Lab, *args: str) -> dict:
    res = subprocess.run([CLI, *args, "--json"], capture_output=True, text=True, env=lab.env, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"migrt {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout)


class Pump:
    """The raw HTTP pump: plain http.client over TLS, one keep-alive connection per thread, the Basic
    credentials sent up front, 4 MiB reads and 1 MiB writes (as migrt's client); no digest check, no
    retries, no deadline: what the registry and the wire give."""

    def __init__(self, reg) -> None:
        self.host = reg.host
        self.ctx = ssl.create_default_context(cafile=reg.ca_file)
        self.auth = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        self.local = threading.local()

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPSConnection(self.host, context=self.ctx, blocksize=1 << 20)
        conn.request(method, path, body=body, headers={"Authorization": self.auth, **(headers or {})})
        resp = conn.getresponse()
        if resp.status >= 300:
            raise RuntimeError(f"pump: {method} {path} answered {resp.status}")
        return resp

    def get(self, path: str, dest: str) -> None:
        resp = self.request("GET", path)
        view = memoryview(bytearray(4 << 20))
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while n := resp.readinto(view):
                os.write(fd, view[:n])
        finally:
            os.close(fd)

    def put(self, repo: str, digest: str, src: str) -> None:
        resp = self.request("POST", f"/v2/{repo}/blobs/uploads/", headers={"Content-Length": "0"})
        resp.read()
        loc = urllib.parse.urlsplit(resp.getheader("Location") or "")
        path = f"{loc.path}?{loc.query + '&' if loc.query else ''}{urllib.parse.urlencode({'digest': digest})}"
        with open(src, "rb") as fh:
            self.request("PUT", path, body=fh, headers={"Content-Type": "application/octet-stream",
                                                        "Content-Length": str(os.path.getsize(src))}).read()


def _each(layers: list[dict], parallel: int, fn) -> float:
    """fn(descriptor) for every layer, `parallel` threads; seconds."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for fut in [pool.submit(fn, d) for d in layers]:
            fut.result()
    return time.monotonic() - t0


def layers_of(reg, ref: str) -> list[dict]:
    """The layer descriptors of a pushed image (distinct blobs)."""
    repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
    resp = Pump(reg).request("GET", f"/v2/{repo}/manifests/{tag}",
                             headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    return list({d["digest"]: d for d in json.loads(resp.read())["layers"]}.values())


def get_pump(reg, ref: str, layers: list[dict], into: str, parallel: int) -> float:
    """The raw GET pump: every blob of the image, `parallel` at a time, into files on the store's
    file system; seconds."""
    repo = ref.split("/", 1)[1].rsplit(":", 1)[0]
    os.makedirs(into, exist_ok=True)
    pump = Pump(reg)
    return _each(layers, parallel, lambda d: pump.get(f"/v2/{repo}/blobs/{d['digest']}",
                                                     os.path.join(into, d["digest"].split(":")[1])))


def put_pump(reg, repo: str, layers: list[dict], blobs_dir: str, parallel: int) -> float:
    """The raw PUT pump: every blob's bytes (the files get_pump wrote) uploaded monolithically (POST,
    then PUT ?digest=), `parallel` at a time, to a repository of their own; seconds."""
    pump = Pump(reg)
    return _each(layers, parallel, lambda d: pump.put(repo, d["digest"],
                                                     os.path.join(blobs_dir, d["digest"].split(":")[1])))


def concurrent_pulls(lab: Lab, ref: str, n: int) -> list[float]:
    """n `migrt pull REF` processes on one store at once (the default name: one download, the
    others wait for it); the wall time of each."""
    t0 = time.monotonic()
    procs = [subprocess.Popen([CLI, "pull", ref, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=lab.env) for _ in range(n)]
    ends = []
    for p in procs:
        out, err = p.communicate(timeout=3600)
        if p.returncode:
            raise RuntimeError(f"concurrent pull failed ({p.returncode}): {err.decode()[-1000:]}")
        ends.append(time.monotonic() - t0)
        name = json.loads(out)["name"]
    subprocess.run([CLI, "rm", name], capture_output=True, env=lab.env, timeout=600)
    return ends


def timed_pull(lab: Lab, ref: str, name: str) -> tuple[float, dict]:
    """One `migrt pull` process, wall time (as concurrent_pulls measures it) and its JSON."""
    t0 = time.monotonic()
    out = cli(lab, "pull", ref, "--name", name)
    return time.monotonic() - t0, out


def wire(lab: Lab, reg, name: str, tag: str, scratch: str, parallel: int) -> dict:
    """push and pull by migrt beside the raw pump (curl GET/PUT of the same blobs, same registry,
    same parallelism), and four pulls of one image at once against one alone."""
    ref = reg.ref(f"wire/{tag}", "a")
    os.sync()  # the checkpoint's pages written back first: the push must not race the kernel's writeback
    p1 = cli(lab, "push", name, ref)
    layers = layers_of(reg, ref)
    raw = sum(d["size"] for d in layers)
    blobs = os.path.join(scratch, f"pump-{tag}")
    try:
        get_s = get_pump(reg, ref, layers, blobs, parallel)
        put_s = put_pump(reg, f"wire/{tag}-raw", layers, blobs, parallel)
    finally:
        shutil.rmtree(blobs, ignore_errors=True)
    single_s, pl = timed_pull(lab, ref, f"rg-w-{tag}")
    subprocess.run([CLI, "rm", pl["name"]], capture_output=True, env=lab.env, timeout=600)
    four = concurrent_pulls(lab, ref, 4)
    return {"bytes": raw, "blobs": len(layers),
            "push_mbps": round(raw / 1e6 / p1["seconds"], 1), "pull_mbps": round(raw / 1e6 / pl["seconds"], 1),
            "get_pump_mbps": round(raw / 1e6 / get_s, 1), "put_pump_mbps": round(raw / 1e6 / put_s, 1),
            "pull_vs_get_pump": round(get_s / pl["seconds"], 3), "push_vs_put_pump": round(put_s / p1["seconds"], 3),
            "single_pull_s": round(single_s, 3), "four_pulls_max_s": round(max(four), 3),
            "four_pulls_ratio": round(max(four) / single_s, 3)}


def synthetic(lab: Lab, size_gib: float, tag: str) -> str:
    """A checkpoint of random pages (no CRIU: what push and pull move is all that is measured)."""
    from migrt.store import Store

    name = f"rg-syn-{tag}"
    with Store(lab.store).writer(name) as w:
        with open(os.path.join(w.images, "inventory.img"), "wb") as fh:
            fh.write(b"inventory")
        with open(os.path.join(w.images, "pages-1.img"), "wb") as fh:
            for _ in range(int(size_gib * 1024)):
                fh.write(os.urandom(1 << 20))
        w.commit({"created": "2026-11-27T00:00:00Z"})
    return name


def container_events(log_file: str, cid: str) -> list[dict]:
    """migrt's log records about one container (the shim's `container_id` or `container`)."""
    out = []
    with open(log_file, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and cid in (ev.get("container_id"), ev.get("container")):
                out.append(ev)
    return out


def restore_path(events: list[dict]) -> str:
    """How a restore got its pages, from its own records: 'lazy from registry' (pages fetched by range
    while the container runs: the page mode's source), 'full pull, then <mode>' (every byte pulled into
    the store first, then restored from there: eager, or lazily from the local copy; '(lazy fallback)'
    when the lazy path said why not), 'store, <mode>' (no reference, or the image already in the store,
    e.g. pulled by a concurrent create)."""
    ready = next((e for e in events if e.get("event") == "restore_image_ready"), {})
    done = next((e for e in reversed(events) if e.get("event") == "restored"), {})
    pages = done.get("pages") or {}
    mode = pages.get("mode") or "?"
    if mode == "lazy" and (pages.get("source") == "registry" or ready.get("lazy") is True):
        return "lazy from registry"
    fell_back = any(e.get("event") == "registry_lazy_fallback" for e in events)
    if ready.get("pulled"):
        return f"full pull{' (lazy fallback)' if fell_back else ''}, then {mode}"
    return f"store, {mode}"


# `python -m MODULE ARGS-JSON`: the page filler's guard, with the store's images or the registry's chunks
GUARD_MODULES = (b"migrt.pagefill.guard", b"migrt.registry.fill")


def guard_of(cid: str) -> tuple[int, str] | None:
    """The page filler's guard of a restored container (pid, status file), found by its argv."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        module = next((m for m in GUARD_MODULES if m in argv), None)
        if module is None:
            continue
        try:
            args = json.loads(argv[argv.index(module) + 1])
        except (ValueError, IndexError):
            continue
        if args.get("container_id") == cid:
            return pid, args.get("status") or ""
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class FillWatch(threading.Thread):
    """Until every page of a restored container is in, watched from right after its create: the page
    filler's guard exits once the fill is over (an eager restore, or a fill over before we looked,
    has none: then the fill ended by the create's return). After join(): done_at (monotonic), guard
    (seen), lazy_bytes and copied_bytes from its last status."""

    def __init__(self, cid: str, timeout: float = 3600) -> None:
        super().__init__(daemon=True)
        self.cid, self.timeout = cid, timeout
        self.found = guard_of(cid)
        self.done_at = time.monotonic()
        self.last: dict = {}
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.found and alive(self.found[0]) and time.monotonic() < deadline:
            try:
                with open(self.found[1], encoding="utf-8") as fh:
                    self.last = json.load(fh)
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        self.done_at = time.monotonic()

    def result(self, log_file: str) -> dict:
        self.join(self.timeout + 10)
        if self.found and alive(self.found[0]):
            raise RuntimeError(f"{self.cid}: the page fill is not over after {self.timeout:.0f} s")
        failed = [e for e in container_events(log_file, self.cid) if e.get("event") == "page_fill_failed"]
        if failed:
            raise RuntimeError(f"{self.cid}: the page fill failed: {failed[-1].get('error')}")
        return {"done_at": self.done_at, "guard": self.found is not None,
                "lazy_bytes": self.last.get("lazy_bytes"), "copied_bytes": self.last.get("copied_bytes")}


def first_tick(out_file: str, wall0: float, timeout: float = 600) -> float:
    """Seconds from wall0 (time.time()) to the restored memhog's first tick (it stamps each tick with
    CLOCK_REALTIME): when the workload runs again."""
    return float(wait_line(out_file, b"tick ", timeout=timeout).split()[2]) - wall0


def restore(lab: Lab, request: str, ready: bytes, tag: str) -> dict:
    """migrt-runc create with MIGRT_RESTORE=request, as containerd calls it: until create returns
    (create_s), until the workload's first tick (running_s), until every page is in (filled_s); how
    the pages came (path); then the memory re-hashed to memhog's checksum; the container deleted."""
    dst = f"rg-dst-{tag}-{uuid.uuid4().hex[:4]}"
    bundle = lab.bundle(os.path.join(lab.base, f"bundle-{dst}"), ["sh", "-c", "echo started-fresh"],
                        env=[f"MIGRT_RESTORE={request}"])
    out_file = os.path.join(lab.base, f"{dst}.out")
    try:
        with open(os.devnull, "rb") as devnull, open(out_file, "ab") as out:
            wall0, t0 = time.time(), time.monotonic()
            rc = subprocess.run([SHIM, "--root", lab.root, "create", "--bundle", bundle, dst], stdin=devnull,
                                stdout=out, stderr=out, env=lab.env, timeout=3600).returncode
            create_s = time.monotonic() - t0
        if rc != 0:
            with open(out_file, "rb") as fh:
                raise RuntimeError(f"restore of {request} failed ({rc}): {fh.read()[-2000:]!r}")
        watch = FillWatch(dst)
        subprocess.run([SHIM, "--root", lab.root, "start", dst], env=lab.env, check=True, timeout=60)
        running_s = first_tick(out_file, wall0)
        fill = watch.result(lab.log_file)
        events = container_events(lab.log_file, dst)
        parts = restored_timings(lab.log_file, dst)
        pid = json.loads(runc(lab, "state", dst).stdout)["pid"]
        os.kill(pid, signal.SIGUSR1)
        got = wait_line(out_file, b"sum ", timeout=900).split()[1]
        if got != ready:
            raise RuntimeError(f"checksum mismatch after restoring {request}: {got!r} != {ready!r}")
        return {"create_s": round(create_s, 3), "running_s": round(running_s, 3),
                "filled_s": round(max(fill["done_at"] - t0, create_s), 3), "filler_seen": fill["guard"],
                "lazy_bytes": fill["lazy_bytes"], "path": restore_path(events), "parts": parts,
                "image_ready": next((e.get("chunks") for e in events if e.get("event") == "restore_image_ready"), None),
                "pages": next((e.get("pages") for e in reversed(events) if e.get("event") == "restored"), None)}
    finally:
        runc(lab, "delete", "--force", dst, check=False)
        shutil.rmtree(bundle, ignore_errors=True)
        if os.path.exists(out_file):
            os.unlink(out_file)


def _drop_pulled(lab: Lab, tag: str) -> None:
    """The checkpoints restores by reference pulled (oci-<repository>-...): the next one pulls again."""
    pulled = [n for n in os.listdir(lab.store) if n.startswith(f"oci-{tag}")]
    if pulled:
        cli(lab, "rm", *pulled)


def concurrent_restores(lab: Lab, request: str, ready: bytes, n: int) -> list[dict]:
    """n `migrt-runc create`s restoring one image reference at once on one store that does not have
    it (one pulls, the others wait for it and restore from it), each checksummed; restore()'s figures
    of each."""
    out: list = [None] * n

    def one(i: int) -> None:
        try:
            out[i] = restore(lab, request, ready, f"c{i}")
        except BaseException as exc:  # noqa: BLE001 - raised below
            out[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def room_for(nbytes: int) -> bool:
    """Memory for that much restored memory at once, with 1 GiB to spare."""
    return meminfo("MemAvailable") >= nbytes + GIB


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def adjacent_pump(reg, ref: str, scratch: str, tag: str) -> float:
    """The raw GET pump of the image right before the restore by reference whose fill it is set
    against (the load on a shared machine changes within a run); seconds."""
    blobs = os.path.join(scratch, f"pump-fill-{tag}")
    try:
        return get_pump(reg, ref, layers_of(reg, ref), blobs, PARALLEL)
    finally:
        shutil.rmtree(blobs, ignore_errors=True)


def restore_figures(local: dict, byref: dict, four: list[dict], wired: dict, pump_s: float) -> dict:
    """One run's restore figures, flat: the local restore, the one by reference and the four at once
    (until running, until filled), the fill's MB/s beside the raw GET pump's just before it, how the
    pages came."""
    nbytes = wired["wire_bytes"]
    out = {"restore_local_s": local["create_s"], "restore_local_running_s": local["running_s"],
           "restore_local_filled_s": local["filled_s"], "restore_local_path": local["path"],
           "restore_local_filler_seen": local["filler_seen"], "byref_filler_seen": byref["filler_seen"],
           "restore_local_verify_s": local["parts"].get("verify_s"),
           "restore_local_runc_s": local["parts"].get("restore_s"),
           "pull_restore_s": byref["create_s"], "byref_running_s": byref["running_s"],
           "byref_filled_s": byref["filled_s"], "byref_path": byref["path"],
           "byref_image_ready": byref.get("image_ready"),  # the create's part, in steps (registry/lazy.py)
           "byref_timings": byref["parts"], "restore_local_timings": local["parts"],  # the restores' own records
           "byref_pages": byref.get("pages"), "restore_local_pages": local.get("pages"),
           "pull_restore_runc_s": byref["parts"].get("restore_s"),
           "pull_restore_ratio": ratio(byref["create_s"], local["create_s"]),
           "byref_running_ratio": ratio(byref["running_s"], local["running_s"]),
           "byref_fill_mbps": round(nbytes / 1e6 / byref["filled_s"], 1),
           "fill_pump_mbps": round(nbytes / 1e6 / pump_s, 1),
           "byref_fill_vs_get_pump": ratio(pump_s, byref["filled_s"]),
           "local_fill_mbps": round(nbytes / 1e6 / local["filled_s"], 1)}
    if four:
        out.update({"four_restores_max_s": max(f["create_s"] for f in four),
                    "four_running_max_s": max(f["running_s"] for f in four),
                    "four_restores_ratio": ratio(max(f["create_s"] for f in four), byref["create_s"]),
                    "four_running_ratio": ratio(max(f["running_s"] for f in four), byref["running_s"]),
                    "four_paths": sorted({f["path"] for f in four})})
    return out


def one_run(lab: Lab, reg, size_gib: float, scratch: str) -> dict:
    mib = int(size_gib * 1024)
    tag = uuid.uuid4().hex[:6]
    src, a, b = f"rg-src-{tag}", f"rg-a-{tag}", f"rg-b-{tag}"
    bundle = lab.bundle(os.path.join(lab.base, f"bundle-{src}"), ["/bin/memhog", str(mib)])
    names = [a, b]
    running = []
    try:
        r_out, w_out = os.pipe()
        with open(os.devnull, "rb") as devnull:
            rc = subprocess.run(["runc", "--root", lab.root, "run", "-d", "--bundle", bundle, src],
                                stdin=devnull, stdout=w_out, stderr=w_out, timeout=120).returncode
        os.close(w_out)
        reader = Reader(r_out)
        reader.start()
        if rc != 0:
            raise RuntimeError(f"runc run {src} failed ({rc})")
        running.append(src)
        ready = reader.find(b"ready ", timeout=900).split()[1]
        reader.find(b"tick 5 ", timeout=60)
        ck_a = cli(lab, "checkpoint", src, "--root", lab.root, "--name", a, "--leave-running")
        time.sleep(2)
        cli(lab, "checkpoint", src, "--root", lab.root, "--name", b)
        runc(lab, "delete", "--force", src, check=False)
        running.remove(src)
        reader.join(timeout=10)
        size = ck_a["size_bytes"]
        path_a = os.path.join(lab.store, a)

        copy = os.path.join(scratch, f"cp-{tag}")
        t0 = time.monotonic()
        subprocess.run(["cp", "-r", path_a, copy], check=True)
        cp_s = time.monotonic() - t0
        shutil.rmtree(copy, ignore_errors=True)

        ref_a = reg.ref(f"bench/{tag}", "a")
        p1 = cli(lab, "push", a, ref_a)
        p2 = cli(lab, "push", a, reg.ref(f"bench/{tag}", "a2"))
        p3 = cli(lab, "push", b, reg.ref(f"bench/{tag}", "b"))

        local = restore(lab, a, ready, "local")
        _drop_pulled(lab, tag)
        pump_s = adjacent_pump(reg, ref_a, scratch, tag)
        byref = restore(lab, "oci:" + ref_a, ready, "byref")
        _drop_pulled(lab, tag)
        four = concurrent_restores(lab, "oci:" + ref_a, ready, 4) if room_for(4 * size) else []
        _drop_pulled(lab, tag)
        pl = cli(lab, "pull", ref_a, "--name", f"rg-p-{tag}")
        names.append(pl["name"])
        wired = {f"wire_{k}": v for k, v in wire(lab, reg, a, tag, scratch, PARALLEL).items()}
        return {**wired,
            "size_gib": size_gib, "checkpoint_bytes": size, "cp_s": round(cp_s, 3),
            "cp_mbps": round(size / 1e6 / cp_s, 1),
            "push_s": p1["seconds"], "push_mbps": round(size / 1e6 / p1["seconds"], 1), "push_sent": p1["bytes_sent"],
            "push_layers": p1["layers"],
            "push_unchanged_s": p2["seconds"], "push_unchanged_sent": p2["bytes_sent"],
            "push_unchanged_pct": round(100 * p2["bytes_sent"] / size, 3),
            "push_changed_s": p3["seconds"], "push_changed_sent": p3["bytes_sent"],
            "push_changed_pct": round(100 * p3["bytes_sent"] / size, 3),
            "pull_s": pl["seconds"], "pull_mbps": round(size / 1e6 / pl["seconds"], 1),
            **restore_figures(local, byref, four, wired, pump_s), "checksum_ok": True}
    finally:
        for cid in running:
            runc(lab, "delete", "--force", cid, check=False)
        for n in names:
            subprocess.run([CLI, "rm", n], capture_output=True, env=lab.env, timeout=600)
        shutil.rmtree(bundle, ignore_errors=True)


def synthetic_run(lab: Lab, reg, size_gib: float, scratch: str) -> dict:
    tag = uuid.uuid4().hex[:6]
    name = synthetic(lab, size_gib, tag)
    try:
        size = du(os.path.join(lab.store, name))
        return {"size_gib": size_gib, "checkpoint_bytes": size,
                **{f"wire_{k}": v for k, v in wire(lab, reg, name, tag, scratch, PARALLEL).items()}}
    finally:
        subprocess.run([CLI, "rm", name], capture_output=True, env=lab.env, timeout=600)


def medians(samples: list[dict]) -> dict:
    """Per key, the median of the runs' numbers (ratios too: the median of the per-run ratios); for
    words (how a restore got its pages), every distinct value, joined."""
    out: dict = {}
    for key in samples[0]:
        vals = [s[key] for s in samples if s.get(key) is not None]
        if vals and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = round(statistics.median(vals), 3)
        elif vals and all(isinstance(v, str) for v in vals):
            out[key] = " / ".join(dict.fromkeys(vals))
        elif vals and all(isinstance(v, list) for v in vals):
            out[key] = " / ".join(dict.fromkeys(x for v in vals for x in v))
    return out


# issue 30's targets: (label, figure key, baseline key, ratio key, "<=" or ">=", bound)
TARGETS = (
    ("by reference until running / local lazy restore", "byref_running_s", "restore_local_running_s",
     "byref_running_ratio", "<=", 2.0),
    ("by reference: the full fill (MB/s) / raw GET pump just before", "byref_fill_mbps", "fill_pump_mbps",
     "byref_fill_vs_get_pump", ">=", 0.8),
    ("push (MB/s) / raw PUT pump", "wire_push_mbps", "wire_put_pump_mbps", "wire_push_vs_put_pump", ">=", 0.8),
    ("pull (MB/s) / raw GET pump", "wire_pull_mbps", "wire_get_pump_mbps", "wire_pull_vs_get_pump", ">=", 0.8),
    ("4 restores by reference at once: slowest until running / one alone", "four_running_max_s",
     "byref_running_s", "four_running_ratio", "<=", 3.0),
)


def targets(row: dict) -> list[dict]:
    """The row's figures against issue 30's targets: figure, baseline, ratio, bound, met (None when
    the run did not measure it)."""
    out = []
    for label, fig, base, key, op, bound in TARGETS:
        r = row.get(key)
        met = None if r is None else (r <= bound if op == "<=" else r >= bound)
        out.append({"target": label, "figure": row.get(fig), "baseline": row.get(base), "ratio": r,
                    "bound": f"{op} {bound:g}", "met": met})
    return out


def print_targets(rows: list[dict], runs: int) -> None:
    for row in rows:
        if "skipped" in row:
            continue
        print(f"{row['size_gib']:g} GiB, issue 30's targets (medians of {runs} run(s); the pages came: by "
              f"reference {row.get('byref_path', '-')}; locally {row.get('restore_local_path', '-')}; "
              f"4 at once {row.get('four_paths', '-')})")
        print(f"  {'':<66} {'figure':>8} {'baseline':>8} {'ratio':>6} {'target':>7}")
        for t in targets(row):
            verdict = "-" if t["met"] is None else "met" if t["met"] else "MISSED"
            print(f"  {t['target']:<66} {_num(t['figure']):>8} {_num(t['baseline']):>8} {_num(t['ratio']):>6} "
                  f"{t['bound']:>7} {verdict}")
    print("  figures in s (until running: memhog's first tick after the create began; filled: its page "
          "filler gone) or MB/s (the image's bytes / time, from the create's start for the fill)")


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def print_wire(rows: list[dict]) -> None:
    print(f"{'GiB':>4} {'push MB/s':>9} {'PUT pump':>8} {'ratio':>5} {'pull MB/s':>9} {'GET pump':>8} {'ratio':>5} "
          f"{'1 pull s':>8} {'4 pulls s':>9} {'ratio':>5}")
    for r in rows:
        if "skipped" in r or "wire_push_mbps" not in r:
            continue
        print(f"{r['size_gib']:>4g} {r['wire_push_mbps']:>9.0f} {r['wire_put_pump_mbps']:>8.0f} "
              f"{r['wire_push_vs_put_pump']:>5.2f} {r['wire_pull_mbps']:>9.0f} {r['wire_get_pump_mbps']:>8.0f} "
              f"{r['wire_pull_vs_get_pump']:>5.2f} {r['wire_single_pull_s']:>8.2f} {r['wire_four_pulls_max_s']:>9.2f} "
              f"{r['wire_four_pulls_ratio']:>5.2f}")
    print(f"raw pump: plain http.client GET/PUT of the same blobs, same registry, same connections ({PARALLEL}); "
          "ratio = migrt / pump; "
          "4 pulls: the slowest of four `migrt pull` processes of one image on one store / one alone")


def set_parallel(n: int) -> None:
    """--parallel: migrt's registry_parallel and the raw pump's connections."""
    global PARALLEL
    PARALLEL = n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4,8", help="comma-separated GiB (default 1,4,8)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--shm", action="store_true", help="store on /dev/shm (needs ~4x the size in memory)")
    ap.add_argument("--synthetic", action="store_true",
                    help="random checkpoints, no CRIU: push/pull beside the raw pump and 4 concurrent pulls only")
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    ap.add_argument("--parallel", type=int, default=PARALLEL,
                    help=f"registry_parallel for migrt and the pump's connections alike (default {PARALLEL})")
    args = ap.parse_args()
    if args.parallel != PARALLEL:
        set_parallel(args.parallel)
    if os.geteuid() != 0:
        log("registry: run as root")
        return 2
    miss = [t for t in ("runc", "criu", *(() if os.environ.get("MIGRT_BENCH_MEMHOG") else ("gcc",)))
            if not shutil.which(t)] + missing()
    if miss:
        log(f"registry: missing {', '.join(miss)}")
        return 2
    info = machine()
    base = tempfile.mkdtemp(prefix="migrt-bench-registry-", dir="/var/tmp")
    rows = []
    try:
        with local_registry(os.path.join(base, "registry")) as reg:
            info["registry"] = subprocess.run(["docker-registry", "--version"], capture_output=True,
                                              text=True).stdout.strip()
            lab = Lab(os.path.join(base, "lab"))
            lab.store = (os.path.join("/dev/shm", f"migrt-bench-registry-{os.getpid()}") if args.shm
                         else os.path.join(base, "store"))
            with open(lab.config, "w") as fh:
                fh.write(f"runtime: runc\nstore: {lab.store}\nlog_file: {lab.log_file}\nlog_level: info\n"
                         f"registry_auth_file: {reg.auth_file}\nregistry_ca_file: {reg.ca_file}\n"
                         f"restore_registries: ['{reg.host}']\nregistry_timeout: 3600\n"
                         f"registry_parallel: {PARALLEL}\n")
            for size in (float(x) for x in args.sizes.split(",")):
                need = int(size * GIB) * (4 if args.shm else 1) + GIB
                if meminfo("MemAvailable") < need:
                    why = f"skipped: {meminfo('MemAvailable') >> 20} MiB available, about {need >> 20} MiB needed"
                    log(f"{size:g} GiB: {why}")
                    rows.append({"size_gib": size, "skipped": why})
                    continue
                samples = []
                for i in range(args.runs):
                    log(f"{size:g} GiB run {i + 1}/{args.runs} ...")
                    r = synthetic_run(lab, reg, size, base) if args.synthetic else one_run(lab, reg, size, base)
                    log("  " + json.dumps(r))
                    samples.append(r)
                rows.append({"size_gib": size, "runs": samples, **medians(samples)})
            if args.shm:
                shutil.rmtree(lab.store, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()[0]
    print_wire(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump({"machine": info, "runs": args.runs, "rows": rows}, fh, indent=2)
    done = [r for r in rows if "skipped" not in r]
    if done:
        big = done[-1]
        print(f"registry_wire gb={big['size_gib']:g} push_vs_put_pump={big['wire_push_vs_put_pump']:.2f} "
              f"pull_vs_get_pump={big['wire_pull_vs_get_pump']:.2f} "
              f"four_pulls_ratio={big['wire_four_pulls_ratio']:.2f}")
    if not args.synthetic:
        print_restores(rows, args.runs)
        print_targets(rows, args.runs)
        print(summary_line(rows) or "registry: no size measured")
    return 0


def print_restores(rows: list[dict], runs: int) -> None:
    print(f"{'GiB':>4} {'ckpt GB':>8} {'cp MB/s':>8} {'push MB/s':>9} {'pull MB/s':>9} {'2nd push %':>10} "
          f"{'changed %':>9} {'local restore s':>15} {'pull+restore s':>14} {'ratio':>6}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['size_gib']:>4g}  {r['skipped']}")
            continue
        print(f"{r['size_gib']:>4g} {r['checkpoint_bytes'] / 1e9:>8.3f} {r['cp_mbps']:>8.0f} {r['push_mbps']:>9.0f} "
              f"{r['pull_mbps']:>9.0f} {r['push_unchanged_pct']:>10.3f} {r['push_changed_pct']:>9.2f} "
              f"{r['restore_local_s']:>15.2f} {r['pull_restore_s']:>14.2f} {r['pull_restore_ratio']:>6.2f}")
    for r in rows:
        if "four_restores_ratio" in r:
            print(f"{r['size_gib']:>4g} GiB: four restores by reference at once on one store: the slowest create "
                  f"{r['four_restores_max_s']:.2f} s, {r['four_restores_ratio']:.2f}x one alone")
    print(f"medians of {runs} run(s); every restore re-hashed the process memory to memhog's checksum")


def summary_line(rows: list[dict]) -> str | None:
    done = [r for r in rows if "skipped" not in r]
    if not done:
        return None
    big = done[-1]
    return (f"registry gb={big['size_gib']:g} push_mbps={big['push_mbps']:.0f} pull_mbps={big['pull_mbps']:.0f} "
            f"cp_mbps={big['cp_mbps']:.0f} pull_restore_ratio={big['pull_restore_ratio']:.2f} "
            f"second_push_pct={big['push_unchanged_pct']:.3f} running_ratio={_num(big.get('byref_running_ratio'))} "
            f"fill_vs_pump={_num(big.get('byref_fill_vs_get_pump'))} "
            f"four_running_ratio={_num(big.get('four_running_ratio'))}")


if __name__ == "__main__":
    sys.exit(main())
