#!/bin/sh
# Idempotent set-up of a node for migrt (Debian 12/13, Ubuntu 24.04; run as root). It leaves the node's
# system alone: no other suite's package, no upgrade of a package the node already has.
#  - packages from the node's OWN release, only those missing: python3-venv, iptables (CRIU's network
#    lock), the build dependencies of CRIU (packaging/build-criu.sh lists them), and runc and containerd
#    only when the node has none (a node keeps its own: migrt needs runc >= 1.1 and containerd >= 1.6);
#  - migrt's own CRIU 4.2 in $MIGRT_PREFIX/criu (built from CRIU's release source by
#    packaging/build-criu.sh, its libraries beside it; migrt hands it to runc, the node's PATH and
#    /usr/sbin/criu are not touched);
#  - a virtual environment with the project under $MIGRT_PREFIX (default /opt/migrt), made with a
#    pinned interpreter (recorded in $MIGRT_PREFIX/interpreter) that survives python3 upgrades, pycriu
#    from the same CRIU build;
#  - /usr/local/sbin/criu -> migrt's CRIU when the node has no criu on PATH (containerd 2.x looks for
#    one before serving kubelet's checkpoint API; MIGRT_CRIU_LINK=0 skips it);
#  - /usr/local/bin/migrt and /usr/local/bin/migrt-runc, $MIGRT_PREFIX/libexec/cuda-criu-action,
#    /etc/migrt/config.yaml (if absent), /var/lib/migrt, and fs.pipe-max-size 4 MiB (sysctl.d file).
# Test-only components (newer runc/containerd, podman, a registry) are packaging/setup-test.sh's.
# Options (environment): MIGRT_PREFIX, MIGRT_SKIP_APT=1 (packages already there), MIGRT_DEV=1
# (editable install of this checkout with the test extras).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
prefix=${MIGRT_PREFIX:-/opt/migrt}
bindir=${MIGRT_BINDIR:-/usr/local/bin}

log() { printf 'setup-host: %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }

if [ "${MIGRT_SKIP_APT:-0}" != 1 ]; then
    want="python3-venv iptables"
    command -v runc >/dev/null 2>&1 || want="$want runc"
    command -v containerd >/dev/null 2>&1 || want="$want containerd"
    missing=
    for p in $want; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
    if [ -n "$missing" ]; then
        export DEBIAN_FRONTEND=noninteractive
        log "installing from the node's release:$missing"
        apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold $missing >/dev/null ||
            { apt-get update -qq && apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold $missing >/dev/null; } ||
            { log "apt-get install$missing failed"; exit 1; }
    fi
fi

# migrt's CRIU (>= 4.2: Debian 12's 3.17 fails on 6.x kernels' vDSO, 4.1 cannot dump inet sockets on
# kernels >= 6.16). MIGRT_CRIU_PREBUILT=DIR installs a build made elsewhere (the DaemonSet's payload).
criu_dir=$prefix/criu
if [ -n "${MIGRT_CRIU_PREBUILT:-}" ]; then
    "$MIGRT_CRIU_PREBUILT/sbin/criu" --version | grep -q 'Version: 4\.[2-9]' ||
        { log "MIGRT_CRIU_PREBUILT=$MIGRT_CRIU_PREBUILT holds no CRIU >= 4.2"; exit 1; }
    rm -rf "$criu_dir.new" && cp -a "$MIGRT_CRIU_PREBUILT" "$criu_dir.new" && rm -rf "$criu_dir" && mv "$criu_dir.new" "$criu_dir"
else
    PREFIX=$criu_dir sh "$here/packaging/build-criu.sh"
fi
"$criu_dir/sbin/criu" --version | grep -q 'Version: 4\.[2-9]' ||
    { log "CRIU 4.2 or newer is required; $criu_dir/sbin/criu says: $("$criu_dir/sbin/criu" --version 2>&1 | head -1)"; exit 1; }
# containerd 2.x checks for a `criu` on its own PATH before it serves CRI CheckpointContainer (kubelet's
# checkpoint API), then checkpoints through migrt-runc, which uses migrt's CRIU whatever containerd
# found. A node with no criu at all gets $sbindir/criu -> migrt's (MIGRT_CRIU_LINK=0: none); a node's
# own criu is left alone.
sbindir=${MIGRT_SBINDIR:-/usr/local/sbin}
if [ "${MIGRT_CRIU_LINK:-1}" = 1 ]; then
    current=$(command -v criu 2>/dev/null || true)
    if [ -z "$current" ] || [ "$(readlink -f "$current")" = "$(readlink -f "$criu_dir/sbin/criu")" ]; then
        mkdir -p "$sbindir"
        ln -sfn "$criu_dir/sbin/criu" "$sbindir/criu"
    else
        log "kept the node's own $current for containerd's CRI checkpoint check (migrt uses $criu_dir/sbin/criu)"
    fi
fi

# The venv: made with a versioned interpreter resolved once (/usr/bin/python3 -> /usr/bin/python3.11),
# recorded in $prefix/interpreter, and self-contained (no system site-packages): an apt upgrade that
# moves /usr/bin/python3 to a newer Python, or rebuilds Debian's python3-* modules for it, leaves the
# venv alone. pycriu is not on PyPI: the CRIU build's pycriu is copied in, and protobuf (its runtime)
# comes from PyPI (pyproject.toml). A venv whose interpreter vanished or changed, or that cannot import
# pycriu, is made again: re-running this script repairs an installation broken by an upgrade.
# MIGRT_PYTHON=/usr/bin/python3.X picks the interpreter; MIGRT_PYCRIU_DIR where pycriu is copied from.
venv=$prefix/venv
pycriu_src=${MIGRT_PYCRIU_DIR:-$criu_dir/python/pycriu}
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
    die "pycriu not found in $pycriu_src: rebuild migrt's CRIU (rm -rf $criu_dir, run this again) or set MIGRT_PYCRIU_DIR"
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
log "done: Python $py, CRIU $("$criu_dir/sbin/criu" --version | sed -n 's/^Version: //p') in $criu_dir," \
    "$(runc --version 2>/dev/null | head -1 || echo 'no runc'), containerd $(containerd --version 2>/dev/null | cut -d' ' -f3 || echo none)"
