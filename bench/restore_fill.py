#!/usr/bin/env python3
"""Restore time of a big CPU process: CRIU's eager copy against migrt's page filler, side by side.

    python bench/restore_fill.py [--sizes 2,4] [--runs 3] [--threads 1,2] [--raw] [--json-out PATH]

For each size (GiB of anonymous memory): `memhog N` (bench/memhog.c, every page touched, xorshift
data) runs under plain runc and is checkpointed once with `migrt checkpoint` into a private store on
/dev/shm. Then, alternating, `runs` times each:
  eager        `migrt restore --pages eager`: CRIU copies every page before the process runs;
  lazy/T       `migrt restore --pages lazy --wait-pages` with fill_threads=T: runc restore --lazy-pages,
               the process runs at once, the filler copies the memory with T threads.
From each restore's own timings: verify (what is checked before runc starts), hash (the sha256 of the
large image files, in the background while CRIU restores: the restore gate holds the tree until it
is done; a lazy restore leaves the pages images to the filler, which verifies each 64 MiB chunk before
it copies from it, and the gate waits only for the chunks CRIU reads itself: "eager"), `runc restore` (until the process runs again), the fill (until all memory is
in, after runc returned), the total, and the filler's own time (from its first background copy, which
starts when CRIU reaches post-restore, to the last). After every restore
SIGUSR1 makes memhog hash its memory again: it must print the checksum it printed before the dump.

--verify as_filled,background adds, beside each lazy/T, lazy/T/bg: the same restore with
MIGRT_RESTORE_VERIFY=background (the pages images hashed whole before the tree may run: the order
before verify-as-filled), alternating in the same run.

--raw measures the same restores without migrt's own steps: `runc restore` of a hard-link view of
the images, eagerly or with --lazy-pages and the page filler driven through its API (what bounds
the memory part alone; migrt's restores add the checkpoint's verification, which holds the tree).

Prints a table of medians with the ratios eager/lazy (memory phase: runc restore + fill; and until
the process runs), writes JSON (default bench/results/restore_fill.json) and, last:

    restore_fill gb=<largest> eager_s=<median> lazy_s=<median, most threads> resume_s=<median> speedup=<x>

(the *_s after verify). Run as root with runc, CRIU 4.2+, gcc and migrt installed (MIGRT_BINDIR picks
a private install). Everything it starts is removed: containers by id, the checkpoint by name, temp dirs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import log, machine, meminfo  # noqa: E402
from tests.helpers.bundles import make_bundle  # noqa: E402

BINDIR = os.environ.get("MIGRT_BINDIR", "/usr/local/bin")
CLI = os.path.join(BINDIR, "migrt")
GIB = 1 << 30
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "restore_fill.json")


class Lab:
    def __init__(self, base: str, store: str, memhog: str | None = None) -> None:
        self.base, self.store = base, store
        self.root = os.path.join(base, "runc-root")
        os.makedirs(self.root)
        self.memhog = memhog or os.path.join(base, "memhog")
        if not memhog:
            subprocess.run(["gcc", "-static", "-O2", "-o", self.memhog, os.path.join(REPO, "bench", "memhog.c")],
                           check=True)
        self.config = os.path.join(base, "config.yaml")
        self.env = {**os.environ, "MIGRT_CONFIG": self.config}
        self.env.pop("MIGRT_RESTORE_PAGES", None)
        self.threads(0)

    def threads(self, n: int) -> None:
        with open(self.config, "w") as fh:
            fh.write(f"runtime: runc\nstore: {self.store}\nlog_file: {self.base}/migrt.log\nfill_threads: {n}\n")

    def bundle(self, name: str, args: list[str]) -> str:
        b = make_bundle(os.path.join(self.base, name), args)
        shutil.copy2(self.memhog, os.path.join(b, "rootfs", "bin", "memhog"))
        return b

    def runc(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["runc", "--root", self.root, *args], capture_output=True, text=True, timeout=600)

    def cli(self, *args: str, env: dict | None = None) -> dict:
        res = subprocess.run([CLI, *args, "--json"], capture_output=True, text=True, env=env or self.env, timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(f"migrt {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()[-1500:]}")
        return json.loads(res.stdout)


def wait_line(path: str, prefix: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(path, errors="replace") as fh:
            for line in fh.read().splitlines():
                if line.startswith(prefix):
                    return line
        time.sleep(0.05)
    raise RuntimeError(f"no {prefix!r} line in {path} within {timeout} s")


def checkpoint(lab: Lab, gib: float, raw: bool = False) -> tuple[str, str]:
    """(checkpoint name, memhog's checksum). memhog's stdout is a pipe (CRIU cannot dump a file
    outside the container), drained by a thread. raw: `runc checkpoint` into <store>/<name>/images
    (no migrt needed)."""
    tag = uuid.uuid4().hex[:6]
    src, name = f"rf-src-{tag}", f"rf-{tag}"
    bundle = lab.bundle(f"b-{src}", ["/bin/memhog", str(int(gib * 1024))])
    r, w = os.pipe()
    with open(os.devnull, "rb") as devnull:
        rc = subprocess.run(["runc", "--root", lab.root, "run", "-d", "--bundle", bundle, src], stdin=devnull,
                            stdout=w, stderr=w, timeout=120).returncode
    os.close(w)
    first: list[bytes] = []

    def drain() -> None:
        buf = b""
        while chunk := os.read(r, 1 << 16):
            if not first:
                buf += chunk
                if b"\n" in buf:
                    first.append(buf.split(b"\n")[0])
        os.close(r)

    threading.Thread(target=drain, daemon=True).start()
    try:
        if rc:
            raise RuntimeError(f"runc run {src} failed ({rc})")
        end = time.monotonic() + 600
        while not first and time.monotonic() < end:
            time.sleep(0.05)
        if not first or not first[0].startswith(b"ready "):
            raise RuntimeError(f"memhog did not get ready: {first!r}")
        ready = first[0].split()[1].decode()
        t0 = time.monotonic()
        if raw:
            images = os.path.join(lab.store, name, "images")
            os.makedirs(images)
            res = lab.runc("checkpoint", "--image-path", images, "--work-path", os.path.join(lab.base, f"w-{src}"), src)
            if res.returncode:
                raise RuntimeError(f"runc checkpoint failed: {res.stderr[-1500:]}")
            size = sum(os.path.getsize(os.path.join(images, f)) for f in os.listdir(images))
        else:
            size = lab.cli("checkpoint", src, "--root", lab.root, "--name", name)["size_bytes"]
        log(f"  checkpoint {gib:g} GiB: {size / GIB:.2f} GiB in {time.monotonic() - t0:.1f} s")
    finally:
        lab.runc("delete", "--force", src)
        shutil.rmtree(bundle, ignore_errors=True)
    return name, ready


def restore_once(lab: Lab, name: str, want: str, mode: str, env: dict | None = None) -> dict:
    cid = f"rf-dst-{uuid.uuid4().hex[:6]}"
    out = os.path.join(lab.base, f"{cid}.out")
    bundle = lab.bundle(f"b-{cid}", ["true"])
    args = ["restore", name, cid, "--bundle", bundle, "--root", lab.root, "--output", out]
    args += ["--pages", "eager"] if mode == "eager" else ["--pages", "lazy", "--wait-pages"]
    try:
        t0 = time.monotonic()
        res = lab.cli(*args, env=env)
        wall = time.monotonic() - t0
        pid = json.loads(lab.runc("state", cid).stdout)["pid"]
        os.kill(pid, signal.SIGUSR1)
        got = wait_line(out, "sum ", 600).split()[1]
        if got != want:
            raise RuntimeError(f"checksum mismatch after a {mode} restore: {got} != {want}")
        t = res["timings"]
        fill = t.get("pages_wait_s", 0.0)
        engine = ((res.get("pages") or {}).get("fill") or {}).get("fill_s")
        return {"mode": mode, "verify_s": t.get("verify_s"), "hash_s": t.get("verify_background_s"),
                "eager_s": t.get("pages_verify_eager_s"),
                "runc_restore_s": t.get("restore_s"), "fill_s": fill, "filler_s": engine,
                "memory_s": round(t.get("restore_s", 0) + fill, 3), "total_s": t.get("total_s"),
                "cli_wall_s": round(wall, 3), "pages": res.get("pages"), "checksum_ok": True}
    finally:
        lab.runc("delete", "--force", cid)
        shutil.rmtree(bundle, ignore_errors=True)
        if os.path.exists(out):
            os.unlink(out)


def restore_raw(lab: Lab, name: str, want: str, mode: str, threads: int) -> dict:
    """The same restore without migrt's own steps (verify, gate): `runc restore` of a hard-link view
    of the checkpoint's images, eagerly, or with --lazy-pages and the page filler (its API)."""
    from migrt.pagefill import PageFill

    cid = f"rf-raw-{uuid.uuid4().hex[:6]}"
    out = os.path.join(lab.base, f"{cid}.out")
    images = os.path.join(lab.store, name, "images")
    view = tempfile.mkdtemp(prefix="view-", dir=lab.store)
    work = tempfile.mkdtemp(prefix="work-", dir=lab.base)
    for f in os.listdir(images):
        os.link(os.path.join(images, f), os.path.join(view, f))
    bundle = lab.bundle(f"b-{cid}", ["true"])
    fill = None
    try:
        t0 = time.monotonic()
        if mode == "lazy":
            fill = PageFill.start(images, threads=threads)
            fill.link(work)
        with open(os.devnull, "rb") as devnull, open(out, "wb") as fh:
            rc = subprocess.run(["runc", "--root", lab.root, "restore", "--detach", "--bundle", bundle, "--image-path",
                                 view, "--work-path", work, "--pid-file", os.path.join(work, "pid"), cid]
                                + (["--lazy-pages"] if fill else []), stdin=devnull, stdout=fh, stderr=fh).returncode
        resume = time.monotonic() - t0
        if rc:
            raise RuntimeError(f"runc restore ({mode}) failed: {open(out).read()[-800:]}")
        pid = int(open(os.path.join(work, "pid")).read())
        st = {}
        if fill:
            fill.restored(pid)
            st = fill.wait(timeout=600)
        full = time.monotonic() - t0
        os.kill(pid, signal.SIGUSR1)
        got = wait_line(out, "sum ", 600).split()[1]
        if got != want:
            raise RuntimeError(f"checksum mismatch after a raw {mode} restore: {got} != {want}")
        return {"mode": mode, "runc_restore_s": round(resume, 3), "memory_s": round(full, 3),
                "fill_s": round(full - resume, 3), "filler_s": st.get("fill_s"), "checksum_ok": True}
    finally:
        if fill:
            fill.detach()
        lab.runc("delete", "--force", cid)
        for d in (view, work, bundle):
            shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(out):
            os.unlink(out)


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4", help="GiB, comma-separated (default 2,4)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="fill_threads values for the lazy restores (default 1,2)")
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    ap.add_argument("--verify", default="as_filled",
                    help="verify orders of the lazy restores, comma-separated: as_filled (default), background")
    ap.add_argument("--memhog", help="a prebuilt static memhog (default: built here with gcc)")
    ap.add_argument("--raw", action="store_true",
                    help="runc restore of the images without migrt's verify and gate (eager vs --lazy-pages + filler)")
    a = ap.parse_args()
    sizes = [float(x) for x in a.sizes.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    base = tempfile.mkdtemp(prefix="migrt-rf-")
    store = tempfile.mkdtemp(prefix="migrt-rf-store-", dir="/dev/shm")
    lab = Lab(base, store, a.memhog)
    rows, results = [], {"machine": machine(), "sizes": {}}
    try:
        for gib in sizes:
            need = 3 * gib * GIB + GIB  # checkpoint on tmpfs + source, then checkpoint + restored process
            if meminfo("MemAvailable") < need:
                log(f"skip {gib:g} GiB: {meminfo('MemAvailable') >> 20} MiB available, {int(need) >> 20} MiB needed")
                continue
            name, want = checkpoint(lab, gib, raw=a.raw)
            runs: dict[str, list[dict]] = {}
            try:
                orders = a.verify.split(",")
                modes = ["eager"] + [f"lazy/{t}" + ("/bg" if o == "background" else "") for t in threads for o in orders]
                for i in range(a.runs):
                    for mode in modes:
                        t = int(mode.split("/")[1]) if "/" in mode else 0
                        env = {**lab.env, "MIGRT_RESTORE_VERIFY": "background"} if mode.endswith("/bg") else None
                        lab.threads(t)
                        if a.raw:
                            r = restore_raw(lab, name, want, "eager" if mode == "eager" else "lazy", t)
                        else:
                            r = restore_once(lab, name, want, "eager" if mode == "eager" else "lazy", env)
                        runs.setdefault(mode, []).append(r)
                        log(f"  {gib:g} GiB run {i + 1} {mode:9s} runc {r['runc_restore_s']:.2f} s  fill {r['fill_s']:.2f} s"
                            f"  memory {r['memory_s']:.2f} s  total {_f(r.get('total_s'))} s")
            finally:
                if a.raw:
                    shutil.rmtree(os.path.join(store, name), ignore_errors=True)
                else:
                    subprocess.run([CLI, "rm", name], capture_output=True, env=lab.env, timeout=300)
            results["sizes"][str(gib)] = runs
            eager = med(runs["eager"], "memory_s")
            for mode in modes:
                rs = runs[mode]
                rows.append({"gib": gib, "mode": mode, "verify_s": med(rs, "verify_s"), "hash_s": med(rs, "hash_s"),
                             "eager_s": med(rs, "eager_s"),
                             "filler_s": med(rs, "filler_s"),
                             "resume_s": med(rs, "runc_restore_s"), "fill_s": med(rs, "fill_s"),
                             "memory_s": med(rs, "memory_s"), "total_s": med(rs, "total_s"),
                             "x_vs_eager": round(eager / med(rs, "memory_s"), 2) if med(rs, "memory_s") else None,
                             "resume_x_vs_eager": round(eager / med(rs, "runc_restore_s"), 2)})
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    results["rows"] = rows
    os.makedirs(os.path.dirname(a.json_out), exist_ok=True)
    with open(a.json_out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"{'GiB':>4} {'mode':9} {'verify':>7} {'hash':>6} {'eager':>6} {'resume':>7} {'fill':>6} {'memory':>7} {'total':>7} "
          f"{'x eager':>8} {'resume x':>9} {'filler':>7}   (medians of {a.runs}, s; memory = resume + fill after it)")
    for r in rows:
        print(f"{r['gib']:>4g} {r['mode']:9} {_f(r['verify_s']):>7} {_f(r['hash_s']):>6} {_f(r.get('eager_s')):>6} "
              f"{r['resume_s']:>7.2f} "
              f"{r['fill_s']:>6.2f} {r['memory_s']:>7.2f} {_f(r['total_s']):>7} {r['x_vs_eager']:>8} "
              f"{r['resume_x_vs_eager']:>9} {_f(r['filler_s']):>7}")
    if not rows:
        return 1
    top = max(r["gib"] for r in rows)
    eager = next(r for r in rows if r["gib"] == top and r["mode"] == "eager")
    lazy = [r for r in rows if r["gib"] == top and r["mode"] != "eager"][-1]
    print(f"restore_fill{' raw' if a.raw else ''} gb={top:g} eager_s={eager['memory_s']} lazy_s={lazy['memory_s']} "
          f"resume_s={lazy['resume_s']} speedup={lazy['x_vs_eager']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
