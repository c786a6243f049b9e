"""`migrt import`: a Kubernetes checkpoint archive (kubelet's checkpoint API, CRI CheckpointContainer)
into the store. The work is in migrt.pods.import_cri."""

from __future__ import annotations

import click

from migrt.cli.group import cli, handle_errors, load_config
from migrt.cli.render import ConsoleProgress, emit_json, human_size


@cli.command("import")
@click.argument("archive", type=click.Path(dir_okay=False))
@click.option("--name", help="Checkpoint name (default: the archive's file name without .tar[.gz|.zst|...]).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def import_cmd(archive, name, as_json):
    """Import a checkpoint archive written by kubelet's checkpoint API (CRI CheckpointContainer,
    e.g. containerd 2.1+) or by `podman container checkpoint --export` (plain, gzip, zstd, bzip2 or xz) into
    the store; prints the checkpoint name, ready for MIGRT_RESTORE."""
    from migrt.pods.import_cri import import_archive

    cfg = load_config()
    progress = ConsoleProgress(enabled=None if not as_json else False)
    if progress.enabled:
        click.echo(f"importing {archive}", err=True)
    data = import_archive(cfg, archive, name=name, progress=progress)
    if as_json:
        emit_json({k: data.get(k) for k in ("name", "created", "size_bytes", "timings", "source", "options", "rootfs",
                                            "imported", "versions", "devshm")})
        return
    if progress.enabled:
        click.echo(f"  total: {data['timings'].get('total_s', 0):.2f} s, {human_size(data['size_bytes'])}", err=True)
    click.echo(data["name"])
