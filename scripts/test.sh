#!/bin/sh
# Sets up this machine (idempotent; packages, venv, /usr/local/bin links) and runs the test suite.
# Integration tests use the real runc, CRIU and containerd; with CI=true they fail instead of skipping.
set -eu
cd "$(dirname "$0")/.."
MIGRT_DEV=1 sh packaging/setup-host.sh
exec "${MIGRT_PREFIX:-/opt/migrt}/venv/bin/python" -m pytest "$@"
