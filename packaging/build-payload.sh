#!/bin/sh
# Builds migrt's DaemonSet payload: a self-contained migrt under /opt/migrt that carries its own C library
# and dynamic loader, so it runs on any Linux node of its architecture whatever C library the node has,
# or none (docs/install.md: the supported nodes), and the installer image that carries it
# (packaging/daemonset.yaml). Two commands, one recipe:
#
#   build-payload.sh stage [--source DIR]
#       Inside a Debian 12 system (packaging/Containerfile's build stage, or the chroot `image` makes),
#       as root: installs what the build needs from that system's release, then builds /opt/migrt:
#         libc/        the release's C library: its dynamic loader (ld-linux-x86-64.so.2; on arm64
#                      ld-linux-aarch64.so.1), libc.so.6 and companions, libnss_compat, libgcc_s. The two
#                      executables below name that loader as their ELF interpreter (absolute path, room
#                      for 256 bytes: install-host.sh rewrites it for another prefix, packaging/elf-interp.sh)
#                      and libc/ in their DT_RPATH; nothing goes into the environment, so the node's
#                      programs the payload runs (runc, iptables, containerd) start on the node's own
#         criu/        migrt's own CRIU (packaging/build-criu.sh: 4.2.1, bundled libraries, RPATH)
#         python/      the release's CPython (bin/python3.X with an RPATH to lib/ and libc/, its standard
#                      library in lib/python3.X, every shared library it and its extension modules need
#                      in lib/; a sitecustomize naming the node's CA bundle where Debian's /usr/lib/ssl is
#                      absent): the same interpreter Debian ships, moved out of /usr
#         venv/        migrt (from --source, default the checkout this script is in) and its PyPI
#                      dependencies, pycriu from the CRIU build; no system site-packages
#         bin/migrt, bin/migrt-runc, libexec/cuda-criu-action   launchers bound to venv/bin/python
#         interpreter, repair, share/config.yaml, share/install-host.sh, PAYLOAD (what was built, from what)
#       Needs the network for pip (PyPI) and apt (the release's mirror).
#
#   build-payload.sh image --out DIR [--cache DIR] [--ref REF]
#       On a Debian host, as root, without a container registry or engine: mmdebstrap makes a Debian 12
#       build root (CRIU's build dependencies, python3, patchelf), runs `stage` in it with this checkout
#       copied in, then a second, minimal Debian 12 root (the Essential set: sh, coreutils, diffutils,
#       util-linux for install-host.sh; no docs, man pages or locales) with the payload at /opt/migrt.
#       Writes DIR/oci.tar (an OCI image layout with one layer, named REF, default the DaemonSet's
#       ghcr.io/migrt/migrt-installer:0.1.0: `ctr images import`, `podman load`) and DIR/PAYLOAD.
#       --cache DIR keeps the result under DIR/<key> (key: a hash of every input from this checkout:
#       $inputs below) and reuses it; the newest key
#       only is kept. Prints the path of oci.tar.
#       Environment: MIGRT_PAYLOAD_MIRRORS (apt source lines separated by '|'; default the release's
#       deb.debian.org main, -updates and -security suites), MIGRT_SKIP_APT=1 (mmdebstrap already here).
#
# The release is Debian 12 (bookworm): CPython 3.11, glibc 2.36, OpenSSL 3. Nothing from another suite
# goes in. Libraries the payload lacks are still found on the node (its /etc/ld.so.cache, /lib and
# /usr/lib): the driver's libcuda.so.1 and libnvidia-ml.so.1 (built against an old glibc, they load into
# the payload's 2.36), NSS modules that nsswitch.conf names beyond files and dns (one built against a
# newer glibc than 2.36 fails to load and is skipped, as a missing one is).
# arm64 (Grace Hopper): the same recipe on an arm64 host (mmdebstrap makes the host's architecture;
# the loader's name and the multiarch directory are read from the build root, the image's
# architecture from dpkg); across architectures, mmdebstrap --arch=arm64 with qemu-user-static's
# binfmt handlers (untested here).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
suite=bookworm
prefix=/opt/migrt
ref=ghcr.io/migrt/migrt-installer:0.1.0
repair_text="re-run the migrt installer on this node (packaging/daemonset.yaml, or packaging/install-host.sh from the migrt-installer image)"
# Packages the stage needs from the release: CRIU's build dependencies (build-criu.sh's own list;
# xz-utils unpacks its source), the interpreter with venv and ensurepip, patchelf for the
# interpreter's RPATH, CA certificates for pip.
criu_deps=$(sed -n 's/^build_deps="\(.*\)"$/\1/p' "$here/build-criu.sh")
[ -n "$criu_deps" ] || { echo "build-payload: error: no build_deps=\"...\" line in $here/build-criu.sh" >&2; exit 1; }
stage_deps="$criu_deps xz-utils python3-venv patchelf ca-certificates libseccomp2"
# What the payload is made of from a checkout (the cache key's basis; `image` copies these, README.md and
# configs/ into the build root). The rest of packaging/ (the node and test set-ups, the checks) is not.
inputs="pyproject.toml migrt hooks configs/config.yaml packaging/build-payload.sh packaging/build-criu.sh
packaging/criu packaging/install-host.sh packaging/elf-interp.sh"
# Bump when the recipe changes (part of the cache key).
recipe=2
# The kernel below which nothing in the payload can run: CRIU's floor (the C library's is 3.2).
kernel_floor=3.11
. "$here/elf-interp.sh"

