"""harness.Node's stand-in on a machine without a GPU, for running the GPU benchmarks' orchestration
end to end before GPU machine time is spent (bench/gpu_migration.py --simulate): two simulated GPU
nodes (migrt/gpu/fakenode.py: node A's driver file names GPU 0, node B's GPU 1, and each node's
migrt processes see their own through `node_env`), the host's Python running tests/gpu/simworkload.py
(workload.py's files, its "GPU memory" in host memory, the driver's host copy made on the simulated
checkpoint) in rig bundles (tests/gpu/rig.py, no device nodes). runc, CRIU and migrt are real."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from migrt.gpu import fakenode
from tests.gpu import harness, rig

SIMWORKLOAD = Path(__file__).with_name("simworkload.py")
PYTHON = "/usr/bin/python3"
GIB = 1 << 30


@dataclass
class SimGpu:
    index: int
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3 (simulated)"
    minor: int | None = None


@dataclass
class SimNode:
    base: Path
    python: str
    needed: list[str]
    env: dict[str, str]
    gpus: list[SimGpu]
    bin: Path
    marker: str
    files: dict[str, str]
    driver: str = "580.159 (simulated)"
    torch: str | None = None
    containers: list[str] = field(default_factory=list)

    @property
    def migrt(self) -> str:
        return str(self.bin / "migrt")

    @property
    def shim(self) -> str:
        return str(self.bin / "migrt-runc")

    def record(self, test: str, **figures) -> None:
        with open(self.base / "results.jsonl", "a") as fh:
            fh.write(json.dumps({"test": test, "gpu": self.gpus[0].name, "driver": self.driver, **figures}) + "\n")

    def tail_logs(self, n: int = 40) -> str:
        logs = sorted(self.base.glob("**/migrt.log"))
        return "\n".join(f"--- {f}\n" + "\n".join(f.read_text().splitlines()[-n:]) for f in logs)

    def node_env(self, name: str) -> dict[str, str]:
        """Node `name`'s migrt processes see that node's simulated driver."""
        return {fakenode.ENV: self.files[name]}

    def bundle(self, name: str, args: list[str], data: Path, gpu_indices: list[int], env: list[str] | None = None,
               annotations: dict | None = None, mounts: list[dict] | None = None, netns: str | None = None,
               criu_config: str | None = None) -> str:
        path = self.base / "bundles" / name
        if path.exists():
            shutil.rmtree(path)
        envs = ["PATH=/usr/bin:/bin", "HOME=/tmp", "PYTHONUNBUFFERED=1",
                f"NVIDIA_VISIBLE_DEVICES={','.join(self.gpus[i].uuid for i in gpu_indices)}"]
        envs += [self.marker] if gpu_indices else []  # a container given no GPU runs no CUDA process
        return rig.make_bundle(str(path), args=args, data_dir=str(data), needed=self.needed, gpu_minors=None,
                               env=envs + list(env or []), annotations=annotations, mounts=mounts, netns=netns,
                               criu_config=criu_config)

    def data_dir(self, name: str) -> Path:
        d = self.base / "data" / name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(SIMWORKLOAD, d / "workload.py")
        return d

    def workload_args(self, *args: str) -> list[str]:
        return [self.python, "/data/workload.py", *args]


def make(base: Path) -> SimNode:
    base.mkdir(parents=True, exist_ok=True)
    binp = base / "bin"
    binp.mkdir(exist_ok=True)
    harness._wrapper(binp / "migrt", "from migrt.cli.main import main\nmain()")
    harness._wrapper(binp / "migrt-runc", "from migrt.shim.__main__ import main\nsys.exit(main())")
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"
    gpus = [SimGpu(0, "GPU-aaaaaaaa-0000-0000-0000-00000000000a"), SimGpu(1, "GPU-bbbbbbbb-0000-0000-0000-00000000000b")]
    files = {}
    for name, gpu, state in (("a", gpus[0], "running"), ("b", gpus[1], "checkpointed")):
        files[name] = str(base / f"gpu-{name}.json")
        with open(files[name], "w") as fh:
            json.dump({"driver_version": "580.159", "marker": marker, "new_state": state, "process_bytes": GIB,
                       "ns_init_only": True, "checkpoint_signal": 10, "checkpoint_ack": "/tmp/gpu-copy",
                       "gpus": [{"uuid": gpu.uuid, "name": gpu.name, "memory_total": 80 * GIB, "minor": 0}]}, fh)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.REPO), env.get("PYTHONPATH")) if p)
    env.pop("MIGRT_GPU_HANDLED", None)
    return SimNode(base=base, python=PYTHON, needed=rig.probe(PYTHON)["paths"], env=env, gpus=gpus, bin=binp,
                   marker=marker, files=files)
