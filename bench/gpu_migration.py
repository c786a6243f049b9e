#!/usr/bin/env python3
"""GPU migration between two "nodes" on one GPU machine, stop-and-copy and lazy: downtime, app gap, total, bytes.

    python bench/gpu_migration.py [--modes "copy lazy"] [--gbs "4 16"] [--runs 1] [--budget-s 0]
                                  [--pump-gib 4] [--pump-runs 3] [--network-lock auto|skip] [--simulate]
                                  [--gpu-thp keep|always] [--json-out PATH]

Node A and node B are network namespaces joined by a veth pair (tests/gpu/twonodes.py), each with
its own config, key, store on /dev/shm and runc root, and each node's container in its own node's
namespace (joined by path, /run/netns/<A|B>: tests/gpu/rig.py): the source in A, the restored copy
in B, so that the frozen source and its copy never share abstract unix sockets and the source can
stay frozen while the copy runs. The container is the GPU test rig's PyTorch workload
(tests/gpu/workload.py) holding GB GiB of tensors on GPU 0; node B's restore bundle gives it GPU 1
(GPU 0 where there is only one: "same_gpu" says so). Per run: `migrt receive --once --restore` in B,
then in A `migrt migrate --json` in one of the modes:

  copy   stop-and-copy: GPU checkpoint, dump, every image over N streams (sha256 per chunk), commit,
         restore on the target (GPU restore included), the source destroyed;
  lazy   `migrt migrate --lazy`: GPU checkpoint, CRIU's lazy dump (no memory), the images (KBs), the
         target restores at once while the source stays frozen serving its memory over N streams
         to the target's page filler; the driver's host copy of each process's GPU memory (where the
         GPU checkpoint put it: `gpu_backing`, migrt/gpu/backing.py) comes first, the GPU restore
         starts as soon as it is in, the rest follows; the source is destroyed once every page is in.

--gpu-thp always puts `gpu_checkpoint_thp: always` in both nodes' configs: the source's migrt switches
THP to `always` only while the driver writes its checkpoint (docs/gpu.md, Faster driver checkpoints);
each run records what the window did (`thp_window`: always, kept or failed; node A's gpu_suspended
log event).

Then the workload's checksum over all its GPU memory must equal the one it had at start, on the new
GPU. Runs go size by size, the modes alternating their order from run to run.

CRIU's network lock: runc and CRIU run in the container's own namespace in this layout (CRIU then
neither dumps nor locks it), but where CRIU's iptables lock cannot work (the GPU machine's kernel
lacks xt_mark; probed with CRIU's own rules in a throwaway namespace, or --network-lock skip) the
rig's bundles name a CRIU configuration file with `network-lock skip` (annotation org.criu.config,
which runc passes to CRIU for those containers' dumps and restores only; nothing node-wide). The
output's "network_lock" says which.

Beside it, in the same run: the raw socket pump (bench/transfer.py: threads, 4 MiB buffers,
sendall / recv_into, nothing checked or stored) over the same veth pair from A to B, with 1 stream
and as many as each mode used (--pump-gib GiB each, median of --pump-runs), so that migrt's own rate
on the wire (copy: bytes / transfer; lazy: the filler's bytes / fill time) is seen against it.

Figures per run: downtime_s (migrate's: from the freeze, before the GPU checkpoint, until the target
reports the container running, its GPU restore included), app_gap_s (the workload's own longest
pause between two counts, sampled every 20 ms), total_s, sent bytes, and the phases (GPU checkpoint,
dump, transfer or pages, commit, restore with the GPU restore; lazy: when the GPU restore started
and what it waited for). Medians per mode and size. --budget-s N: a run that would end past N
seconds (estimated from the runs done, scaled by size) is skipped and listed as such; the JSON is
written after every run. --simulate: the same orchestration on simulated GPU nodes
(tests/gpu/simnode.py: migrt/gpu/fakenode.py and a host-memory workload), for machines without a
GPU. Targets (issue 18): downtime <= 10 s and total <= 20 s at 16 GiB, downtime <= 4 s at 4 GiB.

Prints a table, writes JSON, and as its last lines, per mode and size:

    gpu_migration mode=<m> gb=<g> downtime_s=<median> app_gap_s=<median> total_s=<median> sent_gib=<median>
        wire_gibps=<median> pump_gibps=<same streams> identical=<bool> gpu_thp=<keep|always>
        [<target> met|missed ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import config_lines  # noqa: E402
from tests.gpu import harness, rig, twonodes  # noqa: E402
from tests.gpu.harness import Workload  # noqa: E402

MODES = ("copy", "lazy")
TARGETS = {16.0: {"downtime_s": 10.0, "total_s": 20.0}, 4.0: {"downtime_s": 4.0}}
GIB = 1 << 30


def _r(x, nd=3):
    return round(x, nd) if isinstance(x, (int, float)) else None


def one_run(node, hosts, gb: float, mode: str, port: int, n: int, criu_config: str | None,
            gpu_thp: str = "keep", extra: list[str] | None = None) -> dict:
    tag = f"bmig-{mode}-{gb:g}-{n}".replace(".", "p")
    nodes = twonodes.make(node, node.base / tag)
    lines = ([f"gpu_checkpoint_thp: {gpu_thp}"] if gpu_thp != "keep" else []) + list(extra or [])
    if lines:
        for side in ("a", "b"):
            with open(nodes[side]["config"], "a", encoding="utf-8") as fh:
                fh.write("".join(line + "\n" for line in lines))
    dst = 1 if len(node.gpus) > 1 and node.gpus[1].name == node.gpus[0].name else 0
    own = hosts["netns"]
    t0 = time.monotonic()
    src, data = twonodes.start_source(node, nodes, tag, gb, gpu=0, netns=hosts["a"] if own else None,
                                      criu_config=criu_config if own else None)
    w = Workload(data, "w")
    target_cid = f"{src.cid}-b"
    try:
        ready = w.ready(timeout=600)
        w.counting_past(5)
        bundle = node.bundle(f"{tag}-b", node.workload_args("fresh", "0"), data, [dst],
                             netns=hosts["b"] if own else None, criu_config=criu_config if own else None)
        progress = twonodes.Progress(data / "w.status.json")
        out, rec, res = twonodes.migrate(node, hosts, nodes, src, bundle, port, target_cid=target_cid,
                                         lazy=mode == "lazy")
        gap = progress.stop()
        if res.returncode != 0:
            return {"mode": mode, "gb": gb, "error": res.stderr.strip()[-2000:], "run_s": _r(time.monotonic() - t0),
                    "logs": keep_logs(nodes, tag)}
        w.counting_past(w.status()["count"])
        check = w.verify(timeout=600)
        if check["checksum"] != ready["checksum"]:
            keep_logs(nodes, tag)
        return {"mode": mode, "gb": gb, **figures(mode, out, rec), "app_gap_s": gap, "same_gpu": dst == 0,
                "netns": own, "identical": check["checksum"] == ready["checksum"],
                "thp_window": thp_window(nodes["a"]["dir"] / "migrt.log"), "run_s": _r(time.monotonic() - t0)}
    finally:
        twonodes.remove(nodes["a"]["root"], src.cid)
        twonodes.remove(nodes["b"]["root"], target_cid)
        shutil.rmtree(nodes["a"]["dir"] / "store", ignore_errors=True)
        shutil.rmtree(nodes["b"]["dir"] / "store", ignore_errors=True)


def thp_window(log: Path) -> str | None:
    """What the source's last GPU checkpoint did with THP (its gpu_suspended event): always, kept, failed."""
    found = None
    try:
        with open(log, encoding="utf-8") as fh:
            for line in fh:
                if '"gpu_suspended"' in line:
                    try:
                        found = json.loads(line).get("thp", found)
                    except ValueError:
                        continue
    except OSError:
        return None
    return found