log() { printf 'build-payload: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The C library's own objects: in libc/ (bundle_libc), never in python/lib or criu/lib.
is_libc() {
    case ${1##*/} in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*|libutil.so.*|libanl.so.*|ld-linux*|libnss_*|libmvec.so.*) return 0 ;;
    esac
    return 1
}

# bundle_libs DEST FILE...: every shared library the loader resolves for FILEs, except the C library's,
# copied into DEST under its soname.
bundle_libs() {
    dest=$1; shift
    for f in "$@"; do ldd "$f" 2>/dev/null; done | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
    while read -r name path; do
        is_libc "$name" && continue
        [ -e "$dest/$name" ] || cp -L "$path" "$dest/$name"
    done
}

# bundle_libc DEST: the release's C library copied into DEST: the dynamic loader (its name is the
# architecture's: ld-linux-x86-64.so.2, ld-linux-aarch64.so.1), libc and its companion libraries, the
# NSS modules not built into libc (compat; files and dns are built in since glibc 2.34, the stubs are
# copied all the same), libgcc_s (libc dlopens it to unwind a cancelled thread). Prints the loader's name.
bundle_libc() {
    interp=$(readelf -l /usr/bin/python3 | sed -n 's/.*Requesting program interpreter: \(.*\)]$/\1/p')
    [ -n "$interp" ] || die "/usr/bin/python3 names no ELF interpreter"
    libc=$(ldd /usr/bin/python3 | awk '$1 == "libc.so.6" {print $3}')
    libdir=$(dirname "$(readlink -f "$libc")")
    mkdir -p "$1"
    cp -L "$interp" "$1/${interp##*/}"
    for name in libc.so.6 libm.so.6 libmvec.so.1 libpthread.so.0 libdl.so.2 librt.so.1 libresolv.so.2 \
        libutil.so.1 libanl.so.1 libnss_compat.so.2 libnss_files.so.2 libnss_dns.so.2 libgcc_s.so.1; do
        if [ -e "$libdir/$name" ]; then cp -L "$libdir/$name" "$1/$name"
        else case $name in libc.so.6|libm.so.6|libgcc_s.so.1) die "$libdir/$name is missing" ;; esac
        fi
    done
    echo "${interp##*/}"
}

# own_libc FILE RPATH: FILE runs on the payload's C library: its interpreter PREFIX/libc/<loader> (room
# for INTERP_ROOM bytes, so that install-host.sh can move it: packaging/elf-interp.sh) and RPATH (DT_RPATH:
# it covers every library FILE loads and dlopens; nothing is set in the environment, so no child of
# FILE inherits the payload's C library).
own_libc() {
    placeholder=$(printf "%0$((INTERP_ROOM - 1))d" 0)
    patchelf --set-interpreter "$placeholder" --force-rpath --set-rpath "$2" "$1" || die "patchelf $1 failed"
    set_elf_interp "$1" "$prefix/libc/$ld" || die "cannot set $1's interpreter"
}

# check_own FILE...: every library the payload's loader resolves for FILEs lies in the payload.
check_own() {
    for f in "$@"; do
        "$prefix/libc/$ld" --list "$f" || die "$prefix/libc/$ld --list $f failed"
    done | awk '$2 == "=>" {print $1, $3}' | while read -r name path; do
        case $path in "$prefix"/*) ;; *) die "$name resolves to $path, outside the payload" ;; esac
    done
}

stage() {
    src=$(cd "$here/.." && pwd)
    while [ $# -gt 0 ]; do
        case $1 in
        --source) src=$2; shift 2 ;;
        --source=*) src=${1#*=}; shift ;;
        *) die "stage: unknown argument: $1" ;;
        esac
    done
    [ "$(id -u)" = 0 ] || die "stage must run as root (it writes $prefix)"
    [ -f "$src/pyproject.toml" ] && [ -d "$src/migrt" ] || die "--source $src is not a migrt checkout"
    . /etc/os-release
    [ ! -e "$prefix" ] || [ -f "$prefix/PAYLOAD" ] ||
        die "$prefix exists and is no payload build (a node's installation?): stage builds in a fresh Debian 12 root only"
    [ "${VERSION_CODENAME:-}" = "$suite" ] ||
        die "stage builds on Debian 12 ($suite), the oldest C library migrt supports; this is ${PRETTY_NAME:-unknown}"

    missing=
    for p in $stage_deps; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
    if [ -n "$missing" ]; then
        log "installing from the release:$missing"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; } ||
            die "apt-get install$missing failed"
    fi

    # 1. The C library, then CRIU (idempotent: a build whose stamp matches build-criu.sh's recipe
    #    stays) on it.
    rm -rf "$prefix/libc"
    ld=$(bundle_libc "$prefix/libc")
    PREFIX=$prefix/criu MIGRT_SKIP_APT=1 sh "$src/packaging/build-criu.sh"
    own_libc "$prefix/criu/sbin/criu" '$ORIGIN/../lib:$ORIGIN/../../libc'

    # 2. The release's CPython, out of /usr: bin/python3.X on the payload's C library with DT_RPATH
    #    $ORIGIN/../lib:$ORIGIN/../../libc (DT_RPATH, not RUNPATH: it covers the extension modules'
    #    libraries and ctypes' dlopen too; the extension modules get $ORIGIN/../.. besides; nothing
    #    leaks into children as LD_LIBRARY_PATH would; a library the payload lacks, e.g. the driver's
    #    libcuda.so.1, is found where the node's loader would: /etc/ld.so.cache, then /lib and /usr/lib's
    #    multiarch directories), the standard library in lib/python3.X, where the interpreter looks
    #    first (its landmark, lib/python3.X/os.py, beside its bin/), so the node's /usr/lib/python3* is
    #    never read.
    py=$(readlink -f /usr/bin/python3)
    ver=${py##*/python}
    case $ver in 3.1[1-9]) ;; *) die "$py: Python >= 3.11 needed, found $ver" ;; esac
    pyd=$prefix/python
    rm -rf "$pyd.new"
    mkdir -p "$pyd.new/bin" "$pyd.new/lib"
    cp "$py" "$pyd.new/bin/python$ver"
    ln -s "python$ver" "$pyd.new/bin/python3"
    # The standard library without its tests, IDLE, tkinter, turtle demos, the build configuration
    # (config-3.X-*: static libpython and Makefile, for compiling against Python) and Debian's
    # sitecustomize (a link into /etc/python3.X).
    cp -a "/usr/lib/python$ver" "$pyd.new/lib/"
    std=$pyd.new/lib/python$ver
    rm -rf "$std/test" "$std/idlelib" "$std/tkinter" "$std/turtledemo" "$std/dist-packages" \
        "$std/sitecustomize.py" "$std"/config-"$ver"-*
    find "$std" -xtype l -print | sed -n 1p | grep -q . && die "dangling links in $std: $(find "$std" -xtype l | head -3)"
    bundle_libs "$pyd.new/lib" "$py" "$std"/lib-dynload/*.so
    # What migrt loads with ctypes that a node may lack, or have built for a newer C library than the
    # payload's: libseccomp (migrt/seccomp/profile.py). The interpreter's DT_RPATH finds it first.
    seccomp=$(dirname "$(readlink -f "$(ldd "$py" | awk '$1 == "libc.so.6" {print $3}')")")/libseccomp.so.2
    [ -e "$seccomp" ] || die "$seccomp is missing (package libseccomp2)"
    cp -L "$seccomp" "$pyd.new/lib/libseccomp.so.2"
    own_libc "$pyd.new/bin/python$ver" '$ORIGIN/../lib:$ORIGIN/../../libc'
    for m in "$std"/lib-dynload/*.so; do  # (also found through the interpreter's; this way ldd shows it)
        patchelf --force-rpath --set-rpath '$ORIGIN/../..:$ORIGIN/../../../../libc' "$m"
    done
    readelf -d "$pyd.new/bin/python$ver" | grep -q 'RPATH.*\$ORIGIN/../lib' || die "python$ver lacks its RPATH"
    # Its OpenSSL looks for CA certificates in Debian's /usr/lib/ssl; on a node without it (RHEL, Amazon
    # Linux, SUSE) the node's own bundle is named by SSL_CERT_FILE, for this process and its children.
    cat > "$std/sitecustomize.py" <<'PY'
"""migrt's payload (packaging/build-payload.sh): its OpenSSL was built for Debian's /usr/lib/ssl. On a node
without that store, and where nothing names one (SSL_CERT_FILE, SSL_CERT_DIR), the node's own bundle."""
import os

if not ({"SSL_CERT_FILE", "SSL_CERT_DIR"} & os.environ.keys() or os.path.exists("/usr/lib/ssl/cert.pem")):
    for _ca in ("/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/certs/ca-certificates.crt", "/etc/ssl/ca-bundle.pem",
                "/etc/ssl/cert.pem"):
        if os.path.isfile(_ca):
            os.environ["SSL_CERT_FILE"] = _ca
            break
PY
    "$pyd.new/bin/python$ver" -m compileall -q "$std" >/dev/null || true
    rm -rf "$pyd" "$prefix/venv"
    mv "$pyd.new" "$pyd"
    pybin=$pyd/bin/python$ver

    # 3. The venv: made by that interpreter (ensurepip takes pip from the release's python3-pip-whl),
    #    migrt installed from the source (not editable), pycriu from the CRIU build.
    "$pybin" -m venv "$prefix/venv" || die "$pybin -m venv failed"
    venv=$prefix/venv
    "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check "$src" || die "pip install $src failed"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    cp -r "$prefix/criu/python/pycriu" "$site/pycriu"
    "$venv/bin/python" -m compileall -q "$site/pycriu" >/dev/null || true
    # pip and setuptools served the build only (a node's payload is replaced, never pip-installed
    # into); setuptools' distutils-precedence.pth would also run at every start of migrt-runc's Python.
    "$venv/bin/python" -m pip uninstall -q -y setuptools pip >/dev/null || die "pip uninstall setuptools pip failed"
    # Wheels' extension modules as PyPI ships them carry their debug information (zstandard's two: 23 MB
    # of 24); the payload keeps their code and symbols only.
    find "$venv" -name '*.so' -type f -exec strip --strip-debug {} + || die "strip --strip-debug failed"

    # 4. Launchers bound to the venv's python, the CRIU hook, the files install-host.sh copies.
    mkdir -p "$prefix/bin" "$prefix/libexec" "$prefix/share"
    printf '%s\n' "$pybin" > "$prefix/interpreter"
    printf '%s\n' "$repair_text" > "$prefix/repair"
    install -m 0644 "$src/hooks/cuda-criu-action" "$prefix/libexec/cuda-criu-action.py"
    "$venv/bin/migrt" install runtime --bindir "$prefix/bin" --python "$venv/bin/python" --repair "$repair_text" \
        --criu-hook "$prefix/libexec/cuda-criu-action" --criu-hook-source "$prefix/libexec/cuda-criu-action.py" \
        >/dev/null || die "migrt install runtime failed"
    install -m 0644 "$src/configs/config.yaml" "$prefix/share/config.yaml"
    install -m 0755 "$src/packaging/install-host.sh" "$prefix/share/install-host.sh"
    install -m 0644 "$src/packaging/elf-interp.sh" "$prefix/share/elf-interp.sh"

    # 5. Check it: migrt, pycriu and the standard library's C modules import with nothing from /usr
    #    on sys.path and no library outside the payload but the C library's.
    env -i PATH=/usr/bin:/bin "$venv/bin/python" -P -c '
import sys
import migrt.cli.main, migrt.shim.__main__, pycriu, google.protobuf, psutil, yaml, zstandard, pynvml
import ssl, hashlib, sqlite3, ctypes, lzma, bz2, zlib, uuid, decimal, readline
bad = [p for p in sys.path if p and not p.startswith(sys.argv[1] + "/")]
assert not bad, "sys.path outside the payload: %s" % bad
' "$prefix" || die "the payload's python cannot import what migrt needs"
    check_own "$pybin" "$pyd"/lib/python"$ver"/lib-dynload/*.so "$prefix/criu/sbin/criu"
    env -i "$venv/bin/python" -P -c '
import ctypes, sys
ctypes.CDLL("libseccomp.so.2")
maps = {l.split()[-1] for l in open("/proc/self/maps") if len(l.split()) > 5 and ".so" in l}
bad = sorted(p for p in maps if not p.startswith(sys.argv[1] + "/"))
assert not bad, "mapped from outside the payload: %s" % bad
' "$prefix" || die "the payload's python maps a library from outside the payload"
    "$prefix/bin/migrt" --version >/dev/null || die "$prefix/bin/migrt does not run"

    glibc=$(ldd --version | head -1 | awk '{print $NF}')
    {
        echo "payload: migrt $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("migrt"))') recipe $recipe"
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${PRETTY_NAME:-?}, glibc $glibc (its own, in libc/: a node needs no C library)"
        echo "needs: $(uname -m), Linux >= $kernel_floor"
        echo "libc: $prefix/libc/$ld $(cd "$prefix/libc" && ls | grep -v "^$ld\$" | tr '\n' ' ')"
        echo "prefix: $prefix"
        echo "python: $pybin $("$pybin" -c 'import sys; print(sys.version.split()[0])') (Debian $(dpkg-query -W -f '${Version}' "python$ver"))"
        echo "python libraries: $(cd "$pyd/lib" && ls | grep '\.so' | tr '\n' ' ')"
        echo "criu: $("$prefix/criu/sbin/criu" --version | sed -n 's/^Version: //p') ($(sed -n 's/^libraries: //p' "$prefix/criu/BUILD"))"
        echo "venv: $("$venv/bin/python" -c 'import importlib.metadata as m; print(" ".join(sorted("%s==%s" % (d.metadata["Name"], d.version) for d in m.distributions())))')"
    } > "$prefix/PAYLOAD"
    log "built $prefix ($(du -sh "$prefix" | cut -f1)): Python $ver, CRIU $("$prefix/criu/sbin/criu" --version | sed -n 's/^Version: //p'), its own glibc $glibc"
}

# The inputs of the payload from this checkout, as "sha256  path" lines (the cache key's basis).
input_sums() {
    # shellcheck disable=SC2086
    (cd "$1" && find $inputs \
        \( -name __pycache__ -o -name '*.pyc' -o -name '*.egg-info' \) -prune -o -type f -print |
        LC_ALL=C sort | xargs sha256sum)
}

# oci_layout ROOTFS_TAR OUT_TAR REF: an OCI image layout (one uncompressed layer) as a tar.
oci_layout() {
    layer=$1 oci_out=$2 name=$3
    d=$(mktemp -d "${TMPDIR:-/tmp}/migrt-oci.XXXXXX")
    mkdir -p "$d/blobs/sha256"
    lsum=$(sha256sum "$layer" | cut -d' ' -f1)
    lsize=$(stat -c %s "$layer")
    ln "$layer" "$d/blobs/sha256/$lsum" 2>/dev/null || cp "$layer" "$d/blobs/sha256/$lsum"
    printf '{"architecture":"%s","os":"linux","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["/opt/migrt/share/install-host.sh","--help"],"Labels":{"org.opencontainers.image.title":"migrt-installer"}},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
        "$(dpkg --print-architecture)" "$lsum" > "$d/config"
    csum=$(sha256sum "$d/config" | cut -d' ' -f1)
    csize=$(stat -c %s "$d/config")
    mv "$d/config" "$d/blobs/sha256/$csum"
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
        "$csum" "$csize" "$lsum" "$lsize" > "$d/manifest"
    msum=$(sha256sum "$d/manifest" | cut -d' ' -f1)
    msize=$(stat -c %s "$d/manifest")
    mv "$d/manifest" "$d/blobs/sha256/$msum"
    printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
        "$msum" "$msize" "$name" "${name##*:}" > "$d/index.json"
    printf '{"imageLayoutVersion":"1.0.0"}' > "$d/oci-layout"
    tar -C "$d" -cf "$oci_out.tmp" oci-layout index.json blobs
    mv "$oci_out.tmp" "$oci_out"
    rm -rf "$d"
}

image() {
    out= cache=
    while [ $# -gt 0 ]; do
        case $1 in
        --out) out=$2; shift 2 ;;
        --out=*) out=${1#*=}; shift ;;
        --cache) cache=$2; shift 2 ;;
        --cache=*) cache=${1#*=}; shift ;;
        --ref) ref=$2; shift 2 ;;
        --ref=*) ref=${1#*=}; shift ;;
        *) die "image: unknown argument: $1" ;;
        esac
    done
    [ -n "$out" ] || [ -n "$cache" ] || die "image: give --out DIR and/or --cache DIR"
    [ "$(id -u)" = 0 ] || die "image must run as root (mmdebstrap --mode=root, chroot)"
    repo=$(cd "$here/.." && pwd)
    mirrors=${MIGRT_PAYLOAD_MIRRORS:-"deb http://deb.debian.org/debian $suite main|deb http://deb.debian.org/debian $suite-updates main|deb http://deb.debian.org/debian-security $suite-security main"}
    key=$({ input_sums "$repo"; echo "recipe $recipe; ref $ref; suite $suite; mirrors $mirrors"; } | sha256sum | cut -c1-16)
    if [ -n "$cache" ] && [ -f "$cache/$key/oci.tar" ] && [ -f "$cache/$key/PAYLOAD" ]; then
        log "reusing $cache/$key (inputs unchanged)"
        result=$cache/$key
    else
        if ! command -v mmdebstrap >/dev/null 2>&1; then
            [ "${MIGRT_SKIP_APT:-0}" != 1 ] || die "mmdebstrap is not installed (apt-get install mmdebstrap)"
            log "installing mmdebstrap from the node's release"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null ||
                { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null; } ||
                die "apt-get install mmdebstrap failed"
        fi
        work=$(mktemp -d "${TMPDIR:-/var/tmp}/migrt-payload.XXXXXX")
        trap 'rm -rf "$work"' EXIT
        # The checkout's inputs (and README.md, the package's long description), nothing else.
        mkdir -p "$work/src"
        tar -C "$repo" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' -cf - \
            README.md configs $inputs | tar -C "$work/src" -xf -
        # pip in the build root trusts what this host's pip trusts (PIP_CERT, else the system bundle:
        # a TLS-inspecting proxy's CA is there, not in the root's ca-certificates).
        ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
        pipca=
        if [ -f "$ca" ]; then cp "$ca" "$work/src/.pip-ca.pem"; pipca=PIP_CERT=/src/.pip-ca.pem; fi
        oldifs=$IFS; IFS='|'; set -- $mirrors; IFS=$oldifs
        slim="--dpkgopt=path-exclude=/usr/share/man/* --dpkgopt=path-exclude=/usr/share/locale/* --dpkgopt=path-exclude=/usr/share/doc/* --dpkgopt=path-include=/usr/share/doc/*/copyright --dpkgopt=path-exclude=/usr/share/info/*"
        log "building the payload in a Debian 12 root (mmdebstrap; CRIU's build takes minutes)"
        t0=$(date +%s)
        # shellcheck disable=SC2086
        mmdebstrap --quiet --mode=root --variant=apt --include="$(echo $stage_deps | tr ' ' ',')" $slim \
            --customize-hook="copy-in $work/src /" \
            --customize-hook='chroot "$1" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 MIGRT_CRIU_JOBS='"${MIGRT_CRIU_JOBS:-$(nproc)}"' '"$pipca"' sh /src/packaging/build-payload.sh stage --source /src' \
            --customize-hook="sync-out $prefix $work/payload" \
            "$suite" /dev/null "$@" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; die "the payload build failed"; }
        t1=$(date +%s)
        log "payload built in $((t1 - t0)) s; making the image root"
        # shellcheck disable=SC2086
        mmdebstrap --quiet --mode=root --variant=essential $slim \
            --dpkgopt=path-exclude=/usr/lib/x86_64-linux-gnu/gconv/* \
            --customize-hook="mkdir -p \"\$1$prefix\"" --customize-hook="sync-in $work/payload $prefix" \
            "$suite" "$work/rootfs.tar" "$@" >"$work/image.log" 2>&1 || { tail -40 "$work/image.log" >&2; die "mmdebstrap (image root) failed"; }
        result=${cache:+$cache/$key}
        result=${result:-$out}
        mkdir -p "$result"
        oci_layout "$work/rootfs.tar" "$result/oci.tar" "$ref"
        cp "$work/payload/PAYLOAD" "$result/PAYLOAD"
        echo "key: $key" >> "$result/PAYLOAD"
        log "image $ref in $result/oci.tar ($(du -h "$result/oci.tar" | cut -f1); image root in $(($(date +%s) - t1)) s)"
        if [ -n "$cache" ]; then  # the newest key only
            for old in "$cache"/*/; do
                [ "${old%/}" = "$cache/$key" ] || rm -rf "${old%/}"
            done
        fi
    fi
    if [ -n "$out" ] && [ "$out" != "$result" ]; then
        mkdir -p "$out"
        cp "$result/oci.tar" "$result/PAYLOAD" "$out/"
        result=$out
    fi
    echo "$result/oci.tar"
}

cmd=${1:-}
[ $# -eq 0 ] || shift
case $cmd in
stage) stage "$@" ;;
image) image "$@" ;;
-h|--help|'') sed -n '2,48p' "$0" ;;
*) die "unknown command $cmd (stage or image)" ;;
esac
