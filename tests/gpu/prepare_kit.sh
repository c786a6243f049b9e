#!/bin/bash
# Prepares .device/ for the GPU machine, from the repository root, on the development machine:
#   1. ../shared/device/prepare.sh (CRIU/runc/pycriu .debs and wheels; MIGRT_DEVICE_WHEELS adds ours);
#   2. migrt's own CRIU build (/opt/migrt/criu, packaging/build-criu.sh) as .device/migrt-criu, which
#      tests/gpu/run_on_device.sh and the benches put first (the same CRIU that nodes get);
#   3. Debian 12's iproute2 and the libraries it needs as .debs in .device/debs (setup.sh unpacks them
#      into /opt/migrt-deps there; `ip` is /opt/migrt-deps/bin/ip): the two-node rig's network
#      namespaces and veth pair (tests/gpu/twonodes.py, bench/gpu_migration.py);
#   4. Debian 12's docker-registry (a Go binary needing only libc: it runs on Ubuntu 24.04) and
#      apache2-utils' htpasswd with libapr1 and libaprutil1 (its other libraries, libcrypt, libexpat and
#      libuuid, are the node's) as .debs in .device/debs, unpacked the same way: the TLS + basic-auth
#      registry on loopback of `bench/warm_start.py --from-registry` (tests/helpers/registry.py);
#   5. the apt source prepare.sh adds for sid (download-only) is removed again: this machine's apt
#      configuration stays as it was (nothing was installed from it).
# Then on the GPU machine:  source .device/setup.sh && export PATH=/opt/migrt-deps/bin:$PATH && ...
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -x /opt/migrt/criu/sbin/criu ] || { echo "prepare_kit: /opt/migrt/criu missing: run packaging/setup-host.sh" >&2; exit 2; }
had_sid=0
[ -e /etc/apt/sources.list.d/migrt-sid.sources ] && had_sid=1
MIGRT_DEVICE_WHEELS=${MIGRT_DEVICE_WHEELS:-"nvidia-ml-py click pyyaml pytest iniconfig pluggy packaging psutil protobuf zstandard"} \
    bash ../shared/device/prepare.sh
if [ "$had_sid" = 0 ]; then
    rm -f /etc/apt/sources.list.d/migrt-sid.sources /etc/apt/preferences.d/migrt-sid
    apt-get update -qq || true
fi
rm -rf .device/migrt-criu
cp -a /opt/migrt/criu .device/migrt-criu
(cd .device/debs && apt-get download -qq -t bookworm iproute2 libbpf1 libelf1 libmnl0 libcap2 libxtables12 libdb5.3 \
    libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 >/dev/null)
(cd .device/debs && apt-get download -qq -t bookworm docker-registry apache2-utils libapr1 libaprutil1 >/dev/null)
du -sh .device
echo "prepare_kit: ready (.device/migrt-criu: $(head -1 .device/migrt-criu/BUILD))"
