#!/bin/sh
# Idempotent set-up of a node for migrt (run as root). Nothing is compiled on the node: it installs
# migrt's node payload (packaging/build-payload.sh: migrt's own Python, venv and CRIU 4.2 under one
# prefix) with packaging/install-host.sh, the installer the DaemonSet runs. The node's system is left
# alone: no package it has changes version or goes, nothing from another suite.
#  - from the node's OWN release, only those absent: runc, containerd (a node keeps its own: migrt
#    needs runc >= 1.1 and containerd >= 1.6) and iptables (CRIU's network lock); nothing else;
#  - the payload: MIGRT_PAYLOAD=DIR (an unpacked payload tree, the image's /opt/migrt) or
#    MIGRT_PAYLOAD=FILE (the installer image as build-payload.sh writes it, oci.tar); where none is
#    given, this host builds one first (build-payload.sh image, cached in $MIGRT_PAYLOAD_CACHE, default
#    /var/cache/migrt/payload, by the hash of its inputs: minutes the first time, seconds after; the
#    build host takes mmdebstrap from its release, the build itself happens in a Debian 12 root);
#  - install-host.sh --source PAYLOAD --prefix $MIGRT_PREFIX --bindir $MIGRT_BINDIR --no-containerd:
#    migrt in /opt/migrt, /usr/local/bin/migrt and migrt-runc, /etc/migrt/config.yaml if absent,
#    /var/lib/migrt (0700); containerd's handler is a step of its own (`migrt install containerd`);
#  - /usr/local/sbin/criu -> migrt's CRIU when the node has no criu on PATH (containerd 2.x looks for
#    one before serving kubelet's checkpoint API; MIGRT_CRIU_LINK=0 skips it);
#  - fs.pipe-max-size 4 MiB (a sysctl.d file: big lazy dumps).
# MIGRT_DEV=1 (scripts/test.sh, a development machine, not a node): then this checkout, editable, with
# the test extras, in the payload's venv (pip from the payload's ensurepip, which takes its wheels from
# the host's python3-pip-whl); re-runs keep it while the payload is the same.
# Test-only components (newer runc/containerd, podman, a registry) are packaging/setup-test.sh's.
# Options (environment): MIGRT_PREFIX, MIGRT_BINDIR, MIGRT_PAYLOAD, MIGRT_PAYLOAD_CACHE,
# MIGRT_SKIP_APT=1 (packages already there), MIGRT_DEV=1.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
prefix=${MIGRT_PREFIX:-/opt/migrt}
bindir=${MIGRT_BINDIR:-/usr/local/bin}
cache=${MIGRT_PAYLOAD_CACHE:-/var/cache/migrt/payload}
dev=${MIGRT_DEV:-0}

