#!/usr/bin/env python3
"""Restore time against checkpoint size: does a restore fit in kubelet's runtime request timeout?

    python bench/restore_size.py [--quick] [--sizes 0.25,1,2,4] [--runs 3] [--store DIR] [--json-out PATH]

kubelet gives StartContainer -- and so the whole restore that migrt-runc does inside `create` --
its runtime request timeout, 2 minutes by default. For each size (GiB of anonymous memory), each run:

1. `memhog N` (bench/memhog.c, compiled static with gcc into a busybox rootfs at start) runs under
   plain runc: it fills N GiB with xorshift data (every page touched, no zero page) and prints a
   checksum of it; its stdout is a pipe read by a thread here.
2. `migrt checkpoint` dumps it into a private store (timed: dump + hash + commit).
3. A new bundle asking for the checkpoint (env MIGRT_RESTORE) is created with
   `migrt-runc create` -- the call containerd's shim makes, in which migrt-runc verifies the
   checkpoint (sha256 of every file) and runs `runc restore --detach`. Its wall time is the restore
   time; migrt's log gives the verify and runc restore parts.
4. SIGUSR1 makes the restored process hash its memory again: it must print the checksum of step 1.

The store is on /dev/shm (tmpfs) when memory allows it, so that disk speed does not set the figures:
a size needs about twice its size in available memory (process + checkpoint at once); without
room, /var/tmp is used and said so; sizes that fit nowhere are skipped and said so.

Prints a table of medians (size, checkpoint s, verify s, runc restore s, total restore s, GB/s =
checkpoint bytes / total restore s), the checkpoint size that would take 120 s at the largest size's
rate (median and slowest run) and by a linear fit over the sizes, writes JSON (default bench/results/restore_size.json) and, last:

    restore_size gb=<largest size run> restore_s=<median total restore s> gbps=<median GB/s>

Run as root (runc, CRIU 4.2+, gcc or MIGRT_BENCH_MEMHOG=<a static build of bench/memhog.c>,
/usr/local/bin/migrt-runc). Everything it starts is removed:
containers by id (private runc root), checkpoints by name (private store), the temp dirs.
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

CLI = shutil.which("migrt") or "/usr/local/bin/migrt"
SHIM = "/usr/local/bin/migrt-runc"
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "restore_size.json")
KUBELET_TIMEOUT_S = 120.0
GIB = 1 << 30
FULL_SIZES = (0.25, 1, 2, 4)
QUICK_SIZES = (0.125, 0.25)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def choose_store(size_gib: float, base: str, forced: str | None) -> tuple[str | None, str]:
    """(store directory or None, why). tmpfs needs process + checkpoint in memory at once."""
    need = int(size_gib * GIB)
    margin = 1 * GIB
    avail = meminfo("MemAvailable")
    if forced:
        return forced, "given with --store"
    if os.path.isdir("/dev/shm") and avail >= 2 * need + margin and free_bytes("/dev/shm") >= need + margin:
        return os.path.join("/dev/shm", f"migrt-bench-{os.getpid()}"), "tmpfs (/dev/shm)"
    disk = os.path.join("/var/tmp", f"migrt-bench-{os.getpid()}")
    if avail >= need + margin and free_bytes("/var/tmp") >= need + margin:
        return disk, f"disk (/var/tmp): {avail >> 20} MiB available is too little for tmpfs"
    return None, f"skipped: {avail >> 20} MiB available, {(need + margin) >> 20} MiB needed"


class Lab:
    """The memhog binary, a private runc root, a private config (store set per size)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.root = os.path.join(base, "runc-root")
        os.makedirs(self.root)
        self.memhog = os.path.join(base, "memhog")
        prebuilt = os.environ.get("MIGRT_BENCH_MEMHOG")  # a static build of bench/memhog.c (a machine without gcc)
        if prebuilt:
            shutil.copy2(prebuilt, self.memhog)
        else:
            subprocess.run(["gcc", "-static", "-O2", "-o", self.memhog, os.path.join(REPO, "bench", "memhog.c")],
                           check=True)
        self.config = os.path.join(base, "config.yaml")
        self.log_file = os.path.join(base, "migrt.log")
        self.env = {**os.environ, "MIGRT_CONFIG": self.config}

    def use_store(self, store: str) -> None:
        with open(self.config, "w") as fh:
            fh.write(f"runtime: runc\nstore: {store}\nlog_file: {self.log_file}\nlog_level: info\n")

    def bundle(self, path: str, args: list[str], env: list[str] | None = None) -> str:
        bundle = make_bundle(path, args, env=env)
        shutil.copy2(self.memhog, os.path.join(bundle, "rootfs", "bin", "memhog"))
        if os.environ.get("MIGRT_BENCH_HOST_NETNS"):  # a kernel without xt_mark: CRIU cannot lock a netns of its own
            spec = os.path.join(bundle, "config.json")
            with open(spec) as fh:
                cfg = json.load(fh)
            cfg["linux"]["namespaces"] = [n for n in cfg["linux"]["namespaces"] if n["type"] != "network"]
            with open(spec, "w") as fh:
                json.dump(cfg, fh)
        return bundle


