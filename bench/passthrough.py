#!/usr/bin/env python3
"""Pass-through overhead of migrt-runc against plain runc, measured side by side in one run.

    python bench/passthrough.py [--quick] [--json-out PATH]

Three groups of calls, each timed with plain runc and with /usr/local/bin/migrt-runc, interleaved
(one runc and one migrt-runc sample per iteration, the order alternating) so that drift cancels:

- pass-through calls on a running busybox container, with the global flags containerd sends
  (`--root R --log L --log-format json`): `state ID`, `list`, `--version`, `kill ID 0`, `exec ID true`;
- `create` of an ordinary busybox bundle (the create is timed; its `delete --force` is not);
- a whole `ctr run --rm` of a busybox container through a private containerd, with
  `--runc-binary /usr/local/bin/migrt-runc` or `--runc-binary <runc on PATH>`.

A private MIGRT_CONFIG (runtime: runc; store and log file in the temp dir) is exported before
containerd starts, so containerd, its shims and migrt-runc all read it. Prints a table, writes JSON
(default bench/results/passthrough.json) and, as its last line:

    passthrough added_ms=<median over pass-through calls of added ms> create_added_ms=<..> cycle_ratio=<..>

Targets (issue 2): added_ms <= 15, create_added_ms <= 40, cycle_ratio <= 1.15.
Everything it starts is removed: containers by id, containerd by pid, the temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers.bundles import make_bundle  # noqa: E402
from tests.helpers.containerd import Containerd  # noqa: E402

MIGRT_RUNC = "/usr/local/bin/migrt-runc"
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "passthrough.json")
TARGETS = {"added_ms": 15.0, "create_added_ms": 40.0, "cycle_ratio": 1.15}
RUNTIMES = ("runc", "migrt")
# (warm-up, measured) iterations per group
ITERATIONS = {
    "quick": {"pass": (3, 31), "create": (2, 21), "cycle": (2, 11)},
    "full": {"pass": (10, 201), "create": (5, 81), "cycle": (3, 41)},
}


@dataclass
class Series:
    call: str
    group: str  # pass | create | cycle
    samples: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in RUNTIMES})

    def median(self, runtime: str) -> float:
        return statistics.median(self.samples[runtime])

    @property
    def added_ms(self) -> float:
        return self.median("migrt") - self.median("runc")

    @property
    def ratio(self) -> float:
        return self.median("migrt") / self.median("runc")

    def paired_added_ms(self) -> float:
        """Median of per-iteration differences: a cross-check less sensitive to drift."""
        return statistics.median(m - r for r, m in zip(self.samples["runc"], self.samples["migrt"]))

    def as_dict(self) -> dict:
        return {
            "call": self.call, "group": self.group, "n": len(self.samples["runc"]),
            "runc_median_ms": round(self.median("runc"), 3), "migrt_median_ms": round(self.median("migrt"), 3),
            "added_ms": round(self.added_ms, 3), "paired_added_ms": round(self.paired_added_ms(), 3),
            "ratio": round(self.ratio, 4),
            "quartiles_ms": {r: [round(q, 3) for q in statistics.quantiles(v, n=4)] for r, v in self.samples.items()},
            "samples_ms": {r: [round(s, 3) for s in v] for r, v in self.samples.items()},
        }


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def timed(argv: list[str], timeout: int = 60) -> float:
    """Wall time of one call in ms; a non-zero exit is an error (the benchmark would lie otherwise).

    Waits with a blocking waitpid: subprocess's own timeout= polls with an exponential back-off
    (0.5, 1, 2, 4 ... ms) and would round every sample up to 7.5, 15.5, 31.5, 63.5 ms. The watchdog
    is SIGALRM instead. stderr goes to a temp file, not a pipe: a created container's init inherits
    it and keeps it open."""
    with tempfile.TemporaryFile() as err:
        old = signal.signal(signal.SIGALRM, _alarm)
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        signal.alarm(timeout)
        try:
            rc = proc.wait()
        except Timeout:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{' '.join(argv)} took more than {timeout} s") from None
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        dt = (time.perf_counter() - t0) * 1000.0
        if rc != 0:
            err.seek(0)
            msg = err.read().decode(errors="replace").strip()
            raise RuntimeError(f"{' '.join(argv)} exited {rc}: {msg}")
    return dt


def interleave(series: Series, warmup: int, n: int, sample) -> None:
    """sample(runtime, i) -> ms. Iteration i runs runc first when i is even, migrt first when odd."""
    for i in range(warmup + n):
        order = RUNTIMES if i % 2 == 0 else RUNTIMES[::-1]
        for rt in order:
            ms = sample(rt, i)
            if i >= warmup:
                series.samples[rt].append(ms)


class Bench:
    def __init__(self, quick: bool) -> None:
        self.iters = ITERATIONS["quick" if quick else "full"]
        self.runc = shutil.which("runc")
        if not self.runc:
            raise SystemExit("runc not found on PATH")
        if not os.access(MIGRT_RUNC, os.X_OK):
            raise SystemExit(f"{MIGRT_RUNC} missing: run packaging/setup-host.sh")
        self.bin = {"runc": self.runc, "migrt": MIGRT_RUNC}
        self.base = tempfile.mkdtemp(prefix="migrt-bench-")
        self.root = os.path.join(self.base, "runc-root")  # private runc state root
        self.tag = uuid.uuid4().hex[:6]
        self.live: list[str] = []  # runc containers to delete at the end (by id)
        self.ctd: Containerd | None = None
        self.series: list[Series] = []
        self.reference: dict[str, float] = {}

    # -- set-up -----------------------------------------------------------------------------------
    def configure(self) -> None:
        store, log = os.path.join(self.base, "store"), os.path.join(self.base, "migrt.log")
        cfg = os.path.join(self.base, "config.yaml")
        with open(cfg, "w") as fh:
            fh.write(f"runtime: runc\nstore: {store}\nrestore_failure_policy: fail\nlog_file: {log}\nlog_level: info\n")
        os.environ["MIGRT_CONFIG"] = cfg  # before containerd starts: its shims and migrt-runc inherit it
        os.makedirs(self.root, mode=0o700)

    def globals(self, cid: str) -> list[str]:
        """Global flags as containerd's shim (go-runc) sends them."""
        return ["--root", self.root, "--log", os.path.join(self.base, f"{cid}.log.json"), "--log-format", "json"]

    def start_sleeper(self) -> str:
        cid = f"bench-run-{self.tag}"
        bundle = make_bundle(os.path.join(self.base, "sleeper"), ["sleep", "86400"], runc=self.runc)
        self.live.append(cid)
        g = self.globals(cid)
        subprocess.run([self.runc, *g, "create", "--bundle", bundle, "--pid-file",
                        os.path.join(self.base, "sleeper.pid"), cid], check=True, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run([self.runc, *g, "start", cid], check=True)
        return cid

    # -- groups -----------------------------------------------------------------------------------
    def bench_pass(self, cid: str) -> None:
        g = self.globals(cid)
        calls = {
            "state ID": lambda b: [b, *g, "state", cid],
            "list": lambda b: [b, *g, "list"],
            "--version": lambda b: [b, "--version"],
            "kill ID 0": lambda b: [b, *g, "kill", cid, "0"],
            "exec ID true": lambda b: [b, *g, "exec", cid, "true"],
        }
        warm, n = self.iters["pass"]
        for name, argv in calls.items():
            s = Series(name, "pass")
            interleave(s, warm, n, lambda rt, i, argv=argv: timed(argv(self.bin[rt])))
            self.series.append(s)

    def bench_create(self) -> None:
        bundle = make_bundle(os.path.join(self.base, "create"), ["sleep", "86400"], runc=self.runc)
        pid_file = os.path.join(self.base, "create.pid")

        def sample(rt: str, i: int) -> float:
            cid = f"bench-create-{self.tag}-{rt}-{i}"
            g = self.globals(cid)
            self.live.append(cid)
            try:
                return timed([self.bin[rt], *g, "create", "--bundle", bundle, "--pid-file", pid_file, cid])
            finally:
                self.delete(cid)

        warm, n = self.iters["create"]
        s = Series("create (busybox bundle)", "create")
        interleave(s, warm, n, sample)
        self.series.append(s)

    def bench_cycle(self) -> None:
        self.ctd = Containerd(os.path.join(self.base, "containerd"), namespace=f"migrt-bench-{self.tag}").start()
        image = self.ctd.import_busybox()
        ctr = ["ctr", "--address", self.ctd.sock, "--namespace", self.ctd.namespace]

        def sample(rt: str, i: int) -> float:
            cid = f"bench-ctr-{self.tag}-{rt}-{i}"
            return timed([*ctr, "run", "--rm", "--runc-binary", self.bin[rt], image, cid, "true"], timeout=120)

        warm, n = self.iters["cycle"]
        s = Series("ctr run --rm busybox true", "cycle")
        interleave(s, warm, n, sample)
        self.series.append(s)

    def bench_reference(self) -> None:
        """Start-up costs the shim design has to beat (context only; not in the summary)."""
        calls = {"sh -c :": ["/bin/sh", "-c", ":"], f"{sys.executable} -I -c pass": [sys.executable, "-I", "-c", "pass"]}
        n = self.iters["pass"][1] // 4 + 1
        for name, argv in calls.items():
            self.reference[name] = statistics.median(timed(argv) for _ in range(n))

    # -- clean-up ---------------------------------------------------------------------------------
    def delete(self, cid: str) -> None:
        subprocess.run([self.runc, "--root", self.root, "delete", "--force", cid], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if not os.path.exists(os.path.join(self.root, cid)) and cid in self.live:
            self.live.remove(cid)

    def cleanup(self) -> None:
        for cid in list(self.live):
            self.delete(cid)
        if self.ctd is not None:
            self.ctd.stop()  # removes its containers, then SIGTERM to its pid
            # the shim's runc root for the namespace lives outside the private state dir; empty now
            try:
                os.rmdir(os.path.join("/run/containerd/runc", self.ctd.namespace))
            except OSError:
                pass
        # Never let rmtree walk into a mount left behind (a rootfs of a failed run).
        for mnt in sorted(mounts_under(self.base), key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(self.base, ignore_errors=True)
        if self.live:
            print(f"warning: could not delete runc containers {self.live} (root {self.root})", file=sys.stderr)

    def run(self) -> None:
        self.configure()
        cid = self.start_sleeper()
        self.bench_pass(cid)
        self.delete(cid)
        self.bench_reference()
        self.bench_create()
        self.bench_cycle()


def mounts_under(base: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mnt = line.split()[4].encode().decode("unicode_escape")
            if mnt == base or mnt.startswith(base + "/"):
                out.append(mnt)
    return out


def first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.strip().splitlines()[0] if out.strip() else "?"


def summary(series: list[Series]) -> dict:
    passing = [s.added_ms for s in series if s.group == "pass"]
    create = next(s for s in series if s.group == "create")
    cycle = next(s for s in series if s.group == "cycle")
    return {"added_ms": statistics.median(passing), "create_added_ms": create.added_ms,
            "cycle_ratio": cycle.ratio}


def print_table(series: list[Series]) -> None:
    head = f"{'call':<28} {'runc ms':>9} {'migrt ms':>9} {'added ms':>9} {'ratio':>6} {'n':>4}"
    print(head)
    print("-" * len(head))
    for s in series:
        print(f"{s.call:<28} {s.median('runc'):>9.2f} {s.median('migrt'):>9.2f} {s.added_ms:>9.2f} "
              f"{s.ratio:>6.2f} {len(s.samples['runc']):>4}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few iterations (under a minute)")
    ap.add_argument("--json-out", default=DEFAULT_JSON, help=f"JSON results (default {DEFAULT_JSON})")
    ap.add_argument("--shim", default=None,
                    help="the migrt-runc to time against runc (default /usr/local/bin/migrt-runc; e.g. a launcher of an older "
                         "checkout, for a before/after pair of runs)")
    args = ap.parse_args(argv)
    if args.shim:
        globals()["MIGRT_RUNC"] = args.shim
    if os.geteuid() != 0:
        raise SystemExit("run as root (runc, containerd)")

    def on_signal(signum, _frame):  # make SIGTERM/SIGHUP run the clean-up like Ctrl-C does
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    bench = Bench(quick=args.quick)
    t0 = time.monotonic()
    try:
        bench.run()
    finally:
        bench.cleanup()
    wall = time.monotonic() - t0

    result = summary(bench.series)
    print_table(bench.series)
    print("reference: " + ", ".join(f"{k} {v:.2f} ms" for k, v in bench.reference.items()))
    doc = {
        "benchmark": "passthrough", "mode": "quick" if args.quick else "full", "wall_s": round(wall, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "versions": {"runc": first_line([bench.runc, "--version"]), "containerd": first_line(["containerd", "--version"]),
                     "criu": first_line(["criu", "--version"])},
        "runc": bench.runc, "migrt_runc": MIGRT_RUNC,
        "summary": {k: round(v, 3) for k, v in result.items()},
        "targets": TARGETS,
        "met": {k: result[k] <= TARGETS[k] for k in TARGETS},
        "calls": [s.as_dict() for s in bench.series],
        "reference_median_ms": {k: round(v, 3) for k, v in bench.reference.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    missed = [k for k in TARGETS if not doc["met"][k]]
    print(f"wall {wall:.1f} s; JSON: {args.json_out}; targets "
          + ("met" if not missed else "missed: " + ", ".join(f"{k} > {TARGETS[k]}" for k in missed)))
    print(f"passthrough added_ms={result['added_ms']:.2f} create_added_ms={result['create_added_ms']:.2f} "
          f"cycle_ratio={result['cycle_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
