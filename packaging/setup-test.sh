#!/bin/sh
# Test-only components (scripts/test.sh runs this after setup-host.sh; never needed on a node).
# No other suite's package is ever installed. Installing from the release may take the same-release
# point updates apt requires (on Debian 12, podman takes login and passwd +deb12u2 where +deb12u1 is
# installed): listed as they are taken; a removal, a downgrade or another release's version is refused
# (packaging/apt-release.sh; packaging/base-check.sh compare --point-updates checks it afterwards).
#  - from the node's own release (apt-get install): podman, docker-registry, apache2-utils (htpasswd),
#    openssl, busybox-static, containernetworking-plugins, iproute2, nftables, gcc (test workloads
#    in C), runc and containerd (on Debian 12: runc 1.1.5 and containerd 1.6.20, the oldest that migrt
#    supports; tests/integration/test_oldest.py runs them);
#  - newer components, downloaded as .debs and unpacked (`dpkg-deb -x`, not installed) under
#    $MIGRT_DEPS (default /opt/migrt-deps), with a private apt configuration ($MIGRT_DEPS/apt: its own
#    sources, lists and cache; /etc/apt is not touched): runc 1.3 and containerd 2.1 (sid), containerd
#    1.7 (trixie), checkpointctl (sid), the CRI API's proto files (sid's Go source packages);
#    $MIGRT_DEPS/bin hard-links runc, containerd, ctr, containerd-shim-runc-v2 and checkpointctl there:
#    scripts/test.sh puts it first on PATH, so the tests run runc 1.3 and containerd 2.1 by default.
# Options (environment): MIGRT_DEPS, MIGRT_SKIP_APT=1 (everything already there).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
deps=${MIGRT_DEPS:-/opt/migrt-deps}
log() { printf 'setup-test: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
. "$here/packaging/apt-release.sh"
[ "$(id -u)" = 0 ] || die "must run as root"
[ "${MIGRT_SKIP_APT:-0}" != 1 ] || { log "MIGRT_SKIP_APT=1: nothing installed"; exit 0; }
export DEBIAN_FRONTEND=noninteractive

# 1. The node's own release.
release_debs="podman docker-registry apache2-utils openssl busybox-static containernetworking-plugins iproute2 nftables iptables gcc libc6-dev patchelf runc containerd"
missing=$(apt_absent $release_debs)
if [ -n "$missing" ]; then
    log "installing from the node's release:$missing"
    apt_release_install test $missing
fi
# Packages' services (containerd, docker-registry) may have started: the tests run private instances and
# need neither; a node's own would be left alone, but these came with this script.
for s in containerd docker-registry; do
    if [ -n "$(echo "$missing" | grep -w "$s")" ] && command -v systemctl >/dev/null 2>&1 && systemctl is-active -q "$s" 2>/dev/null; then
        systemctl disable --now -q "$s" 2>/dev/null || true
    fi
done

# 2. Newer components, unpacked under $deps. name|package/suite|file that shows it is there.
apt_dir=$deps/apt
unpacked="runc-1.3|runc/sid|usr/sbin/runc
containerd-2.1|containerd/sid|usr/bin/containerd
containerd-1.7|containerd/trixie|usr/bin/containerd
checkpointctl|checkpointctl/sid|usr/bin/checkpointctl
glibc-sid|libc6/sid|usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
cri-api|golang-github-kubernetes-cri-api-dev/sid|usr/share/gocode/src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto
gogo-protobuf|golang-github-gogo-protobuf-dev/sid|usr/share/gocode/src/github.com/gogo/protobuf/gogoproto/gogo.proto"
need=
for line in $unpacked; do
    name=${line%%|*}; rest=${line#*|}; show=${rest#*|}
    [ -e "$deps/$name/$show" ] || need="$need $line"
done
if [ -n "$need" ]; then
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/empty"
    cat > "$apt_dir/sources.list" <<'SRC'
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
SRC
    set -- -o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts="$apt_dir/empty" \
        -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache::Archives="$apt_dir/archives" \
        -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o Dir::Etc::Preferences="$apt_dir/empty/none" \
        -o Dir::Etc::PreferencesParts="$apt_dir/empty" -o APT::Sandbox::User=root
    log "private apt lists (sid, trixie) in $apt_dir"
    apt-get "$@" update -qq || die "apt-get update (private lists in $apt_dir) failed"
    for line in $need; do
        name=${line%%|*}; rest=${line#*|}; pkg=${rest%%|*}; show=${rest#*|}
        tmp=$(mktemp -d)
        (cd "$tmp" && apt-get "$@" download -qq "$pkg" >/dev/null) || { rm -rf "$tmp"; die "apt-get download $pkg failed"; }
        rm -rf "$deps/$name.new"
        mkdir -p "$deps/$name.new"
        dpkg-deb -x "$tmp"/*.deb "$deps/$name.new"
        ls "$tmp"/*.deb | sed 's|.*/||' > "$deps/$name.new/FROM"
        rm -rf "$tmp"
        [ -e "$deps/$name.new/$show" ] || die "$pkg: $show not in the package"
        rm -rf "$deps/$name"
        mv "$deps/$name.new" "$deps/$name"
        log "unpacked $(cat "$deps/$name/FROM") into $deps/$name"
    done
fi

# sid's runc and checkpointctl are linked against a newer glibc than Debian 12's (2.38 symbols): those
# copies get sid's C library, unpacked beside them, as their ELF interpreter and first library path
# (patchelf; the host's libc is not touched, and runc's re-exec of itself keeps working).
private_libc() {  # BINARY: make it run here
    out=$("$1" --help 2>&1) && return 0
    echo "$out" | grep -q "GLIBC_.* not found" || die "$1 does not run here: $(echo "$out" | head -2)"
    libdir=$deps/glibc-sid/usr/lib/x86_64-linux-gnu
    patchelf --set-interpreter "$libdir/ld-linux-x86-64.so.2" --set-rpath "$libdir:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" "$1" ||
        die "patchelf $1 failed"
    log "$1 runs with sid's C library ($libdir)"
}
private_libc "$deps/runc-1.3/usr/sbin/runc"
private_libc "$deps/checkpointctl/usr/bin/checkpointctl"
# Hard links, not symbolic ones: migrt-runc's fast path hands every call whose runtime path holds a
# symbolic link to Python (its trust rule), which would make every pass-through call of the tests slow.
mkdir -p "$deps/bin"
put() { rm -f "$2"; ln "$1" "$2" 2>/dev/null || cp -p "$1" "$2"; }
put "$deps/runc-1.3/usr/sbin/runc" "$deps/bin/runc"
for b in containerd ctr containerd-shim-runc-v2; do put "$deps/containerd-2.1/usr/bin/$b" "$deps/bin/$b"; done
put "$deps/checkpointctl/usr/bin/checkpointctl" "$deps/bin/checkpointctl"
# The CRI proto files, merged in one tree (tests/helpers/cri.py generates its stubs from it).
mkdir -p "$deps/gocode"
cp -a "$deps/cri-api/usr/share/gocode/src/." "$deps/gocode/"
cp -a "$deps/gogo-protobuf/usr/share/gocode/src/." "$deps/gocode/"
for b in runc containerd; do
    "$deps/bin/$b" --version >/dev/null 2>&1 || die "$deps/bin/$b does not run here: $("$deps/bin/$b" --version 2>&1 | head -2)"
done
"$deps/bin/checkpointctl" --help >/dev/null 2>&1 || die "$deps/bin/checkpointctl does not run here"
log "done: $("$deps/bin/runc" --version | head -1), containerd $("$deps/bin/containerd" --version | cut -d' ' -f3)" \
    "(first on the tests' PATH); the release's $(runc --version | head -1), containerd $(containerd --version | cut -d' ' -f3)"