def keep_logs(nodes: dict, tag: str) -> str | None:
    """A failed run's logs (both nodes' migrt.log, the receiver's output) into $OUT/<tag>-logs."""
    dest = Path(os.environ.get("OUT", ".")) / f"{tag}-logs"
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("a", "b"):
            for f in nodes[name]["dir"].glob("*"):
                if f.is_file() and (f.name == "migrt.log" or f.name.startswith("recv-")):
                    shutil.copy(f, dest / f"{name}-{f.name}")
    except OSError:
        return None
    return str(dest)


def figures(mode: str, out: dict, rec: dict) -> dict:
    """One run's figures from migrate's JSON and the receiver's line."""
    ph = out.get("phases") or {}
    restore = (rec.get("timings") or {}).get("restore") or {}
    row = {"downtime_s": out.get("downtime_s"), "total_s": out.get("total_s"),
           "gpu_checkpoint_s": ph.get("gpu_checkpoint_s"), "dump_s": ph.get("dump_s"),
           "restore_s": ph.get("restore_s"), "target_criu_restore_s": restore.get("restore_s"),
           "gpu_restore_s": restore.get("gpu_restore_s"), "pairs": (out.get("gpu") or {}).get("pairs")}
    if mode == "copy":
        sent = out.get("bytes") or 0
        row.update(transfer_s=ph.get("transfer_s"), commit_s=ph.get("commit_s"), streams=out.get("streams"),
                   sent_gib=_r(sent / GIB, 2),
                   wire_gibps=_r(sent / GIB / ph["transfer_s"], 2) if ph.get("transfer_s") else None)
        return row
    pages = out.get("pages") or {}
    fill = rec.get("pages") or {}
    gpu = restore.get("gpu_restores") or []
    # streams: the filler's copy threads, one stream each (plus one that serves page faults: connections)
    row.update(transfer_s=ph.get("pages_s"), pages_s=ph.get("pages_s"), streams=fill.get("threads"),
               connections=pages.get("streams"),
               sent_gib=_r(((out.get("bytes") or 0) + (pages.get("bytes") or 0)) / GIB, 2),
               pages_gib=_r((pages.get("bytes") or 0) / GIB, 2),
               wire_gibps=_r(fill["copied_bytes"] / GIB / fill["fill_s"], 2) if fill.get("fill_s") else None,
               fill_s=fill.get("fill_s"), gpu_memory_wait_s=restore.get("gpu_memory_wait_s"),
               gpu_waited_for=sorted({g.get("waited_for") for g in gpu if g.get("waited_for")}),
               gpu_backing_in_s=max((g["memory_in_s"] for g in gpu if g.get("memory_in_s") is not None), default=None),
               lazy_dump=out.get("lazy_dump"), fill_counts=fill.get("counts"))
    return row


