"""The migrt demo: private containerd -> counter container through migrt-runc -> `migrt checkpoint`
-> container removed -> new container with MIGRT_RESTORE -> the counter resumes where it stopped.
Everything lives in a temporary directory, removed at the end (--keep keeps it). It needs what
packaging/setup-host.sh sets up and nothing of the test set-up: the container image is made of this
host's own sh and coreutils (scripts/lab/host_rootfs.py), the containerd is the one on PATH.
--containerd 1.7 runs it with containerd 1.7 (unpacked by packaging/setup-test.sh), 1.6 with the node
release's own containerd and runc (Debian 12: 1.6.20 and 1.1.5), instead of the containerd on PATH;
MIGRT_BINDIR names where migrt and migrt-runc are (default /usr/local/bin)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.lab import mountroot
from scripts.lab.containerd import RELEASE_PATH, SYSTEM, VERSIONS, Containerd, missing
from scripts.lab.host_rootfs import make_host_rootfs
from scripts.lab.oci_image import write_image_tar
from scripts.lab.workloads import COUNTER, parse_ticks

BINDIR = os.environ.get("MIGRT_BINDIR", "/usr/local/bin")
SHIM = f"{BINDIR}/migrt-runc"
MIGRT = f"{BINDIR}/migrt"
IMAGE = "docker.io/migrt/demo-counter:1"


def say(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def ticks(path: str) -> list:
    return parse_ticks(open(path).read()) if os.path.exists(path) else []


def import_image(ctd: Containerd, base: str) -> str:
    """The host's sh and coreutils as a one-layer image in the demo's containerd."""
    rootfs = make_host_rootfs(os.path.join(base, "rootfs"))
    tar = write_image_tar(rootfs, os.path.join(base, "image.tar"), IMAGE, {"Env": ["PATH=/bin"], "Cmd": ["sh"]})
    return ctd.import_image(tar, IMAGE)


def main() -> int:
    mountroot.ensure(sys.argv)  # a plain chroot: "/" made a mount point first (scripts/lab/mountroot.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--containerd", choices=VERSIONS, default=SYSTEM,
                    help="containerd: 2 (the one on PATH), 1.7 (unpacked by setup-test.sh) or 1.6 "
                         "(the release's, with its runc)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    why = missing(args.containerd)
    if why:
        print(f"demo: {why}", file=sys.stderr)
        return 2
    base = tempfile.mkdtemp(prefix="migrt-demo.")
    cfg = os.path.join(base, "config.yaml")
    with open(cfg, "w") as fh:
        # 1.6: the release's runc too (its shims find it first; `migrt checkpoint` here must use the same)
        runtime = shutil.which("runc", path=RELEASE_PATH) if args.containerd == "1.6" else "runc"
        fh.write(f"runtime: {runtime}\nstore: {base}/store\nlog_file: {base}/migrt.log\n")
    os.environ["MIGRT_CONFIG"] = cfg
    ctd = Containerd(os.path.join(base, "containerd"), namespace="migrt-demo", version=args.containerd)
    which = "the one on PATH" if args.containerd == SYSTEM else args.containerd
    say(f"private containerd ({which}) under {base} (store {base}/store)")
    ctd.start()
    try:
        server = [line.split(":", 1)[1].strip() for line in ctd.ctr("version").stdout.splitlines()
                  if line.strip().startswith("Version:")]
        print(f"containerd {server[-1] if server else '?'}")
        image = import_image(ctd, base)
        log1 = os.path.join(base, "counter-1.log")
        say("run a counter container through migrt-runc (ordinary container: pure pass-through)")
        ctd.ctr("run", "-d", "--runc-binary", SHIM, "--log-uri", f"file://{log1}", image, "counter-1",
                "sh", "-c", COUNTER)
        while len(ticks(log1)) < 10:
            time.sleep(0.2)
        last = ticks(log1)[-1]
        print(f"counter-1 says: tick {last[0]}, in-memory data hash {last[2]}")

        say("migrt checkpoint counter-1")
        res = subprocess.run([MIGRT, "checkpoint", "counter-1", "--name", "demo-counter", "--json"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            if "another root than mntns" in res.stderr:
                print("demo: this root was entered with chroot: CRIU checkpoints a container only where the tasks' "
                      "root is their mount namespace's root. Run the demo in a container (e.g. debian:12), or enter "
                      "the root with pivot_root in a mount namespace of its own (packaging/check-fresh-root.sh).",
                      file=sys.stderr)
            return 1
        info = json.loads(res.stdout)
        stopped_at = ticks(log1)[-1]
        print(f"checkpoint {info['name']}: {info['size_bytes'] / 1e6:.1f} MB, timings {info['timings']}")
        made = json.loads(subprocess.run([MIGRT, "inspect", info["name"], "--json"], capture_output=True,
                                         text=True, check=True).stdout)["manifest"].get("versions") or {}
        print(f"made with runc {made.get('runtime')} ({made.get('runtime_path')}), CRIU {made.get('criu')}")
        print(f"counter-1 stopped at tick {stopped_at[0]}")
        sys.stdout.flush()  # (before the child writes to the same stdout)
        subprocess.run([MIGRT, "ls"])

        say("remove counter-1")
        ctd.ctr("task", "delete", "counter-1", check=False)
        ctd.ctr("containers", "delete", "counter-1")

        say("create counter-2 from the same image with MIGRT_RESTORE=demo-counter")
        log2 = os.path.join(base, "counter-2.log")
        t0 = time.monotonic()
        ctd.ctr("run", "-d", "--runc-binary", SHIM, "--log-uri", f"file://{log2}", "--env",
                "MIGRT_RESTORE=demo-counter", image, "counter-2", "sh", "-c", "echo I would start from 1")
        print(f"counter-2 created and running in {time.monotonic() - t0:.2f} s")
        while len(ticks(log2)) < 5:
            time.sleep(0.2)
        first = ticks(log2)[0]
        print(f"counter-2 says: tick {first[0]} (counter-1 stopped at {stopped_at[0]}), data hash {first[2]}")
        ok = first[0] == stopped_at[0] + 1 or first[0] > stopped_at[0]
        ok = ok and first[2] == stopped_at[2]
        say("RESULT: " + ("the counter resumed where it stopped, memory intact" if ok else "MISMATCH"))
        return 0 if ok else 1
    finally:
        ctd.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
