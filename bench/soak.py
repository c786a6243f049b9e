#!/usr/bin/env python3
"""Soak: many checkpoint/restore cycles of one container, and what they leave behind.

    python bench/soak.py [--cycles 200] [--warmup 3] [--json-out PATH]

One busybox counter (tests/integration/workloads.py: ~400 KB of random data in memory, a tick with its
hash every 0.2 s) runs under runc in a private root, with a private migrt store and config. Each cycle:

    migrt checkpoint CID --name soak-N     (dump; runc stops the container)
    migrt restore soak-N CID --bundle B    (runc restore --detach; the counter goes on)
    migrt rm soak-N                        (the store goes back to empty)

each through the migrt CLI, timed by wall clock (what a user sees: interpreter start included).
After every restore the container must be running; at the end its output must show one counter
going up without a gap larger than the cycles explain, and the same memory hash throughout.

Leaks: a snapshot after the warm-up cycles and one at the end, compared: open fds and threads of the
container's processes and of this process, mounts naming our directories or the container (the whole
mount table is shown too, but on a shared machine others' work moves it, so it is not a leak test), the store's hidden directories (.staging, .tmp, .locks, and any other), its bytes on
disk, the runc root's entries, work directories left in the bundle, cgroup directories naming the
container, criu lazy-pages work directories in /tmp, and processes naming the container besides its
own. Any growth is reported as a leak, with the numbers.

Prints a table (median, p90, max of checkpoint, restore, rm and whole cycle; the median of the last
20 cycles against the first 20, as a ratio: a drift shows up there), the leak report, writes JSON
(default bench/results/soak.json), and last:

    soak cycles=<N> median_cycle_s=<s> leaks=<none|names>

Run as root (runc, CRIU 4.2+, migrt; MIGRT_BINDIR picks a private install). Everything it starts is
removed: the container by id, checkpoints by name, the temp dir.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import psutil  # noqa: E402

from bench.common import log, machine  # noqa: E402
from tests.helpers.bundles import make_bundle  # noqa: E402
from tests.integration.workloads import COUNTER, parse_ticks  # noqa: E402

BINDIR = os.environ.get("MIGRT_BINDIR", "/usr/local/bin")
CLI = os.path.join(BINDIR, "migrt")
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "soak.json")


class Soak:
    def __init__(self, base: str) -> None:
        self.base = base
        self.mount_points: set[str] = set()
        self.cid = f"soak-{uuid.uuid4().hex[:8]}"
        self.root = os.path.join(base, "runc")
        self.store = os.path.join(base, "store")
        os.makedirs(self.root)
        self.config = os.path.join(base, "config.yaml")
        with open(self.config, "w") as fh:
            fh.write(f"runtime: runc\nstore: {self.store}\nlog_file: {base}/migrt.log\nlog_level: info\n")
        self.bundle = make_bundle(os.path.join(base, "bundle"), ["sh", "-c", COUNTER])
        self.env = {**os.environ, "MIGRT_CONFIG": self.config}
        # The container's stdout is a pipe read here (CRIU dumps a pipe as runc's external stdio; a
        # host file would be outside the container's mounts); each restore gets the same pipe.
        self.r_out, self.w_out = os.pipe()
        self.output = bytearray()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while chunk := os.read(self.r_out, 65536):
            self.output += chunk

    def migrt(self, *args: str, stdout=subprocess.PIPE) -> float:
        t0 = time.monotonic()
        res = subprocess.run([CLI, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=self.env,
                             timeout=300)
        took = time.monotonic() - t0
        if res.returncode != 0:
            raise RuntimeError(f"migrt {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return took

    def start(self) -> None:
        subprocess.run(["runc", "--root", self.root, "run", "-d", "--bundle", self.bundle, self.cid],
                       stdin=subprocess.DEVNULL, stdout=self.w_out, stderr=self.w_out, check=True, timeout=60)

    def state(self) -> dict:
        res = subprocess.run(["runc", "--root", self.root, "state", self.cid], capture_output=True, text=True)
        return json.loads(res.stdout) if res.returncode == 0 else {}

    def cycle(self, n: int) -> dict:
        name = f"{self.cid}-{n}"
        t0 = time.monotonic()
        ck = self.migrt("checkpoint", self.cid, "--root", self.root, "--name", name)
        rs = self.migrt("restore", name, self.cid, "--bundle", self.bundle, "--root", self.root,
                        "--output", "/dev/stdout", stdout=self.w_out)
        st = self.state()
        if st.get("status") != "running":
            raise RuntimeError(f"cycle {n}: after the restore the container is {st.get('status')}")
        rm = self.migrt("rm", name)
        return {"checkpoint_s": ck, "restore_s": rs, "rm_s": rm, "cycle_s": time.monotonic() - t0}

    def snapshot(self) -> dict:
        snap: dict = {}
        pid = self.state().get("pid")
        procs = []
        if pid:
            try:
                top = psutil.Process(pid)
                procs = [top, *top.children(recursive=True)]
            except psutil.Error:
                pass
        snap["container_fds"] = sum(_safe(p.num_fds) for p in procs)
        snap["container_threads"] = sum(_safe(p.num_threads) for p in procs)
        snap["container_procs"] = len(procs)
        snap["bench_fds"] = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/mountinfo") as fh:
            mounts = [ln.split()[4] for ln in fh]
        snap["mounts_total"] = len(mounts)  # the whole host: others' work moves it too (not a leak test)
        self.mount_points = set(mounts)
        snap["mounts_ours"] = sum(1 for m in mounts if self.base in m or self.cid in m)
        for hidden in sorted(glob.glob(os.path.join(self.store, ".*"))):
            snap[f"store_{os.path.basename(hidden)[1:]}_entries"] = len(os.listdir(hidden))
        snap["store_checkpoints"] = len([e for e in os.listdir(self.store) if not e.startswith(".")]) \
            if os.path.isdir(self.store) else 0
        snap["store_bytes"] = _du(self.store)
        snap["runc_root_entries"] = len(os.listdir(self.root))
        snap["bundle_work_dirs"] = len(glob.glob(os.path.join(self.bundle, ".migrt-work-*")))
        snap["cgroup_dirs"] = sum(1 for ctl in glob.glob("/sys/fs/cgroup/*")
                                  for _ in glob.glob(os.path.join(ctl, "**", f"*{self.cid}*"), recursive=True))
        snap["tmp_lazy_dirs"] = len(glob.glob("/tmp/migrt-lazy-*"))
        own = {p.pid for p in procs}
        snap["other_procs_naming_it"] = sum(1 for p in psutil.process_iter(["cmdline"])
                                            if p.pid not in own and self.cid in " ".join(p.info["cmdline"] or []))
        return snap

    def cleanup(self) -> None:
        subprocess.run(["runc", "--root", self.root, "delete", "--force", self.cid], capture_output=True)


def _safe(fn) -> int:
    try:
        return fn()
    except psutil.Error:
        return 0


def _du(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def stats(values: list[float]) -> dict:
    vs = sorted(values)
    return {"median": statistics.median(vs), "p90": vs[min(len(vs) - 1, int(0.9 * len(vs)))], "max": vs[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.access(CLI, os.X_OK):
        log(f"run as root with migrt installed ({CLI})")
        return 2
    base = tempfile.mkdtemp(prefix="migrt-soak-")
    soak = Soak(base)
    rows: list[dict] = []
    t_start = time.monotonic()
    try:
        soak.start()
        time.sleep(0.5)
        for n in range(args.warmup):
            soak.cycle(-1 - n)
        before = soak.snapshot()
        mounts_before = set(soak.mount_points)
        for n in range(args.cycles):
            rows.append(soak.cycle(n))
            if (n + 1) % 20 == 0:
                log(f"  {n + 1}/{args.cycles} cycles, median cycle {statistics.median(r['cycle_s'] for r in rows):.3f} s")
        time.sleep(1.0)  # the last restore's ticks reach the output
        after = soak.snapshot()
        ticks = parse_ticks(soak.output.decode(errors="replace"))
    finally:
        soak.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    wall = time.monotonic() - t_start
    counters = [t[0] for t in ticks]
    hashes = {t[1] for t in ticks} | {t[2] for t in ticks}
    continuity = {"ticks": len(ticks), "monotonic": counters == sorted(counters) and len(set(counters)) == len(counters),
                  "one_memory_hash": len(hashes) == 1}
    leaks = {k: {"before": before.get(k), "after": after.get(k)} for k in sorted(set(before) | set(after))
             if (after.get(k) or 0) > (before.get(k) or 0) and k != "mounts_total"}
    new_mounts = sorted(soak.mount_points - mounts_before)
    # The store's bytes may move by a block or two (a lock file's metadata): more than 64 KiB is a leak.
    if "store_bytes" in leaks and after["store_bytes"] - before["store_bytes"] <= 64 << 10:
        leaks.pop("store_bytes")
    summary = {k: stats([r[k] for r in rows]) for k in ("checkpoint_s", "restore_s", "rm_s", "cycle_s")}
    k = min(20, len(rows) // 2) or 1
    drift = statistics.median(r["cycle_s"] for r in rows[-k:]) / statistics.median(r["cycle_s"] for r in rows[:k])
    result = {"machine": machine(), "cycles": args.cycles, "warmup": args.warmup, "wall_s": round(wall, 1),
              "summary": summary, "drift_last_vs_first": round(drift, 3), "window": k, "continuity": continuity,
              "before": before, "after": after, "leaks": leaks, "new_mounts_on_host": new_mounts, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{'step':<14}{'median s':>10}{'p90 s':>10}{'max s':>10}")
    for key, st in summary.items():
        print(f"{key:<14}{st['median']:>10.3f}{st['p90']:>10.3f}{st['max']:>10.3f}")
    print(f"cycle time, median of the last {k} / first {k} cycles: {drift:.2f}")
    print(f"counter: {continuity['ticks']} ticks, strictly increasing: {continuity['monotonic']}, "
          f"one memory hash: {continuity['one_memory_hash']}")
    print("snapshot (after warm-up -> end):")
    for key in sorted(set(before) | set(after)):
        print(f"  {key:<28}{before.get(key)!s:>12} -> {after.get(key)!s:<12}")
    if new_mounts:
        print(f"mounts new on the host meanwhile (none names our directories or container): {new_mounts[:8]}")
    print("leaks: " + (", ".join(f"{n} {v['before']} -> {v['after']}" for n, v in leaks.items()) or "none"))
    print(f"soak cycles={args.cycles} median_cycle_s={summary['cycle_s']['median']:.3f} "
          f"leaks={','.join(leaks) or 'none'}")
    return 0 if not leaks and continuity["monotonic"] and continuity["one_memory_hash"] else 1


if __name__ == "__main__":
    sys.exit(main())
