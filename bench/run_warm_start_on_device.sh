#!/bin/bash
# bench/warm_start.py on the GPU machine, in one go. From the repository root:
#
#   source .device/setup.sh && bash bench/run_warm_start_on_device.sh [warm_start.py arguments, e.g. --quick]
#
# --from-registry (issue 30) also restores the checkpoint by reference from a docker-registry on
# loopback: docker-registry and htpasswd come from the kit (.device/debs, tests/gpu/prepare_kit.sh).
#
# Uses the checkout in place (PYTHONPATH, nothing installed), the machine's Python with torch
# (MIGRT_GPU_PYTHON to choose another) and criu/runc from .device/. Writes to $OUT (default
# ./warm-start-results): environment.txt, doctor.txt, warm_start.log (all output), warm_start.json
# (figures), warm_start.txt (the table), warm_start_logs/ (migrt.log, the CRIU
# hook's log, each container's output, the servers' ready.json). The benchmark gets a time budget
# (WARM_START_BUDGET_S, default 370 s) and a hard limit (WARM_START_TIMEOUT_S, default 410 s, then 20 s to clean up) so that
# everything, this script included, ends within 8 minutes. Exit status: warm_start.py's (0: measured,
# answers equal; 1: failed or answers differ; 124: killed at the hard limit); 2 when a prerequisite is
# missing. The last line printed is the benchmark's summary line.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
OUT=${OUT:-$PWD/warm-start-results}
mkdir -p "$OUT"
export OUT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export WARM_START_BUDGET_S=${WARM_START_BUDGET_S:-370}
LIMIT=${WARM_START_TIMEOUT_S:-410}
PY=${MIGRT_GPU_PYTHON:-python3}
. tests/gpu/iptables_names.sh
export MIGRT_GPU_PYTHON=$PY
# --from-registry: docker-registry and htpasswd from the kit's Debian 12 .debs (tests/gpu/prepare_kit.sh),
# unpacked here when setup.sh unpacked the kit before they were in it
if ! command -v docker-registry >/dev/null 2>&1 || ! command -v htpasswd >/dev/null 2>&1; then
    for d in .device/debs/docker-registry_*.deb .device/debs/apache2-utils_*.deb .device/debs/libapr1_*.deb \
             .device/debs/libaprutil1_*.deb; do
        [ -e "$d" ] && dpkg -x "$d" /opt/migrt-deps
    done
fi

{
    echo "date: $(date -u +%FT%TZ)"; echo "kernel: $(uname -r)"; echo "cpus: $(nproc)"
    nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total,memory.used,persistence_mode --format=csv
    criu --version | head -1; runc --version | head -1
    echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
    echo "/dev/shm: $(df -h /dev/shm | tail -1)"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1
    echo "cc: $(command -v cc gcc | head -1)"
    echo "registry: $(docker-registry --version 2>&1 | head -1); htpasswd: $(command -v htpasswd || echo none); $(openssl version 2>&1 | head -1)"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# (WARM_START_REQUIRE: the modules checked; "click yaml structlog" to try --mode fake without a GPU)
missing=$(WARM_START_REQUIRE=${WARM_START_REQUIRE:-click yaml structlog pynvml torch} "$PY" - <<'EOF'
import importlib, os
missing = []
for mod in os.environ["WARM_START_REQUIRE"].split():
    try:
        importlib.import_module(mod)
    except Exception as exc:
        missing.append(f"{mod} ({type(exc).__name__}: {exc})")
if not missing and "pynvml" in os.environ["WARM_START_REQUIRE"].split():
    import pynvml
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        missing.append(f"NVML ({exc})")
print("; ".join(missing))
EOF
)
if [ -n "$missing" ]; then
    echo "run_warm_start_on_device: missing: $missing" | tee "$OUT/warm_start.log" >&2
    echo "  add the wheels on the preparing machine and carry .device again, e.g.:" >&2
    echo "  MIGRT_DEVICE_WHEELS='nvidia-ml-py click pyyaml structlog' sh ../shared/device/prepare.sh" >&2
    exit 2
fi

timeout 60 "$PY" -c 'from migrt.cli.main import main; main()' doctor > "$OUT/doctor.txt" 2>&1
echo "setup took $(( $(date +%s) - T0 )) s; benchmark budget ${WARM_START_BUDGET_S} s, hard limit ${LIMIT} s"
# SIGTERM at the limit: warm_start.py removes its containers, checkpoint and directories, then exits.
PYTHONUNBUFFERED=1 timeout -k 20 "$LIMIT" "$PY" bench/warm_start.py --results-dir "$OUT" \
    --json-out "$OUT/warm_start.json" "$@" 2>&1 | tee "$OUT/warm_start.log"
rc=${PIPESTATUS[0]}
# the table (from its header on) into warm_start.txt
sed -n '/^warm start (/,$p' "$OUT/warm_start.log" > "$OUT/warm_start.txt"
echo "run_warm_start_on_device: exit $rc after $(( $(date +%s) - T0 )) s; files in $OUT"
last=$(grep '^warm_start ' "$OUT/warm_start.log" | tail -1)
echo "${last:-warm_start fresh_s=nan restored_s=nan speedup=nan}"
exit "$rc"
