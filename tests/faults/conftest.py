"""Fault-injection suite: real runc, CRIU and containerd, as root (like tests/integration; with CI=true
a missing prerequisite fails). The integration fixtures are shared from there."""

from tests.integration.conftest import CLI, containerd, migrt_config, run_cli, stack  # noqa: F401
