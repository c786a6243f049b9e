"""A process holding N GiB of private anonymous memory and no GPU: the CPU-only row of
bench/gpu_roundtrip.py. Standard library only; the same file protocol as tests/gpu/workload.py
(so tests.gpu.harness.Workload drives it):

    python cpuhog.py NAME GB        (WORKLOAD_DATA: the directory, default /data)

  NAME.ready.json      once the memory is filled: {"checksum", "gb", "pid", "device": "cpu"}
  NAME.status.json     every 0.1 s: {"count", "gpu_count" (= count: no GPU), "t"}
  NAME.verify-K -> NAME.result-K.json   the checksum recomputed now.

The memory is one MAP_PRIVATE|MAP_ANONYMOUS mapping (like the one the CUDA driver leaves after a
process checkpoint), every page written: 1 MiB of random bytes copied over the whole mapping, then
each MiB stamped with its index so that no two are alike. The checksum is sha256 over 64 slices
in threads (hashlib drops the GIL), combined in order: exact and position-sensitive.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

DATA = os.environ.get("WORKLOAD_DATA", "/data")
MIB = 1 << 20


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def fill(gb: float) -> tuple[mmap.mmap, int]:
    size = max(1, round(gb * 1024)) * MIB
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mv = memoryview(mm)
    mv[:MIB] = os.urandom(MIB)
    done = MIB
    while done < size:  # doubling copies: memmove speed
        n = min(done, size - done)
        mv[done:done + n] = mv[:n]
        done += n
    for i in range(size // MIB):
        mv[i * MIB:i * MIB + 8] = i.to_bytes(8, "little")
    mv.release()
    return mm, size


def checksum(mm: mmap.mmap, size: int) -> str:
    mv = memoryview(mm)
    parts = 64
    step = -(-size // parts)
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda i: hashlib.sha256(mv[i * step:min(size, (i + 1) * step)]).digest(),
                                range(parts)))
    mv.release()
    return hashlib.sha256(b"".join(digests)).hexdigest()


def run(name: str, gb: float) -> None:
    mm, size = fill(gb)
    write_json(f"{DATA}/{name}.ready.json", {"checksum": checksum(mm, size), "gb": size / (1 << 30),
                                              "pid": os.getpid(), "device": "cpu"})
    count = 0
    while True:
        count += 1
        write_json(f"{DATA}/{name}.status.json", {"count": count, "gpu_count": count, "t": time.time()})
        for entry in os.listdir(DATA):
            if entry.startswith(f"{name}.verify-"):
                k = entry.rsplit("-", 1)[1]
                write_json(f"{DATA}/{name}.result-{k}.json",
                           {"checksum": checksum(mm, size), "count": count, "gpu_count": count})
                os.unlink(f"{DATA}/{entry}")
        time.sleep(0.1)


if __name__ == "__main__":
    run(sys.argv[1], float(sys.argv[2]))
