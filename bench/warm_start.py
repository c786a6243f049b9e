#!/usr/bin/env python3
"""Warm start: a PyTorch inference server started fresh versus restored from its checkpoint.

    python bench/warm_start.py [--quick] [--runs N] [--mode gpu|cpu|fake] [--from-registry] [--dry-run] [--json-out PATH]

The server (bench/warm_start_server.py, copied into the container's /data) builds a decoder-only
transformer with random weights from a fixed seed in bf16 on the GPU (default ~1.34e9 parameters,
2.7 GB: d_model 2048, 24 layers, FFN 8192, vocabulary 32768; --quick: ~0.27e9, 0.53 GB), compiles
it with torch.compile (mode default, static shapes; eager if compiling fails, said in the output),
warms it up with 3 forward passes (batch 4 x 512 tokens) and then answers requests given as files
in /data (request file -> response file: nothing for CRIU to carry but memory, see the server).

The container is the GPU test rig's (tests/gpu/rig.py): a runc bundle whose rootfs binds the host's
own Python, torch and NVIDIA libraries read-only, /dev/nvidia* of GPU 0, /data bound read-write from
a host directory; the host's network namespace; stdio pipes as containerd gives them. Everything the
server writes (HOME, TMPDIR, the inductor and Triton caches, whose .so files it maps) is under /data,
so the restored container, which binds the same /data, finds them.

Measured, each from the moment the container is asked for to the first answered request (the request
file is written before; the client polls every 2 ms; the server's own timestamps give the phases):
  fresh      `runc create` + `runc start` of a new container with empty compile caches: Python start,
             import torch, CUDA init, build, compile (first call), warm-up, the answer
  restored   `migrt-runc create` with MIGRT_RESTORE=<checkpoint> (restore by create, as containerd does
             it) + `migrt-runc start`: migrt's verify, runc restore (CRIU), GPU restore, the answer;
             the phases come from migrt's "restored" log event
  fresh, warm cache (informative, if time is left): a fresh container whose /data already holds the
             compile caches of the first fresh run (what a persistent inductor cache would give)
  registry   (--from-registry, issue 30) `migrt-runc create` with MIGRT_RESTORE=oci:<ref>: the checkpoint
             pushed once with `migrt push` to a docker-registry on 127.0.0.1 (TLS with a CA made in the
             run, htpasswd basic auth: bench/warm_start_registry.py), restored by reference into a node
             store emptied before each run; how it got its pages (full pull, lazy, fallback) from
             migrt's log. Targets: within 1.5x of the local-store restore, >= 10x faster than fresh
The first fresh server, warmed up and idle, is checkpointed once with `migrt checkpoint` (its time
and phases are reported, not counted as warm start). Runs alternate fresh k / restored k (/ registry k), k = 1..N
(N = 3, --quick 1), so that a short time budget (--budget-s, default 390 s) shortens both alike:
a run is started only if the time left covers it and what must follow.

Every answer carries exact integer digests of the model's outputs for one fixed input; the restored
server's must equal those the checkpointed server gave before its checkpoint (failure otherwise),
and are compared with every fresh server's too.

Prints a table, writes JSON ($OUT/warm_start.json when OUT is set, else bench/results/warm_start.json)
and, as its last line:

    warm_start fresh_s=<median> restored_s=<median> speedup=<fresh/restored>

Target (issue 5): speedup >= 10. Modes: gpu (default; the GPU machine, run by
bench/run_warm_start_on_device.sh), cpu (a tiny model on the CPU, no GPU state; needs torch on the
host), fake (no torch: a stand-in server holding seeded random memory, for testing the benchmark's
logic, containers and checkpoint/restore on a machine without torch). --dry-run builds the node and
the bundles, prints the plan and removes everything (with --from-registry it also runs the registry,
pushes a small synthetic checkpoint and pulls it into the restores' empty store). Everything made is removed at the end:
containers by id, the checkpoint by name, the node's directory on /dev/shm (--keep to keep it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))

import warm_start_server as server_mod  # noqa: E402

from bench.warm_start_registry import RegistryLeg, missing_tools  # noqa: E402
from tests.gpu import harness, rig  # noqa: E402

SERVER = REPO / "bench" / "warm_start_server.py"
SEED = 1234  # the input of the first (compared) request
STEADY = 5  # requests after the first, for the steady latency
TARGET = 20.0  # issue 18 (was 10 in issue 9)
REGISTRY_VS_LOCAL = 1.5  # issue 30: restored from a registry within 1.5x of the local-store restore
REGISTRY_VS_FRESH = 10.0  # ... and >= 10x faster than a fresh start
PRESETS = {
    # model shape, batch x seq, runs
    ("gpu", False): dict(d_model=2048, layers=24, heads=16, ffn=8192, vocab=32768, batch=4, seq=512, runs=3),
    ("gpu", True): dict(d_model=1024, layers=16, heads=16, ffn=4096, vocab=32768, batch=4, seq=512, runs=1),
    ("cpu", False): dict(d_model=256, layers=4, heads=4, ffn=1024, vocab=4096, batch=2, seq=64, runs=3),
    ("cpu", True): dict(d_model=128, layers=2, heads=4, ffn=512, vocab=4096, batch=2, seq=32, runs=1),
    ("fake", False): dict(fake_mb=256, runs=3),
    ("fake", True): dict(fake_mb=64, runs=1),
}


class Interrupted(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def first_line(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        return out[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def plain_node(base: Path, python: str, *, want_torch: bool, strict: bool) -> tuple[harness.Node, list[str]]:
    """A node without GPUs (modes cpu and fake, dry runs): harness.make_node's config, wrappers and
    runc root, none of its GPU checks. Returns the node and the prerequisites it lacks."""
    problems = []
    if os.geteuid() != 0:
        problems.append("root")
    for tool in ("runc", "criu"):
        if not shutil.which(tool):
            problems.append(tool)
    info = {"torch": None, "paths": []}
    try:
        info = rig.probe(python)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        problems.append(f"{python} ({exc})")
    if want_torch and not info.get("torch"):
        problems.append(f"torch importable by {python} (--python)")
    if problems and strict:
        raise RuntimeError("prerequisites missing: " + ", ".join(problems))
    base.mkdir(parents=True, exist_ok=True)
    binp = base / "bin"
    binp.mkdir(exist_ok=True)
    harness._wrapper(binp / "migrt", "from migrt.cli.main import main\nmain()")
    harness._wrapper(binp / "migrt-runc", "from migrt.shim.__main__ import main\nsys.exit(main())")
    config = base / "config.yaml"
    config.write_text(f"runtime: {shutil.which('runc') or 'runc'}\nstore: {base / 'store'}\n"
                      f"restore_failure_policy: fail\nlog_file: {base / 'migrt.log'}\nlog_level: debug\n")
    env = dict(os.environ)
    env["MIGRT_CONFIG"] = str(config)
    env["MIGRT_HOOK_LOG"] = str(base / "hook.log")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("MIGRT_GPU_HANDLED", None)
    root = base / "runc-root"
    root.mkdir(exist_ok=True)
    node = harness.Node(base=base, python=python, needed=info["paths"], torch=info.get("torch") or "", env=env,
                        gpus=[], driver="", results=base / "results", runc_root=root, bin=binp)
    return node, problems


class Box:
    """A container's create (runc or migrt-runc), its stdio pipes drained into a log file by a thread
    (a full pipe would block the server), and its removal by id."""

    def __init__(self, bench: "Bench", cid: str, argv: list[str], cwd: str, timeout: float,
                 env: dict | None = None) -> None:
        self.bench, self.cid = bench, cid
        self.log_path = bench.logs / f"{cid}.log"
        r_in, self.w_in = os.pipe()
        self.r_out, w_out = os.pipe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()
        bench.cids.append(cid)  # before create: cleanup deletes it whatever happens next
        t0 = time.monotonic()
        try:
            # Its own session: on a timeout the whole group goes (migrt-runc's runc and CRIU too).
            proc = subprocess.Popen(argv, cwd=cwd, stdin=r_in, stdout=w_out, stderr=w_out, env=env or bench.node.env,
                                    start_new_session=True)
            try:
                self.rc = proc.wait(timeout=max(5.0, timeout))
            except subprocess.TimeoutExpired:
                log(f"{cid}: {os.path.basename(argv[0])} create timed out after {timeout:.0f} s: killing its group")
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait(timeout=30)
                self.rc = 124
        finally:
            self.seconds = time.monotonic() - t0
            os.close(r_in)
            os.close(w_out)

    def _drain(self) -> None:
        with open(self.log_path, "ab") as fh:
            while not self._stop.is_set():
                ready, _, _ = select.select([self.r_out], [], [], 0.2)
                if not ready:
                    continue
                chunk = os.read(self.r_out, 65536)
                if not chunk:
                    break
                fh.write(chunk)
                fh.flush()

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def status(self) -> str | None:
        r = subprocess.run(["runc", "--root", str(self.bench.node.runc_root), "state", self.cid],
                           capture_output=True, text=True, timeout=20)
        return json.loads(r.stdout).get("status") if r.returncode == 0 else None

    def remove(self) -> None:
        try:
            subprocess.run(["runc", "--root", str(self.bench.node.runc_root), "delete", "--force", self.cid],
                           capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            log(f"runc delete --force {self.cid} timed out")
        self._stop.set()
        self._thread.join(timeout=2)
        for fd in (self.w_in, self.r_out):
            try:
                os.close(fd)
            except OSError:
                pass


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.mode = args.mode
        self.preset = dict(PRESETS[(args.mode, args.quick)])
        self.runs = args.runs or self.preset.pop("runs")
        self.preset.pop("runs", None)
        self.tag = f"ws{uuid.uuid4().hex[:6]}"
        parent = os.environ.get("MIGRT_GPU_TEST_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
        self.base = Path(parent) / f"migrt-warm-{self.tag}"
        self.cids: list[str] = []
        self.checkpoint_name: str | None = None
        self.budget = Budget(args.budget_s)
        self.notes: list[str] = []
        python = args.python or os.environ.get("MIGRT_GPU_PYTHON") or sys.executable
        self.problems: list[str] = []
        if self.mode == "gpu" and not args.dry_run:
            if args.python:
                os.environ["MIGRT_GPU_PYTHON"] = args.python
            self.node = harness.make_node(self.base)  # GPUs, the CUDA checkpoint API, torch: or it raises
        else:
            self.node, self.problems = plain_node(self.base, python, want_torch=self.mode != "fake",
                                                  strict=not args.dry_run)
        self.node.python = shutil.which(self.node.python) or self.node.python  # the container gets an absolute path
        self.logs = self.base / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.store_mount: Path | None = None
        if args.store_huge and not args.dry_run:
            # The store on a tmpfs of our own mounted huge=always (no host setting changes): CRIU
            # restores from huge pages much faster (FIELD.md: restore 1.45x on an H100).
            store = self.node.base / "store"
            store.mkdir(mode=0o700, parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,mode=0700,size=90%", "migrt-store", str(store)],
                           check=True)
            self.store_mount = store
            self.notes.append("store on a private tmpfs mounted huge=always")
        self.gpu = self.node.gpus[args.gpu] if self.node.gpus else None
        self.registry: RegistryLeg | None = None
        self.result: dict = {"bench": "warm_start", "mode": self.mode, "quick": args.quick, "runs_asked": self.runs,
                             "fresh": [], "restored": [], "fresh_warm_cache": None, "checkpoint": None,
                             "registry": [], "push": None, "notes": self.notes}

    # -- the pieces ---------------------------------------------------------------------------------------
    def server_args(self) -> list[str]:
        a = ["--backend", "fake" if self.mode == "fake" else "torch", "--device", "cuda" if self.mode == "gpu" else "cpu",
             "--warmup", str(self.args.warmup), "--poll-ms", "2"]
        for k, v in self.preset.items():
            a += [f"--{k.replace('_', '-')}", str(v)]
        if self.args.no_compile:
            a.append("--no-compile")
        return [self.node.python, "/data/server.py", *a]

    def model_info(self) -> dict:
        p = self.preset
        if self.mode == "fake":
            return {"kind": "fake", "bytes": p["fake_mb"] << 20}
        n = server_mod.param_count(p["d_model"], p["layers"], p["ffn"], p["vocab"])
        width = 2 if self.mode == "gpu" else 4
        return {"kind": "decoder-only transformer", **p, "params": n, "bytes": n * width,
                "dtype": "bfloat16" if self.mode == "gpu" else "float32"}

    def data_dir(self, name: str, caches_from: Path | None = None) -> Path:
        d = self.base / "data" / name
        if d.exists():
            shutil.rmtree(d)
        for sub in ("home", "tmp", "cache"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        if caches_from is not None:
            shutil.rmtree(d / "cache")
            shutil.copytree(caches_from / "cache", d / "cache", symlinks=True)
        shutil.copy(SERVER, d / "server.py")
        return d

    def bundle(self, name: str, data: Path, extra_env: list[str] | None = None) -> str:
        path = self.base / "bundles" / name
        if path.exists():
            shutil.rmtree(path)
        env = [f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", "HOME=/data/home", "TMPDIR=/data/tmp",
               "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1", "TORCHINDUCTOR_CACHE_DIR=/data/cache/inductor",
               "TRITON_CACHE_DIR=/data/cache/triton", "XDG_CACHE_HOME=/data/cache/xdg", "CUDA_CACHE_PATH=/data/cache/nv"]
        if os.environ.get("LD_LIBRARY_PATH"):
            env.append(f"LD_LIBRARY_PATH={os.environ['LD_LIBRARY_PATH']}")
        if self.args.compile_threads:
            env.append(f"TORCHINDUCTOR_COMPILE_THREADS={self.args.compile_threads}")
        minors = None
        if self.gpu is not None:
            env += [f"NVIDIA_VISIBLE_DEVICES={self.gpu.uuid}", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
            minors = [self.gpu.minor]
        return rig.make_bundle(str(path), args=self.server_args(), data_dir=str(data), needed=self.node.needed,
                               gpu_minors=minors, env=env + list(extra_env or []))

    def request(self, data: Path, rid: str, seed: int) -> None:
        tmp = data / f".req-{rid}.tmp"
        tmp.write_text(json.dumps({"id": rid, "seed": seed}))
        os.replace(tmp, data / f"req-{rid}.json")

    def answer(self, data: Path, rid: str, timeout: float, box: Box) -> dict:
        """The response to request rid, read and removed; fails early if the container stops."""
        path = data / f"resp-{rid}.json"
        end = time.monotonic() + timeout
        next_check = time.monotonic() + 1.0
        while True:
            try:
                resp = json.loads(path.read_text())
                path.unlink()
                if resp.get("error"):
                    raise RuntimeError(f"{box.cid}: request {rid} failed in the server: {resp['error']}")
                return resp
            except FileNotFoundError:
                pass
            except ValueError:  # cannot be half-written (renamed into place); retry once anyway
                pass
            now = time.monotonic()
            if now > end:
                raise RuntimeError(f"{box.cid}: no answer to request {rid} within {timeout:.0f} s\n{box.tail()}")
            if now > next_check:
                next_check = now + 1.0
                if box.status() in (None, "stopped"):
                    time.sleep(0.2)
                    if not path.exists():
                        raise RuntimeError(f"{box.cid}: the container stopped before answering {rid}\n{box.tail()}")
            time.sleep(0.002)

    def steady(self, data: Path, box: Box, prefix: str) -> dict:
        """STEADY more requests, one after the other: round trip, the server's forward pass, and the
        wait until the server picked the request up."""
        rt, fwd, pick = [], [], []
        for i in range(STEADY):
            w0, t0 = time.time(), time.monotonic()
            self.request(data, f"{prefix}-s{i}", 100 + i)
            resp = self.answer(data, f"{prefix}-s{i}", 60, box)
            rt.append(time.monotonic() - t0)
            fwd.append(resp.get("forward_s") or 0.0)
            pick.append(resp["received_at"] - w0)
        return {"round_trip_s": round(statistics.median(rt), 4), "forward_s": round(statistics.median(fwd), 4),
                "pickup_s": round(statistics.median(pick), 4), "round_trips_s": [round(x, 4) for x in rt]}

    # -- the runs -----------------------------------------------------------------------------------------
    def fresh(self, k: int | str, timeout: float, caches_from: Path | None = None) -> tuple[dict, Box, Path]:
        cid = f"{self.tag}-fresh-{k}"
        data = self.data_dir(f"fresh-{k}", caches_from)
        bundle = self.bundle(cid, data)
        self.request(data, "first", SEED)
        log(f"fresh {k}: runc create + start {cid} (timeout {timeout:.0f} s)")
        wall0, t0 = time.time(), time.monotonic()
        box = Box(self, cid, ["runc", "--root", str(self.node.runc_root), "create", "--bundle", bundle, cid],
                  bundle, timeout=min(120, timeout))
        if box.rc != 0:
            raise RuntimeError(f"runc create {cid} -> {box.rc}\n{box.tail()}")
        create_s = box.seconds
        subprocess.run(["runc", "--root", str(self.node.runc_root), "start", cid], check=True, env=self.node.env,
                       timeout=60, capture_output=True)
        resp = self.answer(data, "first", timeout - (time.monotonic() - t0), box)
        total = time.monotonic() - t0
        ready = json.loads((data / "ready.json").read_text())
        steady = self.steady(data, box, "f")
        phases = {"runc_create_s": round(create_s, 3),
                  "until_python_s": round(ready["process_start"] - wall0, 3),
                  "import_torch_s": ready.get("import_torch_s"), "device_init_s": ready.get("device_init_s"),
                  "build_s": ready.get("build_s"),
                  "compile_s": ready.get("compile_s"), "first_forward_s": ready.get("first_forward_s"),
                  "warmup_s": ready.get("warmup_s"),
                  "ready_to_answer_s": round(resp["answered_at"] - ready["ready_at"], 3)}
        rec = {"run": k, "container": cid, "first_answer_s": round(total, 3), "phases": phases,
               "steady": steady, "steady_latency_s": steady["round_trip_s"], "answer": slim(resp), "compiled": ready.get("compiled"),
               "compile_error": ready.get("compile_error"), "children_at_ready": ready.get("children"),
               "gpu_allocated_bytes": ready.get("gpu_allocated_bytes"),
               "gpu_reserved_bytes": ready.get("gpu_reserved_bytes"), "params": ready.get("params"),
               "device": ready.get("device_name"), "torch": ready.get("torch")}
        log(f"fresh {k}: first answer after {total:.2f} s (compiled={ready.get('compiled')})")
        return rec, box, data

    def checkpoint(self, box: Box) -> dict:
        name = f"{self.tag}-ckpt"
        timeout = max(30.0, self.budget.left() - 20)
        log(f"checkpoint: migrt checkpoint {box.cid} --name {name} (timeout {timeout:.0f} s)")
        self.checkpoint_name = name
        t0 = time.monotonic()
        r = subprocess.run([self.node.migrt, "checkpoint", box.cid, "--root", str(self.node.runc_root), "--name", name,
                            "--json"], capture_output=True, text=True, env=self.node.env, timeout=timeout)
        wall = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"migrt checkpoint {box.cid} -> {r.returncode}\n{r.stderr}\n{self.node.tail_logs()}")
        manifest = json.loads((self.base / "store" / name / "manifest.json").read_text())
        gpu = manifest.get("gpu") or {}
        rec = {"name": name, "wall_s": round(wall, 3), "timings": manifest.get("timings", {}),
               "image_bytes": manifest.get("size_bytes"),
               "gpu_processes": [{k: p.get(k) for k in ("ns_pid", "command", "memory_bytes")}
                                 for p in gpu.get("processes") or []]}
        log(f"checkpoint: {wall:.2f} s, image {gib(rec['image_bytes'])} GiB")
        return rec

    def restored(self, k: int, data: Path, timeout: float, leg: str = "restored") -> dict:
        """A restore by create: from the local store (leg "restored"), or by reference from the
        registry into an empty store (leg "registry", --from-registry)."""
        cid = f"{self.tag}-{leg}-{k}"
        request, env = self.checkpoint_name, self.node.env
        if leg == "registry":
            request, env = f"oci:{self.registry.ref}", self.registry.empty_store()
        bundle = self.bundle(cid, data, extra_env=[f"MIGRT_RESTORE={request}"])
        runclog = os.path.join(bundle, "log.json")
        rid = f"{'g' if leg == 'registry' else 'r'}{k}"
        self.request(data, rid, SEED)
        log(f"{leg} {k}: migrt-runc create {cid} with MIGRT_RESTORE={request} (timeout {timeout:.0f} s)")
        wall0, t0 = time.time(), time.monotonic()
        box = Box(self, cid, [self.node.shim, "--root", str(self.node.runc_root), "--log", runclog, "--log-format",
                              "json", "create", "--bundle", bundle, "--pid-file", os.path.join(bundle, "init.pid"), cid],
                  bundle, timeout=timeout, env=env)
        create_s = box.seconds
        if box.rc != 0:
            box.remove()
            raise RuntimeError(f"migrt-runc create {cid} -> {box.rc}: {last_error(runclog)}\n{box.tail()}\n"
                               f"{self.node.tail_logs()}")
        subprocess.run([self.node.shim, "--root", str(self.node.runc_root), "start", cid], check=True,
                       env=env, timeout=60, capture_output=True)
        try:
            resp = self.answer(data, rid, max(10.0, timeout - (time.monotonic() - t0)), box)
            total = time.monotonic() - t0
            steady = self.steady(data, box, rid)
        finally:
            box.remove()
            if leg == "registry":
                self.registry.after(cid)
        ev = [e for e in self.node.migrt_events("restored") if e.get("container_id") == cid]
        asked = [e for e in self.node.migrt_events("restore_requested") if e.get("container") == cid]
        t = ev[-1].get("timings", {}) if ev else {}
        inner = sum(t.get(x) or 0 for x in ("verify_s", "rootfs_apply_s", "restore_s", "gpu_restore_s"))
        t_asked = stamp(asked[-1]) if asked else None
        t_done = stamp(ev[-1]) if ev else None
        phases = {
            # migrt-runc's own start (Python, imports, config) until it logs the request
            "shim_start_s": round(t_asked - wall0, 3) if t_asked else None,
            "verify_s": t.get("verify_s"), "runc_restore_s": t.get("restore_s"),
            "gpu_restore_s": t.get("gpu_restore_s"), "migrt_restore_total_s": t.get("total_s"),
            # in restore_checkpoint besides the three (locks, preflight, image view, marker, work dir)
            "migrt_other_s": round(t["total_s"] - inner, 3) if t.get("total_s") is not None else None,
            # from the request logged to the restore's end, less restore_checkpoint's own total
            "shim_other_s": round(t_done - t_asked - t["total_s"], 3) if t_asked and t_done and "total_s" in t else None,
            "shim_exit_s": round(wall0 + create_s - t_done, 3) if t_done else None,
            "create_wall_s": round(create_s, 3),
            "after_create_to_answer_s": round(total - create_s, 3)}
        rec = {"run": k, "container": cid, "first_answer_s": round(total, 3), "phases": phases,
               "steady": steady, "steady_latency_s": steady["round_trip_s"], "answer": slim(resp), "compiled": resp.get("compiled"),
               "served_count": resp.get("served")}
        if leg == "registry":
            rec.update(self.registry.describe(cid))
        log(f"{leg} {k}: first answer after {total:.2f} s (create {create_s:.2f} s)")
        return rec

    def start_registry(self) -> dict:
        """--from-registry: the registry on loopback, the checkpoint pushed to it (timed)."""
        miss = missing_tools()
        if miss:
            raise RuntimeError(f"--from-registry: missing {', '.join(miss)} (on the GPU machine: the kit's "
                               ".device/debs, tests/gpu/prepare_kit.sh)")
        self.registry = RegistryLeg(self.node, self.base)
        self.notes.extend(self.registry.notes)
        log(f"registry: {self.registry.reg.host}; migrt push {self.checkpoint_name} {self.registry.ref}")
        out = self.registry.push(self.checkpoint_name, timeout=max(60.0, self.budget.left() - 30))
        log(f"registry: pushed {out['bytes_sent'] / 1e9:.2f} GB in {out['seconds']} s ({out['mbps']} MB/s)")
        return out

    # -- the plan -----------------------------------------------------------------------------------------
    def run(self) -> dict:
        r = self.result
        r["machine"] = self.machine()
        r["model"] = self.model_info()
        if self.args.dry_run:
            return self.dry_run()
        est = {"fresh": None, "ckpt": None, "restore": None}
        f1, box1, data1 = self.fresh(1, timeout=max(self.budget.left() - 60, self.budget.left() * 0.5))
        r["fresh"].append(f1)
        est["fresh"] = f1["first_answer_s"]
        img_gib = ((f1.get("gpu_reserved_bytes") or self.model_info()["bytes"]) / 2**30) + 1.5
        need = 10 + 4 * img_gib + 10 + 3 * img_gib + 20
        if self.budget.left() < need:
            self.notes.append(f"only {self.budget.left():.0f} s left after the first fresh run, ~{need:.0f} s needed "
                              "for the checkpoint and one restore: trying anyway")
        r["checkpoint"] = self.checkpoint(box1)
        box1.remove()
        est["restore"] = 10 + 3 * gib_f(r["checkpoint"]["image_bytes"])
        if self.args.from_registry:
            r["push"] = self.start_registry()
            est["restore"] *= 2  # the restore from the store and the one by reference
        for k in range(1, self.runs + 1):
            if k > 1:
                need_f = est["fresh"] * 1.15 + 15
                if self.budget.left() < need_f + est["restore"] * 1.3 + 30:
                    self.notes.append(f"fresh run {k} and restored run {k} skipped: {self.budget.left():.0f} s left "
                                      f"of the {self.budget.seconds:.0f} s budget")
                    break
                fk, boxk, _ = self.fresh(k, timeout=self.budget.left() - est["restore"] - 30)
                boxk.remove()
                r["fresh"].append(fk)
                est["fresh"] = max(est["fresh"], fk["first_answer_s"])
            if self.budget.left() < (est["restore"] + 15 if k > 1 else 10):  # the first one is tried regardless
                self.notes.append(f"restored run {k} skipped: {self.budget.left():.0f} s left")
                break
            rk = self.restored(k, data1, timeout=self.budget.left() - 15)
            r["restored"].append(rk)
            est["restore"] = max(rk["first_answer_s"] * 1.3, 10)
            if self.registry is not None:
                if k > 1 and self.budget.left() < est["restore"] * 2 + 15:
                    self.notes.append(f"registry run {k} skipped: {self.budget.left():.0f} s left")
                    break
                rr = self.restored(k, data1, timeout=self.budget.left() - 15, leg="registry")
                r["registry"].append(rr)
                est["restore"] += max(rr["first_answer_s"] * 1.3, 10)
        if not self.args.no_warm_cache:
            want = min(f["first_answer_s"] for f in r["fresh"]) * 0.7 + 20
            if self.budget.left() > want:
                try:
                    fw, boxw, _ = self.fresh("warm-cache", timeout=self.budget.left() - 15, caches_from=data1)
                    boxw.remove()
                    r["fresh_warm_cache"] = fw
                except RuntimeError as exc:  # informative only: never fails the benchmark
                    self.notes.append(f"fresh run with warm compile caches failed: {str(exc).splitlines()[0]}")
            else:
                self.notes.append(f"fresh run with warm compile caches skipped: {self.budget.left():.0f} s left")
        return r

    def dry_run(self) -> dict:
        data = self.data_dir("fresh-1")
        b1 = self.bundle(f"{self.tag}-fresh-1", data)
        b2 = self.bundle(f"{self.tag}-restored-1", data, extra_env=[f"MIGRT_RESTORE={self.tag}-ckpt"])
        cfg = json.loads(Path(b1, "config.json").read_text())
        cfg2 = json.loads(Path(b2, "config.json").read_text())
        m = self.model_info()
        print(f"dry run: mode {self.mode}{' quick' if self.args.quick else ''}, runs {self.runs}, "
              f"budget {self.budget.seconds:.0f} s, node {self.base}")
        print(f"  prerequisites missing: {', '.join(self.problems) or 'none'}")
        print(f"  model: {json.dumps(m)}")
        if "params" in m:
            print(f"  ~{m['params'] / 1e9:.2f}e9 parameters, {m['bytes'] / 1e9:.2f} GB")
        print(f"  server: {' '.join(cfg['process']['args'])}")
        print(f"  env: {' '.join(e for e in cfg['process']['env'] if not e.startswith(('PATH=', 'LD_LIBRARY_PATH=')))}")
        binds = [x['source'] for x in cfg['mounts'] if x.get('type') == 'bind']
        print(f"  bundle {b1}: {len(binds)} bind mounts: {' '.join(binds)}")
        print(f"  devices: {[d['path'] for d in cfg['linux'].get('devices', [])]}; namespaces: "
              f"{[n['type'] for n in cfg['linux']['namespaces']]}")
        restore_env = [e for e in cfg2["process"]["env"] if e.startswith("MIGRT_RESTORE=")]
        print(f"  restore bundle {b2}: {restore_env}")
        steps = ["fresh 1: request file, runc create + start, wait for the answer, 5 more requests",
                 "checkpoint: migrt checkpoint fresh1 (stops it)"]
        for k in range(1, self.runs + 1):
            if k > 1:
                steps.append(f"fresh {k}: as fresh 1 with its own empty caches; removed")
            steps.append(f"restored {k}: request file, migrt-runc create (MIGRT_RESTORE) + start, answer vs fresh 1; removed")
            if self.args.from_registry:
                steps.append(f"registry {k}: the restores' store emptied, migrt-runc create with MIGRT_RESTORE=oci:REF "
                             "(lazily: what CRIU reads in the create, the rest by range while it runs, a GPU "
                             "checkpoint's host copy first; a full pull where it falls back), answer vs fresh 1; "
                             "removed")
        if self.args.from_registry:
            steps.insert(2, "registry: docker-registry on 127.0.0.1 (TLS, CA made here; htpasswd basic auth), "
                            "migrt push of the checkpoint (timed)")
        if not self.args.no_warm_cache:
            steps.append("fresh with warm caches (copy of fresh 1's /data/cache), if time is left; removed")
        steps.append("cleanup: runc delete --force of every container, migrt rm of the checkpoint, rm -r the node")
        for i, s in enumerate(steps, 1):
            print(f"  {i:>2}. {s}")
        self.result["dry_run"] = {"steps": steps, "problems": self.problems, "server_args": cfg["process"]["args"]}
        if self.args.from_registry:
            self.result["dry_run"]["registry"] = self.registry_dry_run()
        return self.result

    def registry_dry_run(self) -> dict:
        """--from-registry in a dry run: the registry leg's plumbing for real with a small synthetic
        checkpoint (no CRIU): tools, registry, TLS, auth, push, and a pull by the restores' config
        into their empty store."""
        from migrt.store import Store

        name = f"{self.tag}-dry"
        with Store(str(self.base / "store")).writer(name) as w:
            for f, size in (("inventory.img", 64), ("pages-1.img", 8 << 20)):
                with open(os.path.join(w.images, f), "wb") as fh:
                    fh.write(os.urandom(size))
            w.commit({"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        self.checkpoint_name = name  # removed by cleanup
        push = self.start_registry()
        env = self.registry.empty_store()
        t0 = time.monotonic()
        r = subprocess.run([self.node.migrt, "pull", self.registry.ref, "--json"], capture_output=True, text=True,
                           env=env, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"registry dry run: migrt pull {self.registry.ref} -> {r.returncode}: {r.stderr.strip()}")
        pulled = json.loads(r.stdout)["name"]
        if not (self.registry.store / pulled / "manifest.json").exists():
            raise RuntimeError(f"registry dry run: {pulled} is not in {self.registry.store}")
        out = {"push": push, "pulled": pulled, "pull_s": round(time.monotonic() - t0, 3), "notes": self.registry.notes}
        print(f"  registry: {push['registry']} on {self.registry.reg.host}: pushed {push['bytes_sent']} bytes, "
              f"pulled {pulled} into the empty store in {out['pull_s']:.2f} s"
              + "".join(f"; {n}" for n in self.registry.notes))
        return out

    def machine(self) -> dict:
        d = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
             "runc": first_line(["runc", "--version"]), "criu": first_line(["criu", "--version"]),
             "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": self.node.torch or None}
        if self.gpu is not None:
            d.update(gpu=self.gpu.name, gpu_uuid=self.gpu.uuid, driver=self.node.driver)
        return d

    def cleanup(self) -> None:
        for cid in self.cids:
            try:
                subprocess.run(["runc", "--root", str(self.node.runc_root), "delete", "--force", cid],
                               capture_output=True, timeout=60)
            except subprocess.TimeoutExpired:
                log(f"cleanup: runc delete --force {cid} timed out")
        if self.checkpoint_name:
            try:
                r = subprocess.run([self.node.migrt, "rm", self.checkpoint_name], capture_output=True, text=True,
                                   env=self.node.env, timeout=120)
                if r.returncode != 0 and "not found" not in (r.stderr or "").lower():
                    log(f"cleanup: migrt rm {self.checkpoint_name}: {r.stderr.strip()}")
            except subprocess.TimeoutExpired:
                log(f"cleanup: migrt rm {self.checkpoint_name} timed out")
        if self.registry is not None:
            self.registry.close()
        if self.store_mount:
            subprocess.run(["umount", str(self.store_mount)], capture_output=True, timeout=60)
        if self.args.results_dir:
            dest = Path(self.args.results_dir) / "warm_start_logs"
            dest.mkdir(parents=True, exist_ok=True)
            for f in [self.base / "migrt.log", self.base / "hook.log", self.base / "registry" / "registry.log",
                      *sorted(self.logs.glob("*.log"))]:
                if f.exists():
                    shutil.copy(f, dest / f.name)
            for f in sorted((self.base / "data").glob("*/ready.json")):
                shutil.copy(f, dest / f"{f.parent.name}.ready.json")
        if self.args.keep:
            log(f"kept {self.base}")
        else:
            shutil.rmtree(self.base, ignore_errors=True)


def stamp(event: dict) -> float | None:
    """A migrt log record's time (ISO 8601, UTC) as epoch seconds."""
    try:
        return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError, AttributeError):
        return None


