"""The GPU section of a checkpoint: the manifest's 'gpu' key, and the same JSON as migrt-gpu.json in
the image directory, so that every restore path (migrt, migrt-runc restore, the CRIU hook) finds it.

    {"schema": 1, "driver_version": "580.159", "cuda_driver_version": 13000, "inventory": "nvml",
     "gpus": [{"uuid", "name", "memory_total", "pci_bus_id", "index", "minor"}],   # the container's GPUs
     "processes": [{"pid", "ns_pid", "comm", "gpus": [uuid], "memory_bytes", "gpu_memory": {uuid: bytes},
                    "gpu_backing": [[start, end], ...]}],  # where the driver's host copy is (gpu/backing.py)
     "timings": {"gpu_checkpoint_s": 4.6}}
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from migrt import jsonsafe
from migrt.gpu import procs
from migrt.kernel.files import atomic_file

if TYPE_CHECKING:  # annotations only: the restore path reads HANDLED_ENV without loading the inventory
    from migrt.gpu.inventory import Inventory

SCHEMA = 1
IMAGE_FILE = "migrt-gpu.json"
# Set by migrt in the lower runtime's environment when migrt itself drives the GPU; CRIU passes it
# on to action scripts, and hooks/cuda-criu-action then does nothing.
HANDLED_ENV = "MIGRT_GPU_HANDLED"


def describe(pids: list[int], inv: Inventory, visible: list[str]) -> dict:
    gpus = []
    for uuid in visible:
        g = inv.by_uuid(uuid)
        gpus.append({"uuid": uuid, "name": g.name if g else None, "memory_total": g.memory_total if g else None,
                     "pci_bus_id": g.pci_bus_id if g else None, "index": g.index if g else None,
                     "minor": g.minor if g else None})
    processes = []
    for pid in pids:
        used = inv.processes.get(pid, [])  # NVML's view; empty without NVML
        per_gpu = {u: b for u, b in used if b is not None}
        processes.append({"pid": pid, "ns_pid": procs.ns_pid(pid), "comm": procs.comm(pid),
                          "gpus": [u for u, _ in used] or list(visible),
                          "memory_bytes": sum(per_gpu.values()) if per_gpu else None, "gpu_memory": per_gpu})
    return {"schema": SCHEMA, "driver_version": inv.driver_version, "cuda_driver_version": inv.cuda_driver_version,
            "inventory": inv.source, "gpus": gpus, "processes": processes, "timings": {}}


def visible_at_checkpoint(config_gpus: list[str] | None, devnode_gpus: list[str] | None, pids: list[int],
                          inv: Inventory) -> list[str]:
    """The GPUs the container could see: its config, else its /dev, else those its processes use,
    else every GPU of the node."""
    for found in (config_gpus, devnode_gpus):
        if found:
            return found
    used = [u for p in pids for u, _ in inv.processes.get(p, [])]
    if used:
        return [g.uuid for g in inv.gpus if g.uuid in set(used)]
    return [g.uuid for g in inv.gpus]


def write_image_file(image_dir: str, section: dict) -> str:
    path = os.path.join(image_dir, IMAGE_FILE)
    with atomic_file(path, 0o644, text=True) as fh:
        json.dump(section, fh, indent=1, sort_keys=True)
    return path


def read_image_file(image_dir: str) -> dict | None:
    """The section of an image directory, None if it has none (not a GPU checkpoint)."""
    try:
        with open(os.path.join(image_dir, IMAGE_FILE), encoding="utf-8") as fh:
            data = jsonsafe.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{os.path.join(image_dir, IMAGE_FILE)}: unreadable: {exc}") from exc
    schema = data.get("schema") if isinstance(data, dict) else None
    if not isinstance(schema, int) or schema > SCHEMA:
        raise ValueError(f"{os.path.join(image_dir, IMAGE_FILE)}: schema {schema!r} is not one this migrt understands")
    return data
