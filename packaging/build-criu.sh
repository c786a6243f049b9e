#!/bin/sh
# Builds migrt's own CRIU from CRIU's release source (packaging/criu/criu_<version>.orig.tar.xz, the
# tarball Debian ships, checked against its SHA-256 below) and installs it under $PREFIX (default
# /opt/migrt/criu):
#   sbin/criu                  the binary, with an RPATH to lib/ (DT_RPATH, so it covers the whole
#                              dependency tree; no LD_LIBRARY_PATH leaks into CRIU's children)
#   lib/                       every shared library it needs except the C library itself, copied from
#                              the build machine: the build serves any glibc >= the build's (the node
#                              payload, build-payload.sh, adds the build's C library and loader beside it
#                              and makes it the binary's interpreter: it then runs on any C library)
#   lib/criu-plugins/          CRIU's plugin directory, empty (a node's /usr/lib/criu plugins, e.g.
#                              CRIU's own CUDA plugin, are never loaded: migrt drives the GPU itself)
#   python/pycriu/             pycriu generated from the same source (setup-host.sh copies it into the venv)
#   BUILD                      what was built, from what, on which C library
# migrt's patches (packaging/criu/patches/*.patch, in name order) are applied to the source first, each
# checked applied; their checksum is part of the recipe. 0001: a lazy dump that keeps no page pipes
# (MIGRT_CRIU_LAZY_NO_PIPES=1; migrt's parallel dump and lazy migration set it: docs/dump-pages.md).
# Why: distributions ship CRIU 3.17 (Debian 12), 4.1 (Debian 13) or nothing recent (Ubuntu 24.04,
# RHEL 9); migrt needs >= 4.2 (3.17 fails on 6.x kernels' vDSO, 4.1 cannot dump inet sockets on
# kernels >= 6.16). Built on Debian 12 (glibc 2.36), one build serves Debian 12/13 and Ubuntu 24.04
# alike as it is, and every node once in the payload.
#
# Idempotent: an installation whose BUILD stamp matches this script's recipe is left alone.
# Options (environment): PREFIX, MIGRT_SKIP_APT=1 (build dependencies already there), MIGRT_CRIU_JOBS.
# Build dependencies come from the node's own release (apt-get install, never another suite):
# gcc make pkgconf libbsd-dev libcap-dev libnet1-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev
# protobuf-c-compiler protobuf-compiler uuid-dev python3 patch.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
prefix=${PREFIX:-/opt/migrt/criu}
version=4.2.1
sha256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
tarball=$here/criu/criu_$version.orig.tar.xz
patches=$(ls "$here"/criu/patches/*.patch 2>/dev/null | LC_ALL=C sort)
patches_sum=$( [ -z "$patches" ] || cat $patches | sha256sum | cut -c1-16)
# Bump when the recipe changes: an installation with another stamp is rebuilt.
recipe="criu $version; no gnutls; plugins $prefix/lib/criu-plugins; rpath \$ORIGIN/../lib; bundled libs; patches ${patches_sum:-none}; recipe 2"
build_deps="gcc make pkgconf libbsd-dev libcap-dev libnet1-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler uuid-dev python3 patch"

log() { printf 'build-criu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

if [ -x "$prefix/sbin/criu" ] && [ "$(sed -n 's/^recipe: //p' "$prefix/BUILD" 2>/dev/null)" = "$recipe" ] &&
    "$prefix/sbin/criu" --version 2>/dev/null | grep -q "Version: $version"; then
    log "$prefix holds CRIU $version (up to date)"
    exit 0
fi
[ "$(id -u)" = 0 ] || [ "${MIGRT_SKIP_APT:-0}" = 1 ] || die "must run as root (or MIGRT_SKIP_APT=1 with the build dependencies installed)"
[ -f "$tarball" ] || die "$tarball is missing"
echo "$sha256  $tarball" | sha256sum -c --quiet - >/dev/null 2>&1 || die "$tarball: SHA-256 mismatch (expected $sha256)"

if [ "${MIGRT_SKIP_APT:-0}" != 1 ]; then
    missing=
    for p in $build_deps; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
    if [ -n "$missing" ]; then
        log "installing build dependencies from the node's release:$missing"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq --no-install-recommends $missing >/dev/null ||
            { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; } ||
            die "apt-get install$missing failed"
    fi
fi

work=$(mktemp -d /tmp/migrt-criu-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
tar -xJf "$tarball" -C "$work"
src=$work/criu-$version
for p in $patches; do
    patch -d "$src" -p1 --forward --batch < "$p" >"$work/patch.log" 2>&1 ||
        { cat "$work/patch.log" >&2; die "${p##*/} does not apply to CRIU $version"; }
    patch -d "$src" -p1 --reverse --dry-run --batch < "$p" >/dev/null 2>&1 || die "${p##*/}: not applied after patching"
    log "applied ${p##*/}"
done
jobs=${MIGRT_CRIU_JOBS:-$(nproc 2>/dev/null || echo 2)}
log "building CRIU $version ($jobs jobs)"
# The RPATH rides on GMONLDOPT, the one variable CRIU's Makefile puts on the final link of criu/criu
# only (LDFLAGS also reaches `ld -r` of the partial objects, which rejects -Wl options).
# '$' and the shell's backslash keep '$ORIGIN' literal up to the linker.
if ! make -C "$src" -j"$jobs" NO_GNUTLS=1 PLUGINDIR="$prefix/lib/criu-plugins" \
        GMONLDOPT='-Wl,-rpath,\$$ORIGIN/../lib -Wl,--disable-new-dtags' criu lib >"$work/build.log" 2>&1; then
    tail -30 "$work/build.log" >&2
    die "make failed (the lines above; build dependencies: $build_deps)"
fi
bin=$src/criu/criu
readelf -d "$bin" | grep -q 'RPATH.*\$ORIGIN/../lib' || die "the CRIU binary lacks its RPATH (\$ORIGIN/../lib)"

# Stage, then swap in whole: a half-copied prefix never replaces a working one.
new=$prefix.new
rm -rf "$new"
mkdir -p "$new/sbin" "$new/lib/criu-plugins" "$new/python"
install -m 0755 "$bin" "$new/sbin/criu"
# Every library the loader resolves for the binary, except the C library's own (libc, libm, ld.so ...).
ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
    case ${lib##*/} in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*|ld-linux*) continue ;;
    esac
    cp -L "$lib" "$new/lib/${lib##*/}"
done
cp -r "$src/lib/pycriu" "$new/python/pycriu"
find "$new/python" \( -name Makefile -o -name '*.pyc' -o -name __pycache__ \) -prune -exec rm -rf {} +
glibc=$(ldd --version 2>/dev/null | head -1 | awk '{print $NF}')
{
    echo "recipe: $recipe"
    echo "source: criu_$version.orig.tar.xz sha256 $sha256"
    echo "patches: $(for p in $patches; do printf '%s ' "${p##*/}"; done)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}"), glibc $glibc"
    echo "libraries: $(ls "$new/lib" | grep -v criu-plugins | tr '\n' ' ')"
} > "$new/BUILD"
"$new/sbin/criu" --version | grep -q "Version: $version" || die "the staged CRIU does not run: $("$new/sbin/criu" --version 2>&1 | head -2)"
rm -rf "$prefix.old"
[ ! -e "$prefix" ] || mv "$prefix" "$prefix.old"
mv "$new" "$prefix"
rm -rf "$prefix.old"
log "installed CRIU $version in $prefix (glibc $glibc; $(ls "$prefix/lib" | grep -c '\.so') bundled libraries)"
