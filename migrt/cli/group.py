"""The `migrt` click group and what every command shares (error translation, config loading).
Command modules register themselves on `cli`; this module imports none of them."""

from __future__ import annotations

import functools
import os
import sys

import click

from migrt import __version__
from migrt.errors import MigrtError


def _fail(message: str, exit_code: int, kind: str, as_json: bool) -> None:
    """The one way a command reports an error: a line on stderr, the JSON object on stdout with --json;
    escaped (migrt.text: parts of a message may come from a container, a registry or a peer)."""
    from migrt.text import printable

    message = printable(message, 8192)
    if as_json:
        from migrt.cli.render import emit_json

        emit_json({"error": message, "exit_code": exit_code, "type": kind})
    click.echo(f"migrt: error: {message}", err=True)
    sys.exit(exit_code)


def handle_errors(fn):
    """Translate MigrtError into its message and exit code (JSON on stdout too with --json). An OSError
    that no lower layer translated (a file the user named cannot be opened, a full disk) becomes an
    unexpected error (exit 1) with its message, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MigrtError as exc:
            _fail(str(exc), exc.exit_code, type(exc).__name__, bool(kwargs.get("as_json")))
        except BrokenPipeError:  # the reader of stdout went away (`migrt inspect X | head`): quietly, like cat
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError as exc:
            _fail(str(exc), 1, type(exc).__name__, bool(kwargs.get("as_json")))

    return wrapper


class Group(click.Group):
    """click's group, plus: a usage error (bad option, missing argument, a path that does not exist) of a
    command run with --json is also printed as the JSON error object on stdout (exit 2), like every
    other error of such a command."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            if "--json" in ctx.meta.get("migrt.argv", ()):
                from migrt.cli.render import emit_json

                emit_json({"error": exc.format_message(), "exit_code": exc.exit_code, "type": "UsageError"})
            raise

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        argv = list(args)
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta["migrt.argv"] = argv
        return ctx


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
            click.echo(f"migrt: warning: recovery of interrupted operations failed: {exc}; run 'migrt recover'",
                       err=True)
            outcomes = []
        for o in outcomes:
            hint = "" if o.status == "recovered" else "; run 'migrt recover'"
            click.echo(f"migrt: recovered {o.line()}{hint}" if o.status == "recovered" else f"migrt: {o.line()}{hint}",
                       err=True)
    return cfg


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="MIGRT_CONFIG",
              help="Config file (default /etc/migrt/config.yaml; env MIGRT_CONFIG).")
@click.version_option(__version__, "--version", prog_name="migrt")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """migrt: checkpoint, restore and migrate containers (and their GPU state) on this node."""
    if config_path and ctx.get_parameter_source("config_path") is click.core.ParameterSource.COMMANDLINE \
            and not os.path.isfile(config_path):
        # a missing /etc/migrt/config.yaml (or MIGRT_CONFIG file) means defaults; a file named on the command
        # line that is not there is a mistake, which must not act on the default store
        raise click.BadParameter(f"{config_path} does not exist", param_hint="'--config'")
    if config_path:
        os.environ["MIGRT_CONFIG"] = config_path
