#!/usr/bin/env python3
"""Live migration into the pod that kubelet creates (a pull), beside `migrt migrate --lazy`, same run.

    python bench/pod_migration.py [--sizes 1,4] [--runs 1] [--json-out PATH]

Pod path: two "nodes" on this machine (tests/helpers/podnodes.py: network namespaces joined by a
veth pair, each with its own containerd + CRI, migrt config, key, store and `migrt serve`). The source
pod on node A runs memhog (bench/memhog.c: N GiB of checksummed data, a timestamped tick every 10 ms),
annotated migrt.io/migratable=true; a pod with the same container spec on node B carries
migrt.io/migrate-from=<A>/<namespace>/<pod>/<container> and is started through CRI as kubelet does
(RunPodSandbox, CreateContainer, StartContainer): its create pulls the container. After the source
is gone (every page across), the target is asked (SIGUSR1) to hash its memory again: it must match.

Baseline: bench/migration.py's lazy run (`migrt receive --restore` in one namespace, `migrt migrate
--lazy` in the other, runc without containerd), same sizes, interleaved with the pod runs.

Per run:
  downtime_s  the source's freeze until the target reported its copy running (the agent's JSON, or
              migrate's): the same measure on both paths
  app_gap_s   the longest gap between two consecutive ticks across the migration, minus the 10 ms
              period: how long the process really did not run
  total_s     the agent's (or migrate's) whole hand-over, the last memory page included
  start_s     pod path only: kubelet's StartContainer call (the create pulls, then a no-op start)

The multi-container case (issue 29), `--pod3`: a pod of three containers moved by the pod-level pull
(migrt.io/migrate-from=<A>/<namespace>/<pod> + migrt.io/migrate-pod, one cut of the source pod):
    native  memhog 1 GiB (a native sidecar: created and started first)
    app     memhog 1 GiB, beside the server end of a TCP connection over the pod's loopback
    side    the client end (tests/integration/tcpticker.c): a round trip every 10 ms on that connection
the target's three containers created and started one after another as kubelet does. Per run:
  downtime_s  for the slowest container: its last tick on the source to its first on the target
              (containerd's timestamps of the CRI log lines, one clock for both nodes)
  per_container  that for each; the connection must be the same one (the client's local port) and
              each memhog's memory hash must match after the move
  start_s     the three StartContainer calls, end to end
Target: downtime <= 1.5 s at 2 x 1 GiB (medians of --runs).

Targets (issue 19): at 4 GiB, downtime <= 1.5 s, the pod path's extra downtime over migrate --lazy
<= 0.3 s, app gap <= 1.5 s. Prints a table and writes JSON (default bench/results/pod_migration.json).
Everything started here is stopped by pid; namespaces, pods and directories are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import log, machine, meminfo  # noqa: E402
from bench.migration import Lab, TICK, one_run, ticks, wait_for_memory  # noqa: E402
from tests.helpers.cri import generate_stubs, read_cri_log  # noqa: E402
from tests.helpers.podnodes import pod_nodes  # noqa: E402
from tests.helpers.twohosts import ADDR_A, two_hosts  # noqa: E402

DEFAULT_JSON = os.path.join(REPO, "bench", "results", "pod_migration.json")
POD3_JSON = os.path.join(REPO, "bench", "results", "pod_migration_pod3.json")
BIN_DEST = "/opt/migrt-bench"
TARGETS = {"downtime_s": 1.5, "extra_s": 0.3, "app_gap_s": 1.5}


def _cri_ticks(node, cid: str) -> tuple[list[tuple[int, float]], str]:
    text = read_cri_log(node.cri.status(cid).log_path)
    ready = next((ln.split()[1] for ln in text.splitlines() if ln.startswith("ready ")), "")
    return ticks(text.encode()), ready


def _wait(what: str, probe, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := probe()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return found


def pod_run(nodes: dict, bin_dir: str, mib: int) -> dict:
    a, b = nodes["a"], nodes["b"]
    name = f"memhog-{uuid.uuid4().hex[:6]}"
    command = [f"{BIN_DEST}/memhog", str(mib)]
    log(f"  pod {mib} MiB: filling memory ...")
    spod = a.cri.run_pod(name, "bench", annotations={"migrt.io/migratable": "true"})
    try:
        scid = a.cri.create_container(spod, "app", a.ctd.image, command, mounts=[(bin_dir, BIN_DEST)])
        a.cri.start(scid)
        _wait("the source's ready line", lambda: _cri_ticks(a, scid)[1], 600)
        _wait("the source's ticks", lambda: len(_cri_ticks(a, scid)[0]) >= 20, 60)
        tpod = b.cri.run_pod(name, "bench", annotations={"migrt.io/migrate-from": f"{ADDR_A}/bench/{name}/app"})
        tcid = b.cri.create_container(tpod, "app", b.ctd.image, command, mounts=[(bin_dir, BIN_DEST)])
        log(f"  pod {mib} MiB: migrating ...")
        t0 = time.monotonic()
        b.cri.start(tcid, timeout=600)
        start_s = time.monotonic() - t0
        a.cri.wait_state(scid, "CONTAINER_EXITED", timeout=900)  # gone once every page is across
        res = [r for r in a.agent_results() if r.get("container_id") == scid]
        if not res or res[-1].get("error"):
            raise RuntimeError(f"the hand-over failed: {res[-1].get('error') if res else 'no record'}")
        res = res[-1]
        before, ready = _cri_ticks(a, scid)
        t_sum = time.time()
        subprocess.run(["runc", "--root", b.root, "kill", tcid, "USR1"], check=True)
        summed = _wait("the target's memory hash",
                       lambda: next((ln.split()[1] for ln in read_cri_log(b.cri.status(tcid).log_path).splitlines()
                                     if ln.startswith("sum ")), None), 600)
        after, _ = _cri_ticks(b, tcid)
        if summed != ready:
            raise RuntimeError(f"memory hash after migration {summed} != {ready} before")
        if not before or not after or after[0][0] != before[-1][0] + 1:
            raise RuntimeError(f"tick sequence broken: {before[-1:]} then {after[:1]}")
        seq = before + [t for t in after if t[1] < t_sum]
        gap = max(y[1] - x[1] for x, y in zip(seq, seq[1:])) - TICK
        return {"path": "pod", "mib": mib, "downtime_s": res["downtime_s"], "app_gap_s": round(gap, 3),
                "total_s": res["timings"].get("total_s"), "start_s": round(start_s, 3), "phases": res["timings"],
                "pages": res.get("pages"), "hash_ok": True}
    finally:
        a.cri.cleanup()
        b.cri.cleanup()


POD3 = ("native", "app", "side")
POD3_PORT = 7400


def _stamped(node, cid: str) -> list[tuple[float, str]]:
    """(containerd's timestamp, text) of every full line of a container's CRI log."""
    from datetime import datetime

    out = []
    try:
        with open(node.cri.status(cid).log_path) as fh:
            text = fh.read()
    except OSError:
        return out
    for line in text.splitlines():
        stamp, _, rest = line.partition(" ")
        stream, _, rest = rest.partition(" ")
        tag, _, body = rest.partition(" ")
        if tag != "F":
            continue
        head, _, frac = stamp.rstrip("Z").partition(".")
        when = datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0"))
        out.append((when, body))
    return out


def _pod3_commands(mib: int) -> dict[str, list[str]]:
    return {"native": [f"{BIN_DEST}/memhog", str(mib)],
            "app": ["sh", "-c", f"{BIN_DEST}/tcpticker serve {POD3_PORT} & exec {BIN_DEST}/memhog {mib}"],
            "side": [f"{BIN_DEST}/tcpticker", "client", str(POD3_PORT), "10"]}


def _pod3_source(a, bin_dir: str, name: str, mib: int) -> dict[str, str]:
    spod = a.cri.run_pod(name, "bench", annotations={"migrt.io/migratable": "true"})
    cids = {}
    for n, cmd in _pod3_commands(mib).items():  # one after the other, as kubelet does
        cids[n] = a.cri.create_container(spod, n, a.ctd.image, cmd, mounts=[(bin_dir, BIN_DEST)])
        a.cri.start(cids[n])
        if n != "side":
            _wait(f"{n}'s ready line", lambda c=cids[n]: _cri_ticks(a, c)[1], 600)
    for cid in cids.values():
        _wait("the source's ticks", lambda c=cid: sum(t.startswith("tick") for _, t in _stamped(a, c)) >= 20, 60)
    return cids


def _pod3_check(a, b, src: dict[str, str], tgt: dict[str, str]) -> dict[str, float]:
    """Per container: its last tick on the source to its first on the target; the memory and the
    connection checked."""
    out = {}
    for n in POD3:
        before = [(t, x) for t, x in _stamped(a, src[n]) if x.startswith("tick ")]
        after = _wait(f"{n}'s ticks on the target",
                      lambda c=tgt[n]: [(t, x) for t, x in _stamped(b, c) if x.startswith("tick ")][:2], 60)
        if int(after[0][1].split()[1]) != int(before[-1][1].split()[1]) + 1:
            raise RuntimeError(f"{n}: tick sequence broken: {before[-1][1]} then {after[0][1]}")
        if n == "side" and after[0][1].split()[2:] != before[-1][1].split()[2:3] * 2:
            raise RuntimeError(f"side: another connection: {before[-1][1]} then {after[0][1]}")
        out[n] = round(after[0][0] - before[-1][0], 3)
    for n in ("native", "app"):
        ready = _cri_ticks(a, src[n])[1]
        subprocess.run(["runc", "--root", b.root, "kill", tgt[n], "USR1"], check=True)
        summed = _wait(f"{n}'s memory hash", lambda c=tgt[n]: next(
            (x.split()[1] for _, x in _stamped(b, c) if x.startswith("sum ")), None), 600)
        if summed != ready:
            raise RuntimeError(f"{n}: memory hash after migration {summed} != {ready} before")
    if any(x.startswith("broken") for _, x in _stamped(b, tgt["side"])):
        raise RuntimeError("side: the loopback connection broke")
    return out


def pod3_run(nodes: dict, bin_dir: str, mib: int) -> dict:
    a, b = nodes["a"], nodes["b"]
    name = f"trio-{uuid.uuid4().hex[:6]}"
    log(f"  pod of 3, 2 x {mib} MiB: filling memory ...")
    try:
        src = _pod3_source(a, bin_dir, name, mib)
        parts = ",".join(f"{n}={a.cri.status(src[n]).image.image}" for n in POD3)
        tpod = b.cri.run_pod(f"{name}-moved", "bench", annotations={
            "migrt.io/migrate-from": f"{ADDR_A}/bench/{name}", "migrt.io/migrate-pod": parts})
        tgt = {n: b.cri.create_container(tpod, n, b.ctd.image, cmd, mounts=[(bin_dir, BIN_DEST)])
               for n, cmd in _pod3_commands(mib).items()}
        log("  pod of 3: migrating ...")
        t0 = time.monotonic()
        starts = {}
        for n in POD3:
            t1 = time.monotonic()
            b.cri.start(tgt[n], timeout=600)
            starts[n] = round(time.monotonic() - t1, 3)
        start_s = time.monotonic() - t0
        for cid in src.values():
            a.cri.wait_state(cid, "CONTAINER_EXITED", timeout=900)
        per = _pod3_check(a, b, src, tgt)
        res = {r["pod"]["part"]: r for r in a.agent_results() if r.get("pod") and r.get("container_id") in
               src.values()}
        return {"path": "pod3", "mib": mib, "downtime_s": max(per.values()), "per_container": per,
                "start_s": round(start_s, 3), "starts": starts,
                "total_s": max((r["timings"].get("total_s") or 0) for r in res.values()) if res else None,
                "agent_downtime_s": {n: r.get("downtime_s") for n, r in res.items()},
                "phases": {n: r.get("timings") for n, r in res.items()}, "hash_ok": True,
                "connection_ok": True}
    finally:
        a.cri.cleanup()
        b.cri.cleanup()


def pod3_main(args, info: dict, base: pathlib.Path, stubs: str, bin_dir: str) -> dict:
    """--pod3: the multi-container case, --runs times; medians."""
    mib = int(float(args.sizes.split(",")[0]) * 1024) if args.sizes_given else 1024
    subprocess.run([shutil.which("gcc") or "cc", "-static", "-O2", "-o", os.path.join(bin_dir, "tcpticker"),
                    os.path.join(REPO, "tests", "integration", "tcpticker.c")], check=True)
    config = "pod_pull_deadline: 120\ncriu_options:\n  tcp_established: true\n"
    samples, failures = [], []
    with _pipe_limit(), pod_nodes(base / "pods", stubs, config) as nodes:
        for _ in range(args.runs):
            wait_for_memory(2 * mib * (2 << 20) + (1 << 30))
            try:
                run = pod3_run(nodes, bin_dir, mib)
            except Exception as exc:  # noqa: BLE001 - reported, not hidden
                log(f"    FAILED: {exc}")
                failures.append(str(exc))
                continue
            run["loadavg"] = os.getloadavg()[0]
            samples.append(run)
            log(f"    pod of 3: downtime {run['downtime_s']:.3f} s (slowest), {run['per_container']}, "
                f"starts {run['starts']}, load {run['loadavg']:.1f}")
    point = {"gib_each": mib / 1024, "path": "pod3", "failures": failures}
    if samples:
        point.update(summarize(samples), samples=samples)
        for n in POD3:
            point[f"downtime_{n}_s"] = round(statistics.median(r["per_container"][n] for r in samples), 3)
    return {"machine": info, "runs_per_point": args.runs, "points": [point], "loadavg_end": os.getloadavg()[0]}


def summarize(runs: list[dict]) -> dict:
    out = {"runs": len(runs)}
    for key in ("downtime_s", "app_gap_s", "total_s", "start_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = round(statistics.median(vals), 3)
    return out


@contextlib.contextmanager
def _pipe_limit():
    """fs.pipe-max-size at the kernel's default for the run (the tests' rule: migrt needs no more)."""
    path = "/proc/sys/fs/pipe-max-size"
    old = open(path).read().strip()
    with open(path, "w") as fh:
        fh.write(str(1 << 20))
    try:
        yield
    finally:
        with open(path, "w") as fh:
            fh.write(old)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4", help="GiB, comma-separated (default 1,4)")
    ap.add_argument("--runs", type=int, default=1, help="runs per size and path (default 1)")
    ap.add_argument("--json-out", default=None, help=f"default {DEFAULT_JSON} ({POD3_JSON} with --pod3)")
    ap.add_argument("--pod3", action="store_true",
                    help="the multi-container case: 3 containers, 2 x 1 GiB (--sizes: GiB each) and a TCP sidecar")
    args = ap.parse_args()
    args.sizes_given = "--sizes" in sys.argv
    args.json_out = args.json_out or (POD3_JSON if args.pod3 else DEFAULT_JSON)
    if os.geteuid() != 0:
        log("bench/pod_migration.py needs root (containerd, runc, CRIU, network namespaces)")
        return 2
    sizes = [float(s) for s in args.sizes.split(",")]
    info = machine()
    log(f"machine: {info['cpus']} CPUs ({info['cpu']}), {info['mem_gib']} GiB, kernel {info['kernel']}; "
        f"{info['runc']}; CRIU {info['criu']}")
    results: dict = {"machine": info, "sizes_gib": sizes, "runs_per_point": args.runs, "points": []}
    base = pathlib.Path(tempfile.mkdtemp(prefix="migrt-podbench-"))
    if args.pod3:
        return _pod3_report(args, info, base)
    shm = tempfile.mkdtemp(prefix="migrt-podbench-", dir="/dev/shm")
    try:
        lab = Lab(str(base / "lab"), shm)  # migrate --lazy's two hosts, and memhog built once
        bin_dir = str(base / "bin")
        os.makedirs(bin_dir)
        shutil.copy2(lab.memhog, os.path.join(bin_dir, "memhog"))
        stubs = generate_stubs(str(base / "stubs"))
        with _pipe_limit(), two_hosts("pbench") as hosts, pod_nodes(base / "pods", stubs) as nodes:
            port = 7960
            for gib in sizes:
                mib = int(gib * 1024)
                need = mib * (2 << 20) + (1 << 30)
                samples: dict[str, list] = {"pod": [], "migrate --lazy": []}
                failures: dict[str, list] = {"pod": [], "migrate --lazy": []}
                for _ in range(args.runs):
                    for path in ("migrate --lazy", "pod"):
                        wait_for_memory(need)
                        if meminfo("MemAvailable") < need:
                            failures[path].append(f"not enough memory: about {need >> 30} GiB needed")
                            continue
                        port += 1
                        try:
                            run = (pod_run(nodes, bin_dir, mib) if path == "pod"
                                   else {**one_run(lab, hosts, "lazy", mib, port), "path": path})
                        except Exception as exc:  # reported, not hidden
                            log(f"    FAILED: {exc}")
                            failures[path].append(str(exc))
                            continue
                        samples[path].append(run)
                        log(f"    {path}: downtime {run['downtime_s']:.3f} s, app gap {run['app_gap_s']:.3f} s, "
                            f"total {run['total_s']:.3f} s")
                for path in samples:
                    point = {"gib": gib, "path": path, "failures": failures[path]}
                    if samples[path]:
                        point.update(summarize(samples[path]), samples=samples[path])
                    results["points"].append(point)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(results, fh, indent=2)
    points = [p for p in results["points"] if "downtime_s" in p]
    print(f"{'GiB':>5} {'path':<15} {'downtime s':>10} {'app gap s':>9} {'total s':>8} {'start s':>8}")
    for p in points:
        start = f"{p['start_s']:>8.3f}" if "start_s" in p else f"{'-':>8}"
        print(f"{p['gib']:>5g} {p['path']:<15} {p['downtime_s']:>10.3f} {p['app_gap_s']:>9.3f} {p['total_s']:>8.3f} "
              f"{start}")
    for p in results["points"]:
        if p.get("failures"):
            print(f"{p['gib']:g} GiB {p['path']}: {len(p['failures'])} failed run(s): {p['failures'][0][:200]}")
    for gib in sizes:
        pod = next((p for p in points if p["gib"] == gib and p["path"] == "pod"), None)
        lazy = next((p for p in points if p["gib"] == gib and p["path"] == "migrate --lazy"), None)
        if pod and lazy:
            extra = pod["downtime_s"] - lazy["downtime_s"]
            verdict = "" if gib != 4 else (" (targets at 4 GiB: downtime <= 1.5 s "
                                           f"{'met' if pod['downtime_s'] <= TARGETS['downtime_s'] else 'MISSED'}, "
                                           f"extra <= 0.3 s {'met' if extra <= TARGETS['extra_s'] else 'MISSED'}, "
                                           f"app gap <= 1.5 s {'met' if pod['app_gap_s'] <= TARGETS['app_gap_s'] else 'MISSED'})")
            print(f"pod_migration gb={gib:g} downtime_s={pod['downtime_s']:.3f} app_gap_s={pod['app_gap_s']:.3f} "
                  f"total_s={pod['total_s']:.3f} extra_over_lazy_s={extra:.3f}{verdict}")
    return 0 if points else 1


def _pod3_report(args, info: dict, base: pathlib.Path) -> int:
    shm = tempfile.mkdtemp(prefix="migrt-podbench-", dir="/dev/shm")
    try:
        lab = Lab(str(base / "lab"), shm)  # memhog built once
        bin_dir = str(base / "bin")
        os.makedirs(bin_dir)
        shutil.copy2(lab.memhog, os.path.join(bin_dir, "memhog"))
        results = pod3_main(args, info, base, generate_stubs(str(base / "stubs")), bin_dir)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(results, fh, indent=2)
    p = results["points"][0]
    if "downtime_s" not in p:
        print(f"pod3: every run failed: {p['failures'][:1]}")
        return 1
    met = "met" if p["downtime_s"] <= TARGETS["downtime_s"] else "MISSED"
    print(f"pod_migration pod3 gib_each={p['gib_each']:g} runs={p['runs']} downtime_s={p['downtime_s']:.3f} "
          f"(native {p['downtime_native_s']:.3f}, app {p['downtime_app_s']:.3f}, side {p['downtime_side_s']:.3f}) "
          f"start_s={p['start_s']:.3f} load_end={results['loadavg_end']:.1f} (target <= 1.5 s {met})")
    if p["failures"]:
        print(f"pod3: {len(p['failures'])} failed run(s): {p['failures'][0][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
