#!/bin/sh
# Idempotent host set-up for migrt (Debian 12/13 or sid; run as root).
#  - system packages: CRIU 4.2, runc, containerd and python3-pycriu from Debian sid (pinned low,
#    trixie pinned a bit higher for the libraries they need), iptables, busybox-static;
#  - podman (sid) for the neighbour tests, its libraries pinned one by one so that nothing else
#    (python3 above all: the venvs are built on it) moves to sid;
#  - containerd 1.7 (trixie's) unpacked beside the system's containerd 2.x, in $MIGRT_DEPS/containerd-1.7
#    (the tests run it with MIGRT_TEST_CONTAINERD=1.7); the system containerd is left alone;
#  - a virtual environment with the project under $MIGRT_PREFIX (default /opt/migrt), made with a
#    pinned interpreter (recorded in $MIGRT_PREFIX/interpreter) that survives python3 upgrades;
#  - /usr/local/bin/migrt and /usr/local/bin/migrt-runc.
# Options (environment): MIGRT_PREFIX, MIGRT_SKIP_APT=1 (packages already there), MIGRT_DEV=1
# (install the test extras too, editable install of this checkout).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
prefix=${MIGRT_PREFIX:-/opt/migrt}
deps=${MIGRT_DEPS:-/opt/migrt-deps}
bindir=${MIGRT_BINDIR:-/usr/local/bin}

log() { printf 'setup-host: %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }

need_apt() {
    command -v criu >/dev/null 2>&1 || return 0
    criu --version 2>/dev/null | grep -q 'Version: 4\.[2-9]' || return 0
    for b in runc containerd ctr iptables busybox podman; do command -v $b >/dev/null 2>&1 || return 0; done
    [ -f /usr/lib/python3/dist-packages/pycriu/__init__.py ] || return 0
    for p in $MIGRT_EXTRA_DEBS; do dpkg -s "$p" >/dev/null 2>&1 || return 0; done
    return 1
}

# Packages the CRI tests (and Kubernetes-like set-ups) use; cheap, so always installed.
# Registry tests: docker-registry (CNCF distribution), htpasswd (apache2-utils), openssl; checkpointctl.
MIGRT_EXTRA_DEBS=${MIGRT_EXTRA_DEBS:-"containernetworking-plugins golang-github-kubernetes-cri-api-dev golang-github-gogo-protobuf-dev iproute2 python3-venv docker-registry apache2-utils openssl checkpointctl"}

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
    # podman 5 from sid: only it and the libraries it needs newer than the base has (`-t sid podman`
    # would also move python3 and every python3-* module to sid's).
    printf '%s\n' \
        'Package: podman libgpgme45 libseccomp2 libseccomp-dev libsubid6 golang-github-containers-common golang-github-containers-image netavark' \
        'Pin: release n=sid' 'Pin-Priority: 600' '' \
        'Package: libgpg-error0 libgpg-error-dev libgpg-error-l10n libassuan9' \
        'Pin: release n=trixie' 'Pin-Priority: 600' > /etc/apt/preferences.d/migrt-podman
    log "installing podman (sid, pinned)"
    apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold podman >/dev/null
fi

# containerd 1.7 beside 2.x: the .deb unpacked, not installed (the tests start it with a private config).
ctd17=$deps/containerd-1.7
if [ "${MIGRT_SKIP_APT:-0}" != 1 ] && [ ! -x "$ctd17/usr/bin/containerd" ]; then
    log "unpacking containerd 1.7 (trixie) into $ctd17"
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -qq -o APT::Sandbox::User=root containerd/trixie >/dev/null)
    mkdir -p "$ctd17.new"
    dpkg -x "$tmp"/containerd_*.deb "$ctd17.new"
    rm -rf "$tmp" "$ctd17"
    mv "$ctd17.new" "$ctd17"
fi

criu --version | grep -q 'Version: 4\.[2-9]' || { log "CRIU 4.2 or newer is required; found: $(criu --version | head -1)"; exit 1; }

