#!/usr/bin/env python3
"""GPU checkpoint/restore round trip, migrt against the raw steps, phase by phase.

    python bench/gpu_roundtrip.py [--sizes 8,16,32] [--thp madvise,always] [--runs 3]
                                  [--rows gpu,cpu] [--budget-s 520] [--json-out PATH]
                                  [--restore-pages lazy] [--dump criu,parallel] [--gpu-thp keep|always]
    python bench/gpu_roundtrip.py --report RESULT.json...    (one table from several runs)

On the GPU machine, as root (bench/run_gpu_roundtrip_on_device.sh sets it up). For each THP
setting (written to /sys/kernel/mm/transparent_hugepage/enabled for the run and ALWAYS put back,
also on SIGTERM) and each size N (GiB):

GPU rows: the PyTorch workload of the GPU tests (tests/gpu/workload.py: N GiB of int32 tensors
on cuda:0, a counter advanced on the GPU every step, an exact checksum on request) runs twice:
- raw: a bare host process (its own session, stdio to a file). Checkpoint = the driver API by
  ctypes (migrt/gpu/cuda.py: cuCheckpointProcessLock + cuCheckpointProcessCheckpoint), then
  `criu dump -t PID` into a directory on /dev/shm. Restore = `criu restore -d` from it, then
  cuCheckpointProcessRestore + cuCheckpointProcessUnlock. No hashing, no manifest, no runc.
- migrt: a runc container (tests/gpu/rig.py: the host's Python and torch bind-mounted, the GPU's
  device nodes). Checkpoint = `migrt checkpoint` (GPU suspend, runc checkpoint, hash + commit into
  a store on /dev/shm). Restore = `migrt-runc create` of a new bundle with MIGRT_RESTORE (what
  containerd does for a restoring pod: verify, runc restore, GPU restore), then `start`. The
  dump is the config's default (`dump_pages: auto`: migrt's parallel dump from 256 MiB on);
  --dump MODE[,MODE] adds paths migrt/dump=MODE whose checkpoints run with MIGRT_DUMP_PAGES=MODE
  (criu: CRIU writes the memory, one thread; parallel: docs/dump-pages.md), on the same container.
--gpu-thp always puts `gpu_checkpoint_thp: always` in the node's migrt config: migrt then switches THP
to `always` only while the driver writes its checkpoint (docs/gpu.md, Faster driver checkpoints), so
`--thp madvise --gpu-thp always` measures that window against the node's madvise (the raw path's
checkpoint is the bare driver call and runs at --thp). Each migrt run records what its window did
(`thp_window`: always, kept or failed, from the manifest's gpu.thp).
CPU rows: the same two paths for bench/cpuhog.py (N GiB of private anonymous memory, no GPU), so
that CRIU's part is visible alone.

Each path does `--runs` round trips on the same workload (each restore is checkpointed again);
every restore must give back the checksum taken before the first checkpoint and a process that
counts on (GPU counter == CPU counter), else the run fails. Phases are wall times measured here
(raw) or migrt's own timings (manifest `timings`, the `restored` log event). Raw and migrt runs
alternate so that both see the same machine state. Figures are medians over the runs (the count
is printed); ratio = migrt / raw of the same run.

Prints the table; writes JSON (--json-out); the last line:

    gpu_roundtrip gb=<N> migrt_s=<round trip> baseline_s=<round trip> restore_s=<migrt restore only>
                  path=<fastest migrt path> gpu_thp=<keep|always>

for the largest size run at THP madvise (else the first THP setting run). A time budget
(--budget-s) ends a size's runs early rather than overrun the device's 10-minute call limit: the
figures then say how many runs they are made of.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import config_lines, log, machine, meminfo  # noqa: E402

THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
CPUHOG = REPO / "bench" / "cpuhog.py"
GIB = 1 << 30
PR_SET_CHILD_SUBREAPER = 36


class Interrupted(Exception):
    pass


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# -- THP: set for the run, always put back ------------------------------------------------------------
def thp_current() -> str:
    text = Path(THP_PATH).read_text()
    return text[text.index("[") + 1:text.index("]")]


class Thp:
    """Sets THP 'enabled' for the with-block; puts the value found back on the way out (also when
    the run is interrupted: the signal handlers raise, so this __exit__ runs)."""

    def __init__(self, want: str) -> None:
        self.want, self.before = want, None

    def __enter__(self) -> "Thp":
        self.before = thp_current()
        if self.want != self.before:
            Path(THP_PATH).write_text(self.want)
            log(f"THP: {self.before} -> {self.want} for this run")
        return self

    def __exit__(self, *exc) -> None:
        if self.before and thp_current() != self.before:
            Path(THP_PATH).write_text(self.before)
            log(f"THP: put back to {self.before}")


# -- the raw steps ----------------------------------------------------------------------------------
def run_timed(argv: list[str], what: str) -> float:
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{what}: {' '.join(argv)} -> {r.returncode}\n{r.stdout}{r.stderr}")
    return seconds


def criu_log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no {path})"


class RawProc:
    """A bare host process (own session, stdio to a file), checkpointed with the driver API and the
    criu CLI. After the first restore it is no longer our child: our subreaper flag collects it."""

    def __init__(self, argv: list[str], data: Path, env: dict, gpu: bool, images: Path) -> None:
        self.data, self.gpu, self.images = data, gpu, images
        self.out = open(data / "raw.out", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(argv, cwd=str(data), env=env, stdin=subprocess.DEVNULL, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.backend = None
        if gpu:
            from migrt.gpu.cuda import CudaDriverBackend

            self.backend = CudaDriverBackend()

    def round_trip(self, k: int, images: Path | None = None) -> dict:
        img = (images or self.images) / f"raw-{k}"
        shutil.rmtree(img, ignore_errors=True)
        img.mkdir(parents=True)
        t: dict[str, float] = {}
        t_all = time.monotonic()
        if self.gpu:
            t0 = time.monotonic()
            self.backend.lock(self.pid, 30_000)
            self.backend.checkpoint(self.pid)
            t["gpu_checkpoint_s"] = time.monotonic() - t0
        try:
            t["dump_s"] = run_timed(["criu", "dump", "-t", str(self.pid), "-D", str(img), "-o", "dump.log", "-v2"],
                                    "criu dump")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{criu_log_tail(img / 'dump.log')}") from None
        t["checkpoint_s"] = time.monotonic() - t_all
        t["image_bytes"] = sum(f.stat().st_size for f in img.iterdir() if f.is_file())
        reap()
        t_r = time.monotonic()
        try:
            t["criu_restore_s"] = run_timed(["criu", "restore", "-D", str(img), "-d", "-o", "restore.log", "-v2"],
                                            "criu restore")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{criu_log_tail(img / 'restore.log')}") from None
        if self.gpu:
            t0 = time.monotonic()
            self.backend.restore(self.pid)
            self.backend.unlock(self.pid)
            t["gpu_restore_s"] = time.monotonic() - t0
        t["restore_s"] = time.monotonic() - t_r
        t["round_trip_s"] = t["checkpoint_s"] + t["restore_s"]
        shutil.rmtree(img, ignore_errors=True)
        return t

    def remove(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        self.out.close()


def reap() -> None:
    """Collect exited children (the raw process, once criu restore reparented it to us)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# -- migrt ----------------------------------------------------------------------------------------
