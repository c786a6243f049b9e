"""`migrt install containerd`: add the runtime handler `migrt` to containerd's configuration."""

from __future__ import annotations

import click

from migrt.cli.group import cli, handle_errors
from migrt.cli.render import emit_json
from migrt.node.containerd_config import DEFAULT_CONFIG, MIGRT_RUNC


@cli.group()
def install() -> None:
    """Configure other software on this node for migrt."""


@install.command("containerd")
@click.option("--config", "config_path", default=DEFAULT_CONFIG, show_default=True,
              help="containerd's main config file (a host path).")
@click.option("--root", default="/", show_default=True, type=click.Path(file_okay=False),
              help="Where the host's / is mounted (e.g. /host in a DaemonSet); paths written stay host paths.")
@click.option("--binary", default=MIGRT_RUNC, show_default=True, help="migrt-runc as the host sees it.")
@click.option("--dry-run", is_flag=True, help="Show the changes as a diff; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def install_containerd(config_path, root, binary, dry_run, as_json):
    """Declare runtime handler `migrt` (BinaryName migrt-runc) in a drop-in imported by containerd's
    config. Idempotent; changed files are backed up first. containerd is NOT restarted."""
    from migrt.node.install import apply, plan_containerd

    plan = plan_containerd(config_path, root=root, binary=binary)
    if not dry_run:
        apply(plan, root=root)
    if as_json:
        emit_json({**plan.to_dict(), "dry_run": dry_run})
        return
    click.echo(f"containerd config version {plan.version}: {plan.main}; handler in {plan.dropin}", err=True)
    for change in plan.changes:
        if dry_run:
            if change.action != "unchanged":
                click.echo(change.diff(), nl=False)
            click.echo(f"  would {change.action if change.action != 'unchanged' else 'leave unchanged'}: {change.path}",
                       err=True)
        else:
            extra = f" (backup: {change.backup})" if change.backup else ""
            click.echo(f"  {change.action}: {change.path}{extra}", err=True)
    for note in plan.notes:
        click.echo(f"  note: {note}", err=True)
    if not plan.changed:
        click.echo("nothing to do: the handler is already configured", err=True)
    elif dry_run:
        click.echo("dry run: nothing written", err=True)
    else:
        click.echo("containerd was not restarted: restart it to load the handler (e.g. `systemctl restart "
                   "containerd`; running containers keep running)", err=True)
