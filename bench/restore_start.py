#!/usr/bin/env python3
"""What the restore path costs before its first CRIU call, step by step, each in a fresh interpreter.

    python bench/restore_start.py [--runs 5] [--importtime FILE]

Steps (medians over --runs fresh interpreters; each row adds one step to the previous one, so a
row's own cost is its difference from the row above):
  interpreter       python -c pass (-S: no site; then with site, e.g. .pth files of installed wheels)
  shim imports      migrt.shim.__main__ (what migrt-runc imports before deciding)
  restore imports   + migrt.ops.restore (what the create -> restore swap imports)
  config + log      + config.load() and log.setup() (yaml, the log file)
  NVML inventory    + migrt.gpu.inventory.take() (pynvml: nvmlInit and the queries)
  libcuda + cuInit  + the CUDA driver backend loaded (ctypes, cuInit(0))
--importtime FILE: `python -X importtime` of the restore imports, sorted by cumulative time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--importtime", help="write python -X importtime of the restore imports here")
    args = ap.parse_args()
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