# The venv: made with a versioned interpreter resolved once (/usr/bin/python3 -> /usr/bin/python3.11),
# recorded in $prefix/interpreter, and self-contained (no system site-packages): an apt upgrade that
# moves /usr/bin/python3 to a newer Python, or rebuilds Debian's python3-* modules for it, leaves the
# venv alone. pycriu is not on PyPI: Debian's python3-pycriu is copied in, and protobuf (its runtime)
# comes from PyPI (pyproject.toml). A venv whose interpreter vanished or changed, or that cannot import
# pycriu, is made again: re-running this script repairs an installation broken by an upgrade.
# MIGRT_PYTHON=/usr/bin/python3.X picks the interpreter; MIGRT_PYCRIU_DIR where pycriu is copied from.
venv=$prefix/venv
pycriu_src=${MIGRT_PYCRIU_DIR:-/usr/lib/python3/dist-packages/pycriu}
die() { log "error: $*"; exit 1; }
# The versioned path of a usable interpreter (>= 3.11, venv and ensurepip there), else nothing.
usable_python() {
    [ -n "$1" ] && [ -x "$1" ] || return 0
    "$1" -c 'import ensurepip, os, sys, venv
if sys.version_info >= (3, 11): print(os.path.realpath(sys.executable))' 2>/dev/null || true
}
venv_problem() {  # why the venv cannot stay (empty: it can)
    [ -f "$venv/pyvenv.cfg" ] || { echo "there is none"; return; }
    [ -n "$recorded" ] || { echo "no $prefix/interpreter: made by an older setup-host.sh"; return; }
    [ -x "$recorded" ] || { echo "its interpreter $recorded is gone"; return; }
    [ "$(readlink -f "$venv/bin/python")" = "$recorded" ] || {
        echo "$venv/bin/python is $(readlink -f "$venv/bin/python"), not $recorded"; return; }
    made=$(sed -n 's/^version *= *\([0-9]*\.[0-9]*\).*/\1/p' "$venv/pyvenv.cfg")
    now=$("$recorded" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "?")
    [ "$made" = "$now" ] || { echo "its interpreter $recorded is now Python $now, the venv was made for $made"; return; }
    [ -z "$want" ] || [ "$want" = "$recorded" ] || { echo "MIGRT_PYTHON asks for $want"; return; }
    grep -qs '^include-system-site-packages *= *false' "$venv/pyvenv.cfg" ||
        { echo "it sees the system site-packages: made by an older setup-host.sh"; return; }
    "$venv/bin/python" -c 'import pycriu' 2>/dev/null || echo "pycriu does not import in it"
}
[ -f "$pycriu_src/__init__.py" ] ||
    die "pycriu not found in $pycriu_src: install Debian's python3-pycriu (run without MIGRT_SKIP_APT=1) or set MIGRT_PYCRIU_DIR"
recorded=$(cat "$prefix/interpreter" 2>/dev/null || true)
want=
if [ -n "${MIGRT_PYTHON:-}" ]; then
    want=$(usable_python "$MIGRT_PYTHON")
    [ -n "$want" ] || die "MIGRT_PYTHON=$MIGRT_PYTHON is not a Python >= 3.11 with the venv module and ensurepip"
fi
problem=$(venv_problem)
if [ -n "$problem" ]; then
    py=$want
    [ -n "$py" ] || py=$(usable_python "$recorded")
    [ -n "$py" ] || py=$(usable_python /usr/bin/python3)
    [ -n "$py" ] || die "no Python >= 3.11 with the venv module here (tried ${recorded:+$recorded and }/usr/bin/python3):" \
        "install python3-venv, or set MIGRT_PYTHON=/usr/bin/python3.X"
    log "creating $venv with $py ($problem)"
    mkdir -p "$prefix"
    rm -rf "$venv" "$prefix/interpreter"
    "$py" -m venv "$venv" || die "$py -m venv $venv failed"
    printf '%s\n' "$py" > "$prefix/interpreter.new"
    mv -f "$prefix/interpreter.new" "$prefix/interpreter"
