"""What the GPU tests share: the node (GPUs, Python with torch, a private migrt config and store on
/dev/shm), containers started the way containerd starts them (pipes for stdio), the workload's
files, and the figures each test records for tests/gpu/report.py."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.gpu import rig

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = Path(__file__).with_name("workload.py")


def gbs() -> list[float]:
    return [float(x) for x in os.environ.get("MIGRT_GPU_TEST_GBS", "2").split()]


@dataclass
class Node:
    base: Path
    python: str
    needed: list[str]
    torch: str
    env: dict[str, str]
    gpus: list  # migrt.gpu.inventory.Gpu
    driver: str
    results: Path
    runc_root: Path
    bin: Path
    containers: list[str] = field(default_factory=list)

    @property
    def migrt(self) -> str:
        return str(self.bin / "migrt")

    @property
    def shim(self) -> str:
        return str(self.bin / "migrt-runc")

    def record(self, test: str, **figures) -> None:
        self.results.mkdir(parents=True, exist_ok=True)
        with open(self.results / "results.jsonl", "a") as fh:
            fh.write(json.dumps({"test": test, "gpu": self.gpus[0].name, "driver": self.driver,
                                 "torch": self.torch, **figures}) + "\n")

    def cli(self, *args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
        r = subprocess.run([self.migrt, *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"migrt {' '.join(args)} -> {r.returncode}\n{r.stderr}\n{self.tail_logs()}")
        return r

    def tail_logs(self, n: int = 40) -> str:
        out = []
        for f in (self.base / "migrt.log", self.base / "hook.log"):
            if f.exists():
                out.append(f"--- {f} (last {n} lines)\n" + "\n".join(f.read_text().splitlines()[-n:]))
        return "\n".join(out)

    def migrt_events(self, event: str) -> list[dict]:
        path = self.base / "migrt.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == event:
                out.append(rec)
        return out

    def bundle(self, name: str, args: list[str], data: Path, gpu_indices: list[int], env: list[str] | None = None,
               annotations: dict | None = None, mounts: list[dict] | None = None, netns: str | None = None,
               criu_config: str | None = None) -> str:
        gpus = [self.gpus[i] for i in gpu_indices]
        path = self.base / "bundles" / name
        if path.exists():
            shutil.rmtree(path)
        envs = [f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", "HOME=/tmp", "PYTHONUNBUFFERED=1",
                f"NVIDIA_VISIBLE_DEVICES={','.join(g.uuid for g in gpus)}", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
        for key in ("PYTHONPATH", "LD_LIBRARY_PATH"):
            if os.environ.get(key):
                envs.append(f"{key}={os.environ[key]}")
        envs += [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("WORKLOAD_")]  # e.g. dry runs
        return rig.make_bundle(str(path), args=args, data_dir=str(data), needed=self.needed,
                               gpu_minors=[g.minor for g in gpus], env=envs + list(env or []),
                               annotations=annotations, mounts=mounts, netns=netns, criu_config=criu_config)

    def data_dir(self, name: str) -> Path:
        d = self.base / "data" / name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(WORKLOAD, d / "workload.py")
        return d

    def workload_args(self, *args: str) -> list[str]:
        return [self.python, "/data/workload.py", *args]


STACKS = """import faulthandler, os, signal, sys
_d = os.environ.get("MIGRT_TEST_STACKS")  # SIGUSR1: the stacks of all Python threads, into <dir>/<pid>.txt
faulthandler.register(signal.SIGUSR1, file=open(f"{_d}/{os.getpid()}.txt", "w") if _d else sys.stderr,
                      all_threads=True)
"""


def _wrapper(path: Path, code: str) -> None:
    """A launcher running the checkout's code; SIGUSR1 prints the stacks of all its Python threads
    (into $MIGRT_TEST_STACKS/<pid>.txt, else to its stderr): what a test dumps when the command does
    not end in time."""
    path.write_text(f"#!{sys.executable}\n{STACKS}sys.path.insert(0, {str(REPO)!r})\n{code}\n")
    path.chmod(0o755)


def make_node(base: Path) -> Node:
    """The GPU node, checked: a missing prerequisite fails the test run (these tests must not skip)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("root")
    for tool in ("runc", "criu"):
        if not shutil.which(tool):
            problems.append(tool)
    from migrt.gpu import inventory, select

    inv = inventory.take()
    if not inv.gpus:
        problems.append(f"NVIDIA GPUs ({inv.error})")
    backend = select.get_backend("auto")
    if not backend.available():
        problems.append(f"the CUDA checkpoint API ({select.unavailable_reason(backend)})")
    python = os.environ.get("MIGRT_GPU_PYTHON") or sys.executable
    info = rig.probe(python) if not problems else {"torch": None, "paths": []}
    if not info.get("torch") and not problems:
        problems.append(f"torch importable by {python} (set MIGRT_GPU_PYTHON)")
    if problems:
        raise RuntimeError("GPU test prerequisites missing: " + ", ".join(problems))
    base.mkdir(parents=True, exist_ok=True)
    installed = os.environ.get("MIGRT_GPU_PREFIX")
    if installed:  # an installed migrt (packaging/install-host.sh): its own launchers, Python and CRIU
        binp = Path(installed) / "bin"
        if not (os.access(binp / "migrt", os.X_OK) and os.access(binp / "migrt-runc", os.X_OK)):
            raise RuntimeError(f"MIGRT_GPU_PREFIX={installed}: no bin/migrt and bin/migrt-runc there")
    else:
        binp = base / "bin"
        binp.mkdir(exist_ok=True)
        _wrapper(binp / "migrt", "from migrt.cli.main import main\nmain()")
        _wrapper(binp / "migrt-runc", "from migrt.shim.__main__ import main\nsys.exit(main())")
    config = base / "config.yaml"
    config.write_text(f"runtime: {shutil.which('runc')}\nstore: {base / 'store'}\nrestore_failure_policy: fail\n"
                      f"log_file: {base / 'migrt.log'}\nlog_level: debug\n")
    env = dict(os.environ)
    env["MIGRT_CONFIG"] = str(config)
    env["MIGRT_HOOK_LOG"] = str(base / "hook.log")
    if installed:  # nothing of the checkout or the kit's site-packages reaches the installed migrt
        env.pop("PYTHONPATH", None)
        env.pop("MIGRT_CRIU", None)
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("MIGRT_GPU_HANDLED", None)
    os.environ["MIGRT_CONFIG"] = str(config)
    results = Path(os.environ.get("MIGRT_GPU_RESULTS") or base / "results")
    root = base / "runc-root"
    root.mkdir(exist_ok=True)
    return Node(base=base, python=python, needed=info["paths"], torch=info["torch"], env=env, gpus=inv.gpus,
                driver=inv.driver_version or "?", results=results, runc_root=root, bin=binp)


