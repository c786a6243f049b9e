"""The multi-GPU workload of tests/gpu/test_gpu_multi.py: a torch.distributed job run inside the test
container by the host's own Python + PyTorch, one process per GPU, NCCL between them.

    python ddp_workload.py --job GB       the container's init (no CUDA): starts ranks 0 and 1, waits
    python ddp_workload.py --rank R GB    rank R on cuda:R, GB GiB of int32 tensors

Rendezvous through a file store in /data (no TCP store to carry through CRIU). Each step all-reduces
a small tensor (rank r contributes (r + 1) * step, so the sum is 3 * step) and advances a counter
kept in GPU memory. NCCL settings come from the container's environment (the test's case).
With WORKLOAD_HOOK=1 each rank registers the application hook (apphook.py, copied next to this
file: an application copies it) in inline mode: at a step all ranks agree on (an all-reduce of
"a request is pending"), it destroys its process group, and after "post-restore" builds a new one
(the next generation's file store) and goes on.

Files in /data, per rank R:
  rR.log              the rank's stdout and stderr (NCCL_DEBUG output, tracebacks), its progress lines
                      ("<time> rank R: ..."), and, on SIGUSR1, the stacks of all its Python threads
                      (faulthandler: what the GPU tests dump when a step does not end in time);
                      opened O_WRONLY|O_APPEND, which CRIU restores without checking its size
  rR.ready.json       {"checksum", "gb", "pid", "device"} once the tensors and the group exist
  rR.status.json      every step: {"count", "gpu_count", "allreduce_ok", "allreduce_bad", "gen", "t"}
  rR.verify-K -> rR.result-K.json   on request: the checksum now, with the counters
  rR.hook.jsonl       the hook's events: {"event", "reason", "seconds"}
and job.log: the supervisor's word when a rank exits (then the job ends).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time

DATA = os.environ.get("WORKLOAD_DATA", "/data")
CHUNK_ELEMS = int(os.environ.get("WORKLOAD_CHUNK_ELEMS", 64 << 20))  # 256 MiB of int32 per tensor
ROW = 1024
WORLD = 2


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def append(path: str, obj: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(obj) + "\n")


def say(rank: int, what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} rank {rank}: {what}", file=sys.stderr,
          flush=True)


def rank_main(rank: int, gb: float) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stderr is rR.log
    say(rank, f"start, pid {os.getpid()}, NCCL settings "
              f"{ {k: v for k, v in sorted(os.environ.items()) if k.startswith('NCCL_')} }")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}")
    n = max(1, round(gb * (1 << 30) / (CHUNK_ELEMS * 4)))
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + rank)
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

    state = {"gen": 0}

    def join() -> None:
        say(rank, f"init_process_group gen {state['gen']}")
        dist.init_process_group("nccl", init_method=f"file://{DATA}/pg-{state['gen']}", rank=rank,
                                world_size=WORLD, timeout=timedelta(hours=1), device_id=dev)
        warm = torch.ones(1, device=dev)
        dist.all_reduce(warm)  # the communicator and its transports exist from here on
        torch.cuda.synchronize()
        say(rank, f"process group gen {state['gen']} up (first all-reduce done)")

    say(rank, f"{n} tensors on {dev} ({n * CHUNK_ELEMS * 4 / (1 << 30):g} GiB)")
    join()
    hook = None
    if os.environ.get("WORKLOAD_HOOK") == "1":
        sys.path.insert(0, DATA)
        from apphook import AppHook  # the copy an application carries

        log = f"{DATA}/r{rank}.hook.jsonl"

        def down(request: dict) -> None:
            say(rank, "pre-checkpoint: destroying the process group")
            t0 = time.monotonic()
            torch.cuda.synchronize()
            dist.destroy_process_group()
            torch.cuda.synchronize()
            append(log, {"event": "pre-checkpoint", "seconds": round(time.monotonic() - t0, 3)})

        def up(request: dict) -> None:
            say(rank, f"post-restore ({request.get('reason')}): a new process group")
            t0 = time.monotonic()
            state["gen"] += 1
            join()
            append(log, {"event": "post-restore", "reason": request.get("reason"),
                         "seconds": round(time.monotonic() - t0, 3)})

        hook = AppHook(f"rank{rank}", on_checkpoint=down, on_restore=up, inline=True).start()

    gpu_count = torch.zeros((), dtype=torch.int64, device=dev)
    props = torch.cuda.get_device_properties(dev)
    write_json(f"{DATA}/r{rank}.ready.json", {"checksum": checksum(), "gb": n * CHUNK_ELEMS * 4 / (1 << 30),
                                               "pid": os.getpid(), "device": props.name})
    say(rank, "ready")
    count = ok = bad = 0
    while True:
        if hook is not None:  # agree on the step: a rank that stopped alone would leave its peer in a collective
            flag = torch.tensor([int(hook.pending())], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                hook.safe_point(timeout=120)
        count += 1
        x = torch.full((1024,), float((rank + 1) * count), device=dev)
        dist.all_reduce(x)
        if x[0].item() == 3.0 * count:
            ok += 1
        else:
            bad += 1
        gpu_count += 1
        g = int(gpu_count.item())
        write_json(f"{DATA}/r{rank}.status.json", {"count": count, "gpu_count": g, "allreduce_ok": ok,
                                                   "allreduce_bad": bad, "gen": state["gen"], "t": time.time()})
        for entry in os.listdir(DATA):
            if entry.startswith(f"r{rank}.verify-"):
                k = entry.rsplit("-", 1)[1]
                write_json(f"{DATA}/r{rank}.result-{k}.json", {"checksum": checksum(), "count": count,
                                                               "gpu_count": int(gpu_count.item())})
                os.unlink(f"{DATA}/{entry}")
        time.sleep(0.05)


def job_main(gb: float) -> None:
    logs = [open(f"{DATA}/r{r}.log", "ab", buffering=0) for r in range(WORLD)]  # O_WRONLY|O_APPEND
    ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), str(gb)],
                              stdout=logs[r], stderr=logs[r]) for r in range(WORLD)]
    while all(p.poll() is None for p in ranks):
        time.sleep(0.5)
    with open(f"{DATA}/job.log", "a") as fh:
        fh.write(f"{time.strftime('%H:%M:%S')} job: rank(s) "
                 f"{', '.join(f'{r} exited {p.returncode}' for r, p in enumerate(ranks) if p.poll() is not None)}"
                 "; the job ends\n")
    sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "--job":
        job_main(float(sys.argv[2]))
    else:
        rank_main(int(sys.argv[2]), float(sys.argv[3]))
