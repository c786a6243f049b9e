#!/usr/bin/env python3
"""What the restore path costs before its first CRIU call, step by step, each in a fresh interpreter.

    python bench/restore_start.py [--runs 5] [--importtime FILE]
    python bench/restore_start.py --create [--runs 11] [--shim PATH ...]    # as root: real migrt-runc creates
    python bench/restore_start.py --create --mib 2048 [--gap 16] [--without-record]    # a lazy restore

Steps (medians over --runs fresh interpreters; each row adds one step to the previous one, so a
row's own cost is its difference from the row above):
  interpreter       python -c pass (-S: no site; then with site, e.g. .pth files of installed wheels)
  shim imports      migrt.shim.__main__ (what migrt-runc imports before deciding)
  restore imports   + migrt.ops.restore (what the create -> restore swap imports)
  config + log      + config.load() and log.setup() (yaml, the log file)
  NVML inventory    + migrt.gpu.inventory.take() (pynvml: nvmlInit and the queries)
  libcuda + cuInit  + the CUDA driver backend loaded (ctypes, cuInit(0))
--importtime FILE: `python -X importtime` of the restore imports, sorted by cumulative time.

--create: the real thing, as containerd calls it. A busybox container (a few MiB) under a private
runc root is checkpointed once with `migrt checkpoint` into a private store; then --runs times, for
each --shim in turn (before/after comparisons side by side), `migrt-runc --root R --log L
--log-format json create --bundle B ID` of a bundle with MIGRT_RESTORE. The config's `runtime:` is a
sh wrapper that stamps the wall clock (date +%s%N) when it is called with `restore`, then execs runc:
"exec to runc restore" is that stamp minus the moment before the exec (the wrapper's own start
included; "sh + date" measures it alone). Also from migrt's `restored` event: the steps before the
runc call (timings.start_marks: the process's age, the first step at 10 ms resolution, exact
differences after it) and the create's wall time. Each restored container is deleted; the store, the
bundles and the runc root are removed at the end. Time it as installed, with migrt's bytecode
cached (PYTHONDONTWRITEBYTECODE in the environment makes every run compile migrt again).

--mib N: the container is bench/memhog.c holding N MiB (built with gcc -static), so that a restore
under `restore_pages: auto` goes through the page filler once N reaches fill_min_mib (256); --gap G
leaves every G-th page of it unwritten (one pagemap entry per G-1 pages: what planning the images
costs grows with the entries, as for processes with many mappings). --without-record: a second
checkpoint, the same images with the manifest's `pagefill` record removed (what a migrt before the
record wrote), restored in the same runs: its restore plans the images before CRIU, the first
takes the figure from the manifest. Rows are then per launcher and checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = [
    ("interpreter (-S)", ["-S", "-c", "pass"]),
    ("interpreter (site)", ["-c", "pass"]),
    ("shim imports", ["-c", "import migrt.shim.__main__"]),
    ("restore imports", ["-c", "import migrt.shim.__main__, migrt.ops.restore"]),
    ("config + log", ["-c", "import migrt.shim.__main__, migrt.ops.restore\n"
                            "from migrt import config, log\nc = config.load()\nlog.setup(c.log_file, c.log_level)"]),
    ("NVML inventory", ["-c", "import migrt.shim.__main__, migrt.ops.restore\n"
                              "from migrt import config, log\nc = config.load()\nlog.setup(c.log_file, c.log_level)\n"
                              "from migrt.gpu import inventory\ninventory.take()"]),
    ("libcuda + cuInit", ["-c", "import migrt.shim.__main__, migrt.ops.restore\n"
                                "from migrt import config, log\nc = config.load()\nlog.setup(c.log_file, c.log_level)\n"
                                "from migrt.gpu import inventory, select\ninventory.take()\n"
                                "select.get_backend('auto').available()"]),
]


def once(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)})
    return time.perf_counter() - t0


SHIM = "/usr/local/bin/migrt-runc"
CLI = shutil.which("migrt") or "/usr/local/bin/migrt"
WRAPPER = """#!/bin/sh
for a in "$@"; do [ "$a" = restore ] && {{ date +%s%N >> {stamp}; break; }}; done
exec {runc} "$@"
"""


def _restored_event(log_file: str, cid: str) -> dict:
    with open(log_file) as fh:
        for line in reversed(fh.read().splitlines()):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "restored" and ev.get("container_id") == cid:
                return ev
    raise RuntimeError(f"no 'restored' event for {cid} in {log_file}")


def _memhog_source(base: str, root: str, mib: int, gap: int) -> str:
    """A memhog container under runc, running once its memory is filled (its "ready" line)."""
    from tests.helpers.bundles import make_bundle

    binary = os.path.join(base, "memhog")
    subprocess.run(["gcc", "-static", "-O2", "-o", binary, os.path.join(REPO, "bench", "memhog.c")], check=True)
    src = make_bundle(os.path.join(base, "src"), ["/bin/memhog", str(mib)] + ([str(gap)] if gap else []))
    shutil.copy2(binary, os.path.join(src, "rootfs", "bin", "memhog"))
    r, w = os.pipe()
    subprocess.run(["runc", "--root", root, "run", "-d", "--bundle", src, "rs-src"], stdin=subprocess.DEVNULL,
                   stdout=w, stderr=w, check=True, timeout=60)
    os.close(w)
    buf = b""
    while b"ready" not in buf:
        chunk = os.read(r, 4096)
        if not chunk:
            raise RuntimeError(f"memhog ended before it was ready: {buf[-500:]!r}")
        buf += chunk
    os.close(r)
    return src


def _without_record(store: str, name: str, copy: str) -> None:
    """`copy`: the checkpoint `name` as a migrt before the `pagefill` record wrote it (hard links:
    the same files)."""
    src, dst = os.path.join(store, name), os.path.join(store, copy)
    shutil.copytree(src, dst, copy_function=os.link)
    path = os.path.join(dst, "manifest.json")
    with open(path) as fh:
        data = json.load(fh)
    data.pop("pagefill", None)
    data["name"] = copy
    os.unlink(path)  # a hard link to the original's manifest
    with open(path, "w") as fh:
        json.dump(data, fh)
    os.chmod(path, 0o600)


def create_runs(runs: int, shims: list[str], mib: int = 0, gap: int = 0, without_record: bool = False) -> int:
    sys.path.insert(0, REPO)
    from tests.helpers.bundles import make_bundle

    base = tempfile.mkdtemp(prefix="migrt-restore-start-")
    root, store, stamp = (os.path.join(base, n) for n in ("runc-root", "store", "stamp"))
    wrapper, config, log_file = (os.path.join(base, n) for n in ("runc-wrapper", "config.yaml", "migrt.log"))
    with open(wrapper, "w") as fh:
        fh.write(WRAPPER.format(stamp=stamp, runc=shutil.which("runc")))
    os.chmod(wrapper, 0o755)
    with open(config, "w") as fh:
        fh.write(f"runtime: {wrapper}\nstore: {store}\nlog_file: {log_file}\nlog_level: info\n")
    env = {**os.environ, "MIGRT_CONFIG": config}
    devnull = subprocess.DEVNULL
    checkpoints = ["rs-ck"] + (["rs-ck-norecord"] if without_record else [])
    cases = [(shim, ck) for shim in shims for ck in checkpoints]
    rows: dict[tuple[str, str], list[dict]] = {case: [] for case in cases}
    created: list[str] = []
    calib = []
    try:
        if mib:
            _memhog_source(base, root, mib, gap)
        else:
            src = make_bundle(os.path.join(base, "src"), ["sh", "-c", "while true; do sleep 1; done"])
            subprocess.run(["runc", "--root", root, "run", "-d", "--bundle", src, "rs-src"], stdin=devnull,
                           stdout=devnull, stderr=devnull, check=True, timeout=60)
        subprocess.run([CLI, "checkpoint", "rs-src", "--root", root, "--name", "rs-ck"], env=env, check=True,
                       stdout=devnull, timeout=600)
        subprocess.run(["runc", "--root", root, "delete", "--force", "rs-src"], check=False, timeout=60)
        if without_record:
            _without_record(store, "rs-ck", "rs-ck-norecord")
        bundles = {ck: make_bundle(os.path.join(base, f"dst-{ck}"), ["sh", "-c", "echo fresh"],
                                   env=[f"MIGRT_RESTORE={ck}"]) for ck in checkpoints}
        if mib:
            for b in bundles.values():
                shutil.copy2(os.path.join(base, "memhog"), os.path.join(b, "rootfs", "bin", "memhog"))
        for i in range(runs):
            t0 = time.time_ns()
            out = subprocess.run(["sh", "-c", "date +%s%N"], capture_output=True, text=True, check=True)
            calib.append((int(out.stdout) - t0) / 1e6)
            for k, (shim, ck) in enumerate(cases):  # side by side: the cases alternate within each run
                bundle = bundles[ck]
                cid = f"rs-dst-{i}-{k}"
                runc_log = os.path.join(base, f"runc-{cid}.log")
                if os.path.exists(stamp):
                    os.unlink(stamp)
                t0 = time.time_ns()
                rc = subprocess.run([shim, "--root", root, "--log", runc_log, "--log-format", "json", "create",
                                     "--bundle", bundle, cid], stdin=devnull, stdout=devnull, stderr=devnull,
                                    env=env, timeout=120).returncode
                wall = (time.time_ns() - t0) / 1e6
                created.append(cid)
                if rc != 0:
                    with open(runc_log) as fh:
                        raise RuntimeError(f"{shim} create failed ({rc}): {fh.read()[-2000:]}")
                with open(stamp) as fh:
                    to_criu = (int(fh.read().split()[0]) - t0) / 1e6
                ev = _restored_event(log_file, cid)
                t = ev.get("timings") or {}
                rows[(shim, ck)].append({"exec_to_criu_ms": to_criu, "create_wall_ms": wall,
                                         "marks": t.get("start_marks") or {}, "pages": ev.get("pages") or {},
                                         "pages_plan_s": t.get("pages_plan_s")})
                subprocess.run(["runc", "--root", root, "delete", "--force", cid], check=False, timeout=60)
                created.remove(cid)
    finally:
        for cid in created:
            subprocess.run(["runc", "--root", root, "delete", "--force", cid], check=False, timeout=60)
        subprocess.run(["runc", "--root", root, "delete", "--force", "rs-src"], capture_output=True, timeout=60)
        for ck in ("rs-ck", "rs-ck-norecord"):
            subprocess.run([CLI, "rm", ck], env=env, capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    what = f"memhog {mib} MiB" + (f" (every {gap}th page unwritten)" if gap else "") if mib else "busybox"
    print(f"create with MIGRT_RESTORE of a {what} checkpoint, medians of {runs} runs, the cases alternating "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at the end); "
          f"sh + date alone (the wrapper's own start): {med(calib):.1f} ms")
    first = None
    print("\n| migrt-runc | checkpoint | pages (lazy bytes from) | exec to runc restore ms | x first | create wall ms "
          "| guard planned, s after the runc call |\n|---|---|---|---|---|---|---|")
    for case in cases:
        ms = med(r["exec_to_criu_ms"] for r in rows[case])
        first = first or ms
        p = rows[case][-1]["pages"] if rows[case] else {}
        mode = f"{p.get('mode')} ({p.get('lazy_bytes_from', '-')}, {(p.get('lazy_bytes') or 0) >> 20} MiB)"
        plan = med(r["pages_plan_s"] for r in rows[case])
        print(f"| {case[0]} | {case[1]} | {mode} | {ms:.1f} | {ms / first:.2f} | "
              f"{med(r['create_wall_ms'] for r in rows[case]):.1f} | {'-' if plan is None else f'{plan:.3f}'} |")
    for case in cases:
        steps = list(rows[case][0]["marks"]) if rows[case] else []
        print(f"\n{case[0]} [{case[1]}]: the steps before the runc call (migrt's marks: process age; the first at "
              "10 ms resolution)")
        print("| step | ms | this step ms |\n|---|---|---|")
        prev = 0.0
        for step in steps:
            ms = med(r["marks"].get(step) for r in rows[case])
            if ms is None:
                continue
            print(f"| {step} | {ms * 1000:.1f} | {ms * 1000 - prev:+.1f} |")
            prev = ms * 1000
    print("restore_start " + " ".join(f"exec_to_criu_ms[{k}]={med(r['exec_to_criu_ms'] for r in rows[c]):.1f}"
                                      for k, c in enumerate(cases)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--importtime", help="write python -X importtime of the restore imports here")
    ap.add_argument("--create", action="store_true", help="time a real migrt-runc create (root, runc, CRIU)")
    ap.add_argument("--shim", action="append", help=f"a migrt-runc to time (default {SHIM}); several alternate "
                    "run by run (e.g. ones `migrt install runtime --bindir DIR` wrote for other installs)")
    ap.add_argument("--mib", type=int, default=0, help="--create: checkpoint memhog holding this many MiB")
    ap.add_argument("--gap", type=int, default=0, help="--mib: leave every GAP-th page unwritten (fragmented)")
    ap.add_argument("--without-record", action="store_true",
                    help="--create: also restore a copy whose manifest lacks the pagefill record")
    args = ap.parse_args()
    if args.create:
        return create_runs(args.runs, args.shim or [SHIM], args.mib, args.gap, args.without_record)
    print(f"python {sys.version.split()[0]} ({sys.executable}); medians of {args.runs} fresh interpreters")
    print("| step (cumulative) | ms | this step ms |\n|---|---|---|")
    prev = 0.0
    for name, argv in STEPS:
        try:
            ms = statistics.median(once(argv) for _ in range(args.runs)) * 1000
        except subprocess.CalledProcessError as exc:
            print(f"| {name} | failed ({exc.returncode}) | - |")
            continue
        print(f"| {name} | {ms:.1f} | {ms - prev:+.1f} |")
        prev = ms
    if args.importtime:
        r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import migrt.shim.__main__, migrt.ops.restore"],
                           capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)})
        rows = [ln for ln in r.stderr.splitlines() if ln.startswith("import time:") and "|" in ln]
        rows = [ln for ln in rows if ln.split("|")[1].strip().isdigit()]
        rows.sort(key=lambda ln: int(ln.split("|")[1]), reverse=True)
        with open(args.importtime, "w") as fh:
            fh.write("\n".join(rows[:60]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
