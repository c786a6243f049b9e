"""The inference server of bench/warm_start.py, run inside the benchmark's container by the host's
own Python + PyTorch (copied into the container's /data as server.py).

    python server.py --backend torch --device cuda --d-model 2048 --layers 24 ...   a real model
    python server.py --backend fake --fake-mb 64 --fake-compile-s 2                  no torch (CPU tests)

The torch backend builds a decoder-only transformer (pre-LayerNorm blocks, causal SDPA attention,
GELU MLP, untied embedding and head, no biases) with random weights from a fixed seed, directly on
the device in bf16 (cuda) or fp32 (cpu); eval mode, no gradients. It is torch.compile'd (mode
default, static shapes); when compiling fails the server falls back to eager and says so in its
ready file and in every answer. It is warmed up with --warmup forward passes, then it serves.

Protocol, all through files in --data (the container's /data, a bind mount, so nothing of it is
network state that CRIU would have to restore):
  ready.json           written once warmed up: phases (wall-clock timestamps and seconds), model
                       size, compiled or not, GPU memory, child processes left
  req-<ID>.json        a request, written by the client (atomically: temp name, then rename):
                       {"id": ID, "seed": S}; the input is batch x seq token ids drawn from seed S
  resp-<ID>.json       the answer (atomically): {"id", "seed", "digest_logits", "digest_hidden",
                       "argmax", "logits_sum", "forward_s", "received_at", "answered_at", "pid",
                       "compiled", "served"}. digest_* are exact, position-sensitive integer sums
                       over the bits of the output tensors (deterministic: the same input gives the
                       same digests on the same GPU with the same kernels)
The server polls --data every --poll-ms milliseconds (default 2), requests in name order.

Stdlib only at import time: `python -m py_compile` and the CPU tests import this module without torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

T_PROCESS = time.time()  # as early as this process can see: the first line run after Python's start


def write_json(path: str, obj: dict) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp.{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def param_count(d_model: int, layers: int, ffn: int, vocab: int) -> int:
    """Parameters of the model below (LayerNorms have weight + bias)."""
    per_block = 4 * d_model * d_model + 2 * d_model * ffn + 4 * d_model
    return 2 * vocab * d_model + layers * per_block + 2 * d_model


def children_of_self() -> list[dict]:
    """Child processes still alive (e.g. compile workers), with their command lines."""
    out = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    pids: set[int] = set()
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/children") as fh:
                pids.update(int(p) for p in fh.read().split())
        except OSError:
            continue
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        out.append({"pid": pid, "cmd": cmd[:200]})
    return out


# -- the torch backend -------------------------------------------------------------------------------------
class TorchBackend:
    def __init__(self, args, phases: dict) -> None:
        t0 = time.time()
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        phases["import_torch_s"] = round(time.time() - t0, 3)
        self.torch = torch
        self.args = args
        t0 = time.time()
        if args.device == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("server: CUDA is not available in the container")
            self.dev = torch.device("cuda:0")
            torch.cuda.init()
            torch.zeros(1, device=self.dev)  # the context exists from here on
            self.dtype = torch.bfloat16
            phases["device_name"] = torch.cuda.get_device_name(self.dev)
        else:
            self.dev = torch.device("cpu")
            self.dtype = torch.float32
            phases["device_name"] = "cpu"
        phases["device_init_s"] = round(time.time() - t0, 3)
        phases["torch"] = torch.__version__

        dev, dt = self.dev, self.dtype

        class Block(nn.Module):
            def __init__(self, d: int, heads: int, ffn: int) -> None:
                super().__init__()
                self.heads = heads
                self.ln1 = nn.LayerNorm(d, device=dev, dtype=dt)
                self.qkv = nn.Linear(d, 3 * d, bias=False, device=dev, dtype=dt)
                self.proj = nn.Linear(d, d, bias=False, device=dev, dtype=dt)
                self.ln2 = nn.LayerNorm(d, device=dev, dtype=dt)
                self.up = nn.Linear(d, ffn, bias=False, device=dev, dtype=dt)
                self.down = nn.Linear(ffn, d, bias=False, device=dev, dtype=dt)

            def forward(self, x):
                b, t, d = x.shape
                q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
                return x + self.down(F.gelu(self.up(self.ln2(x))))

        class LM(nn.Module):
            def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int) -> None:
                super().__init__()
                self.emb = nn.Embedding(vocab, d, device=dev, dtype=dt)
                self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
                self.ln_f = nn.LayerNorm(d, device=dev, dtype=dt)
                self.head = nn.Linear(d, vocab, bias=False, device=dev, dtype=dt)

            def forward(self, tokens):
                x = self.emb(tokens)
                for blk in self.blocks:
                    x = blk(x)
                x = self.ln_f(x)
                return x, self.head(x[:, -1])

        t0 = time.time()
        torch.manual_seed(args.seed)
        model = LM(args.vocab, args.d_model, args.layers, args.heads, args.ffn).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.sync()
        phases["build_s"] = round(time.time() - t0, 3)
        phases["params"] = sum(p.numel() for p in model.parameters())
        phases["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        self.model = model
        self.fn = model
        self.compiled = False
        self.compile_error = None
        if args.compile:
            try:
                self.fn = torch.compile(model, dynamic=False)
                self.compiled = True
            except Exception as exc:  # torch.compile itself is lazy; this is rare
                self.compile_error = f"{type(exc).__name__}: {exc}"[:2000]

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def tokens(self, seed: int):
        g = self.torch.Generator(device="cpu")
        g.manual_seed(seed)
        t = self.torch.randint(0, self.args.vocab, (self.args.batch, self.args.seq), generator=g)
        return t.to(self.dev)

    def forward(self, seed: int) -> tuple:
        tokens = self.tokens(seed)
        with self.torch.no_grad():
            hidden, logits = self.fn(tokens)
        self.sync()
        return hidden, logits

    def digest(self, t) -> str:
        torch = self.torch
        bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).flatten().to(torch.int64)
        w = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 1000003
        return f"{int(bits.sum())}:{int((bits * w).sum())}:{bits.numel()}"

    def first_call(self, phases: dict) -> None:
        """The first forward pass (where torch.compile compiles); eager when compiling fails."""
        t0 = time.time()
        try:
            self.forward(1)
        except Exception as exc:
            if not self.compiled:
                raise
            self.compile_error = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"server: torch.compile failed, falling back to eager: {self.compile_error}", flush=True)
            try:
                import torch._dynamo

                torch._dynamo.reset()
            except Exception:
                pass
            self.fn, self.compiled = self.model, False
            self.forward(1)
        phases["compile_s" if self.compiled else "first_forward_s"] = round(time.time() - t0, 3)

    def after_warmup(self, phases: dict) -> None:
        torch = self.torch
        if self.compiled:  # compile workers are no longer needed; a server would not keep them either
            try:
                from torch._inductor import async_compile

                async_compile.shutdown_compile_workers()
                phases["compile_workers_shut_down"] = True
            except Exception as exc:
                phases["compile_workers_shut_down"] = f"{type(exc).__name__}: {exc}"[:300]
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()  # freed blocks would otherwise be dumped with the checkpoint
            phases["gpu_allocated_bytes"] = torch.cuda.memory_allocated(self.dev)
            phases["gpu_reserved_bytes"] = torch.cuda.memory_reserved(self.dev)

    def answer(self, seed: int) -> dict:
        hidden, logits = self.forward(seed)
        return {"digest_logits": self.digest(logits), "digest_hidden": self.digest(hidden),
                "argmax": [int(x) for x in logits.argmax(dim=-1).tolist()],
                "logits_sum": float(logits.double().sum())}


# -- the fake backend: no torch, for the CPU tests of the benchmark's logic ------------------------------------
class FakeBackend:
    """Holds --fake-mb MiB of seeded random bytes (memory for CRIU to carry) and sleeps to stand in
    for import, build and compile; answers are hashes over that memory and the request."""

    def __init__(self, args, phases: dict) -> None:
        self.args = args
        t0 = time.time()
        time.sleep(args.fake_import_s)
        phases["import_torch_s"] = round(time.time() - t0, 3)
        phases["device_init_s"] = 0.0
        phases["device_name"] = "fake"
        phases["torch"] = None
        t0 = time.time()
        rng = random.Random(args.seed)
        self.state = b"".join(rng.randbytes(1 << 20) for _ in range(args.fake_mb))
        phases["build_s"] = round(time.time() - t0, 3)
        phases["params"] = len(self.state)
        phases["param_bytes"] = len(self.state)
        self.compiled = bool(args.compile)
        self.compile_error = None

    def first_call(self, phases: dict) -> None:
        t0 = time.time()
        time.sleep(self.args.fake_compile_s if self.compiled else 0)
        self.answer(1)
        phases["compile_s" if self.compiled else "first_forward_s"] = round(time.time() - t0, 3)

    def after_warmup(self, phases: dict) -> None:
        pass

    def answer(self, seed: int) -> dict:
        h = hashlib.sha256(seed.to_bytes(8, "little"))
        h.update(self.state)
        d = h.hexdigest()
        return {"digest_logits": d[:32], "digest_hidden": d[32:], "argmax": [int(d[:4], 16)], "logits_sum": 0.0}


# -- the server ---------------------------------------------------------------------------------------------
def serve(args) -> None:
    data = args.data
    phases: dict = {"process_start": T_PROCESS, "pid": os.getpid(), "backend": args.backend}
    backend = TorchBackend(args, phases) if args.backend == "torch" else FakeBackend(args, phases)
    backend.first_call(phases)
    t0 = time.time()
    for i in range(max(0, args.warmup - 1)):
        backend.answer(2 + i)
    phases["warmup_s"] = round(time.time() - t0, 3)
    backend.after_warmup(phases)
    phases["compiled"] = backend.compiled
    phases["compile_error"] = backend.compile_error
    phases["children"] = children_of_self()
    phases["ready_at"] = time.time()
    write_json(os.path.join(data, "ready.json"), phases)
    print(f"server: ready (compiled={backend.compiled}) after {phases['ready_at'] - T_PROCESS:.2f} s", flush=True)
    served = 0
    poll = args.poll_ms / 1000.0
    while True:
        try:
            entries = sorted(e for e in os.listdir(data) if e.startswith("req-") and e.endswith(".json"))
        except OSError:
            entries = []
        for entry in entries:
            received = time.time()
            path = os.path.join(data, entry)
            try:
                with open(path) as fh:
                    req = json.load(fh)
            except (OSError, ValueError):
                continue
            rid = str(req.get("id") or entry[4:-5])
            out = {"id": rid, "seed": req.get("seed"), "pid": os.getpid(), "received_at": received,
                   "compiled": backend.compiled}
            t0 = time.time()
            try:
                out.update(backend.answer(int(req["seed"])))
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            out["forward_s"] = round(time.time() - t0, 4)
            served += 1
            out["served"] = served
            out["answered_at"] = time.time()
            write_json(os.path.join(data, f"resp-{rid}.json"), out)
            try:
                os.unlink(path)
            except OSError:
                pass
        time.sleep(poll)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("torch", "fake"), default="torch")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--data", default="/data")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3, help="forward passes before serving (the first compiles)")
    p.add_argument("--compile", dest="compile", action="store_true", default=True)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--poll-ms", type=float, default=2.0)
    p.add_argument("--fake-mb", type=int, default=64)
    p.add_argument("--fake-import-s", type=float, default=0.5)
    p.add_argument("--fake-compile-s", type=float, default=2.0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.d_model % args.heads:
        raise SystemExit("server: --d-model must be a multiple of --heads")
    serve(args)


if __name__ == "__main__":
    sys.exit(main())
