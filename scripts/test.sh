#!/bin/sh
# Sets up this machine (idempotent) and runs the test suite:
#   packaging/setup-host.sh   what a node gets (migrt's node payload: its own Python, venv and CRIU,
#                             installed by install-host.sh; built here first, cached in
#                             $MIGRT_DEPS/payload, unless MIGRT_PAYLOAD names one), with MIGRT_DEV=1:
#                             this checkout, editable, with the test extras, in the payload's venv
#   packaging/setup-test.sh   test-only components (podman, a registry, runc 1.3 and containerd 2.1
#                             unpacked under /opt/migrt-deps, never installed)
# The tests run with /opt/migrt-deps/bin first on PATH (runc 1.3, containerd 2.1); the node release's
# runc and containerd (Debian 12: 1.1.5 and 1.6.20) are tested by tests/integration/test_oldest.py.
# Integration tests use the real runc, CRIU and containerd; with CI=true they fail instead of skipping.
set -eu
cd "$(dirname "$0")/.."
deps=${MIGRT_DEPS:-/opt/migrt-deps}
MIGRT_DEV=1 MIGRT_PAYLOAD_CACHE=${MIGRT_PAYLOAD_CACHE:-$deps/payload} sh packaging/setup-host.sh
sh packaging/setup-test.sh
PATH=$deps/bin:$PATH
export PATH
exec "${MIGRT_PREFIX:-/opt/migrt}/venv/bin/python" -m pytest "$@"
