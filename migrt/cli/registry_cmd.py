"""`migrt push`, `migrt pull` (migrt.registry) and `migrt export` (migrt.pods.export_cri)."""

from __future__ import annotations

import click

from migrt.cli.group import cli, handle_errors, load_config
from migrt.cli.render import ConsoleProgress, emit_json, human_size
from migrt.errors import UsageError


def _progress(as_json: bool) -> ConsoleProgress:
    return ConsoleProgress(enabled=None if not as_json else False)


def _timeout(what: str):
    return click.option(
        "--timeout", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
        help=f"Give up when the whole {what} (every request, retry and wait) takes longer. Default: registry_timeout "
             "from the migrt config (60 s) plus the image's size at 8 MiB/s, counted once that size is known; "
             "a registry that trickles its answers is cut there.")


@cli.command()
@click.argument("name")
@click.argument("reference")
@click.option("--format", "fmt", type=click.Choice(["migrt", "cri"]), default="migrt", show_default=True,
              help="migrt: 64 MiB blobs, parallel, unchanged blobs not sent again; cri: one layer in the checkpoint "
                   "archive layout with the CRI-O checkpoint annotations (for CRI-O, Podman, checkpointctl).")
@_timeout("push (hashing included)")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def push(name, reference, fmt, timeout, as_json):
    """Push checkpoint NAME to a registry as an OCI image (REFERENCE: registry/repository:tag).
    Credentials and CA come from the config (registry_auth_file, registry_ca_file)."""
    from migrt.registry.connect import deadline_for
    from migrt.registry.push import push as do_push

    cfg = load_config()
    deadline = deadline_for(cfg, "migrt push", timeout)
    progress = _progress(as_json)
    if progress.enabled:
        click.echo(f"pushing {name} to {reference}", err=True)
    out = do_push(cfg, name, reference, fmt=fmt, progress=progress, deadline=deadline)
    if as_json:
        emit_json(out)
        return
    click.echo(f"  sent {human_size(out['bytes_sent'])}, {human_size(out['bytes_skipped'])} already in the registry, "
               f"{out['seconds']:.2f} s", err=True)
    click.echo(f"{out['reference']}@{out['digest']}")


@cli.command()
@click.argument("reference")
@click.option("--name", help="Store name (default: oci-<repository>-<manifest digest prefix>, the name a restore "
                             "by reference looks for).")
@_timeout("pull (what arrived is kept and the next pull resumes it)")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def pull(reference, name, timeout, as_json):
    """Pull a checkpoint image (pushed by migrt, or a CRI-O/Podman checkpoint image) into the store,
    every digest checked before it is committed; prints the checkpoint name."""
    from migrt.registry.connect import deadline_for
    from migrt.registry.pull import pull as do_pull

    cfg = load_config()
    deadline = deadline_for(cfg, "migrt pull", timeout)
    progress = _progress(as_json)
    if progress.enabled:
        click.echo(f"pulling {reference}", err=True)
    out = do_pull(cfg, reference, name=name, progress=progress, deadline=deadline)
    if as_json:
        emit_json(out)
        return
    if out.get("already_present"):
        click.echo(f"  {out['name']} is already in the store (same manifest digest)", err=True)
    else:
        click.echo(f"  received {human_size(out['bytes_received'])}, {out['seconds']:.2f} s", err=True)
    click.echo(out["name"])


@cli.command("export")
@click.argument("name")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Archive to write (a plain tar in the layout Podman, CRI-O and kubelet write).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def export_cmd(name, output, as_json):
    """Export checkpoint NAME as a checkpoint archive (checkpoint/, config.dump, spec.dump, rootfs-diff.tar, ...)
    that checkpointctl, podman container restore --import and migrt import read."""
    from migrt.pods.export_cri import export
    from migrt.store import Store

    if output == "-":  # not stdout: the archive is written beside its path and renamed into place
        raise UsageError("-o -: export writes a file (atomically: renamed into place once complete); give a path, "
                         f"e.g. -o /tmp/{name}.tar")
    cfg = load_config()
    store = Store(cfg.store)
    progress = _progress(as_json)
    with store.reading(name) as ckpt:
        out = export(ckpt, output, progress=progress)
    if as_json:
        emit_json({"checkpoint": name, **out})
        return
    click.echo(out["path"])
