#!/usr/bin/env python3
"""What the restore's seccomp check costs (ops/restore_privileges.py _seccomp), each run in a fresh
interpreter, as a restore runs it.

    python bench/seccomp_check.py --profile FILE [--threads 4] [--runs 11] [--json OUT]

--profile: a linux.seccomp object, e.g. containerd's default profile:
    ctr containers create --seccomp IMAGE p && ctr containers info p | jq .Spec.linux.seccomp > FILE
The checkpoint's threads (--threads, one chain shared as runc leaves it) run the program runc loads
for that profile: libseccomp's bytes after an -ENOSYS stub assembled otherwise than the one migrt
builds (as runc's is). Rows (medians over --runs; check = compile + recognise; imports come on top):
  imports           migrt.seccomp's modules and libseccomp loaded (ctypes), once per restore
  compile           the profile compiled as runc compiles it (libseccomp seccomp_export_bpf)
  recognise         the threads' filters found to be the profile's program (compare.runs_profile)
  check             _seccomp as a restore calls it: compile + recognise, every thread
  region by region  the same threads read without the shortcut (what any other filter costs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import log, machine  # noqa: E402

ONE_RUN = r"""
import json, sys, time
from migrt.ops import restore_privileges as rp  # imported by every restore anyway
t0 = time.perf_counter()
from migrt.seccomp import bpf, compare, profile
profile.libseccomp()
t1 = time.perf_counter()
from migrt.criu.tasks import SECCOMP_FILTER, SeccompFilter, Tasks, Thread
from migrt.oci.grants import Grants
prof, threads = json.load(open(sys.argv[1])), int(sys.argv[2])
c = profile.compile_profile(prof)
raw = bpf.encode([(0x05, 0, 0, 0)] + c.stub) + c.body  # a stub assembled otherwise, same answers
t = Tasks(threads=[Thread(pid=1, tid=1 + i, comm="app", seccomp_mode=SECCOMP_FILTER, seccomp_filter=0)
                   for i in range(threads)], files=[], mounts=[], seccomp_filters=1,
          filters=[SeccompFilter(raw, None, 1)])
class Bundle:
    config = {"linux": {"seccomp": prof}}
t2 = time.perf_counter()
c = profile.compile_profile(prof)
t3 = time.perf_counter()
assert compare.Comparer(c).runs_profile(raw)
t4 = time.perf_counter()
assert rp._seccomp(t, Grants(seccomp=True), Bundle) == []
t5 = time.perf_counter()
assert compare.Comparer(c.program).weaker([(raw, bpf.decode(raw))]) is None
t6 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "compile": t3 - t2, "recognise": t4 - t3, "check": t5 - t4,
                  "region by region": t6 - t5}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        out = subprocess.run([sys.executable, "-c", ONE_RUN, args.profile, str(args.threads)], cwd=REPO,
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
        log(f"run {i + 1}/{args.runs}: check {runs[-1]['check'] * 1e3:.1f} ms")
    rows = {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0]}
    print(f"{'step':<18} {'median ms':>9}   ({args.threads} threads, {args.runs} fresh interpreters)")
    for k, v in rows.items():
        print(f"{k:<18} {v:9.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "threads": args.threads, "runs": args.runs, "median_ms": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
