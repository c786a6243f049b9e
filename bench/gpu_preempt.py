#!/usr/bin/env python3
"""GPU preemption in place: `migrt gpu suspend` / `migrt gpu resume` times and the GPU memory freed,
per size, against plain copies of the same bytes measured in the same run. GPU machine only.

    python bench/gpu_preempt.py [--gbs "8 32"] [--rounds 3] [--json-out PATH]

For each size: one GPU test-rig container (tests/gpu/rig.py) holding GB GiB of tensors on GPU 0
(tests/gpu/workload.py); `rounds` times: suspend (the CLI's own figure and its wall time), NVML's
used memory of the GPU before/while suspended, resume; then the workload's checksum must equal
the one it had at the start. Baseline: a separate process copying the same number of bytes from the
GPU into pageable host memory and back (torch .cpu() / .to('cuda'): what the driver's checkpoint
and restore must move at least), median of `rounds`. Prints a table and, last, one line:

    gpu_preempt gb=<g> suspend_s=<median> resume_s=<median> freed_gib=<median> ... (one per size)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.gpu import harness  # noqa: E402
from tests.gpu.harness import Container, Workload  # noqa: E402

GIB = 1 << 30
COPY = r"""
import sys, time, statistics, torch
n, rounds = int(float(sys.argv[1]) * (1 << 30)), int(sys.argv[2])
x = torch.ones(n, dtype=torch.uint8, device="cuda:0"); torch.cuda.synchronize()
d2h, h2d = [], []
for _ in range(rounds):
    t0 = time.monotonic(); h = x.cpu(); torch.cuda.synchronize(); d2h.append(time.monotonic() - t0)
    del x; torch.cuda.empty_cache()
    t0 = time.monotonic(); x = h.to("cuda:0"); torch.cuda.synchronize(); h2d.append(time.monotonic() - t0)
    del h
print(statistics.median(d2h), statistics.median(h2d))
"""


def used(uuid: str) -> int:
    from migrt.gpu import inventory

    return inventory.take().by_uuid(uuid).memory_used


def baseline(node, gb: float, rounds: int) -> tuple[float, float]:
    out = subprocess.run([node.python, "-c", COPY, str(gb), str(rounds)], capture_output=True, text=True,
                         env=node.env, timeout=600, check=True)
    d2h, h2d = out.stdout.split()
    return float(d2h), float(h2d)


def one_size(node, gb: float, rounds: int) -> dict:
    g0 = node.gpus[0].uuid
    idle = used(g0)
    tag = f"bpre-{gb:g}".replace(".", "p")
    data = node.data_dir(tag)
    c = Container.run(node, tag, node.bundle(tag, node.workload_args("w", str(gb)), data, [0]))
    w = Workload(data, "w")
    rows = []
    try:
        ready = w.ready(timeout=600)
        w.counting_past(3)
        for _ in range(rounds):
            before = used(g0)
            t0 = time.monotonic()
            rec = json.loads(node.cli("gpu", "suspend", tag, "--root", str(node.runc_root), "--json").stdout)
            s_wall = time.monotonic() - t0
            during = used(g0)
            t0 = time.monotonic()
            done = json.loads(node.cli("gpu", "resume", tag, "--root", str(node.runc_root), "--json").stdout)
            r_wall = time.monotonic() - t0
            rows.append({"suspend_s": rec["timings"]["suspend_s"], "suspend_wall_s": s_wall,
                         "resume_s": done["timings"]["resume_s"], "resume_wall_s": r_wall,
                         "freed_gib": (before - during) / GIB, "left_gib": (during - idle) / GIB,
                         "host_rss_after_gib": (rec.get("host_rss_bytes") or {}).get("after", 0) / GIB})
            w.counting_past(w.status()["count"])
        check = w.verify(timeout=600)
        same = check["checksum"] == ready["checksum"] and check["gpu_count"] == check["count"]
    finally:
        c.remove()
    d2h, h2d = baseline(node, gb, rounds)
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    return {"gb": gb, "rounds": rounds, "data_identical": same, **med, "copy_d2h_s": round(d2h, 3),
            "copy_h2d_s": round(h2d, 3), "suspend_vs_copy": round(med["suspend_s"] / d2h, 2),
            "resume_vs_copy": round(med["resume_s"] / h2d, 2), "samples": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbs", default="8 32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", default=os.path.join(os.environ.get("OUT", "."), "gpu_preempt.json"))
    args = ap.parse_args()
    node = harness.make_node(harness.base_dir())
    results = []
    try:
        for gb in [float(x) for x in args.gbs.split()]:
            results.append(one_size(node, gb, args.rounds))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "samples"}), flush=True)
    finally:
        import shutil

        shutil.rmtree(node.base, ignore_errors=True)
    meta = {"gpu": node.gpus[0].name, "driver": node.driver, "torch": node.torch, "results": results}
    Path(args.json_out).write_text(json.dumps(meta, indent=1))
    print(f"{'GiB':>5} {'suspend s':>10} {'resume s':>9} {'D2H copy s':>10} {'H2D copy s':>10} {'freed GiB':>9} "
          f"{'left GiB':>8} {'same data':>9}")
    for r in results:
        print(f"{r['gb']:>5g} {r['suspend_s']:>10.2f} {r['resume_s']:>9.2f} {r['copy_d2h_s']:>10.2f} "
              f"{r['copy_h2d_s']:>10.2f} {r['freed_gib']:>9.2f} {r['left_gib']:>8.2f} {str(r['data_identical']):>9}")
    for r in results:
        print(f"gpu_preempt gb={r['gb']:g} suspend_s={r['suspend_s']} resume_s={r['resume_s']} "
              f"freed_gib={r['freed_gib']:.2f} suspend_vs_copy={r['suspend_vs_copy']} "
              f"resume_vs_copy={r['resume_vs_copy']} identical={r['data_identical']}")
    return 0 if all(r["data_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