def pump_streams(extra: list[str] | None = None) -> dict[str, int]:
    """The streams each mode uses with the rig's configs (migration_streams and fill_threads as --config
    set them, else unset)."""
    from migrt.config import Config
    from migrt.migration import bulk
    from migrt.ops import pages

    cfg = Config(path="/none")
    for line in extra or []:
        key, _, value = line.partition(": ")
        if key in ("migration_streams", "fill_threads") and value.isdigit():
            setattr(cfg, key, int(value))
    return {"copy": cfg.migration_streams or bulk.auto_streams(), "lazy": pages.streams(cfg)}


def measure_pump(hosts: dict, counts: list[int], gib: float, runs: int) -> dict[int, dict]:
    """The raw pump from A to B (the veth pair; loopback without namespaces): {streams: {gibps, runs}}."""
    from bench import transfer

    if hosts["netns"]:
        where = {"host": hosts["addr_b"], "recv_in": ["nsenter", f"--net=/run/netns/{hosts['b']}"],
                 "send_in": ["nsenter", f"--net=/run/netns/{hosts['a']}"]}
    else:
        where = {}
    out = {}
    for n in counts:
        got = [transfer.run_pump(n, int(gib * GIB), None, **where)["gibps"] for _ in range(runs)]
        out[n] = {"gibps": round(statistics.median(got), 2), "runs": [round(g, 2) for g in got]}
        print(f"pump streams={n} {out[n]['gibps']} GiB/s (runs {out[n]['runs']})", flush=True)
    return out


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return statistics.median(vals) if vals else None


