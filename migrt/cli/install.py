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


@install.command("runtime")
@click.option("--bindir", default="/usr/local/bin", show_default=True, type=click.Path(file_okay=False),
              help="Where to write migrt-runc and migrt.")
@click.option("--python", "python", default=None,
              help="The interpreter they start (default: this one: a venv's python, else the versioned path "
                   "behind python3, e.g. /usr/bin/python3.11). It must import migrt.")
@click.option("--repair", default=None, help="The command they name when migrt cannot start.")
@click.option("--criu-hook", default=None, type=click.Path(dir_okay=False),
              help="Also write the CRIU action script (GPU hook) wrapper at this path, bound to the same interpreter.")
@click.option("--criu-hook-source", default=None, type=click.Path(dir_okay=False, exists=True),
              help="The hook it runs (default: hooks/cuda-criu-action of this migrt's checkout).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def install_runtime(bindir, python, repair, criu_hook, criu_hook_source, as_json):
    """Write migrt-runc (the runc-compatible runtime: sh fast path, Python when a decision is needed)
    and migrt (a launcher for this CLI) into BINDIR, both bound to one interpreter. Run it after
    `pip install`; packaging/setup-host.sh runs it too. Idempotent."""
    from migrt.node.launchers import install as install_launchers
    from migrt.node.launchers import python_problem

    if python:
        problem = python_problem(python)
        if problem:
            from migrt.errors import ConfigError

            raise ConfigError(f"--python {python}: {problem}")
    written = install_launchers(bindir, python=python, repair=repair, criu_hook=criu_hook,
                                hook_source=criu_hook_source)
    if not python:
        from migrt.node.doctor_install import python_check

        check = python_check()
        if check["status"] != "ok":
            click.echo(f"migrt: warning: {check['detail']}; {check['fix']}", err=True)
    if as_json:
        emit_json({"files": written})
        return
    for f in written:
        click.echo(f"  {f['action']}: {f['path']} (Python {f['python']})", err=True)
