"""`migrt gpu suspend|resume|status`: GPU preemption in place (the work is in migrt.ops.gpu_preempt)."""

from __future__ import annotations

import click

from migrt.cli.group import cli, handle_errors, load_config
from migrt.cli.render import ConsoleProgress, emit_json, human_size, table

JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
ROOT = click.option("--root", help="runc state root (default: searched in /run/containerd/runc/<ns>, /run/runc).")


@cli.group()
def gpu() -> None:
    """Take a running container's GPU memory away and give it back (its processes stay alive)."""


def _root(cfg, container_id: str, root: str | None) -> str:
    from migrt.ops.gpu_preempt import find_root

    return root or find_root(container_id, cfg.runtime_roots)


def _id(container_id: str | None) -> str | None:
    """The id checked before anything builds a path from it (InvalidName, exit 2)."""
    from migrt import names

    return None if container_id is None else names.container_id(container_id)


@gpu.command()
@click.argument("container_id")
@ROOT
@JSON
@handle_errors
def suspend(container_id, root, as_json):
    """Lock and checkpoint every CUDA process of a running container: its GPU memory moves into host
    memory and the GPU is free; the processes stay alive and block on their next CUDA call."""
    from migrt.ops import gpu_preempt

    container_id = _id(container_id)
    cfg = load_config()
    progress = ConsoleProgress(enabled=None if not as_json else False)
    rec = gpu_preempt.suspend(cfg, container_id, _root(cfg, container_id, root), progress=progress)
    rec.pop("section", None)
    if as_json:
        emit_json(rec)
        return
    rss = rec.get("host_rss_bytes") or {}
    took = rec["timings"]["suspend_s"]
    click.echo(f"{container_id}: suspended {len(rec['processes'])} CUDA process(es) in {took:.2f} s; "
               f"GPU(s) {', '.join(rec['gpus']) or '?'} released "
               f"({human_size(rec.get('gpu_memory_bytes'))} of GPU memory); host memory of the processes "
               f"{human_size(rss.get('before'))} -> {human_size(rss.get('after'))}")


@gpu.command()
@click.argument("container_id")
@click.option("--gpus", help="GPU UUIDs to resume onto, comma-separated, one for each GPU the container ran "
                             "on, in the order 'migrt gpu status' lists those (default: the same GPUs). The "
                             "container must be allowed to open them (its config.json devices).")
@ROOT
@JSON
@handle_errors
def resume(container_id, gpus, root, as_json):
    """Bring a suspended container's GPU state back (after a preflight), onto the same or other GPUs."""
    from migrt.ops import gpu_preempt

    container_id = _id(container_id)
    cfg = load_config()
    targets = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else None
    progress = ConsoleProgress(enabled=None if not as_json else False)
    done = gpu_preempt.resume(cfg, container_id, _root(cfg, container_id, root), gpus=targets, progress=progress)
    if as_json:
        emit_json(done)
        return
    where = ", ".join(done["gpus"]) or "?"
    click.echo(f"{container_id}: resumed {len(done['processes'])} CUDA process(es) on {where}"
               f"{' (moved)' if done['moved'] else ''} in {done['timings']['resume_s']:.2f} s")


@gpu.command()
@click.argument("container_id", required=False)
@ROOT
@JSON
@handle_errors
def status(container_id, root, as_json):
    """GPU-suspended containers of this node: since when, host memory, the GPUs they ran on."""
    from migrt.ops import gpu_preempt

    container_id = _id(container_id)
    cfg = load_config()
    found = gpu_preempt.status(cfg, container_id, root)
    if as_json:
        emit_json(found)
        return
    if not found:
        click.echo("no GPU-suspended container", err=True)
        return
    rows = [[r["container_id"], r.get("status", "?"), r.get("by", "?"),
             r.get("suspended_at") or r.get("started_at") or "-",
             str(len(r.get("processes") or [])), human_size(r.get("host_memory_bytes")),
             human_size(r.get("gpu_memory_bytes")), ",".join(r.get("gpus") or []) or "-"] for r in found]
    click.echo(table(["CONTAINER", "STATUS", "BY", "SINCE", "PROCS", "HOST MEM", "GPU MEM", "GPUS"], rows))
