#!/usr/bin/env python3
"""`migrt import` of a podman-shaped checkpoint archive, plain, gzip and zstd, against `cp` of the
same plain archive into the same store directory (the baseline, same run).

    python bench/import_archive.py [--mib 256] [--runs 3] [--store DIR] [--json-out PATH]

The archive: podman 5's layout (tests/unit/test_import_podman.py: libpod config.dump, spec.dump,
CRIU mount and file images, rootfs-diff.tar + deleted.files, devshm-checkpoint.tar) with one
pages-1.img of --mib MiB: half random bytes (incompressible, like a heap of numbers), half a
repeated text line (compressible, like many real pages). gzip level 6 (podman's), zstd level 3
(podman's default). Each run imports into a fresh checkpoint name (the import hashes and fsyncs
every file, like any commit) and removes it; `cp` is followed by `sync -f` so both pay the writeback.

Prints per format the median seconds, MB/s of uncompressed archive bytes and the ratio to `cp`'s
median; writes JSON (default bench/results/import_archive.json); last line:

    import_archive mib=<N> plain_s=<> gzip_s=<> zstd_s=<> cp_s=<>
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import log, machine  # noqa: E402


def pages(mib: int) -> bytes:
    half = (mib << 20) // 2
    text = b"tick 1234 0123456789abcdef some text a program keeps in its heap\n"
    return os.urandom(half) + (text * (half // len(text) + 1))[:half]


def build(tmp: str, mib: int) -> dict[str, str]:
    import tarfile

    import zstandard

    from tests.unit.test_import_podman import podman_entries
    from tests.unit.test_import_cri import _entry

    entries = [e for e in podman_entries() if e[0].name != "checkpoint/pages-1.img"]
    entries.append(_entry("checkpoint/pages-1.img", pages(mib)))
    plain = os.path.join(tmp, "ckpt.tar")
    with tarfile.open(plain, "w", format=tarfile.PAX_FORMAT) as tar:
        import io

        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    with open(plain, "rb") as src, gzip.open(plain + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 4 << 20)
    with open(plain, "rb") as src, open(plain + ".zst", "wb") as dst:
        zstandard.ZstdCompressor(level=3).copy_stream(src, dst)
    return {"plain": plain, "gzip": plain + ".gz", "zstd": plain + ".zst"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--store", help="directory for the store (default: a temp dir under /var/tmp)")
    ap.add_argument("--json-out", default=os.path.join(os.path.dirname(__file__), "results", "import_archive.json"))
    args = ap.parse_args()

    from migrt.config import Config
    from migrt.pods.import_cri import import_archive
    from migrt.store import Store

    base = tempfile.mkdtemp(prefix="migrt-bench-import.", dir=args.store or "/var/tmp")
    try:
        log(f"building a {args.mib} MiB podman-shaped archive (plain, gzip -6, zstd -3) in {base}")
        files = build(base, args.mib)
        sizes = {k: os.path.getsize(v) for k, v in files.items()}
        store_dir = os.path.join(base, "store")
        cfg = Config(path=os.path.join(base, "config.yaml"), store=store_dir)
        times: dict[str, list[float]] = {"cp": [], "plain": [], "gzip": [], "zstd": []}
        for run in range(args.runs):
            for fmt in ("cp", "plain", "gzip", "zstd"):  # interleaved: load changes hit every format alike
                if fmt == "cp":
                    os.makedirs(store_dir, exist_ok=True)
                    dest = os.path.join(store_dir, "cp-copy.tar")
                    t0 = time.monotonic()
                    subprocess.run(["cp", files["plain"], dest], check=True)
                    subprocess.run(["sync", "-f", dest], check=True)
                    times["cp"].append(time.monotonic() - t0)
                    os.unlink(dest)
                    continue
                name = f"bench-{fmt}-{run}"
                t0 = time.monotonic()
                import_archive(cfg, files[fmt], name=name)
                times[fmt].append(time.monotonic() - t0)
                shutil.rmtree(Store(store_dir).get(name).path)
            log(f"run {run + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
        med = {k: statistics.median(v) for k, v in times.items()}
        mb = sizes["plain"] / 1e6
        rows = []
        print(f"{'format':8} {'archive MB':>10} {'median s':>9} {'MB/s':>8} {'x cp':>6}")
        for fmt in ("cp", "plain", "gzip", "zstd"):
            size = sizes["plain" if fmt == "cp" else fmt] / 1e6
            row = {"format": fmt, "archive_mb": round(size, 1), "median_s": round(med[fmt], 3),
                   "mb_per_s": round(mb / med[fmt], 1), "ratio_to_cp": round(med[fmt] / med["cp"], 2),
                   "runs_s": [round(t, 3) for t in times[fmt]]}
            rows.append(row)
            print(f"{fmt:8} {size:10.1f} {med[fmt]:9.2f} {row['mb_per_s']:8.1f} {row['ratio_to_cp']:6.2f}")
        os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
        with open(args.json_out, "w") as fh:
            json.dump({"machine": machine(), "mib": args.mib, "runs": args.runs, "uncompressed_mb": round(mb, 1),
                       "rows": rows, "loadavg_end": os.getloadavg()[0]}, fh, indent=2)
        print(f"import_archive mib={args.mib} plain_s={med['plain']:.2f} gzip_s={med['gzip']:.2f} "
              f"zstd_s={med['zstd']:.2f} cp_s={med['cp']:.2f}")
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