fi
py=$(cat "$prefix/interpreter")
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
if ! diff -rq -x __pycache__ "$pycriu_src" "$site/pycriu" >/dev/null 2>&1; then
    rm -rf "$site/.pycriu.new"
    cp -r "$pycriu_src" "$site/.pycriu.new"
    find "$site/.pycriu.new" -name __pycache__ -prune -exec rm -rf {} +
    rm -rf "$site/pycriu"
    mv "$site/.pycriu.new" "$site/pycriu"
fi
# migrt once depended on the deprecated `pynvml` wrapper (12+), whose .pth import hook slows every
# Python start in the venv; nvidia-ml-py (a dependency now) provides the pynvml module itself. Only
# that wrapper goes (an old pynvml 11 that ships pynvml.py stays).
if "$venv/bin/python" -c 'import importlib.metadata as m, sys
names = {str(f) for f in (m.files("pynvml") or [])}
sys.exit(0 if "_pynvml_redirector.pth" in names and "pynvml.py" not in names else 1)' 2>/dev/null; then
    "$venv/bin/pip" uninstall -q -y pynvml >/dev/null 2>&1 || log "could not remove the deprecated pynvml wrapper"
fi
if [ "${MIGRT_DEV:-0}" = 1 ]; then
    "$venv/bin/pip" install -q -e "$here[test]"
else
    "$venv/bin/pip" install -q "$here"
fi
err=$("$venv/bin/python" -c 'import pycriu, migrt' 2>&1) ||
    die "the venv ($py) cannot import pycriu (copied from $pycriu_src) and migrt: $(printf '%s' "$err" | tail -1)"

# $bindir/migrt (the CLI) and $bindir/migrt-runc (the POSIX-sh fast path, which hands every call that
# needs a decision to Python), both bound to the venv's python; when that cannot start migrt they say
# so and name this command (as it was run) as the repair.
repair="sh $here/packaging/setup-host.sh"
for v in MIGRT_DEV MIGRT_SKIP_APT MIGRT_BINDIR MIGRT_PREFIX; do
    eval "val=\${$v:-}"
    [ -z "$val" ] || repair="$v=$val $repair"
done
# $prefix/libexec/cuda-criu-action: the CRIU action script (GPU hook, docs/gpu.md) behind a wrapper bound
# to the same python; CRIU's configuration is left alone (GPU nodes name it there).
printf '%s\n' "$repair" > "$prefix/repair"
install -d "$prefix/libexec"
install -m 0644 "$here/hooks/cuda-criu-action" "$prefix/libexec/cuda-criu-action.py"
out=$("$venv/bin/migrt" install runtime --bindir "$bindir" --python "$venv/bin/python" --repair "$repair" \
    --criu-hook "$prefix/libexec/cuda-criu-action" --criu-hook-source "$prefix/libexec/cuda-criu-action.py" 2>&1) ||
    die "migrt install runtime --bindir $bindir failed: $out"

# Lazy dumps (lazy migration, the parallel memory dump) keep the memory they leave in the tasks
# referenced from CRIU's page pipes, two descriptors per pipe of at most fs.pipe-max-size (CRIU stops at
# 3.2 MiB): at the 1 MiB default a 32 GiB container needs 65k descriptors, at 4 MiB 20k
# (docs/migration.md; migrt checks the limit before freezing anything).
if [ "$(cat /proc/sys/fs/pipe-max-size 2>/dev/null || echo 0)" -lt 4194304 ]; then
    echo 'fs.pipe-max-size = 4194304' > /etc/sysctl.d/90-migrt.conf
    sysctl -q -w fs.pipe-max-size=4194304 || log "could not raise fs.pipe-max-size (big lazy dumps need more descriptors then)"
fi

mkdir -p /etc/migrt
[ -f /etc/migrt/config.yaml ] || install -m 0644 "$here/configs/config.yaml" /etc/migrt/config.yaml
install -d -m 0700 /var/lib/migrt
log "done: Python $py, $(criu --version | head -1 | tr -s ' '), $(runc --version | head -1), $(containerd --version | cut -d' ' -f3)"