class MigrtBox:
    """A runc container checkpointed by `migrt checkpoint` and restored by `migrt-runc create`."""

    def __init__(self, node, tag: str, argv: list[str], data: Path, gpu: bool) -> None:
        from tests.gpu.harness import Container

        self.node, self.tag, self.data, self.gpu, self.argv = node, tag, data, gpu, argv
        bundle = self.bundle(f"{tag}-0", [])
        self.box = Container.run(node, f"{tag}-0", bundle)

    def bundle(self, cid: str, env: list[str]) -> str:
        from tests.gpu import rig

        if self.gpu:
            return self.node.bundle(cid, self.argv, self.data, [0], env=env)
        envs = [f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", "HOME=/tmp", "PYTHONUNBUFFERED=1",
                "CUDA_VISIBLE_DEVICES=", *env]
        return rig.make_bundle(str(self.node.base / "bundles" / cid), args=self.argv, data_dir=str(self.data),
                               needed=self.node.needed, gpu_minors=None, env=envs)

    def round_trip(self, k: int, pages: str | None = None, dump: str | None = None) -> dict:
        """One checkpoint + restore; `pages` sets MIGRT_RESTORE_PAGES for the restore (the page filler),
        `dump` MIGRT_DUMP_PAGES for the checkpoint."""
        from tests.gpu.harness import Container

        node, name = self.node, f"{self.tag}-ck{k}{pages or ''}{dump or ''}"
        t0 = time.monotonic()
        argv = [node.migrt, "checkpoint", self.box.cid, "--root", str(node.runc_root), "--name", name, "--json"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                           env={**node.env, "MIGRT_DUMP_PAGES": dump} if dump else node.env)
        if r.returncode != 0:
            raise RuntimeError(f"migrt checkpoint {name} -> {r.returncode}\n{r.stderr[-3000:]}\n{node.tail_logs()}")
        ck_wall = time.monotonic() - t0
        assert json.loads(r.stdout)["name"] == name
        manifest = json.loads(node.cli("inspect", name, "--json").stdout)["manifest"]
        self.box.remove()
        cid = f"{self.tag}-{k + 1}{pages or ''}{dump or ''}"
        bundle = self.bundle(cid, [f"MIGRT_RESTORE={name}"])
        logf = os.path.join(bundle, "log.json")
        t0 = time.monotonic()
        c = Container(node, cid, [node.shim, "--root", str(node.runc_root), "--log", logf, "--log-format", "json",
                                  "create", "--bundle", bundle, "--pid-file", os.path.join(bundle, "init.pid"), cid],
                      bundle, env={**node.env, "MIGRT_RESTORE_PAGES": pages} if pages else None)
        create_wall = time.monotonic() - t0
        if c.rc != 0:
            err = Path(logf).read_text() if os.path.exists(logf) else ""
            raise RuntimeError(f"migrt-runc create {cid} -> {c.rc}\n{err[-3000:]}\n{node.tail_logs()}")
        subprocess.run([node.shim, "--root", str(node.runc_root), "start", cid], check=True, env=node.env)
        rs_wall = time.monotonic() - t0
        self.box = c
        restored = node.migrt_events("restored")[-1]
        node.cli("rm", name, check=False)
        ct, rt = manifest.get("timings", {}), restored.get("timings", {})
        out = {"gpu_checkpoint_s": ct.get("gpu_checkpoint_s"), "dump_s": ct.get("dump_s"),
               "lazy_dump_s": ct.get("lazy_dump_s"), "pages_s": ct.get("pages_s"),
               "dump_pages": manifest.get("dump_pages"), "commit_s": ct.get("commit_s"), "checkpoint_s": ck_wall, "image_bytes": manifest.get("size_bytes"),
               "verify_s": rt.get("verify_s"), "criu_restore_s": rt.get("restore_s"),
               "gpu_restore_s": rt.get("gpu_restore_s"), "create_s": create_wall, "restore_s": rs_wall,
               "round_trip_s": ck_wall + rs_wall, "thp_window": (manifest.get("gpu") or {}).get("thp")}
        for key, value in rt.items():  # whatever else migrt records (e.g. the shim's start)
            out.setdefault(f"m_{key}", value)
        for key, value in ct.items():  # and the checkpoint's own (e.g. stop_s, total_s)
            out.setdefault(f"c_{key}", value)
        out["restore_gate"] = restored.get("restore_gate")
        out["pages"] = restored.get("pages")
        return out

    def remove(self) -> None:
        self.box.remove()


