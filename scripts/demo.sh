#!/bin/sh
# Sets up this machine (idempotent) and runs the demo: a counter container checkpointed and resumed
# through a private containerd with migrt-runc as its runtime.
set -eu
cd "$(dirname "$0")/.."
sh packaging/setup-host.sh
exec "${MIGRT_PREFIX:-/opt/migrt}/venv/bin/python" scripts/demo.py "$@"