def slim(resp: dict) -> dict:
    return {k: resp.get(k) for k in ("digest_logits", "digest_hidden", "argmax", "logits_sum", "forward_s", "compiled")}


def same(a: dict, b: dict) -> str:
    if a["digest_logits"] == b["digest_logits"] and a["digest_hidden"] == b["digest_hidden"]:
        return "exact"
    if a["argmax"] == b["argmax"]:
        return f"argmax equal, digests differ (logits sum {a['logits_sum']:.6g} vs {b['logits_sum']:.6g})"
    return "DIFFERENT"


def last_error(path: str) -> str:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return ""
    errors = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("level") == "error":
            errors.append(rec.get("msg", ""))
    return errors[-1] if errors else ""


def gib_f(n) -> float:
    return (n or 0) / 2**30


def gib(n) -> str:
    return f"{gib_f(n):.2f}"


def fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def summarize(r: dict) -> tuple[dict, bool]:
    fresh = [f["first_answer_s"] for f in r["fresh"]]
    rest = [x["first_answer_s"] for x in r["restored"]]
    s: dict = {"fresh_s": round(statistics.median(fresh), 3) if fresh else None,
               "restored_s": round(statistics.median(rest), 3) if rest else None,
               "fresh_runs": len(fresh), "restored_runs": len(rest), "target_speedup": TARGET}
    s["speedup"] = round(s["fresh_s"] / s["restored_s"], 2) if fresh and rest and s["restored_s"] > 0 else None
    s["target_met"] = bool(s["speedup"] and s["speedup"] >= TARGET)
    if r.get("fresh_warm_cache"):
        s["fresh_warm_cache_s"] = r["fresh_warm_cache"]["first_answer_s"]
        if s["restored_s"]:
            s["speedup_vs_warm_cache"] = round(s["fresh_warm_cache_s"] / s["restored_s"], 2)
    ok = bool(fresh and rest)
    if r.get("push") is not None:
        s.update(registry_summary(r, s))
        ok = ok and bool(s.get("registry_runs"))
    if r["fresh"]:
        ref = r["fresh"][0]["answer"]
        checks = {}
        for x in r["restored"] + r.get("registry", []):
            key = f"{'restored' if x in r['restored'] else 'registry'} {x['run']} vs checkpointed server"
            checks[key] = same(x["answer"], ref)
            ok = ok and checks[key] == "exact"
        for f in r["fresh"][1:] + ([r["fresh_warm_cache"]] if r.get("fresh_warm_cache") else []):
            checks[f"fresh {f['run']} vs fresh 1"] = same(f["answer"], ref)
        s["answers"] = checks
    s["ok"] = ok
    return s, ok


