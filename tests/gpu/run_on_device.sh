#!/bin/bash
# The GPU tests, on the GPU machine, in one go. From the repository root:
#
#   source .device/setup.sh && bash tests/gpu/run_on_device.sh [pytest arguments, e.g. -k two_cuda]
#
# Uses the checkout in place (PYTHONPATH, nothing installed), the machine's Python with torch
# (MIGRT_GPU_PYTHON to choose another) and criu/runc from .device/ (migrt's own CRIU build when
# .device/migrt-criu holds it: `cp -a /opt/migrt/criu .device/migrt-criu` after prepare.sh). Writes to $OUT (default
# ./gpu-results): environment.txt, doctor.txt, pytest.log, junit.xml, results.jsonl (figures per
# test), results.md (the table), migrt.log and hook.log (migrt's and the CRIU hook's own logs).
# Sizes: MIGRT_GPU_TEST_GBS (default "2 8": the round trip runs at each, the other tests at the
# smallest). Exit status: pytest's; 2 when a prerequisite is missing.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MIGRT_GPU_TEST_GBS=${MIGRT_GPU_TEST_GBS:-"2 8"}
export MIGRT_GPU_RESULTS="$OUT"
PY=${MIGRT_GPU_PYTHON:-python3}
# migrt's own CRIU build (packaging/build-criu.sh, the one nodes get), carried as .device/migrt-criu
# (copy /opt/migrt/criu there on the preparing machine): first on PATH, and migrt's choice.
# MIGRT_GPU_PREFIX=/opt/migrt: the tests drive an INSTALLED migrt (packaging/install-host.sh) through its
# own launchers, Python and CRIU, with neither the checkout nor the kit's site-packages on its path.
if [ -n "${MIGRT_GPU_PREFIX:-}" ]; then
    export PATH="$MIGRT_GPU_PREFIX/criu/sbin:$PATH"
elif [ -x .device/migrt-criu/sbin/criu ]; then
    export PATH="$PWD/.device/migrt-criu/sbin:$PATH" MIGRT_CRIU="$PWD/.device/migrt-criu/sbin/criu"
    export PYTHONPATH="$PWD/.device/migrt-criu/python:$PYTHONPATH"  # its pycriu, from the same source
fi
. tests/gpu/iptables_names.sh
export MIGRT_GPU_PYTHON=$PY

{
    echo "date: $(date -u +%FT%TZ)"; echo "kernel: $(uname -r)"
    nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total,persistence_mode --format=csv
    echo "criu: $(command -v criu) ($(head -3 "$(dirname "$(command -v criu)")/../BUILD" 2>/dev/null | tr '\n' ' '))"
    criu --version | head -1; runc --version | head -1
    echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

missing=$("$PY" - <<'EOF'
import importlib
missing = []
for mod in ("pytest", "click", "yaml", "structlog", "pynvml", "torch"):
    try:
        importlib.import_module(mod)
    except Exception as exc:
        missing.append(f"{mod} ({type(exc).__name__}: {exc})")
if not missing:
    import pynvml
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        missing.append(f"NVML ({exc})")
print("; ".join(missing))
EOF
)
if [ -n "$missing" ]; then
    echo "run_on_device: missing: $missing" | tee "$OUT/pytest.log" >&2
    echo "  add the wheels on the preparing machine and carry .device again, e.g.:" >&2
    echo "  MIGRT_DEVICE_WHEELS='nvidia-ml-py click pyyaml pytest iniconfig pluggy packaging' sh ../shared/device/prepare.sh" >&2
    exit 2
fi

if [ -n "${MIGRT_GPU_PREFIX:-}" ]; then
    env -u PYTHONPATH -u MIGRT_CRIU "$MIGRT_GPU_PREFIX/bin/migrt" doctor > "$OUT/doctor.txt" 2>&1
else
    "$PY" -c 'from migrt.cli.main import main; main()' doctor > "$OUT/doctor.txt" 2>&1
fi
"$PY" -m pytest tests/gpu -m gpu -v -ra -p no:cacheprovider --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
if [ -s "$OUT/results.jsonl" ]; then
    "$PY" tests/gpu/report.py "$OUT/results.jsonl" > "$OUT/results.md" && cat "$OUT/results.md"
fi
exit "$rc"
