#!/bin/bash
# bench/gpu_migration.py on the GPU machine, in one go. From the repository root, with .device/ made
# by tests/gpu/prepare_kit.sh (migrt's own CRIU as .device/migrt-criu, iproute2 for the two nodes):
#
#   source .device/setup.sh && bash bench/run_gpu_migration_on_device.sh [gpu_migration.py arguments]
#   e.g. ... --modes "copy lazy" --gbs "4 16"
#
# Uses the checkout in place (PYTHONPATH, nothing installed), the machine's Python with torch
# (MIGRT_GPU_PYTHON to choose another), migrt's CRIU build first on PATH (the one nodes get), and
# `ip` from /opt/migrt-deps/bin. Writes to $OUT (default ./gpu-migration-results): environment.txt,
# gpu_migration.json (written after every run), gpu_migration.log, and <run>-logs/ for a failed run.
# The benchmark gets a time budget (GPU_MIG_BUDGET_S, default 420 s from its start: runs that would
# end later are skipped and listed) and a hard limit (GPU_MIG_TIMEOUT_S, default 500 s, then 20 s to
# clean up), so that a 10-minute call ends in time. Exit status: gpu_migration.py's; 2 when a
# prerequisite is missing. The last lines are the benchmark's summary.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
OUT=${OUT:-$PWD/gpu-migration-results}
mkdir -p "$OUT"
export OUT MIGRT_GPU_RESULTS="$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/opt/migrt-deps/bin:$PATH"
if [ -x .device/migrt-criu/sbin/criu ]; then
    export PATH="$PWD/.device/migrt-criu/sbin:$PATH" MIGRT_CRIU="$PWD/.device/migrt-criu/sbin/criu"
    export PYTHONPATH="$PWD/.device/migrt-criu/python:$PYTHONPATH"
fi
. tests/gpu/iptables_names.sh
PY=${MIGRT_GPU_PYTHON:-python3}
export MIGRT_GPU_PYTHON=$PY
BUDGET=${GPU_MIG_BUDGET_S:-420}
LIMIT=${GPU_MIG_TIMEOUT_S:-500}
{
    echo "date: $(date -u +%FT%TZ)"; echo "kernel: $(uname -r)"; echo "cpus: $(nproc)"
    echo "mem: $(grep MemTotal /proc/meminfo)"
    nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total,memory.used --format=csv
    echo "criu: $(command -v criu) ($(head -3 "$(dirname "$(command -v criu)")/../BUILD" 2>/dev/null | tr '\n' ' '))"
    criu --version | head -1; runc --version | head -1
    echo "ip: $(command -v ip) $(ip -V 2>&1)"; echo "nsenter: $(command -v nsenter)"; echo "unshare: $(command -v unshare)"
    echo "iptables-restore: $(command -v iptables-restore)"
    echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
    echo "/dev/shm: $(df -h /dev/shm | tail -1)"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$OUT/environment.txt" 2>&1
. bench/huge_store.sh  # GPU_STORE_HUGE_GIB: the nodes' stores in 2 MiB pages
cat "$OUT/environment.txt"
for tool in ip nsenter unshare runc criu; do
    command -v "$tool" >/dev/null || { echo "run_gpu_migration_on_device: $tool missing" | tee "$OUT/gpu_migration.log"; exit 2; }
done
echo "setup took $(( $(date +%s) - T0 )) s; benchmark budget $BUDGET s, hard limit $LIMIT s"
PYTHONUNBUFFERED=1 timeout -k 20 "$LIMIT" "$PY" bench/gpu_migration.py --budget-s "$BUDGET" \
    --json-out "$OUT/gpu_migration.json" "$@" 2>&1 | tee "$OUT/gpu_migration.log"
rc=${PIPESTATUS[0]}
# a run killed at the hard limit leaves its namespaces and containers: the next call starts a fresh machine
echo "run_gpu_migration_on_device: exit $rc after $(( $(date +%s) - T0 )) s; files in $OUT"
exit "$rc"
