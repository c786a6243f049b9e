#!/usr/bin/env python3
"""Checkpoints through a local OCI registry: push and pull MB/s against `cp`, the second push, and
pull + restore against a restore from the local store.

    python bench/registry.py [--sizes 1,4,8] [--runs 1] [--json-out PATH]

Per size (GiB of anonymous memory held by bench/memhog.c under plain runc), per run:
 1. `migrt checkpoint --leave-running` (A), 2 s later `migrt checkpoint` (B: the same workload a
    little later, memhog's counters moved).
 2. baseline: `cp -r` of A's directory to the registry's disk, timed (no fsync: like the registry).
 3. `migrt push A REG/bench:a` (cold registry), again to `:a2` (unchanged: bytes sent), `migrt push B
    REG/bench:b` (the small change: bytes sent).
 4. restore from the local store: `migrt-runc create` with MIGRT_RESTORE=A (what containerd calls),
    the restored memory re-hashed to memhog's checksum, then deleted.
 5. restore by reference: `migrt-runc create` with MIGRT_RESTORE=oci:REG/bench:a on a node store
    that does not have it (pull + restore in the create), checksum again; then `migrt pull` alone
    into a fresh name, timed (pull MB/s).
The registry is Debian's docker-registry on 127.0.0.1 with TLS (CA made here) and htpasswd basic
auth (tests/helpers/registry.py); its storage and the store are on the same file system (/var/tmp,
or /dev/shm for the store with --shm when memory allows). Prints a table of medians and writes JSON
(default bench/results/registry.json); the last line is

    registry gb=<largest size> push_mbps=<..> pull_mbps=<..> cp_mbps=<..> pull_restore_ratio=<..> second_push_pct=<..>

Run as root (runc, CRIU 4.2+, gcc, docker-registry, htpasswd, openssl, migrt and migrt-runc on PATH
or MIGRT_BINDIR). Everything it starts is removed.
"""

from __future__ import annotations

import argparse
import json
import os
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

from bench.common import log, machine, meminfo  # noqa: E402
from bench.restore_size import Lab, Reader, restored_timings, runc, wait_line  # noqa: E402
from tests.helpers.registry import local_registry, missing  # noqa: E402

BINDIR = os.environ.get("MIGRT_BINDIR", "/usr/local/bin")
CLI, SHIM = f"{BINDIR}/migrt", f"{BINDIR}/migrt-runc"
GIB = 1 << 30
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "registry.json")


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def cli(lab: Lab, *args: str) -> dict:
    res = subprocess.run([CLI, *args, "--json"], capture_output=True, text=True, env=lab.env, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"migrt {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout)


def restore(lab: Lab, request: str, ready: bytes, tag: str) -> tuple[float, dict]:
    """migrt-runc create with MIGRT_RESTORE=request; checksum checked; the container deleted."""
    dst = f"rg-dst-{tag}-{uuid.uuid4().hex[:4]}"
    bundle = lab.bundle(os.path.join(lab.base, f"bundle-{dst}"), ["sh", "-c", "echo started-fresh"],
                        env=[f"MIGRT_RESTORE={request}"])
    out_file = os.path.join(lab.base, f"{dst}.out")
    try:
        with open(os.devnull, "rb") as devnull, open(out_file, "ab") as out:
            t0 = time.monotonic()
            rc = subprocess.run([SHIM, "--root", lab.root, "create", "--bundle", bundle, dst], stdin=devnull,
                                stdout=out, stderr=out, env=lab.env, timeout=3600).returncode
            seconds = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"restore of {request} failed ({rc}): {open(out_file, 'rb').read()[-2000:]!r}")
        subprocess.run([SHIM, "--root", lab.root, "start", dst], env=lab.env, check=True, timeout=60)
        parts = restored_timings(lab.log_file, dst)
        pid = json.loads(runc(lab, "state", dst).stdout)["pid"]
        os.kill(pid, signal.SIGUSR1)
        got = wait_line(out_file, b"sum ", timeout=900).split()[1]
        if got != ready:
            raise RuntimeError(f"checksum mismatch after restoring {request}: {got!r} != {ready!r}")
        return seconds, parts
    finally:
        runc(lab, "delete", "--force", dst, check=False)
        shutil.rmtree(bundle, ignore_errors=True)
        if os.path.exists(out_file):
            os.unlink(out_file)


