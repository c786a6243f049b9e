#!/usr/bin/env python3
"""Checkpoint dump of a big CPU process: CRIU's one-threaded dump against migrt's parallel dump, side by side.

    python bench/dump_parallel.py [--sizes 1,2,4] [--runs 3] [--threads 1,2] [--json-out PATH]

For each size (GiB of anonymous memory): `memhog N` (bench/memhog.c, every page touched, xorshift
data) runs under plain runc; the same container is then checkpointed `runs` times per mode with
`migrt checkpoint --leave-running` into a private store on /dev/shm, the modes alternating within
each run (and each mode first in turn, after one dump that is not counted):
  criu        MIGRT_DUMP_PAGES=criu: `runc checkpoint`, CRIU writes every page (one thread);
  parallel/T  MIGRT_DUMP_PAGES=parallel, MIGRT_DUMP_THREADS=T: CRIU's lazy dump writes the other
              images, migrt writes the memory with T threads (docs/dump-pages.md).
Figures from each checkpoint's own timings (manifest): dump (freeze to images complete: what
--leave-running costs the workload on top of the freeze), for the parallel dump its two parts
(CRIU's lazy dump, migrt's page writing), the commit (hash + fsync), and the checkpoint's wall time.
The first parallel checkpoint of each size is restored once (`migrt restore --pages eager`) and
memhog must print the checksum it printed at start (--no-verify skips it). Each checkpoint is
removed before the next.

Prints a table of medians with the ratio criu/parallel of the dump, writes JSON (default
bench/results/dump_parallel.json) and, last:

    dump_parallel gb=<largest> criu_s=<median> parallel_s=<median, most threads> speedup=<x>

Run as root with runc, CRIU 4.2+, gcc and migrt installed (MIGRT_BINDIR picks a private install).
Everything it starts is removed: containers by id, checkpoints by name, temp dirs.
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
from bench.restore_fill import Lab, wait_line  # noqa: E402

GIB = 1 << 30
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "dump_parallel.json")


def start(lab: Lab, gib: float, cids: list[str]) -> tuple[str, str, str]:
    """(container id, memhog's checksum, its output file); stdout is a pipe drained into the file. The id
    goes into `cids` before runc starts it (the caller deletes what is there, whatever happens)."""
    cid = f"dp-{uuid.uuid4().hex[:6]}"
    cids.append(cid)
    bundle = lab.bundle(f"b-{cid}", ["/bin/memhog", str(int(gib * 1024))])
    out = os.path.join(lab.base, f"{cid}.out")
    open(out, "wb").close()
    r, w = os.pipe()
    with open(os.devnull, "rb") as devnull:
        rc = subprocess.run(["runc", "--root", lab.root, "run", "-d", "--bundle", bundle, cid], stdin=devnull,
                            stdout=w, stderr=w, timeout=120).returncode
    os.close(w)
    if rc != 0:
        raise RuntimeError(f"runc run {cid} failed ({rc})")

    def drain() -> None:
        with open(out, "ab") as fh:
            while chunk := os.read(r, 1 << 16):
                fh.write(chunk)
                fh.flush()
        os.close(r)

    threading.Thread(target=drain, daemon=True).start()
    ready = wait_line(out, "ready", 60 + 30 * gib)
    return cid, ready.split()[1], out


def checkpoint(lab: Lab, cid: str, mode: str, threads: int) -> dict:
    name = f"dp-{uuid.uuid4().hex[:6]}"
    env = {**lab.env, "MIGRT_DUMP_PAGES": mode}
    if threads:
        env["MIGRT_DUMP_THREADS"] = str(threads)
    t0 = time.monotonic()
    res = subprocess.run([os.path.join(os.environ.get("MIGRT_BINDIR", "/usr/local/bin"), "migrt"), "checkpoint", cid,
                          "--root", lab.root, "--name", name, "--leave-running"], capture_output=True, text=True,
                         env=env, timeout=1800)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise RuntimeError(f"checkpoint ({mode}) failed: {res.stderr.strip()[-1500:]}")
    with open(os.path.join(lab.store, name, "manifest.json")) as fh:
        m = json.load(fh)
    t = m.get("timings", {})
    rec = m.get("dump_pages") or {}
    if rec.get("mode") != mode:
        raise RuntimeError(f"asked for a {mode} dump, got {rec}")
    size = sum(meta.get("size") or 0 for rel, meta in m.get("files", {}).items() if rel.startswith("images/"))
    return {"name": name, "mode": mode, "threads": rec.get("threads"), "dump_s": t.get("dump_s"),
            "lazy_dump_s": t.get("lazy_dump_s"), "pages_s": t.get("pages_s"), "commit_s": t.get("commit_s"),
            "wall_s": round(wall, 3), "image_bytes": size, "lazy_bytes": rec.get("lazy_bytes")}


def verify(lab: Lab, name: str, want: str) -> None:
    did = f"dpv-{uuid.uuid4().hex[:6]}"
    out = os.path.join(lab.base, f"{did}.out")
    bundle = lab.bundle(f"b-{did}", ["true"])
    try:
        lab.cli("restore", name, did, "--bundle", bundle, "--root", lab.root, "--output", out, "--pages", "eager")
        pid = json.loads(lab.runc("state", did).stdout)["pid"]
        os.kill(pid, signal.SIGUSR1)
        got = wait_line(out, "sum", 120).split()[1]
        if got != want:
            raise RuntimeError(f"restored memory differs: checksum {got}, want {want}")
    finally:
        lab.runc("delete", "--force", did)


def med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(vals), 3) if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,2,4", help="GiB, comma-separated (default 1,2,4)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="dump_threads of the parallel dumps (default 1,2)")
    ap.add_argument("--store", default="/dev/shm", help="where the private store goes (default /dev/shm)")
    ap.add_argument("--no-verify", action="store_true", help="skip the restore + checksum of one parallel checkpoint")
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    modes = [("criu", 0)] + [("parallel", t) for t in threads]
    info = {"machine": machine(), "args": vars(args), "results": []}
    base = tempfile.mkdtemp(prefix="migrt-dp-")
    store = tempfile.mkdtemp(prefix="migrt-dp-store-", dir=args.store)
    shutil.rmtree(store)
    lab = Lab(base, store)
    cids: list[str] = []
    try:
        for gib in sizes:
            need = int(gib * GIB) * 3 + GIB
            if meminfo("MemAvailable") < need:
                raise RuntimeError(f"{gib} GiB: {meminfo('MemAvailable') >> 30} GiB available, {need >> 30} GiB needed")
            cid, want, _out = start(lab, gib, cids)
            rows: dict[str, list[dict]] = {f"{m}/{t}" if t else m: [] for m, t in modes}
            verified = args.no_verify
            # a first dump of fresh memory is slower and erratic in this guest whatever the mode: not counted
            lab.cli("rm", checkpoint(lab, cid, "criu", 0)["name"])
            for k in range(args.runs):
                for mode, t in modes[k % len(modes):] + modes[:k % len(modes)]:  # each mode goes first in turn
                    r = checkpoint(lab, cid, mode, t)
                    key = f"{mode}/{t}" if t else mode
                    rows[key].append(r)
                    log(f"{gib:g} GiB {key} run {k + 1}: dump {r['dump_s']:.2f} s (lazy dump {r['lazy_dump_s']}, "
                        f"pages {r['pages_s']}), commit {r['commit_s']:.2f} s, load {os.getloadavg()[0]:.1f}")
                    if mode == "parallel" and not verified:
                        verify(lab, r["name"], want)
                        verified = True
                        log(f"{gib:g} GiB: the parallel checkpoint restored with the same checksum")
                    lab.cli("rm", r["name"])
            lab.runc("delete", "--force", cid)
            cids.remove(cid)
            info["results"].append({"gb": gib, "rows": rows})
    finally:
        for cid in cids:
            lab.runc("delete", "--force", cid)
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    info["machine"]["loadavg_end"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(info, fh, indent=1)
    print(f"machine: {json.dumps(info['machine'])}")
    print("| GiB | mode | runs | dump s | lazy dump s | pages write s | commit s | wall s | GB/s (dump) | x criu (dump) |")
    print("|----:|------|----:|------:|------:|------:|------:|------:|------:|------:|")
    last = None
    for res in info["results"]:
        base_dump = med(res["rows"]["criu"], "dump_s")
        for key, rows in res["rows"].items():
            d = med(rows, "dump_s")
            gbps = (med(rows, "image_bytes") or 0) / 1e9 / d if d else None
            ratio = base_dump / d if base_dump and d else None
            print(f"| {res['gb']:g} | {key} | {len(rows)} | {d} | {med(rows, 'lazy_dump_s') or '-'} | "
                  f"{med(rows, 'pages_s') or '-'} | {med(rows, 'commit_s')} | {med(rows, 'wall_s')} | "
                  f"{gbps:.2f} | {ratio:.2f} |")
        best = f"parallel/{max(threads)}"
        last = (res["gb"], base_dump, med(res["rows"][best], "dump_s"))
    if last:
        gb, c, p = last
        print(f"dump_parallel gb={gb:g} criu_s={c} parallel_s={p} speedup={c / p:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
