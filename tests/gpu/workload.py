"""The GPU workload of tests/gpu, run inside the test container by the host's own Python + PyTorch.

    python workload.py NAME GB        one CUDA process holding GB GiB of int32 tensors on cuda:0
    python workload.py --pair GB      a supervisor (no CUDA) with two such processes, 'a' and 'b'

Each process, in /data (a bind mount the test reads):
  NAME.ready.json          once the tensors exist: {"checksum", "gb", "pid", "device"}
  NAME.status.json         every 0.1 s: {"count", "gpu_count", "t"}; gpu_count is a counter kept in
                           GPU memory and advanced by a kernel each step (so the GPU state is live);
  NAME.verify-K -> NAME.result-K.json   on request: the checksum recomputed now, with the counters.
The checksum is exact (int64 sums, wrapping, so order-independent) and position-sensitive (rows
of 1024 elements weighted by their index), computed on the GPU over every tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DATA = os.environ.get("WORKLOAD_DATA", "/data")
CHUNK_ELEMS = int(os.environ.get("WORKLOAD_CHUNK_ELEMS", 64 << 20))  # 256 MiB of int32 per tensor
ROW = 1024


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def run(name: str, gb: float) -> None:
    import torch

    dev = torch.device("cuda:0")
    n = max(1, round(gb * (1 << 30) / (CHUNK_ELEMS * 4)))
    gen = torch.Generator(device=dev)
    gen.manual_seed(sum(name.encode()))
    tensors = [torch.randint(-(2**31), 2**31 - 1, (CHUNK_ELEMS,), dtype=torch.int32, device=dev, generator=gen)
               for _ in range(n)]
    weights = torch.arange(1, CHUNK_ELEMS // ROW + 1, device=dev, dtype=torch.int64)

    def checksum() -> str:
        plain = torch.zeros((), dtype=torch.int64, device=dev)
        weighted = torch.zeros((), dtype=torch.int64, device=dev)
        for i, t in enumerate(tensors):
            rows = t.view(-1, ROW).sum(dim=1, dtype=torch.int64)
            plain += rows.sum()
            weighted += (rows * weights).sum() * (i + 1)
        return f"{plain.item()}:{weighted.item()}:{n}"

    gpu_count = torch.zeros((), dtype=torch.int64, device=dev)
    props = torch.cuda.get_device_properties(dev)
    write_json(f"{DATA}/{name}.ready.json", {"checksum": checksum(), "gb": n * CHUNK_ELEMS * 4 / (1 << 30),
                                              "pid": os.getpid(), "device": props.name})
    count = 0
    while True:
        count += 1
        gpu_count += 1
        g = int(gpu_count.item())  # a CUDA call every step: blocks while the process is locked
        write_json(f"{DATA}/{name}.status.json", {"count": count, "gpu_count": g, "t": time.time()})
        for entry in os.listdir(DATA):
            if entry.startswith(f"{name}.verify-"):
                k = entry.rsplit("-", 1)[1]
                write_json(f"{DATA}/{name}.result-{k}.json",
                           {"checksum": checksum(), "count": count, "gpu_count": int(gpu_count.item())})
                os.unlink(f"{DATA}/{entry}")
        time.sleep(0.1)


def pair(gb: float) -> None:
    children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), n, str(gb)]) for n in ("a", "b")]
    while all(c.poll() is None for c in children):
        time.sleep(0.5)
    sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "--pair":
        pair(float(sys.argv[2]))
    else:
        run(sys.argv[1], float(sys.argv[2]))
