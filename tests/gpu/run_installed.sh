#!/bin/bash
# The GPU tests against an INSTALLED node payload (issue 26: one payload, its own C library, on the GPU
# node's Ubuntu 24.04). From the repository root on the GPU machine:
#
#   source .device/setup.sh && bash tests/gpu/run_installed.sh PAYLOAD.tar.gz [pytest arguments]
#
# PAYLOAD.tar.gz: the payload tree (the installer image's /opt/migrt, as `migrt/`), made on the
# preparing machine from packaging/build-payload.sh's image (docs/install.md, "On the GPU machine").
# Steps, each written to $OUT (default ./gpu-results):
#   1. packaging/install-host.sh of the payload (its own installer) into /opt/migrt, timed, twice (the
#      second is the "already installed" case);
#   2. with a clean environment (no PYTHONPATH, no LD_LIBRARY_PATH): `migrt doctor`, the payload's
#      `criu check`, the payload's python loading the driver's libcuda and libnvidia-ml (cuInit, NVML);
#   3. tests/gpu/run_on_device.sh with MIGRT_GPU_PREFIX=/opt/migrt: every GPU test drives the installed
#      migrt-runc and migrt (its launchers, Python and CRIU), not the checkout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
payload=${1:?usage: run_installed.sh PAYLOAD.tar.gz [pytest arguments]}
shift
OUT=${OUT:-$PWD/gpu-results}
export OUT
mkdir -p "$OUT"
work=$(mktemp -d /tmp/migrt-payload.XXXXXX)
tar -xzf "$payload" -C "$work" || { echo "run_installed: cannot unpack $payload" >&2; exit 2; }
{
    for i in 1 2; do
        t0=$(date +%s%N)
        sh "$work/migrt/share/install-host.sh" --source "$work/migrt" --no-containerd || exit 2
        echo "install $i: $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    done
} > "$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 2; }
cat "$OUT/install.txt"
clean() { env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }
{
    head -4 /opt/migrt/PAYLOAD
    echo "node: $(. /etc/os-release; echo "$PRETTY_NAME"), $(ldd --version | head -1)"
    echo "--- migrt doctor (clean environment)"; clean /opt/migrt/bin/migrt doctor; echo "rc=$?"
    echo "--- criu check"; clean /opt/migrt/criu/sbin/criu check; echo "rc=$?"
    echo "--- the payload's python: the driver's libraries"
    clean /opt/migrt/venv/bin/python -P -c '
import ctypes, pynvml
pynvml.nvmlInit()
print("NVML driver", pynvml.nvmlSystemGetDriverVersion(), "GPUs", pynvml.nvmlDeviceGetCount())
cuda = ctypes.CDLL("libcuda.so.1")
print("cuInit", cuda.cuInit(0))
v = ctypes.c_int(); cuda.cuDriverGetVersion(ctypes.byref(v)); print("CUDA driver API", v.value)
print("libc of this process:", [l.split()[-1] for l in open("/proc/self/maps") if "libc.so" in l][0])
'; echo "rc=$?"
} > "$OUT/payload-checks.txt" 2>&1
cat "$OUT/payload-checks.txt"
MIGRT_GPU_PREFIX=/opt/migrt bash tests/gpu/run_on_device.sh "$@"