def base_dir() -> Path:
    parent = os.environ.get("MIGRT_GPU_TEST_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    return Path(parent) / f"migrt-gpu-{uuid.uuid4().hex[:8]}"


class Container:
    """A container started with fresh pipes as stdio (as containerd's shim does), by `argv`."""

    def __init__(self, node: Node, cid: str, argv: list[str], cwd: str, env: dict | None = None,
                 timeout: float = 600, on_timeout=None) -> None:
        """on_timeout(popen) runs when argv has not ended within timeout, before it is killed
        (subprocess.TimeoutExpired is raised then)."""
        self.node, self.cid = node, cid
        r_in, self.w_in = os.pipe()
        self.r_out, w_out = os.pipe()
        node.containers.append(cid)
        t0 = time.monotonic()
        try:
            p = subprocess.Popen(argv, cwd=cwd, stdin=r_in, stdout=w_out, stderr=w_out, env=env or node.env)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                if on_timeout is not None:
                    on_timeout(p)
                p.kill()
                p.wait()
                raise
        finally:
            os.close(r_in)
            os.close(w_out)
        self.seconds = time.monotonic() - t0
        self.proc = subprocess.CompletedProcess(argv, p.returncode)
        self.rc = p.returncode

    @classmethod
    def run(cls, node: Node, cid: str, bundle: str) -> "Container":
        c = cls(node, cid, ["runc", "--root", str(node.runc_root), "create", "--bundle", bundle, cid], bundle)
        assert c.rc == 0, f"runc create {cid}: {c.output()}"
        subprocess.run(["runc", "--root", str(node.runc_root), "start", cid], check=True, env=node.env)
        return c

    def output(self, seconds: float = 0.2) -> str:
        buf = b""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.r_out], [], [], 0.05)
            if ready:
                chunk = os.read(self.r_out, 65536)
                if not chunk:
                    break
                buf += chunk
        return buf.decode(errors="replace")

    def state(self) -> dict:
        r = subprocess.run(["runc", "--root", str(self.node.runc_root), "state", self.cid], capture_output=True,
                           text=True)
        return json.loads(r.stdout) if r.returncode == 0 else {}

    def remove(self) -> None:
        subprocess.run(["runc", "--root", str(self.node.runc_root), "delete", "--force", self.cid],
                       capture_output=True)
        for fd in (self.w_in, self.r_out):
            try:
                os.close(fd)
            except OSError:
                pass


class Workload:
    """The files one workload process keeps in its data directory."""

    def __init__(self, data: Path, name: str) -> None:
        self.data, self.name = data, name
        self.k = 0

    def _read(self, suffix: str) -> dict | None:
        try:
            return json.loads((self.data / f"{self.name}.{suffix}").read_text())
        except (OSError, ValueError):
            return None

    def ready(self, timeout: float = 300) -> dict:
        return wait_for(lambda: self._read("ready.json"), timeout, f"{self.name} ready")

    def status(self) -> dict:
        return wait_for(lambda: self._read("status.json"), 30, f"{self.name} status")

    def counting_past(self, count: int, timeout: float = 120) -> dict:
        return wait_for(lambda: (s := self._read("status.json")) and s["count"] > count and s, timeout,
                        f"{self.name} counting past {count}")

    def verify(self, timeout: float = 300) -> dict:
        self.k += 1
        (self.data / f"{self.name}.verify-{self.k}").write_text("")
        return wait_for(lambda: self._read(f"result-{self.k}.json"), timeout, f"{self.name} checksum #{self.k}")


def wait_for(fn, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def gpu_of_pid(pid: int) -> list[str]:
    """UUIDs of the GPUs on which NVML sees memory of pid (host pid)."""
    from migrt.gpu import inventory

    return [u for u, _ in inventory.take().processes.get(pid, [])]
