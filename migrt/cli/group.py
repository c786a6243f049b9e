"""The `migrt` click group and what every command shares (error translation, config loading).
Command modules register themselves on `cli`; this module imports none of them."""

from __future__ import annotations

import functools
import os
import sys

import click

from migrt import __version__
from migrt.errors import MigrtError


def handle_errors(fn):
    """Translate MigrtError into its message and exit code (JSON on stdout too with --json)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MigrtError as exc:
            if kwargs.get("as_json"):
                from migrt.cli.render import emit_json

                emit_json({"error": str(exc), "exit_code": exc.exit_code, "type": type(exc).__name__})
            click.echo(f"migrt: error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def load_config(*, auto_recover: bool = True):
    """The config, the log, and (by default) recovery of what an interrupted migrt left (ops/recover.py):
    every command first brings back a workload a killed checkpoint froze. One line per recovery on stderr."""
    from migrt import config
    from migrt import log as log_mod

    cfg = config.load()
    log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-cli")
    if auto_recover and os.path.isdir(os.path.join(cfg.store, ".journal")):
        from migrt.ops import recover

        try:
            outcomes = recover.recover(cfg)
        except (MigrtError, OSError) as exc:  # e.g. a read-only store: the command itself may still work
            click.echo(f"migrt: warning: recovery of interrupted operations failed: {exc}; run 'migrt recover'", err=True)
            outcomes = []
        for o in outcomes:
            hint = "" if o.status == "recovered" else "; run 'migrt recover'"
            click.echo(f"migrt: recovered {o.line()}{hint}" if o.status == "recovered" else f"migrt: {o.line()}{hint}",
                       err=True)
    return cfg


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="MIGRT_CONFIG",
              help="Config file (default /etc/migrt/config.yaml; env MIGRT_CONFIG).")
@click.version_option(__version__, "--version", prog_name="migrt")
def cli(config_path: str | None) -> None:
    """migrt: checkpoint, restore and migrate containers (and their GPU state) on this node."""
    if config_path:
        os.environ["MIGRT_CONFIG"] = config_path
