#!/usr/bin/env python3
"""GPU migration between two "nodes" on one GPU machine: downtime, app gap, total and bytes sent.

    python bench/gpu_migration.py [--gbs "4 16"] [--runs 1] [--json-out PATH]

Node A and node B are network namespaces joined by a veth pair (tests/gpu/twonodes.py), each with
its own config, key, store on /dev/shm and runc root. The container is the GPU test rig's PyTorch
workload (tests/gpu/workload.py) holding GB GiB of tensors on GPU 0; node B's restore bundle gives
it GPU 1 (GPU 0 where there is only one: then it says so). Without `ip` on the machine both nodes
use the host's network namespace over loopback ("netns": false in the JSON). Per run: `migrt receive
--once --restore` in B, `migrt migrate --json` (stop-and-copy) in A, then the workload's checksum
over all its GPU memory must equal the one it had at start, on the new GPU.

Figures per run: downtime_s (migrate's: from the GPU lock on the source until the target reports the
container running), app_gap_s (the workload's own longest pause between two counts, sampled every 20
ms from its status file), total_s, sent bytes, and the phases (GPU checkpoint, dump, transfer,
commit, restore with the GPU restore). Medians over runs. Stop-and-copy only: on this rig lazy mode
cannot run (its containers share the host's network namespace and the GPU machine has no iproute2
for namespaces, so the source, which must stay frozen to serve pages while the target restores,
holds abstract unix sockets the restored copy needs). Targets at 16 GB (issue 10): downtime <= 10 s,
total <= 20 s.

Prints a table, writes JSON, and as its last lines:

    gpu_migration gb=<g> downtime_s=<median> app_gap_s=<median> total_s=<median> sent_gib=<median>
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.gpu import harness, twonodes  # noqa: E402
from tests.gpu.harness import Workload  # noqa: E402

TARGETS = {16.0: {"downtime_s": 10.0, "total_s": 20.0}}


def one_run(node, hosts, gb: float, port: int, n: int) -> dict:
    nodes = twonodes.make(node, node.base / f"bmig-{gb:g}-{n}")
    tag = f"bmig-{gb:g}-{n}".replace(".", "p")
    dst = 1 if len(node.gpus) > 1 and node.gpus[1].name == node.gpus[0].name else 0
    src, data = twonodes.start_source(node, nodes, tag, gb, gpu=0)
    w = Workload(data, "w")
    target_cid = f"{src.cid}-b"
    try:
        ready = w.ready(timeout=600)
        w.counting_past(5)
        bundle = node.bundle(f"{tag}-b", node.workload_args("fresh", "0"), data, [dst])
        progress = twonodes.Progress(data / "w.status.json")
        out, rec, res = twonodes.migrate(node, hosts, nodes, src, bundle, port, target_cid=target_cid)
        gap = progress.stop()
        if res.returncode != 0:
            return {"gb": gb, "error": res.stderr.strip()[-2000:]}
        w.counting_past(w.status()["count"])
        check = w.verify(timeout=600)
        ph = out["phases"]
        restore = (rec.get("timings") or {}).get("restore") or {}
        return {"gb": gb, "same_gpu": dst == 0, "netns": hosts["netns"], "identical": check["checksum"] == ready["checksum"],
                "downtime_s": out["downtime_s"], "app_gap_s": gap, "total_s": out["total_s"],
                "sent_gib": round(out["bytes"] / (1 << 30), 2), "gpu_checkpoint_s": ph.get("gpu_checkpoint_s"),
                "dump_s": ph.get("dump_s"), "transfer_s": ph.get("transfer_s"), "commit_s": ph.get("commit_s"),
                "restore_s": ph.get("restore_s"), "target_criu_restore_s": restore.get("restore_s"),
                "gpu_restore_s": restore.get("gpu_restore_s"), "pairs": out["gpu"]["pairs"]}
    finally:
        twonodes.remove(nodes["a"]["root"], src.cid)
        twonodes.remove(nodes["b"]["root"], target_cid)
        shutil.rmtree(nodes["a"]["dir"] / "store", ignore_errors=True)
        shutil.rmtree(nodes["b"]["dir"] / "store", ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbs", default="4 16")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json-out", default=os.path.join(os.environ.get("OUT", "."), "gpu_migration.json"))
    args = ap.parse_args()
    node = harness.make_node(harness.base_dir())
    rows: list[dict] = []
    port = 7960
    try:
        with twonodes.hosts("bgpu") as hosts:
            for gb in [float(x) for x in args.gbs.split()]:
                for n in range(args.runs):
                    port += 1
                    rows.append(one_run(node, hosts, gb, port, n))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(node.base, ignore_errors=True)
    Path(args.json_out).write_text(json.dumps({"gpu": node.gpus[0].name, "gpus": len(node.gpus), "driver": node.driver,
                                               "torch": node.torch, "runs": rows}, indent=1))
    keys = ("downtime_s", "app_gap_s", "total_s", "sent_gib", "gpu_checkpoint_s", "dump_s", "transfer_s",
            "commit_s", "restore_s", "gpu_restore_s")
    print("  GiB " + " ".join(f"{k[:-2] if k.endswith('_s') else k:>14}" for k in keys) + "  identical")
    ok = True
    for gb in sorted({r["gb"] for r in rows}):
        good = [r for r in rows if r["gb"] == gb and "error" not in r]
        if not good:
            ok = False
            print(f"{gb:>5g} failed: {[r.get('error') for r in rows if r['gb'] == gb]}")
            continue
        med = {k: statistics.median(r[k] for r in good if r.get(k) is not None) if any(r.get(k) is not None for r in good)
               else None for k in keys}
        ok &= all(r["identical"] for r in good)
        print(f"{gb:>5g} " + " ".join(f"{(med[k] if med[k] is not None else float('nan')):>14.3f}" for k in keys)
              + f"  {all(r['identical'] for r in good)}")
        target = TARGETS.get(gb)
        verdict = ""
        if target:
            verdict = " " + " ".join(f"{k}_target={v} {'met' if med[k] <= v else 'missed'}" for k, v in target.items())
        print(f"gpu_migration gb={gb:g} downtime_s={med['downtime_s']} app_gap_s={med['app_gap_s']} "
              f"total_s={med['total_s']} sent_gib={med['sent_gib']}{verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
