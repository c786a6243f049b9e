#!/bin/bash
# bench/gpu_roundtrip.py on the GPU machine, in one go. From the repository root:
#
#   source .device/setup.sh && bash bench/run_gpu_roundtrip_on_device.sh [gpu_roundtrip.py arguments]
#   e.g. ... --sizes 8,16 --thp madvise,always --runs 3
#
# Uses the checkout in place (PYTHONPATH, nothing installed), the machine's Python with torch
# (MIGRT_GPU_PYTHON to choose another) and criu/runc from .device/. Writes to $OUT (default
# ./gpu-roundtrip-results): environment.txt, doctor.txt, restore_start.txt (the restore path's start,
# step by step) and restore_start_imports.txt, gpu_roundtrip-<tag>.json and .log (tag: GPU_RT_TAG,
# default the sizes), migrt.log. The benchmark gets a time budget (GPU_RT_BUDGET_S, default 470 s)
# and a hard limit (GPU_RT_TIMEOUT_S, default 530 s, then 20 s to clean up and put THP back) so that
# everything ends within 10 minutes; split the sizes over several calls. Exit status:
# gpu_roundtrip.py's; 2 when a prerequisite is missing. The last line is the benchmark's summary.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
OUT=${OUT:-$PWD/gpu-roundtrip-results}
mkdir -p "$OUT"
export OUT MIGRT_GPU_RESULTS="$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${GPU_RT_BUDGET_S:-470}
LIMIT=${GPU_RT_TIMEOUT_S:-530}
PY=${MIGRT_GPU_PYTHON:-python3}
. tests/gpu/iptables_names.sh
export MIGRT_GPU_PYTHON=$PY
TAG=${GPU_RT_TAG:-$(echo "$*" | tr -c 'a-zA-Z0-9,.\n' '_' | tr -s '_' | cut -c1-60)}
TAG=${TAG:-default}

if [ ! -s "$OUT/environment.txt" ]; then
    {
        echo "date: $(date -u +%FT%TZ)"; echo "kernel: $(uname -r)"; echo "cpus: $(nproc)"
        echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
        echo "mem: $(grep MemTotal /proc/meminfo)"
        nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total,memory.used,persistence_mode,pcie.link.gen.current,pcie.link.width.current --format=csv
        criu --version | head -1; runc --version | head -1
        echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
        echo "/dev/shm: $(df -h /dev/shm | tail -1)"
        "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    } > "$OUT/environment.txt" 2>&1
    timeout 60 "$PY" -c 'from migrt.cli.main import main; main()' doctor > "$OUT/doctor.txt" 2>&1
    MIGRT_CONFIG=/nonexistent timeout 120 "$PY" bench/restore_start.py --runs 5 \
        --importtime "$OUT/restore_start_imports.txt" > "$OUT/restore_start.txt" 2>&1
fi
cat "$OUT/environment.txt" "$OUT/restore_start.txt"

missing=$("$PY" - <<'PYEOF'
import importlib
missing = []
for mod in ("click", "yaml", "structlog", "pynvml", "torch"):
    try:
        importlib.import_module(mod)
    except Exception as exc:
        missing.append(f"{mod} ({type(exc).__name__}: {exc})")
print("; ".join(missing))
PYEOF
)
if [ -n "$missing" ]; then
    echo "run_gpu_roundtrip_on_device: missing: $missing" | tee -a "$OUT/gpu_roundtrip-$TAG.log" >&2
    exit 2
fi
# GPU_RT_HUGE_TMPFS_GIB=N: a private huge=always tmpfs of N GiB for the raw@hugetmpfs path (unmounted at the end;
# a mount of our own, no node-wide setting)
HUGE_ARGS=()
if [ -n "${GPU_RT_HUGE_TMPFS_GIB:-}" ]; then
    HUGE_DIR=$(mktemp -d /tmp/migrt-huge.XXXXXX)
    mount -t tmpfs -o "huge=always,size=${GPU_RT_HUGE_TMPFS_GIB}G,mode=0700" migrt-huge "$HUGE_DIR" && HUGE_ARGS=(--raw-huge-images "$HUGE_DIR")
    trap 'umount "$HUGE_DIR" 2>/dev/null; rmdir "$HUGE_DIR" 2>/dev/null' EXIT
fi
. bench/huge_store.sh  # GPU_STORE_HUGE_GIB: the nodes' stores in 2 MiB pages
THP_BEFORE=$(sed 's/.*\[\(.*\)\].*/\1/' /sys/kernel/mm/transparent_hugepage/enabled)
echo "setup took $(( $(date +%s) - T0 )) s; benchmark budget $BUDGET s, hard limit $LIMIT s"
# SIGTERM at the limit: gpu_roundtrip.py removes its processes and directories and puts THP back.
PYTHONUNBUFFERED=1 timeout -k 20 "$LIMIT" "$PY" bench/gpu_roundtrip.py --budget-s "$BUDGET" \
    --json-out "$OUT/gpu_roundtrip-$TAG.json" "${HUGE_ARGS[@]}" "$@" 2>&1 | tee "$OUT/gpu_roundtrip-$TAG.log"
rc=${PIPESTATUS[0]}
# the benchmark puts THP back itself; this catches a SIGKILL at the hard limit
if [ "$(sed 's/.*\[\(.*\)\].*/\1/' /sys/kernel/mm/transparent_hugepage/enabled)" != "$THP_BEFORE" ]; then
    echo "$THP_BEFORE" > /sys/kernel/mm/transparent_hugepage/enabled && echo "THP put back to $THP_BEFORE (by the runner)"
fi
echo "THP now: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
echo "run_gpu_roundtrip_on_device: exit $rc after $(( $(date +%s) - T0 )) s; files in $OUT"
tail -1 "$OUT/gpu_roundtrip-$TAG.log"
exit "$rc"