def one_run(lab: Lab, reg, size_gib: float, scratch: str) -> dict:
    mib = int(size_gib * 1024)
    tag = uuid.uuid4().hex[:6]
    src, a, b = f"rg-src-{tag}", f"rg-a-{tag}", f"rg-b-{tag}"
    bundle = lab.bundle(os.path.join(lab.base, f"bundle-{src}"), ["/bin/memhog", str(mib)])
    names = [a, b]
    running = []
    try:
        r_out, w_out = os.pipe()
        with open(os.devnull, "rb") as devnull:
            rc = subprocess.run(["runc", "--root", lab.root, "run", "-d", "--bundle", bundle, src],
                                stdin=devnull, stdout=w_out, stderr=w_out, timeout=120).returncode
        os.close(w_out)
        reader = Reader(r_out)
        reader.start()
        if rc != 0:
            raise RuntimeError(f"runc run {src} failed ({rc})")
        running.append(src)
        ready = reader.find(b"ready ", timeout=900).split()[1]
        reader.find(b"tick 5 ", timeout=60)
        ck_a = cli(lab, "checkpoint", src, "--root", lab.root, "--name", a, "--leave-running")
        time.sleep(2)
        cli(lab, "checkpoint", src, "--root", lab.root, "--name", b)
        runc(lab, "delete", "--force", src, check=False)
        running.remove(src)
        reader.join(timeout=10)
        size = ck_a["size_bytes"]
        path_a = os.path.join(lab.store, a)

        copy = os.path.join(scratch, f"cp-{tag}")
        t0 = time.monotonic()
        subprocess.run(["cp", "-r", path_a, copy], check=True)
        cp_s = time.monotonic() - t0
        shutil.rmtree(copy, ignore_errors=True)

        ref_a = reg.ref(f"bench/{tag}", "a")
        p1 = cli(lab, "push", a, ref_a)
        p2 = cli(lab, "push", a, reg.ref(f"bench/{tag}", "a2"))
        p3 = cli(lab, "push", b, reg.ref(f"bench/{tag}", "b"))

        local_s, local_parts = restore(lab, a, ready, "local")
        byref_s, byref_parts = restore(lab, "oci:" + ref_a, ready, "byref")
        pulled = [n for n in os.listdir(lab.store) if n.startswith(f"oci-{tag}")]
        names += pulled
        cli(lab, "rm", *pulled) if pulled else None
        names = [n for n in names if n not in pulled]
        pl = cli(lab, "pull", ref_a, "--name", f"rg-p-{tag}")
        names.append(pl["name"])
        return {
            "size_gib": size_gib, "checkpoint_bytes": size, "cp_s": round(cp_s, 3),
            "cp_mbps": round(size / 1e6 / cp_s, 1),
            "push_s": p1["seconds"], "push_mbps": round(size / 1e6 / p1["seconds"], 1), "push_sent": p1["bytes_sent"],
            "push_layers": p1["layers"],
            "push_unchanged_s": p2["seconds"], "push_unchanged_sent": p2["bytes_sent"],
            "push_unchanged_pct": round(100 * p2["bytes_sent"] / size, 3),
            "push_changed_s": p3["seconds"], "push_changed_sent": p3["bytes_sent"],
            "push_changed_pct": round(100 * p3["bytes_sent"] / size, 3),
            "pull_s": pl["seconds"], "pull_mbps": round(size / 1e6 / pl["seconds"], 1),
            "restore_local_s": round(local_s, 3), "restore_local_verify_s": local_parts.get("verify_s"),
            "restore_local_runc_s": local_parts.get("restore_s"),
            "pull_restore_s": round(byref_s, 3), "pull_restore_runc_s": byref_parts.get("restore_s"),
            "pull_restore_ratio": round(byref_s / local_s, 3), "checksum_ok": True,
        }
    finally:
        for cid in running:
            runc(lab, "delete", "--force", cid, check=False)
        for n in names:
            subprocess.run([CLI, "rm", n], capture_output=True, env=lab.env, timeout=600)
        shutil.rmtree(bundle, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4,8", help="comma-separated GiB (default 1,4,8)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--shm", action="store_true", help="store on /dev/shm (needs ~4x the size in memory)")
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    args = ap.parse_args()
    if os.geteuid() != 0:
        log("registry: run as root")
        return 2
    miss = [t for t in ("runc", "criu", "gcc") if not shutil.which(t)] + missing()
    if miss:
        log(f"registry: missing {', '.join(miss)}")
        return 2
    info = machine()
    base = tempfile.mkdtemp(prefix="migrt-bench-registry-", dir="/var/tmp")
    rows = []
    try:
        with local_registry(os.path.join(base, "registry")) as reg:
            info["registry"] = subprocess.run(["docker-registry", "--version"], capture_output=True,
                                              text=True).stdout.strip()
            lab = Lab(os.path.join(base, "lab"))
            lab.store = (os.path.join("/dev/shm", f"migrt-bench-registry-{os.getpid()}") if args.shm
                         else os.path.join(base, "store"))
            with open(lab.config, "w") as fh:
                fh.write(f"runtime: runc\nstore: {lab.store}\nlog_file: {lab.log_file}\nlog_level: info\n"
                         f"registry_auth_file: {reg.auth_file}\nregistry_ca_file: {reg.ca_file}\n"
                         f"restore_registries: ['{reg.host}']\nregistry_timeout: 3600\n")
            for size in (float(x) for x in args.sizes.split(",")):
                need = int(size * GIB) * (4 if args.shm else 1) + GIB
                if meminfo("MemAvailable") < need:
                    why = f"skipped: {meminfo('MemAvailable') >> 20} MiB available, about {need >> 20} MiB needed"
                    log(f"{size:g} GiB: {why}")
                    rows.append({"size_gib": size, "skipped": why})
                    continue
                samples = []
                for i in range(args.runs):
                    log(f"{size:g} GiB run {i + 1}/{args.runs} ...")
                    r = one_run(lab, reg, size, base)
                    log("  " + json.dumps(r))
                    samples.append(r)
                row = {"size_gib": size, "runs": samples}
                for key in samples[0]:
                    if isinstance(samples[0][key], (int, float)) and not isinstance(samples[0][key], bool):
                        row[key] = round(statistics.median(s[key] for s in samples), 3)
                rows.append(row)
            if args.shm:
                shutil.rmtree(lab.store, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()[0]
    print(f"{'GiB':>4} {'ckpt GB':>8} {'cp MB/s':>8} {'push MB/s':>9} {'pull MB/s':>9} {'2nd push %':>10} "
          f"{'changed %':>9} {'local restore s':>15} {'pull+restore s':>14} {'ratio':>6}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['size_gib']:>4g}  {r['skipped']}")
            continue
        print(f"{r['size_gib']:>4g} {r['checkpoint_bytes'] / 1e9:>8.3f} {r['cp_mbps']:>8.0f} {r['push_mbps']:>9.0f} "
              f"{r['pull_mbps']:>9.0f} {r['push_unchanged_pct']:>10.3f} {r['push_changed_pct']:>9.2f} "
              f"{r['restore_local_s']:>15.2f} {r['pull_restore_s']:>14.2f} {r['pull_restore_ratio']:>6.2f}")
    print(f"medians of {args.runs} run(s); every restore re-hashed the process memory to memhog's checksum")
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump({"machine": info, "runs": args.runs, "rows": rows}, fh, indent=2)
    done = [r for r in rows if "skipped" not in r]
    if done:
        big = done[-1]
        print(f"registry gb={big['size_gib']:g} push_mbps={big['push_mbps']:.0f} pull_mbps={big['pull_mbps']:.0f} "
              f"cp_mbps={big['cp_mbps']:.0f} pull_restore_ratio={big['pull_restore_ratio']:.2f} "
              f"second_push_pct={big['push_unchanged_pct']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
