#!/bin/sh
# CI check: the README's first command in a fresh minimal Debian 12 root, as a new user's machine or a
# `debian:12` container is. As root, on a Debian host with network access to the Debian mirror and PyPI:
#  1. mmdebstrap --variant=minbase --include=git,ca-certificates,xz-utils bookworm ROOT (the mirror and
#     suites of packaging/build-payload.sh: bookworm, -updates, -security on deb.debian.org; override
#     with MIGRT_PAYLOAD_MIRRORS, '|'-separated source lines); this host's /etc/pip.conf and
#     /etc/ssl/certs copied in for pip (a proxy's CA, a package index), /etc/resolv.conf for names;
#  2. `git clone` of this checkout (its committed HEAD) into ROOT/root/migrt;
#  3. the node payload: this host builds it (build-payload.sh image, cached in $MIGRT_PAYLOAD_CACHE,
#     default /var/cache/migrt/payload) and hands it in as MIGRT_PAYLOAD, or MIGRT_PAYLOAD=FILE names
#     one; MIGRT_CHECK_BUILD_IN_ROOT=1 hands none in, so setup-host.sh builds it inside the root;
#  4. in a mount namespace of its own (nothing leaks onto the host): /proc mounted, /sys and /dev
#     bound, a tmpfs on /run, then a plain chroot into ROOT, as a newcomer tries an install (the
#     harder case: "/" is no mount point there, so no container runtime can start a container until
#     the demo makes it one, scripts/lab/mountroot.py; a container or a pivot_root'ed root needs
#     nothing of that). There: base-check.sh record,
#     `sh scripts/demo.sh` from the clone (it must print its RESULT line), base-check.sh compare (no
#     installed package may change version);
#  5. ROOT removed (MIGRT_CHECK_KEEP=1 keeps it). Prints each step's time; exit 0 when all passed.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${MIGRT_PAYLOAD_CACHE:-/var/cache/migrt/payload}
mirrors=${MIGRT_PAYLOAD_MIRRORS:-"deb http://deb.debian.org/debian bookworm main|deb http://deb.debian.org/debian bookworm-updates main|deb http://deb.debian.org/debian-security bookworm-security main"}
log() { printf 'check-fresh-root: %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap, chroot, mounts)"
command -v mmdebstrap >/dev/null 2>&1 || die "mmdebstrap is not installed (apt-get install mmdebstrap)"
t_all=$(date +%s)
step() { log "$1 ($(($(date +%s) - t_all)) s so far)"; }

root=$(mktemp -d "${TMPDIR:-/var/tmp}/migrt-fresh.XXXXXX")
[ "${MIGRT_CHECK_KEEP:-0}" = 1 ] || trap 'rm -rf "$root"' EXIT

# 1-3. The root, the clone, the payload.
payload=${MIGRT_PAYLOAD:-}
if [ -z "$payload" ] && [ "${MIGRT_CHECK_BUILD_IN_ROOT:-0}" != 1 ]; then
    step "the payload (built here, or reused from $cache)"
    sh "$here/packaging/build-payload.sh" image --cache "$cache" > "$root.built" || die "the payload build failed"
    payload=$(tail -1 "$root.built"); rm -f "$root.built"
fi
step "mmdebstrap minbase bookworm into $root"
oldifs=$IFS; IFS='|'; set -- $mirrors; IFS=$oldifs
mmdebstrap --quiet --mode=root --variant=minbase --include=git,ca-certificates,xz-utils bookworm "$root" "$@" ||
    die "mmdebstrap failed"
[ ! -f /etc/pip.conf ] || cp /etc/pip.conf "$root/etc/pip.conf"
cp -a /etc/ssl/certs/. "$root/etc/ssl/certs/"
cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
git clone -q "$here" "$root/root/migrt" || die "git clone $here failed"
env=
if [ -n "$payload" ]; then
    cp "$payload" "$root/root/payload.tar" 2>/dev/null || cp -a "$payload" "$root/root/payload" ||
        die "cannot copy $payload into the root"
    [ -f "$root/root/payload.tar" ] && env="MIGRT_PAYLOAD=/root/payload.tar" || env="MIGRT_PAYLOAD=/root/payload"
fi

# 4. In the root: record, the demo, compare.
step "the demo in the root (${env:-the payload built inside it})"
status=0
unshare --mount --propagation private sh -eu -c '
    r=$1; shift
    mount -t proc proc "$r/proc"
    mount --rbind /sys "$r/sys"
    mount --rbind /dev "$r/dev"
    mount -t tmpfs -o mode=0755 tmpfs "$r/run"
    exec chroot "$r" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"
' fresh "$root" sh -c '
    cd /root/migrt
    sh packaging/base-check.sh record /root/base.txt
    t0=$(date +%s)
    env '"$env"' sh scripts/demo.sh > /root/demo.log 2>&1 || { tail -40 /root/demo.log >&2; echo "check-fresh-root: the demo failed" >&2; exit 1; }
    echo "check-fresh-root: scripts/demo.sh took $(($(date +%s) - t0)) s" >&2
    grep -q "RESULT: the counter resumed where it stopped, memory intact" /root/demo.log ||
        { tail -20 /root/demo.log >&2; echo "check-fresh-root: no RESULT line" >&2; exit 1; }
    grep "^setup-host:\|^install-host:\|^== RESULT" /root/demo.log >&2
    sh packaging/base-check.sh compare /root/base.txt
' || status=$?
[ "$status" = 0 ] || die "in the fresh root $root (MIGRT_CHECK_KEEP=1 keeps it for a look)"
log "passed: the README's demo in a fresh Debian 12 minbase root, no installed package moved ($(($(date +%s) - t_all)) s)"
