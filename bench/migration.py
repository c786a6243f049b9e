#!/usr/bin/env python3
"""Live migration between two hosts on one machine: downtime and total time by memory size and mode.

    python bench/migration.py [--quick] [--sizes 1,4,8] [--runs 3] [--modes stop-and-copy,lazy] [--json-out PATH]

Two network namespaces joined by a veth pair stand for two nodes (tests/helpers/twohosts.py), each
with its own config, key, runc root and store; both stores live on tmpfs (/dev/shm) so that disks do
not bound the figures. The container runs `memhog` (bench/memhog.c, compiled static with gcc into a
busybox rootfs at start): it fills N GiB with checksummed data, then prints a timestamped tick every
10 ms. For each size and mode, `migrt receive --once --restore` waits in namespace B and
`migrt migrate --json` runs in namespace A; after each migration the restored process is asked
(SIGUSR1) to hash its whole memory again, which must match the hash it printed at start.

Per run it records what `migrt migrate --json` reports -- downtime_s (pause on the source until the
target reports the container running), total_s, the phases -- and the application's own view:
app_gap_s, the longest gap between two consecutive ticks across the migration (minus the 10 ms
period), i.e. how long the process really did not run.

Modes: stop-and-copy (with --free-source-early: both "nodes" share this machine's memory; --streams N
connections, migration/bulk.py), direct (`migrate --direct`: the memory straight from the frozen source
into the target's tasks, which run once all of it is in), pre-dump
(run only where the kernel has soft-dirty tracking; otherwise reported as unavailable), lazy (post-copy:
CRIU page server on the source, `criu lazy-pages` on the target).

Prints a table, writes JSON (default bench/results/migration.json) and, as its last line, for the
largest size run:

    migration gb=<N> mode=<best mode by median downtime> downtime_s=<median> total_s=<median>

Targets (issue 5): downtime <= 0.5 s at 1 GB and <= 1.0 s at 8 GB.
Everything it starts is removed: containers by id, processes by pid, namespaces and stores by name.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from migrt.criu.lazy import lazy_problem, soft_dirty  # noqa: E402
from bench.common import log, machine, meminfo  # noqa: E402
from tests.helpers.bundles import make_bundle  # noqa: E402
from tests.helpers.twohosts import ADDR_B, in_ns, two_hosts  # noqa: E402

CLI = shutil.which("migrt") or "/usr/local/bin/migrt"
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "migration.json")
TICK = 0.010
MODES = ("stop-and-copy", "pre-dump", "lazy", "direct")
TARGETS = {1: 0.5, 8: 1.0}


class Lab:
    """Two nodes' configs and stores (tmpfs), the memhog bundle, the compiled binary."""

    def __init__(self, base: str, shm: str) -> None:
        self.base, self.shm = base, shm
        key = os.urandom(32).hex()
        self.nodes = {}
        for node in ("a", "b"):
            d = os.path.join(base, node)
            os.makedirs(os.path.join(d, "root"))
            with open(os.path.join(d, "key"), "w") as fh:
                fh.write(key)
            os.chmod(os.path.join(d, "key"), 0o600)
            cfg = os.path.join(d, "config.yaml")
            with open(cfg, "w") as fh:
                fh.write(f"runtime: runc\nstore: {os.path.join(shm, node, 'store')}\nlog_file: {d}/migrt.log\n"
                         f"log_level: info\nmigration_key_file: {d}/key\n")
            self.nodes[node] = {"config": cfg, "root": os.path.join(d, "root"),
                                "env": {**os.environ, "MIGRT_CONFIG": cfg}}
        self.memhog = os.path.join(base, "memhog")
        subprocess.run(["gcc", "-static", "-O2", "-o", self.memhog, os.path.join(REPO, "bench", "memhog.c")],
                       check=True)
        self.target_bundle = make_bundle(os.path.join(base, "target-bundle"), ["sh", "-c", "exit 3"])
        shutil.copy2(self.memhog, os.path.join(self.target_bundle, "rootfs", "bin", "memhog"))

    def source_bundle(self, cid: str, mib: int) -> str:
        bundle = make_bundle(os.path.join(self.base, f"bundle-{cid}"), ["/bin/memhog", str(mib)])
        shutil.copy2(self.memhog, os.path.join(bundle, "rootfs", "bin", "memhog"))
        return bundle