def registry_summary(r: dict, s: dict) -> dict:
    """--from-registry: the median first answer restored by reference, against the local-store
    restore (target <= REGISTRY_VS_LOCAL) and the fresh start (target >= REGISTRY_VS_FRESH)."""
    reg = [x["first_answer_s"] for x in r.get("registry") or []]
    out: dict = {"registry_runs": len(reg), "registry_s": round(statistics.median(reg), 3) if reg else None,
                 "registry_paths": sorted({x.get("path") or "?" for x in r.get("registry") or []}),
                 "target_registry_vs_local": REGISTRY_VS_LOCAL, "target_registry_speedup": REGISTRY_VS_FRESH}
    if reg and s.get("restored_s"):
        out["registry_vs_local"] = round(out["registry_s"] / s["restored_s"], 2)
        out["registry_vs_local_met"] = out["registry_vs_local"] <= REGISTRY_VS_LOCAL
    if reg and s.get("fresh_s"):
        out["registry_speedup"] = round(s["fresh_s"] / out["registry_s"], 2)
        out["registry_speedup_met"] = out["registry_speedup"] >= REGISTRY_VS_FRESH
    return out


def print_registry(r: dict) -> None:
    """--from-registry: the push, each restore by reference, and the two targets."""
    p, s = r.get("push"), r.get("summary", {})
    if not p:
        return
    print(f"{'push':<18} {p['wall_s']:>14.2f} {'':>9}  migrt push to {p['ref']} ({p.get('registry')}, TLS + basic "
          f"auth, loopback): {p['bytes_sent'] / 1e9:.2f} GB, {p.get('mbps')} MB/s, {p.get('layers')} layers")
    for x in r.get("registry") or []:
        ph = x["phases"]
        print(f"{'registry ' + str(x['run']):<18} {x['first_answer_s']:>14.2f} {x['steady_latency_s']:>9.4f}  "
              f"{x.get('path')}: image ready {fmt(x.get('image_ready_s'))} | runc restore {fmt(ph['runc_restore_s'])}"
              f" | GPU restore {fmt(ph['gpu_restore_s'])} (create {fmt(ph['create_wall_s'])}) | start+answer "
              f"{fmt(ph['after_create_to_answer_s'], 3)}"
              + (f" | lazy fallback: {x['lazy_fallback']}" if x.get("lazy_fallback") else ""))
    if s.get("registry_s") is None:
        return
    met = {True: "met", False: "MISSED", None: "-"}
    print(f"restored by reference (empty store, median of {s['registry_runs']}): {s['registry_s']:.2f} s: "
          f"{fmt(s.get('registry_vs_local'))}x the local-store restore (target <= {REGISTRY_VS_LOCAL:g}: "
          f"{met[s.get('registry_vs_local_met')]}), {fmt(s.get('registry_speedup'), 1)}x faster than fresh "
          f"(target >= {REGISTRY_VS_FRESH:g}: {met[s.get('registry_speedup_met')]})")


