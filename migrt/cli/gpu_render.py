"""`migrt inspect`: the GPU part of a checkpoint (the manifest's 'gpu' section), for people."""

from __future__ import annotations

import click

from migrt.cli.render import human_size


def gpu_lines(gpu: dict) -> list[str]:
    procs = gpu.get("processes") or []
    gpus = gpu.get("gpus") or []
    cuda = gpu.get("cuda_driver_version")
    head = f"gpu:        NVIDIA driver {gpu.get('driver_version') or '?'}"
    if isinstance(cuda, int):
        head += f" (CUDA {cuda // 1000}.{cuda % 1000 // 10})"
    head += f", {len(gpus)} GPU(s), {len(procs)} CUDA process(es)"
    timings = gpu.get("timings") or {}
    if "gpu_checkpoint_s" in timings:
        head += f", GPU checkpoint {timings['gpu_checkpoint_s']:.2f} s"
    if gpu.get("driven_by"):
        head += f" (by {gpu['driven_by']})"
    lines = [head]
    for i, g in enumerate(gpus):
        lines.append(f"  GPU {i}  {g.get('name') or '?'}  {g.get('uuid')}  {human_size(g.get('memory_total'))}"
                     + (f"  bus {g['pci_bus_id']}" if g.get("pci_bus_id") else ""))
    for p in procs:
        ns = f" (ns {p['ns_pid']})" if p.get("ns_pid") is not None else ""
        where = ", ".join(p.get("gpus") or []) or "?"
        lines.append(f"  pid {p.get('pid'):>7}{ns} {p.get('comm') or '?':<16} {human_size(p.get('memory_bytes'))} "
                     f"on {where}")
    return lines


def render_gpu(gpu: dict) -> None:
    for line in gpu_lines(gpu):
        click.echo(line)