class Source:
    """memhog under runc in the default namespace; stdout is a pipe we read."""

    def __init__(self, lab: Lab, cid: str, mib: int) -> None:
        self.root, self.cid = lab.nodes["a"]["root"], cid
        self.bundle = lab.source_bundle(cid, mib)
        r_in, w_in = os.pipe()
        self.r_out, w_out = os.pipe()
        rc = subprocess.run(["runc", "--root", self.root, "run", "-d", "--bundle", self.bundle, cid], stdin=r_in,
                            stdout=w_out, stderr=w_out, timeout=120).returncode
        for fd in (r_in, w_in, w_out):
            os.close(fd)
        if rc != 0:
            raise RuntimeError(f"runc run {cid} failed")
        self.buf = b""
        self.ready = self.wait_for(b"ready ", timeout=300).split()[1].decode()
        self.wait_for(b"tick 20 ", timeout=30)

    def wait_for(self, prefix: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.buf.splitlines():
                if line.startswith(prefix):
                    return line
            r, _, _ = select.select([self.r_out], [], [], 0.2)
            if r:
                chunk = os.read(self.r_out, 1 << 16)
                if not chunk:
                    break
                self.buf += chunk
        raise RuntimeError(f"source {self.cid}: no {prefix!r} line")

    def drain(self) -> bytes:
        while True:
            r, _, _ = select.select([self.r_out], [], [], 2.0)
            if not r:
                break
            chunk = os.read(self.r_out, 1 << 16)
            if not chunk:
                break
            self.buf += chunk
        os.close(self.r_out)
        return self.buf

    def destroy(self) -> None:
        subprocess.run(["runc", "--root", self.root, "delete", "--force", self.cid], capture_output=True)
        shutil.rmtree(self.bundle, ignore_errors=True)



def _target_timings(out: bytes) -> dict | None:
    """The receiver's own view (its --json line): receive, commit, restore (and its steps), pages."""
    for line in out.decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("timings"):
            return rec["timings"]
    return None

def ticks(data: bytes) -> list[tuple[int, float]]:
    out = []
    for line in data.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "tick" and parts[1].isdigit():
            out.append((int(parts[1]), float(parts[2])))
    return out


def one_run(lab: Lab, hosts: dict, mode: str, mib: int, port: int, streams: int | None = None) -> dict:
    cid = f"bench-{uuid.uuid4().hex[:6]}"
    out_file = os.path.join(lab.base, f"{cid}.out")
    log(f"  {mode} {mib} MiB: filling memory ...")
    src = Source(lab, cid, mib)
    recv = subprocess.Popen(
        in_ns(hosts["b"], CLI, "receive", "--listen", f"{ADDR_B}:{port}", "--once", "--json", "--restore",
              lab.target_bundle, "--root", lab.nodes["b"]["root"], "--container-id", f"{cid}-b", "--output", out_file,
              *(["--streams", str(streams)] if streams else [])),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=lab.nodes["b"]["env"])
    try:
        deadline = time.monotonic() + 20
        while recv.poll() is None and time.monotonic() < deadline:  # wait until it listens
            probe = subprocess.run(in_ns(hosts["b"], "ss", "-Hltn", f"sport = :{port}"), capture_output=True, text=True)
            if probe.stdout.strip():
                break
            time.sleep(0.05)
        argv = in_ns(hosts["a"], CLI, "migrate", cid, "--to", f"{ADDR_B}:{port}", "--root", lab.nodes["a"]["root"],
                     "--json", "--pre-dump", "0")
        argv += ["--lazy"] if mode == "lazy" else ["--direct"] if mode == "direct" else ["--free-source-early"]
        argv += ["--streams", str(streams)] if streams and mode == "stop-and-copy" else []
        log(f"  {mode} {mib} MiB: migrating ...")
        res = subprocess.run(argv, capture_output=True, text=True, env=lab.nodes["a"]["env"], timeout=1800)
        recv_out, recv_err = recv.communicate(timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"migrate failed ({res.returncode}): {res.stderr.strip()} | receiver: {recv_err.decode()}")
        data = json.loads(res.stdout)
        before = ticks(src.drain())
        # the restored process: ticks go on, and its memory hashes as before
        # memhog stops ticking while it hashes its memory (8 GiB: ~3 s): the app gap counts ticks up to here
        t_sum = time.time()
        subprocess.run(["runc", "--root", lab.nodes["b"]["root"], "kill", f"{cid}-b", "USR1"], check=True)
        deadline = time.monotonic() + 600
        summed = None
        while time.monotonic() < deadline and summed is None:
            time.sleep(0.1)
            with open(out_file, "rb") as fh:
                for line in fh.read().splitlines():
                    if line.startswith(b"sum "):
                        summed = line.split()[1].decode()
        with open(out_file, "rb") as fh:
            after = ticks(fh.read())
        if summed != src.ready:
            raise RuntimeError(f"memory hash after migration {summed} != {src.ready} before")
        if not before or not after or after[0][0] != before[-1][0] + 1:
            raise RuntimeError(f"tick sequence broken: {before[-1:]} then {after[:1]}")
        seq = before + [t for t in after if t[1] < t_sum]
        gaps = [(b[1] - a[1], i) for i, (a, b) in enumerate(zip(seq, seq[1:]))]
        gap, at = max(gaps)
        gap -= TICK
        # where the longest pause was: across the hand-over, or in ticks before/after it (and how far)
        cut = len(before) - 1
        second = sorted(gaps)[-2][0] - TICK if len(gaps) > 1 else 0.0
        gap_where = {"at": "hand-over" if at == cut else ("source" if at < cut else "target"),
                     "ticks_from_handover": at - cut, "handover_gap_s": round(gaps[cut][0] - TICK, 3),
                     "second_longest_s": round(second, 3)}
        if data.get("committed"):  # the target's copy: remove it, or tmpfs fills up run after run
            subprocess.run([CLI, "rm", data["committed"]], capture_output=True, env=lab.nodes["b"]["env"], check=True)
        return {"mode": mode, "mib": mib, "downtime_s": data["downtime_s"], "total_s": data["total_s"],
                "app_gap_s": round(gap, 3), "bytes": data["bytes"], "phases": data["phases"],
                "lazy_pages_s": data.get("lazy_pages_s"), "pages": data.get("pages"), "lazy_dump": data.get("lazy_dump"),
                "target": _target_timings(recv_out), "gap_where": gap_where, "hash_ok": True}
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
        subprocess.run(["runc", "--root", lab.nodes["b"]["root"], "delete", "--force", f"{cid}-b"], capture_output=True)
        src.destroy()
        with_suppress_remove(out_file)


def with_suppress_remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def wait_for_memory(need: int, patience: float = 900) -> None:
    """The machine may be shared: wait (a while) until `need` bytes are available again."""
    deadline = time.monotonic() + patience
    while meminfo("MemAvailable") < need and time.monotonic() < deadline:
        log(f"    waiting for memory: {meminfo('MemAvailable') >> 20} MiB available, {need >> 20} MiB wanted")
        time.sleep(15)


def summarize(runs: list[dict]) -> dict:
    med = lambda k: round(statistics.median(r[k] for r in runs), 3)  # noqa: E731
    return {"runs": len(runs), "downtime_s": med("downtime_s"), "total_s": med("total_s"), "app_gap_s": med("app_gap_s"),
            "downtime_min_s": min(r["downtime_s"] for r in runs), "downtime_max_s": max(r["downtime_s"] for r in runs),
            "dump_s": round(statistics.median(r["phases"].get("dump_s", 0) for r in runs), 3),
            "transfer_s": round(statistics.median(r["phases"].get("transfer_s", 0) for r in runs), 3),
            "restore_s": round(statistics.median(r["phases"].get("restore_s", 0) for r in runs), 3),
            "bytes": runs[0]["bytes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="0.25 and 1 GiB, 2 runs each")
    ap.add_argument("--sizes", help="GiB, comma-separated (default 1,4,8; quick 0.25,1)")
    ap.add_argument("--runs", type=int, help="runs per size and mode (default 3; quick 2)")
    ap.add_argument("--modes", default="stop-and-copy,pre-dump,lazy")
    ap.add_argument("--streams", type=int, help="stop-and-copy: connections (migrate/receive --streams; "
                                                 "default: migration_streams, 0 = half the CPUs)")
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    args = ap.parse_args()
    if os.geteuid() != 0:
        log("bench/migration.py needs root (runc, CRIU, network namespaces)")
        return 2
    sizes = [float(s) for s in (args.sizes or ("0.25,1" if args.quick else "1,4,8")).split(",")]
    runs = args.runs or (2 if args.quick else 3)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        log(f"unknown mode(s) {sorted(unknown)}; known: {MODES}")
        return 2
    info = machine()
    log(f"machine: {info['cpus']} CPUs ({info['cpu']}), {info['mem_gib']} GiB, kernel {info['kernel']}; "
        f"{info['runc']}; CRIU {info['criu']}")
    notes: dict[str, str] = {}
    if "pre-dump" in modes and not soft_dirty():
        notes["pre-dump"] = "unavailable: no soft-dirty tracking in this kernel (CONFIG_MEM_SOFT_DIRTY unset)"
        modes.remove("pre-dump")
    elif "pre-dump" in modes:
        notes["pre-dump"] = "soft-dirty present, but migrt does not run pre-dump rounds yet"
        modes.remove("pre-dump")
    results: dict = {"machine": info, "notes": notes, "sizes_gib": sizes, "runs_per_point": runs, "points": []}
    base = tempfile.mkdtemp(prefix="migrt-bench-")
    shm = tempfile.mkdtemp(prefix="migrt-bench-", dir="/dev/shm")
    port = 7950
    try:
        lab = Lab(base, shm)
        with two_hosts("mbench") as hosts:
            for m in ("lazy", "direct"):
                if m in modes and lazy_problem("source"):
                    notes[m] = f"unavailable: {lazy_problem('source')}"
                    modes.remove(m)
            for gib in sizes:
                mib = int(gib * 1024)
                need = mib * (2 << 20) + (1 << 30)  # one copy on each "node", plus slack
                wait_for_memory(need)
                if meminfo("MemAvailable") < need:
                    log(f"skipping {gib} GiB: needs about {need >> 30} GiB available")
                    results["points"].append({"gib": gib, "skipped": "not enough memory"})
                    continue
                for mode in modes:
                    samples, failures = [], []
                    for _ in range(runs):
                        port += 1
                        wait_for_memory(need)
                        try:
                            samples.append(one_run(lab, hosts, mode, mib, port, args.streams))
                        except Exception as exc:  # reported, not hidden: the point shows its failures
                            log(f"    FAILED: {exc}")
                            failures.append(str(exc))
                            continue
                        s = samples[-1]
                        log(f"    downtime {s['downtime_s']:.3f} s, app gap {s['app_gap_s']:.3f} s, "
                            f"total {s['total_s']:.3f} s")
                    point = {"gib": gib, "mode": mode, "failures": failures}
                    if samples:
                        point.update(summarize(samples), samples=samples)
                    results["points"].append(point)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(results, fh, indent=2)
    points = [p for p in results["points"] if "downtime_s" in p]
    print(f"{'GiB':>5} {'mode':<14} {'downtime s':>10} {'app gap s':>9} {'total s':>8} {'dump s':>7} "
          f"{'xfer s':>7} {'restore s':>9} {'sent MiB':>9}")
    for p in points:
        print(f"{p['gib']:>5g} {p['mode']:<14} {p['downtime_s']:>10.3f} {p['app_gap_s']:>9.3f} {p['total_s']:>8.3f} "
              f"{p['dump_s']:>7.3f} {p['transfer_s']:>7.3f} {p['restore_s']:>9.3f} {p['bytes'] / 2**20:>9.1f}")
    for p in results["points"]:
        if p.get("failures"):
            print(f"{p['gib']:g} GiB {p['mode']}: {len(p['failures'])} failed run(s): {p['failures'][0][:200]}")
    for mode, note in notes.items():
        print(f"{mode}: {note}")
    for gib, target in TARGETS.items():
        best = min((p for p in points if p["gib"] == gib), key=lambda p: p["downtime_s"], default=None)
        if best:
            print(f"target at {gib} GiB: downtime <= {target} s: {best['downtime_s']:.3f} s ({best['mode']}) "
                  f"{'met' if best['downtime_s'] <= target else 'MISSED'}")
    if not points:
        print("migration gb=0 mode=none downtime_s=nan total_s=nan")
        return 1
    top = max(p["gib"] for p in points)
    best = min((p for p in points if p["gib"] == top), key=lambda p: p["downtime_s"])
    print(f"migration gb={top:g} mode={best['mode']} downtime_s={best['downtime_s']:.3f} total_s={best['total_s']:.3f}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