def print_table(r: dict) -> None:
    m, mach = r.get("model", {}), r.get("machine", {})
    print()
    if "params" in m:
        desc = (f"{m['kind']} d={m['d_model']} L={m['layers']} ffn={m['ffn']} vocab={m['vocab']}: "
                f"{m['params'] / 1e9:.2f}e9 params, {m['bytes'] / 1e9:.2f} GB {m['dtype']}; batch {m['batch']} x {m['seq']}")
    else:
        desc = f"{m.get('kind')} {gib(m.get('bytes'))} GiB"
    print(f"warm start ({r['mode']}{', quick' if r['quick'] else ''}): {desc}")
    print(f"machine: {mach.get('gpu', 'no GPU')} driver {mach.get('driver', '-')}, torch {mach.get('torch')}, "
          f"python {mach.get('python')}, {mach.get('runc')}, criu {mach.get('criu')}, kernel {mach.get('kernel')}, "
          f"{mach.get('date')}")
    comp = [f.get("compiled") for f in r["fresh"]]
    if comp:
        err = next((f.get("compile_error") for f in r["fresh"] if f.get("compile_error")), None)
        print(f"torch.compile: {'yes' if all(comp) else 'NO, eager fallback' if not any(comp) else 'mixed'}"
              + (f" (error: {err.splitlines()[0][:300]})" if err else ""))
    print()
    print(f"{'run':<18} {'first answer s':>14} {'steady s':>9}  phases (s)")
    for f in r["fresh"] + ([r["fresh_warm_cache"]] if r.get("fresh_warm_cache") else []):
        p = f["phases"]
        comp_key = "compile" if p.get("compile_s") is not None else "1st fwd"
        comp_val = p.get("compile_s") if p.get("compile_s") is not None else p.get("first_forward_s")
        print(f"{'fresh ' + str(f['run']):<18} {f['first_answer_s']:>14.2f} {f['steady_latency_s']:>9.4f}  "
              f"create {fmt(p['runc_create_s'])} | to python {fmt(p['until_python_s'])} | import {fmt(p['import_torch_s'])}"
              f" | dev init {fmt(p['device_init_s'])} | build {fmt(p['build_s'])} | {comp_key} {fmt(comp_val)}"
              f" | warm-up {fmt(p['warmup_s'])} | ready->answer {fmt(p['ready_to_answer_s'], 3)}")
    c = r.get("checkpoint")
    if c:
        t = c["timings"]
        print(f"{'checkpoint':<18} {c['wall_s']:>14.2f} {'':>9}  gpu ckpt {fmt(t.get('gpu_checkpoint_s'))} | dump "
              f"{fmt(t.get('dump_s'))} | checksum {fmt(t.get('checksum_s'))} | commit {fmt(t.get('commit_s'))} | migrt total {fmt(t.get('total_s'))} | image "
              f"{gib(c['image_bytes'])} GiB"
              + "".join(f" | GPU proc {gib(p.get('memory_bytes'))} GiB" for p in c["gpu_processes"]))
    for x in r["restored"]:
        p = x["phases"]
        print(f"{'restored ' + str(x['run']):<18} {x['first_answer_s']:>14.2f} {x['steady_latency_s']:>9.4f}  "
              f"shim start {fmt(p['shim_start_s'])} | verify {fmt(p['verify_s'])} | runc restore "
              f"{fmt(p['runc_restore_s'])} | GPU restore {fmt(p['gpu_restore_s'])} | other migrt "
              f"{fmt(p['migrt_other_s'])} + {fmt(p['shim_other_s'])} | exit {fmt(p['shim_exit_s'])} (create "
              f"{fmt(p['create_wall_s'])}) | start+answer {fmt(p['after_create_to_answer_s'], 3)}")
    print_registry(r)
    s = r.get("summary", {})
    print()
    if s.get("fresh_s") is not None and s.get("restored_s") is not None:
        print(f"median fresh {s['fresh_s']:.2f} s ({s['fresh_runs']} runs), median restored {s['restored_s']:.2f} s "
              f"({s['restored_runs']} runs): speedup {s['speedup']:.1f}x (target >= {TARGET:g}: "
              f"{'met' if s['target_met'] else 'MISSED'})")
    if s.get("fresh_warm_cache_s") is not None:
        print(f"fresh with warm compile caches: {s['fresh_warm_cache_s']:.2f} s "
              f"(restored is {s.get('speedup_vs_warm_cache', 0):.1f}x faster)")
    for k, v in (s.get("answers") or {}).items():
        print(f"answer {k}: {v}")
    for n in r["notes"]:
        print(f"note: {n}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model (~0.5 GB), 1 run each")
    ap.add_argument("--runs", type=int, default=0, help="fresh and restored runs (default 3, --quick 1)")
    ap.add_argument("--mode", choices=("gpu", "cpu", "fake"), default="gpu")
    ap.add_argument("--dry-run", action="store_true", help="build the node and bundles, print the plan, remove all")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("WARM_START_BUDGET_S", 390)),
                    help="wall time for all runs (default 390; env WARM_START_BUDGET_S)")
    ap.add_argument("--warmup", type=int, default=3, help="forward passes before serving (the first compiles)")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--compile-threads", type=int, default=0, help="TORCHINDUCTOR_COMPILE_THREADS (default: torch's)")
    ap.add_argument("--no-warm-cache", action="store_true", help="skip the fresh run with warm compile caches")
    ap.add_argument("--gpu", type=int, default=0, help="GPU index (gpu mode)")
    ap.add_argument("--store-huge", action="store_true",
                    help="put the checkpoint store on a private tmpfs mounted huge=always")
    ap.add_argument("--from-registry", action="store_true",
                    help="also push the checkpoint to a docker-registry on loopback (TLS, basic auth) and restore it "
                         "by reference into an empty store (issue 30)")
    ap.add_argument("--python", help="Python with torch for the container (default MIGRT_GPU_PYTHON or this one)")
    ap.add_argument("--json-out", help="default $OUT/warm_start.json, else bench/results/warm_start.json")
    ap.add_argument("--results-dir", help="copy migrt's log and the containers' output there")
    ap.add_argument("--keep", action="store_true", help="keep the node directory (stores, bundles, data)")
    args = ap.parse_args(argv)
    if not args.json_out:
        out = os.environ.get("OUT")
        args.json_out = os.path.join(out, "warm_start.json") if out else str(REPO / "bench" / "results" / "warm_start.json")

    def on_signal(signum, _frame):
        raise Interrupted(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    bench = None
    error = None
    result: dict = {}
    try:
        bench = Bench(args)
        result = bench.run()
    except (Exception, Interrupted) as exc:
        error = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {error}")
        if bench is not None:
            result = bench.result
            bench.notes.append(f"failed: {error.splitlines()[0][:500]}")
    finally:
        if bench is not None:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)  # let the cleanup finish
            bench.cleanup()
    if args.dry_run and not error:
        print("dry run: node, bundles and directories removed")
        return 0
    if not result:
        print("warm_start fresh_s=nan restored_s=nan speedup=nan")
        return 1
    summary, ok = summarize(result)
    result["summary"] = summary
    result["error"] = error
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump(result, fh, indent=2)
    print_table(result)
    print(f"results: {args.json_out}")
    if error:
        print(f"error: {error.splitlines()[0][:500]}")
    fs, rs, sp = summary["fresh_s"], summary["restored_s"], summary["speedup"]
    regs = ""
    if result.get("push") is not None:
        regs = (f" registry_s={fmt(summary.get('registry_s'), 2) if summary.get('registry_s') is not None else 'nan'}"
                f" registry_vs_local={fmt(summary.get('registry_vs_local'))}")
    print(f"warm_start fresh_s={fmt(fs, 2) if fs is not None else 'nan'} restored_s={fmt(rs, 2) if rs is not None else 'nan'} "
          f"speedup={fmt(sp, 1) if sp is not None else 'nan'}{regs}")
    return 0 if ok and not error else 1


if __name__ == "__main__":
    sys.exit(main())