class Reader(threading.Thread):
    """Drains the source container's stdout pipe (memhog ticks every 10 ms) and keeps its lines."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.buf = b""
        self.lock = threading.Lock()

    def run(self) -> None:
        while chunk := os.read(self.fd, 1 << 16):
            with self.lock:
                self.buf = self.buf[-(1 << 20):] + chunk if b"ready " in self.buf else self.buf + chunk
        os.close(self.fd)

    def find(self, prefix: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for line in self.buf.splitlines():
                    if line.startswith(prefix):
                        return line
            time.sleep(0.05)
        raise RuntimeError(f"no {prefix!r} line from memhog within {timeout} s")


def wait_line(path: str, prefix: bytes, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, "rb") as fh:
            for line in fh.read().splitlines():
                if line.startswith(prefix):
                    return line
        time.sleep(0.05)
    raise RuntimeError(f"no {prefix!r} line in {path} within {timeout} s")


def runc(lab: Lab, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["runc", "--root", lab.root, *args], capture_output=True, text=True, timeout=600,
                          check=check)


def restored_timings(log_file: str, container: str) -> dict:
    with open(log_file) as fh:
        for line in reversed(fh.read().splitlines()):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "restored" and ev.get("container_id") == container:
                return ev.get("timings") or {}
    raise RuntimeError(f"no 'restored' event for {container} in {log_file}")


def one_run(lab: Lab, size_gib: float) -> dict:
    mib = int(size_gib * 1024)
    tag = uuid.uuid4().hex[:6]
    src, dst, name = f"rs-src-{tag}", f"rs-dst-{tag}", f"rs-{tag}"
    src_bundle = lab.bundle(os.path.join(lab.base, f"bundle-{src}"), ["/bin/memhog", str(mib)])
    out_file = os.path.join(lab.base, f"{dst}.out")
    started = []
    try:
        # 1. the source: memhog under plain runc, stdout a pipe (CRIU hands pipes over at restore)
        r_out, w_out = os.pipe()
        with open(os.devnull, "rb") as devnull:
            rc = subprocess.run(["runc", "--root", lab.root, "run", "-d", "--bundle", src_bundle, src],
                                stdin=devnull, stdout=w_out, stderr=w_out, timeout=120).returncode
        os.close(w_out)
        reader = Reader(r_out)
        reader.start()
        if rc != 0:
            raise RuntimeError(f"runc run {src} failed ({rc})")
        started.append(src)
        t0 = time.monotonic()
        ready = reader.find(b"ready ", timeout=600).split()[1]
        fill_s = time.monotonic() - t0
        reader.find(b"tick 5 ", timeout=30)

        # 2. checkpoint into the store
        t0 = time.monotonic()
        res = subprocess.run([CLI, "checkpoint", src, "--root", lab.root, "--name", name, "--json"],
                             capture_output=True, text=True, env=lab.env, timeout=1800)
        checkpoint_s = time.monotonic() - t0
        if res.returncode != 0:
            raise RuntimeError(f"migrt checkpoint failed ({res.returncode}): {res.stderr.strip()}")
        ck = json.loads(res.stdout)
        runc(lab, "delete", "--force", src, check=False)
        started.remove(src)
        reader.join(timeout=10)

        # 3. restore: `migrt-runc create` of a bundle asking for the checkpoint (what containerd calls)
        dst_bundle = lab.bundle(os.path.join(lab.base, f"bundle-{dst}"), ["sh", "-c", "echo started-fresh"],
                                env=[f"MIGRT_RESTORE={name}"])
        with open(os.devnull, "rb") as devnull, open(out_file, "ab") as out:
            t0 = time.monotonic()
            rc = subprocess.run([SHIM, "--root", lab.root, "create", "--bundle", dst_bundle, dst], stdin=devnull,
                                stdout=out, stderr=out, env=lab.env, timeout=1800).returncode
            restore_s = time.monotonic() - t0
        started.append(dst)
        if rc != 0:
            with open(out_file, "rb") as fh:
                raise RuntimeError(f"migrt-runc create (restore) failed ({rc}): {fh.read()[-2000:]!r}")
        subprocess.run([SHIM, "--root", lab.root, "start", dst], env=lab.env, check=True, timeout=60)
        parts = restored_timings(lab.log_file, dst)

        # 4. the restored memory hashes to the same checksum
        pid = json.loads(runc(lab, "state", dst).stdout)["pid"]
        os.kill(pid, signal.SIGUSR1)
        got = wait_line(out_file, b"sum ", timeout=600).split()[1]
        if got != ready:
            raise RuntimeError(f"checksum mismatch after restore: {got!r} != {ready!r}")
        return {
            "size_gib": size_gib, "checkpoint_bytes": ck["size_bytes"], "fill_s": round(fill_s, 3),
            "checkpoint_s": round(checkpoint_s, 3), "dump_s": ck["timings"].get("dump_s"),
            "checkpoint_commit_s": ck["timings"].get("commit_s"), "verify_s": parts.get("verify_s"),
            "runc_restore_s": parts.get("restore_s"), "migrt_restore_total_s": parts.get("total_s"),
            "restore_s": round(restore_s, 3), "gbps": round(ck["size_bytes"] / 1e9 / restore_s, 3),
            "checksum": ready.decode(), "checksum_ok": True,
        }
    finally:
        for cid in started:
            runc(lab, "delete", "--force", cid, check=False)
        subprocess.run([CLI, "rm", name], capture_output=True, env=lab.env, timeout=300)
        for path in (src_bundle, os.path.join(lab.base, f"bundle-{dst}"), out_file):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else \
                (os.path.exists(path) and os.unlink(path))


def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def fit(rows: list[dict]) -> dict | None:
    """Least squares of total restore s against checkpoint GB; the size that takes 120 s."""
    pts = [(r["checkpoint_gb"], r["restore_s"]) for r in rows]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    return {"s_per_gb": round(slope, 3), "fixed_s": round(intercept, 3),
            "max_gb_in_120s": round((KUBELET_TIMEOUT_S - intercept) / slope, 1) if slope > 0 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"1 run of {', '.join(map(str, QUICK_SIZES))} GiB")
    ap.add_argument("--sizes", help="comma-separated GiB (default 0.25,1,2,4)")
    ap.add_argument("--runs", type=int, help="runs per size (default 3; --quick 1)")
    ap.add_argument("--store", help="store directory (default: /dev/shm when memory allows)")
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    args = ap.parse_args()
    if os.geteuid() != 0:
        log("restore_size: run as root")
        return 2
    for tool in ("runc", "criu", "gcc"):
        if not shutil.which(tool):
            log(f"restore_size: {tool} not found")
            return 2
    sizes = [float(x) for x in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else FULL_SIZES)
    runs = args.runs or (1 if args.quick else 3)
    info = machine()
    base = tempfile.mkdtemp(prefix="migrt-restore-size-")
    rows, stores = [], set()
    try:
        lab = Lab(base)
        for size in sizes:
            store, why = choose_store(size, base, args.store)
            if store is None:
                log(f"{size:g} GiB: {why}")
                rows.append({"size_gib": size, "skipped": why})
                continue
            stores.add(store)
            lab.use_store(store)
            log(f"{size:g} GiB: store on {why}")
            samples = []
            for i in range(runs):
                log(f"  run {i + 1}/{runs} ...")
                r = one_run(lab, size)
                log(f"    checkpoint {r['checkpoint_s']:.2f} s, restore {r['restore_s']:.2f} s "
                    f"(verify {r['verify_s']}, runc restore {r['runc_restore_s']}), {r['gbps']:.2f} GB/s, checksum ok")
                samples.append(r)
            row = {"size_gib": size, "store": why, "runs": samples,
                   "checkpoint_gb": round(statistics.median(s["checkpoint_bytes"] for s in samples) / 1e9, 3)}
            for key in ("checkpoint_s", "verify_s", "runc_restore_s", "restore_s", "gbps", "fill_s", "dump_s"):
                row[key] = median_of(samples, key)
            rows.append(row)
    finally:
        for store in stores:
            shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    done = [r for r in rows if "skipped" not in r]
    line_fit = fit(done)
    info["loadavg_end"] = os.getloadavg()[0]
    print(f"{'size GiB':>8} {'ckpt GB':>8} {'checkpoint s':>12} {'verify s':>9} {'runc restore s':>14} "
          f"{'total restore s':>15} {'GB/s':>6}  store")
    for r in rows:
        if "skipped" in r:
            print(f"{r['size_gib']:>8g}  {r['skipped']}")
            continue
        print(f"{r['size_gib']:>8g} {r['checkpoint_gb']:>8.3f} {r['checkpoint_s']:>12.2f} {r['verify_s']:>9.2f} "
              f"{r['runc_restore_s']:>14.2f} {r['restore_s']:>15.2f} {r['gbps']:>6.2f}  {r['store'].split(':')[0]}")
    print(f"medians of {runs} run(s) per size; every restored process re-hashed its memory to the original checksum")
    if done:
        big = done[-1]
        slowest = min(r["gbps"] for r in big["runs"])
        print(f"in kubelet's default {KUBELET_TIMEOUT_S:.0f} s, at the {big['size_gib']:g} GiB rate: about "
              f"{KUBELET_TIMEOUT_S * big['gbps']:.0f} GB (median run), {KUBELET_TIMEOUT_S * slowest:.0f} GB (slowest run)")
        estimate = {"at_gib": big["size_gib"], "median_gb": round(KUBELET_TIMEOUT_S * big["gbps"], 1),
                    "slowest_gb": round(KUBELET_TIMEOUT_S * slowest, 1)}
    else:
        estimate = None
    if line_fit:
        print(f"linear fit over the sizes: total restore = {line_fit['fixed_s']:.2f} s + {line_fit['s_per_gb']:.2f} s/GB "
              f"-> {line_fit['max_gb_in_120s']} GB in {KUBELET_TIMEOUT_S:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump({"machine": info, "runs_per_size": runs, "rows": rows, "fit": line_fit,
                   "max_gb_in_120s": estimate}, fh, indent=2)
    if not done:
        print("restore_size gb=0 restore_s=nan gbps=nan")
        return 1
    big = done[-1]
    print(f"restore_size gb={big['size_gib']:g} restore_s={big['restore_s']:.2f} gbps={big['gbps']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
