#!/bin/sh
# Idempotent host set-up for migrt (Debian 12/13 or sid; run as root).
#  - system packages: CRIU 4.2, runc, containerd and python3-pycriu from Debian sid (pinned low,
#    trixie pinned a bit higher for the libraries they need), iptables, busybox-static;
#  - a virtual environment with the project under $MIGRT_PREFIX (default /opt/migrt);
#  - /usr/local/bin/migrt and /usr/local/bin/migrt-runc.
# Options (environment): MIGRT_PREFIX, MIGRT_SKIP_APT=1 (packages already there), MIGRT_DEV=1
# (install the test extras too, editable install of this checkout).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
prefix=${MIGRT_PREFIX:-/opt/migrt}
bindir=${MIGRT_BINDIR:-/usr/local/bin}

log() { printf 'setup-host: %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }

need_apt() {
    command -v criu >/dev/null 2>&1 || return 0
    criu --version 2>/dev/null | grep -q 'Version: 4\.[2-9]' || return 0
    for b in runc containerd ctr iptables busybox; do command -v $b >/dev/null 2>&1 || return 0; done
    [ -f /usr/lib/python3/dist-packages/pycriu/__init__.py ] || return 0
    for p in $MIGRT_EXTRA_DEBS; do dpkg -s "$p" >/dev/null 2>&1 || return 0; done
    return 1
}

# Packages the CRI tests (and Kubernetes-like set-ups) use; cheap, so always installed.
MIGRT_EXTRA_DEBS=${MIGRT_EXTRA_DEBS:-"containernetworking-plugins golang-github-kubernetes-cri-api-dev golang-github-gogo-protobuf-dev iproute2 python3-venv"}

if [ "${MIGRT_SKIP_APT:-0}" != 1 ] && need_apt; then
    export DEBIAN_FRONTEND=noninteractive
    for s in trixie sid; do
        f=/etc/apt/sources.list.d/migrt-$s.sources
        [ -f "$f" ] || cat > "$f" <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: $s
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    done
    printf 'Package: *\nPin: release n=trixie\nPin-Priority: 100\n\nPackage: *\nPin: release n=sid\nPin-Priority: 50\n' \
        > /etc/apt/preferences.d/migrt
    log "apt-get update"
    apt-get update -qq
    log "installing CRIU 4.2, runc, containerd, pycriu (sid) and helpers"
    apt-get install -y -qq -o Dpkg::Options::=--force-confold -t sid criu python3-pycriu runc containerd >/dev/null
    apt-get install -y -qq -o Dpkg::Options::=--force-confold iptables busybox-static $MIGRT_EXTRA_DEBS >/dev/null
fi

criu --version | grep -q 'Version: 4\.[2-9]' || { log "CRIU 4.2 or newer is required; found: $(criu --version | head -1)"; exit 1; }

# The venv uses the system Python so that pycriu (a Debian package, not on PyPI) is importable.
py=/usr/bin/python3
if [ ! -x "$prefix/venv/bin/python" ] || ! "$prefix/venv/bin/python" -c 'import pycriu' 2>/dev/null; then
    log "creating $prefix/venv"
    mkdir -p "$prefix"
    rm -rf "$prefix/venv"
    "$py" -m venv --system-site-packages "$prefix/venv"
fi
if [ "${MIGRT_DEV:-0}" = 1 ]; then
    "$prefix/venv/bin/pip" install -q -e "$here[test]"
else
    "$prefix/venv/bin/pip" install -q "$here"
fi

# /usr/local/bin/migrt: the CLI. /usr/local/bin/migrt-runc: the POSIX-sh fast path, which hands
# every call that needs a decision to the Python runtime shim in the venv.
ln -sf "$prefix/venv/bin/migrt" "$bindir/migrt"
sed "s|@MIGRT_PY_SHIM@|$prefix/venv/bin/migrt-runc-py|" "$here/migrt/shim/migrt-runc.sh" > "$bindir/.migrt-runc.new"
chmod 0755 "$bindir/.migrt-runc.new"
mv -f "$bindir/.migrt-runc.new" "$bindir/migrt-runc"

# Lazy migration: CRIU's page server asks for pipes of several MB; without CAP_SYS_RESOURCE that
# needs fs.pipe-max-size >= 4 MiB (else the page server fails and the lazy restore hangs; docs/migration.md).
if [ "$(cat /proc/sys/fs/pipe-max-size 2>/dev/null || echo 0)" -lt 4194304 ]; then
    echo 'fs.pipe-max-size = 4194304' > /etc/sysctl.d/90-migrt.conf
    sysctl -q -w fs.pipe-max-size=4194304 || log "could not raise fs.pipe-max-size (lazy migration needs it)"
fi

mkdir -p /etc/migrt
[ -f /etc/migrt/config.yaml ] || install -m 0644 "$here/configs/config.yaml" /etc/migrt/config.yaml
install -d -m 0700 /var/lib/migrt
log "done: $(criu --version | head -1 | tr -s ' '), $(runc --version | head -1), $(containerd --version | cut -d' ' -f3)"
