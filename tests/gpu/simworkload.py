"""tests/gpu/workload.py's stand-in on a simulated GPU node (tests/gpu/simnode.py): the same files in
/data, its "GPU memory" in host memory, run by the host's Python inside a rig bundle.

    python simworkload.py NAME GB

NAME.ready.json, NAME.status.json (every 0.1 s: count, gpu_count, t) and NAME.verify-K ->
NAME.result-K.json (the checksum now) as workload.py writes them; the checksum is the sha256 of the
GB GiB of "device" memory. The simulated driver's checkpoint (migrt/gpu/fakenode.py host_copy) sends
SIGUSR1: the process then does what the real driver does inside it, copying its device memory into
fresh private anonymous host memory, and creates /tmp/gpu-copy; from then on the checksum covers
that copy too (it must equal the original's), as a restore reads the driver's copy back.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import signal
import sys
import time

DATA = os.environ.get("WORKLOAD_DATA", "/data")
host_copy = None


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def run(name: str, gb: float) -> None:
    size = max(1 << 20, int(gb * (1 << 30)) // (1 << 20) << 20)
    device = bytearray(size)
    block = os.urandom(1 << 20)
    for off in range(0, size, 1 << 20):
        device[off:off + (1 << 20)] = block
        block = hashlib.sha256(block).digest() * (1 << 15)  # cheap, different megabytes

    def on_checkpoint(_sig, _frame) -> None:
        global host_copy
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.write(device)
        host_copy = m
        open("/tmp/gpu-copy", "w").close()

    def checksum() -> str:
        h = hashlib.sha256(device).hexdigest()
        if host_copy is not None and hashlib.sha256(host_copy).hexdigest() != h:
            return "host copy differs: " + hashlib.sha256(host_copy).hexdigest()
        return h

    signal.signal(signal.SIGUSR1, on_checkpoint)
    write_json(f"{DATA}/{name}.ready.json", {"checksum": checksum(), "gb": size / (1 << 30), "pid": os.getpid(),
                                              "device": "simulated"})
    count = 0
    while True:
        count += 1
        write_json(f"{DATA}/{name}.status.json", {"count": count, "gpu_count": count, "t": time.time()})
        for entry in os.listdir(DATA):
            if entry.startswith(f"{name}.verify-"):
                k = entry.rsplit("-", 1)[1]
                write_json(f"{DATA}/{name}.result-{k}.json", {"checksum": checksum(), "count": count,
                                                              "gpu_count": count})
                os.unlink(f"{DATA}/{entry}")
        time.sleep(0.1)


if __name__ == "__main__":
    run(sys.argv[1], float(sys.argv[2]))