# -- one size -------------------------------------------------------------------------------------------
def median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def wait_memory(need: int, what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while meminfo("MemAvailable") < need and time.monotonic() < end:
        time.sleep(1)
    if meminfo("MemAvailable") < need:
        raise RuntimeError(f"{what}: {meminfo('MemAvailable') >> 30} GiB available, {need >> 30} GiB needed")


def one_size(node, args, gb: float, thp: str, kind: str, budget: Budget) -> dict:
    """raw and migrt round trips of one workload kind (gpu|cpu) at one size."""
    from tests.gpu.harness import Workload

    gpu = kind == "gpu"
    tag = f"{kind}{gb:g}{thp[0]}".replace(".", "p")
    base = node.base / tag
    images = Path(args.raw_images) / f"migrt-rt-{os.getpid()}-{tag}"
    modes = [m for m in (args.restore_pages or "").split(",") if m]
    dumps = [m for m in (args.dump or "").split(",") if m]
    paths = ["raw", *(["raw@hugetmpfs"] if args.raw_huge_images else []), "migrt", *(f"migrt+{m}" for m in modes),
             *(f"migrt/dump={m}" for m in dumps)]
    res = {"gb": gb, "thp": thp, "gpu_thp": args.gpu_thp, "kind": kind, "paths": paths, "errors": [],
           **{p: [] for p in paths}}
    boxes = []
    t_start = time.monotonic()
    try:
        wait_memory(int(gb * GIB) + 4 * GIB, f"{tag}: start")
        script = harness_workload(node) if gpu else CPUHOG
        dirs = {}
        for path in ("raw", "migrt"):
            d = base / path
            d.mkdir(parents=True, exist_ok=True)
            shutil.copy(script, d / script.name)
            dirs[path] = d
        env = {**node.env, "WORKLOAD_DATA": str(dirs["raw"]), "PYTHONUNBUFFERED": "1"}
        if not gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        raw = RawProc([node.python, str(dirs["raw"] / script.name), "w", str(gb)], dirs["raw"], env, gpu, images)
        boxes.append(raw)
        # GPU: both hold their data on the GPU (N + N GiB fit on one H100 up to 32 GiB), the host only
        # during a checkpoint, so both start at once. CPU: the second starts once the first is ready.
        if not gpu:
            Workload(dirs["raw"], "w").ready(timeout=600)
        box = MigrtBox(node, f"m{tag}", node.workload_args("w", str(gb)) if gpu else
                       [node.python, f"/data/{script.name}", "w", str(gb)], dirs["migrt"], gpu)
        boxes.append(box)
        ws = {"raw": Workload(dirs["raw"], "w"), "migrt": Workload(dirs["migrt"], "w")}
        ready = {p: w.ready(timeout=600) for p, w in ws.items()}
        for w in ws.values():
            w.counting_past(3)
        res["start_s"] = round(time.monotonic() - t_start, 1)
        log(f"{tag}: both ready after {res['start_s']} s ({ready['raw'].get('device')})")
        last = None
        for k in range(args.runs):
            est = (last or 0) * 1.15 + 5
            if k > 0 and budget.left() < est:
                res["errors"].append(f"stopped after {k} run(s): {budget.left():.0f} s of budget left, "
                                     f"a run takes ~{est:.0f} s")
                break
            t_run = time.monotonic()
            for path in paths:
                wl = "raw" if path.startswith("raw") else "migrt"  # paths of one kind take turns on one process
                wait_memory(int(gb * GIB) * 2 + 4 * GIB, f"{tag} {path} run {k + 1}")
                count = ws[wl].status()["count"]
                if path == "raw":
                    figs = raw.round_trip(k)
                elif path == "raw@hugetmpfs":
                    figs = raw.round_trip(k, Path(args.raw_huge_images))
                elif path.startswith("migrt/dump="):
                    figs = box.round_trip(k, dump=path.partition("=")[2])
                else:
                    figs = box.round_trip(k, path.partition("+")[2] or None)
                after = ws[wl].counting_past(count, timeout=120)
                check = ws[wl].verify(timeout=300)
                if check["checksum"] != ready[wl]["checksum"] or after["gpu_count"] != after["count"]:
                    raise RuntimeError(f"{tag} {path} run {k + 1}: data changed: {check} vs {ready[wl]}")
                res[path].append(figs)
                log(f"{tag} {path} run {k + 1}: checkpoint {figs['checkpoint_s']:.2f} s, restore "
                    f"{figs['restore_s']:.2f} s, round trip {figs['round_trip_s']:.2f} s; checksum equal")
            last = time.monotonic() - t_run
    except (Exception, Interrupted) as exc:  # noqa: BLE001 - reported in the results and the exit code
        res["errors"].append(f"{type(exc).__name__}: {exc}")
        log(f"{tag}: FAILED: {exc}")
        if isinstance(exc, Interrupted):
            raise
    finally:
        for b in boxes:
            b.remove()
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        res["seconds"] = round(time.monotonic() - t_start, 1)
    return res


def harness_workload(node) -> Path:
    from tests.gpu.harness import WORKLOAD

    return WORKLOAD


# -- table ------------------------------------------------------------------------------------------
COLS = [("gpu_checkpoint_s", "GPU ckpt"), ("dump_s", "dump"), ("lazy_dump_s", "lazy dump"), ("pages_s", "pages write"),
        ("commit_s", "commit"), ("checkpoint_s", "ckpt wall"),
        ("verify_s", "verify"), ("m_criu_call_after_start_s", "start to CRIU"),
        ("m_verify_background_s", "bg verify"), ("criu_restore_s", "CRIU/runc restore"), ("gpu_restore_s", "GPU restore"),
        ("restore_s", "restore wall"), ("round_trip_s", "round trip")]


def fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(results: list[dict]) -> list[str]:
    lines = ["| GiB | THP | kind | path | runs | " + " | ".join(c[1] for c in COLS) + " | GB/s restore | ratio rt |",
             "|---|---|---|---|---|" + "---|" * len(COLS) + "---|---|"]
    for r in results:
        base = median(r["raw"], "round_trip_s")
        for path in r.get("paths", ("raw", "migrt")):
            rows = r[path]
            if not rows:
                continue
            meds = {k: median(rows, k) for k, _ in COLS}
            gbps = (median(rows, "image_bytes") or 0) / 1e9 / meds["restore_s"] if meds["restore_s"] else None
            ratio = f"{meds['round_trip_s'] / base:.2f}" if base else "-"
            thp = r["thp"] + (" (ckpt always)" if r.get("gpu_thp") == "always" and path.startswith("migrt") else "")
            lines.append(f"| {r['gb']:g} | {thp} | {r['kind']} | {path} | {len(rows)} | "
                         + " | ".join(fmt(meds[k]) for k, _ in COLS) + f" | {fmt(gbps)} | {ratio} |")
    return lines


def summary_line(results: list[dict]) -> str:
    """The largest GPU size at THP madvise (else the first setting run); migrt's fastest path there."""
    gpu = [r for r in results if r["kind"] == "gpu" and r["raw"] and r["migrt"]]
    pick = [r for r in gpu if r["thp"] == "madvise"] or gpu
    if not pick:
        return "gpu_roundtrip gb=nan migrt_s=nan baseline_s=nan restore_s=nan"
    r = max(pick, key=lambda x: x["gb"])
    best = min((p for p in r.get("paths", ("migrt",)) if not p.startswith("raw") and r[p]),
               key=lambda p: median(r[p], "round_trip_s"))
    return (f"gpu_roundtrip gb={r['gb']:g} migrt_s={median(r[best], 'round_trip_s'):.2f} "
            f"baseline_s={median(r['raw'], 'round_trip_s'):.2f} restore_s={median(r[best], 'restore_s'):.2f} "
            f"path={best} gpu_thp={r.get('gpu_thp', 'keep')}")


def report(paths: list[str]) -> int:
    results, machines = [], []
    for p in paths:
        data = json.loads(Path(p).read_text())
        results += data["results"]
        machines.append(data.get("machine"))
    results.sort(key=lambda r: (r["kind"] != "gpu", r["thp"] != "madvise", r["gb"]))
    for m in machines[:1]:
        print(f"machine: {json.dumps(m)}")
    print("\n".join(table(results)))
    for r in results:
        for e in r["errors"]:
            print(f"note {r['kind']} {r['gb']:g} GiB THP {r['thp']}: {e}")
    print(summary_line(results))
    return 0


def sizes_for(args, kind: str) -> list[float]:
    sizes = [float(s) for s in args.sizes.split(",")]
    if kind == "cpu":
        # a CPU process holds its N GiB on the host next to the raw one's and an image: 3N at once
        return [float(s) for s in args.cpu_sizes.split(",")] if args.cpu_sizes else [g for g in sizes if g <= 16]
    return sizes


def make_node(rows: list[str]):
    """The GPU tests' node; for CPU rows alone (a machine without a GPU, to try the bench) a node
    with no GPU made the same way."""
    from tests.gpu import harness, rig

    if "gpu" in rows:
        return harness.make_node(harness.base_dir())
    base = harness.base_dir()
    base.mkdir(parents=True)
    binp = base / "bin"
    binp.mkdir()
    harness._wrapper(binp / "migrt", "from migrt.cli.main import main\nmain()")
    harness._wrapper(binp / "migrt-runc", "from migrt.shim.__main__ import main\nsys.exit(main())")
    config = base / "config.yaml"
    config.write_text(f"runtime: {shutil.which('runc')}\nstore: {base / 'store'}\nrestore_failure_policy: fail\n"
                      f"log_file: {base / 'migrt.log'}\nlog_level: debug\n")
    env = {**os.environ, "MIGRT_CONFIG": str(config),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    os.environ["MIGRT_CONFIG"] = str(config)
    python = os.environ.get("MIGRT_GPU_PYTHON") or sys.executable
    root = base / "runc-root"
    root.mkdir()
    return harness.Node(base=base, python=python, needed=rig.probe(python)["paths"], torch="-", env=env, gpus=[],
                        driver="-", results=base / "results", runc_root=root, bin=binp)


# -- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16,32", help="GiB, comma-separated (default 8,16,32)")
    ap.add_argument("--thp", default="madvise,always", help="THP settings to run under (default madvise,always)")
    ap.add_argument("--rows", default="gpu,cpu", help="gpu, cpu or both (default gpu,cpu)")
    ap.add_argument("--cpu-sizes", help="GiB for the CPU rows (default: the sizes up to 16)")
    ap.add_argument("--runs", type=int, default=3, help="round trips per path and size (default 3)")
    ap.add_argument("--budget-s", type=float, default=520, help="stop starting runs after this (default 520)")
    ap.add_argument("--restore-pages", help="also restore with MIGRT_RESTORE_PAGES=MODE[,MODE] (the page filler), "
                    "as paths migrt+MODE on the same container")
    ap.add_argument("--dump", help="also checkpoint with MIGRT_DUMP_PAGES=MODE[,MODE] (criu, parallel), as paths "
                    "migrt/dump=MODE on the same container")
    ap.add_argument("--raw-huge-images", help="also run the raw steps with the image in DIR (a huge=always tmpfs "
                    "the runner mounts privately), as path raw@hugetmpfs")
    ap.add_argument("--raw-images", default="/dev/shm", help="where the raw path's images go (default /dev/shm)")
    ap.add_argument("--config", action="append", metavar="KEY=VALUE",
                    help="one more line of the node's migrt config (e.g. fill_threads=16); repeatable")
    ap.add_argument("--gpu-thp", choices=("keep", "always"), default="keep",
                    help="gpu_checkpoint_thp in the node's migrt config: always = THP always only while the driver "
                    "writes its checkpoint (default keep)")
    ap.add_argument("--json-out", help="write the results here")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print one table from result files and exit")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report)

    def on_signal(signum, _frame):
        raise Interrupted(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the raw process comes back to us after criu restore
    budget = Budget(args.budget_s)
    extra = ([f"gpu_checkpoint_thp: {args.gpu_thp}"] if args.gpu_thp != "keep" else []) + config_lines(args.config, ap.error)
    node = make_node(args.rows.split(","))
    if extra:
        with open(node.env["MIGRT_CONFIG"], "a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in extra))
    info = {"machine": machine(), "gpu": node.gpus[0].name if node.gpus else "no GPU", "driver": node.driver, "torch": node.torch,
            "thp_before": thp_current(), "gpu_thp": args.gpu_thp, "args": vars(args)}
    log(f"gpu_roundtrip: {info['gpu']}, driver {node.driver}, torch {node.torch}, THP {info['thp_before']}, "
        f"gpu_checkpoint_thp {args.gpu_thp}")
    results: list[dict] = []
    rc = 0
    try:
        for thp in args.thp.split(","):
            with Thp(thp):
                for kind in args.rows.split(","):
                    for gb in sizes_for(args, kind):
                        npaths = 2 + bool(args.raw_huge_images) + len([m for m in (args.restore_pages or "").split(",") if m]) \
                            + len([m for m in (args.dump or "").split(",") if m])
                        # start + one run of each path, roughly (H100: ~3 s/GiB per GPU path, ~2 per CPU path)
                        need = gb * (3 if kind == "gpu" else 2) * npaths + 20
                        if budget.left() < need:
                            results.append({"gb": gb, "thp": thp, "kind": kind, "raw": [], "migrt": [], "paths": [],
                                            "errors": [f"skipped: {budget.left():.0f} s of the time budget left, "
                                                       f"~{need:.0f} s needed"]})
                            continue
                        r = one_size(node, args, gb, thp, kind, budget)
                        results.append(r)
                        rc |= 1 if r["errors"] and not r["migrt"] else 0
    except Interrupted as exc:
        log(f"gpu_roundtrip: interrupted ({exc}); cleaned up")
        rc = 124
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        for cid in node.containers:
            subprocess.run(["runc", "--root", str(node.runc_root), "delete", "--force", cid], capture_output=True)
        if os.environ.get("MIGRT_GPU_RESULTS"):
            for name in ("migrt.log", "hook.log"):
                if (node.base / name).exists():
                    shutil.copy(node.base / name, Path(os.environ["MIGRT_GPU_RESULTS"]) / name)
        shutil.rmtree(node.base, ignore_errors=True)
    info["thp_after"] = thp_current()
    info["results"] = results
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(info, indent=1))
    print(f"{info['gpu']}, driver {node.driver}, torch {node.torch}; THP before {info['thp_before']}, "
          f"after {info['thp_after']}; gpu_checkpoint_thp {args.gpu_thp}; medians of the runs given")
    print("\n".join(table(results)))
    for r in results:
        for e in r["errors"]:
            print(f"note {r['kind']} {r['gb']:g} GiB THP {r['thp']}: {e}")
    if any(r["errors"] and not r["raw"] for r in results):
        rc = rc or 1
    print(summary_line(results))
    return rc


if __name__ == "__main__":
    sys.exit(main())