def summary(rows: list[dict], pump: dict[int, dict], gpu_thp: str = "keep") -> tuple[list[str], bool]:
    keys = ("downtime_s", "app_gap_s", "total_s", "gpu_checkpoint_s", "dump_s", "transfer_s", "restore_s",
            "gpu_restore_s", "sent_gib", "wire_gibps")
    lines = ["mode   GiB " + " ".join(f"{k[:-2] if k.endswith('_s') else k:>12}" for k in keys)
             + "  pump_gibps  identical   (transfer: copy's transfer, lazy's pages after the restore)"]
    finals, ok = [], True
    for mode in MODES:
        for gb in sorted({r["gb"] for r in rows if r["mode"] == mode}):
            mine = [r for r in rows if r["mode"] == mode and r["gb"] == gb]
            good = [r for r in mine if "error" not in r and "skipped" not in r]
            if not good:
                ok &= all("skipped" in r for r in mine)
                lines.append(f"{mode:5s} {gb:>5g} no run: {[r.get('error') or r.get('skipped') for r in mine]}")
                continue
            ok &= all(r["identical"] for r in good) and len(good) == len([r for r in mine if "skipped" not in r])
            med = {k: _r(_median(good, k)) for k in keys}
            streams = _median(good, "streams")
            p = pump.get(int(streams)) if streams else None
            pg = p["gibps"] if p else None
            identical = all(r["identical"] for r in good)
            lines.append(f"{mode:5s} {gb:>5g} " + " ".join(f"{med[k]:>12.3f}" if med[k] is not None else f"{'-':>12}"
                                                            for k in keys)
                         + f"  {pg if pg is not None else '-':>10}  {identical}  ({len(good)} run(s), {streams} streams)")
            verdict = " ".join(f"{k}_target={v} {'met' if med[k] is not None and med[k] <= v else 'missed'}"
                               for k, v in TARGETS.get(gb, {}).items())
            finals.append(f"gpu_migration mode={mode} gb={gb:g} downtime_s={med['downtime_s']} "
                          f"app_gap_s={med['app_gap_s']} total_s={med['total_s']} sent_gib={med['sent_gib']} "
                          f"wire_gibps={med['wire_gibps']} pump_gibps={pg} identical={identical} gpu_thp={gpu_thp}"
                          + (f" {verdict}" if verdict else ""))
    return lines + finals, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="copy lazy")
    ap.add_argument("--gbs", default="4 16")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=0, help="skip runs that would end past this (0: no limit)")
    ap.add_argument("--pump-gib", type=float, default=4.0)
    ap.add_argument("--pump-runs", type=int, default=3)
    ap.add_argument("--network-lock", choices=("auto", "skip"), default="auto")
    ap.add_argument("--simulate", action="store_true", help="simulated GPU nodes (no GPU needed)")
    ap.add_argument("--config", action="append", metavar="KEY=VALUE",
                    help="one more line of both nodes' migrt configs (e.g. migration_streams=16); repeatable")
    ap.add_argument("--gpu-thp", choices=("keep", "always"), default="keep",
                    help="gpu_checkpoint_thp in both nodes' configs: always = THP always only while the driver "
                    "writes its checkpoint (default keep)")
    ap.add_argument("--json-out", default=os.path.join(os.environ.get("OUT", "."), "gpu_migration.json"))
    args = ap.parse_args()
    extra = config_lines(args.config, ap.error)
    modes = args.modes.split()
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes takes {' and '.join(MODES)}")
    t_start = time.monotonic()
    # `timeout` ends us with SIGTERM: unwind (namespaces, containers, directories), the runs done are saved
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = harness.base_dir()
    if args.simulate:
        from tests.gpu import simnode

        node = simnode.make(base)
    else:
        node = harness.make_node(base)
    rows: list[dict] = []
    info: dict = {"gpu": node.gpus[0].name, "gpus": len(node.gpus), "driver": node.driver, "torch": node.torch,
                  "simulated": args.simulate, "kernel": platform.release(), "cpus": os.cpu_count(),
                  "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"), "gpu_thp": args.gpu_thp, "modes": modes}
    port = 7960

    def save() -> None:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({**info, "runs": rows}, indent=1))

    try:
        with twonodes.hosts("bgpu") as hosts:
            info["netns"] = hosts["netns"]
            conf, lock = rig.criu_config_file(str(node.base), force_skip=args.network_lock == "skip")
            info["network_lock"] = lock if hosts["netns"] else "none (the host's namespace: CRIU locks nothing)"
            print(f"nodes: {'netns per node (veth)' if hosts['netns'] else 'host namespace, loopback (no ip)'}; "
                  f"network lock: {info['network_lock']}", flush=True)
            streams = pump_streams(extra)
            info["streams_expected"] = streams
            counts = sorted({1, *(streams[m] for m in modes)})
            info["pump"] = {str(k): v for k, v in measure_pump(hosts, counts, args.pump_gib, args.pump_runs).items()}
            save()
            for gb in [float(x) for x in args.gbs.split()]:
                for n in range(args.runs):
                    for mode in (modes if n % 2 == 0 else modes[::-1]):
                        if not hosts["netns"] and mode == "lazy":
                            rows.append({"mode": mode, "gb": gb, "skipped": "lazy needs a network namespace per node "
                                                                              "(no ip on this machine)"})
                            continue
                        est = _estimate(rows, gb)
                        left = args.budget_s - (time.monotonic() - t_start)
                        if args.budget_s and est is not None and est > left:
                            rows.append({"mode": mode, "gb": gb, "skipped": f"budget: about {est:.0f} s needed, "
                                                                             f"{left:.0f} s left"})
                            print(json.dumps(rows[-1]), flush=True)
                            continue
                        port += 1
                        rows.append(one_run(node, hosts, gb, mode, port, n, conf, args.gpu_thp, extra))
                        print(json.dumps(rows[-1]), flush=True)
                        save()
    finally:
        save()
        shutil.rmtree(node.base, ignore_errors=True)
    pump = {int(k): v for k, v in (info.get("pump") or {}).items()}
    for r in rows:
        p = pump.get(r.get("streams")) if isinstance(r.get("streams"), int) else None
        if p and r.get("wire_gibps"):
            r["pump_gibps"], r["wire_vs_pump"] = p["gibps"], round(r["wire_gibps"] / p["gibps"], 2)
    info["wall_s"] = round(time.monotonic() - t_start, 1)
    save()
    lines, ok = summary(rows, pump, args.gpu_thp)
    print(f"{info['gpu']} x{info['gpus']}, driver {info['driver']}, THP {info['thp']} (gpu_checkpoint_thp "
          f"{args.gpu_thp}), network lock: "
          f"{info.get('network_lock')}; pump over {'the veth pair' if info.get('netns') else 'loopback'}: "
          + ", ".join(f"{k} stream(s) {v['gibps']} GiB/s" for k, v in sorted(pump.items())))
    print("\n".join(lines))
    return 0 if ok else 1


def _estimate(rows: list[dict], gb: float) -> float | None:
    """Seconds a run at gb would take: the slowest run done at that size, else the runs done at other
    sizes scaled linearly (an overestimate: the workload's start does not grow with the size); None
    before any."""
    done = [r for r in rows if r.get("run_s") and r.get("gb")]
    same = [r["run_s"] for r in done if r["gb"] == gb]
    if same:
        return max(same)
    return max((r["run_s"] * max(1.0, gb / r["gb"]) for r in done), default=None)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
