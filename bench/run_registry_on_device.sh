#!/bin/bash
# bench/registry.py on the GPU machine (a 16+-core host: where one filler process, not the CPU, set
# the lazy fill's pace). From the repository root:
#
#   source .device/setup.sh && bash bench/run_registry_on_device.sh [registry.py arguments, e.g. --sizes 4 --parallel 8]
#
# Uses the checkout in place (PYTHONPATH, launchers written here), migrt's own CRIU build from
# .device/migrt-criu, runc and docker-registry/htpasswd from the kit (.device/debs), and a static
# memhog built on the preparing machine (.device/bench/memhog: `gcc -static -O2 -o .device/bench/memhog
# bench/memhog.c`; the GPU machine has no gcc) and a static busybox (.device/bench/busybox). Writes $OUT (default ./registry-results):
# environment.txt, registry.log (all output), registry.json. Exit status: registry.py's; 2 when a
# prerequisite is missing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/registry-results}
mkdir -p "$OUT"
PY=${MIGRT_BENCH_PYTHON:-python3}
if [ ! -x .device/migrt-criu/sbin/criu ]; then echo "no .device/migrt-criu (migrt's CRIU build)" >&2; exit 2; fi
export PATH="$PWD/.device/migrt-criu/sbin:/opt/migrt-deps/bin:$PATH" MIGRT_CRIU="$PWD/.device/migrt-criu/sbin/criu"
export PYTHONPATH="$PWD:$PWD/.device/migrt-criu/python${PYTHONPATH:+:$PYTHONPATH}"
if ! command -v docker-registry >/dev/null 2>&1 || ! command -v htpasswd >/dev/null 2>&1; then
    for d in .device/debs/docker-registry_*.deb .device/debs/apache2-utils_*.deb .device/debs/libapr1_*.deb \
             .device/debs/libaprutil1_*.deb; do
        [ -e "$d" ] && dpkg -x "$d" /opt/migrt-deps
    done
fi
if [ -z "${MIGRT_BENCH_MEMHOG:-}" ] && ! command -v gcc >/dev/null 2>&1; then
    [ -x .device/bench/memhog ] || { echo "no gcc and no .device/bench/memhog" >&2; exit 2; }
    export MIGRT_BENCH_MEMHOG="$PWD/.device/bench/memhog"
fi
# the containers' rootfs is busybox (tests/helpers/bundles.py): the kit's static one when the machine has none
command -v busybox >/dev/null 2>&1 || export PATH="$PATH:$PWD/.device/bench"
BIN=$(mktemp -d /tmp/migrt-bench-bin.XXXXXX)
for tool in migrt migrt-runc; do
    mod=$([ "$tool" = migrt ] && echo "from migrt.cli.main import main; main()" || echo "import sys; from migrt.shim.__main__ import main; sys.exit(main())")
    printf '#!%s\nimport sys\nsys.path.insert(0, %s)\n%s\n' "$(command -v "$PY")" "'$PWD'" "$mod" > "$BIN/$tool"
    chmod 755 "$BIN/$tool"
done
export MIGRT_BINDIR=$BIN
export MIGRT_BENCH_HOST_NETNS=1  # the kernel lacks xt_mark (CRIU's network lock): memhog in the host's netns
{
    echo "date: $(date -u +%FT%TZ)"; echo "kernel: $(uname -r)"; echo "cpus: $(nproc)"
    echo "criu: $(command -v criu)"; criu --version | head -1; runc --version | head -1
    echo "registry: $(docker-registry --version 2>&1 | head -1); htpasswd: $(command -v htpasswd || echo none)"
    "$PY" --version
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
"$PY" bench/registry.py --json-out "$OUT/registry.json" "$@" 2>&1 | tee "$OUT/registry.log"
rc=${PIPESTATUS[0]}
rm -rf "$BIN"
exit "$rc"