log() { printf 'setup-host: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
. "$here/packaging/apt-release.sh"

[ "$(id -u)" = 0 ] || die "must run as root"
work=$(mktemp -d "${TMPDIR:-/tmp}/migrt-setup.XXXXXX")
trap 'rm -rf "$work"' EXIT

# 1. What the node needs from its release (and, where the payload is built here, what the build needs).
# (Whether a tool is there, not a package: a node's runc may come from elsewhere.)
if [ "${MIGRT_SKIP_APT:-0}" != 1 ]; then
    want=
    command -v iptables-restore >/dev/null 2>&1 || want="$want iptables"
    command -v runc >/dev/null 2>&1 || want="$want runc"
    command -v containerd >/dev/null 2>&1 || want="$want containerd"
    [ -n "${MIGRT_PAYLOAD:-}" ] || command -v mmdebstrap >/dev/null 2>&1 || want="$want mmdebstrap"
    [ "$dev" != 1 ] || ls /usr/share/python-wheels/pip-*.whl >/dev/null 2>&1 || want="$want python3-pip-whl"
    if [ -n "$want" ]; then
        command -v apt-get >/dev/null 2>&1 ||
            die "this node lacks$want and has no apt-get: install them with its package manager (or use the" \
                "DaemonSet, packaging/daemonset.yaml), then run this again"
        log "installing from the node's release:$want"
        apt_release_install node $want
    fi
fi

# 2. The payload: given (a tree, or the installer image's oci.tar), else built here (cached).
payload_tree() {  # OCI_TAR: unpack its one layer's opt/migrt under $work; prints the tree's path
    tar -C "$work" -xf "$1" index.json || die "$1: no OCI image layout (index.json)"
    m=$(sed -n 's/.*"digest":"sha256:\([0-9a-f]*\)".*/\1/p' "$work/index.json" | head -1)
    tar -C "$work" -xf "$1" "blobs/sha256/$m" || die "$1: manifest $m missing"
    l=$(sed -n 's/.*"layers":\[{[^}]*"digest":"sha256:\([0-9a-f]*\)".*/\1/p' "$work/blobs/sha256/$m")
    mkdir -p "$work/layer"
    { tar -xOf "$1" "blobs/sha256/$l" | tar -C "$work/layer" -xf - --wildcards './opt/migrt/*' 'opt/migrt/*'; } 2>/dev/null ||
        true  # (one of the two spellings is absent from the layer: tar says so and fails)
    [ -f "$work/layer/opt/migrt/PAYLOAD" ] || die "$1: its layer ($l) holds no /opt/migrt payload"
    echo "$work/layer/opt/migrt"
}
payload=${MIGRT_PAYLOAD:-}
if [ -z "$payload" ]; then
    log "no MIGRT_PAYLOAD given: building the node payload here (packaging/build-payload.sh, cache $cache)"
    MIGRT_SKIP_APT=1 sh "$here/packaging/build-payload.sh" image --cache "$cache" > "$work/built" ||
        die "the payload build failed (see above); a payload built elsewhere: MIGRT_PAYLOAD=DIR-or-oci.tar"
    payload=$(tail -1 "$work/built")
fi
if [ -f "$payload" ]; then
    payload=$(payload_tree "$payload")
fi
[ -d "$payload" ] || die "MIGRT_PAYLOAD=$payload is neither a payload tree nor an oci.tar"
[ -f "$payload/PAYLOAD" ] || die "$payload is not a migrt payload: no PAYLOAD file (packaging/build-payload.sh builds one)"

# 3. Install it (install-host.sh checks it runs here first; an unchanged payload is left in place).
#    A development install (its venv holds this checkout, so it differs from the payload) is kept while
#    the payload it was made from and the checkout's pyproject.toml (its dependencies) are the same.
stamp="$(cat "$payload/PAYLOAD" "$here/pyproject.toml" | sha256sum | cut -c1-16) $here"
if [ "$dev" = 1 ] && [ "$(cat "$prefix/DEV" 2>/dev/null)" = "$stamp" ] &&
    "$prefix/venv/bin/python" -c 'import migrt, sys; sys.exit(not migrt.__file__.startswith(sys.argv[1]))' "$here/migrt/" 2>/dev/null; then
    log "$prefix: the development install of $here is up to date"
else
    rm -f "$prefix/DEV"
    sh "$here/packaging/install-host.sh" --source "$payload" --prefix "$prefix" --bindir "$bindir" --no-containerd ||
        die "install-host.sh failed (see above)"
    if [ "$dev" = 1 ]; then
        log "development install: $here (editable, test extras) into $prefix/venv"
        "$prefix/venv/bin/python" -m ensurepip >"$work/pip.log" 2>&1 ||
            { cat "$work/pip.log" >&2; die "ensurepip failed in $prefix/venv (python3-pip-whl installed?)"; }
        "$prefix/venv/bin/python" -m pip install -q --disable-pip-version-check -e "$here[test]" ||
            die "pip install -e $here[test] failed"
        printf '%s\n' "$stamp" > "$prefix/DEV"
    fi
fi
criu=$prefix/criu/sbin/criu

# 4. containerd 2.x checks for a `criu` on its own PATH before it serves CRI CheckpointContainer
#    (kubelet's checkpoint API), then checkpoints through migrt-runc, which uses migrt's CRIU whatever
#    containerd found. A node with no criu at all gets $sbindir/criu -> migrt's; its own is left alone.
sbindir=${MIGRT_SBINDIR:-/usr/local/sbin}
if [ "${MIGRT_CRIU_LINK:-1}" = 1 ]; then
    current=$(command -v criu 2>/dev/null || true)
    if [ -z "$current" ] || [ "$(readlink -f "$current")" = "$(readlink -f "$criu")" ]; then
        mkdir -p "$sbindir"
        ln -sfn "$criu" "$sbindir/criu"
    else
        log "kept the node's own $current for containerd's CRI checkpoint check (migrt uses $criu)"
    fi
fi

# 5. Lazy dumps (lazy migration, the parallel memory dump) keep the memory they leave in the tasks
#    referenced from CRIU's page pipes, two descriptors per pipe of at most fs.pipe-max-size (CRIU stops
#    at 3.2 MiB): at the 1 MiB default a 32 GiB container needs 65k descriptors, at 4 MiB 20k
#    (docs/migration.md; migrt checks the limit before freezing anything).
if [ "$(cat /proc/sys/fs/pipe-max-size 2>/dev/null || echo 0)" -lt 4194304 ]; then
    mkdir -p /etc/sysctl.d  # (a minimal root has no procps; systemd-sysctl reads it too)
    echo 'fs.pipe-max-size = 4194304' > /etc/sysctl.d/90-migrt.conf
    echo 4194304 2>/dev/null > /proc/sys/fs/pipe-max-size ||
        log "could not raise fs.pipe-max-size (big lazy dumps need more descriptors then)"
fi
log "done: migrt $("$bindir/migrt" --version 2>/dev/null | sed 's/.*version //') in $prefix (CRIU" \
    "$("$criu" --version | sed -n 's/^Version: //p'))," \
    "$(runc --version 2>/dev/null | head -1 || echo 'no runc'), containerd $(containerd --version 2>/dev/null | cut -d' ' -f3 || echo none)"
