"""`migrt`: the node CLI. Exit codes: see migrt.errors (and README "Exit codes").

The group lives in migrt.cli.group; importing the command modules here registers them on it, so
imports run one way: main -> command modules -> group.
"""

from __future__ import annotations

from migrt.cli import commands, gpu_cmd, import_cmd, install, k8s_cmd, migrate, registry_cmd  # noqa: F401 - register the commands
from migrt.cli.group import cli
from migrt.criu.binary import use_migrt_criu
from migrt.runtime.lower import configured_value

__all__ = ["cli", "main"]


def main() -> None:
    # runc and CRIU's children find migrt's CRIU first on PATH (migrt.criu.binary)
    use_migrt_criu(configured_value("criu"))
    cli(prog_name="migrt")
