#!/bin/sh
# Builds migrt's DaemonSet payload: a self-contained migrt under /opt/migrt that runs on any node with a
# C library >= the build's (Debian 12's glibc 2.36: Debian 12/13, Ubuntu 24.04), and the installer image
# that carries it (packaging/daemonset.yaml). Two commands, one recipe:
#
#   build-payload.sh stage [--source DIR]
#       Inside a Debian 12 system (packaging/Containerfile's build stage, or the chroot `image` makes),
#       as root: installs what the build needs from that system's release, then builds /opt/migrt:
#         criu/        migrt's own CRIU (packaging/build-criu.sh: 4.2.1, bundled libraries, RPATH)
#         python/      the release's CPython (bin/python3.X with an RPATH to lib/, its standard library
#                      in lib/python3.X, every shared library it and its extension modules need except
#                      the C library's own in lib/): the same interpreter Debian ships, moved out of /usr
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
#       packaging/, migrt/, hooks/, configs/config.yaml, pyproject.toml) and reuses it; the newest key
#       only is kept. Prints the path of oci.tar.
#       Environment: MIGRT_PAYLOAD_MIRRORS (apt source lines separated by '|'; default the release's
#       deb.debian.org main, -updates and -security suites), MIGRT_SKIP_APT=1 (mmdebstrap already here).
#
# The release is Debian 12 (bookworm) on purpose: its glibc 2.36 is the oldest migrt supports, so one
# build runs on every supported node. Nothing from another suite goes in.
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
stage_deps="$criu_deps xz-utils python3-venv patchelf ca-certificates"
# Bump when the recipe changes (part of the cache key).
recipe=1

log() { printf 'build-payload: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The C library's own objects: never bundled (the node's are used).
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

    # 1. CRIU (idempotent: a build whose stamp matches build-criu.sh's recipe stays)
    PREFIX=$prefix/criu MIGRT_SKIP_APT=1 sh "$src/packaging/build-criu.sh"

    # 2. The release's CPython, out of /usr: bin/python3.X with DT_RPATH $ORIGIN/../lib (DT_RPATH, not
    #    RUNPATH: it covers the extension modules' libraries too, which get $ORIGIN/../.. besides;
    #    nothing leaks into children as
    #    LD_LIBRARY_PATH would), the standard library in lib/python3.X, where the interpreter looks
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
    patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$pyd.new/bin/python$ver"
    for m in "$std"/lib-dynload/*.so; do  # (also found through the interpreter's; this way ldd shows it)
        patchelf --force-rpath --set-rpath '$ORIGIN/../..' "$m"
    done
    readelf -d "$pyd.new/bin/python$ver" | grep -q 'RPATH.*\$ORIGIN/../lib' || die "python$ver lacks its RPATH"
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

    # 5. Check it: migrt, pycriu and the standard library's C modules import with nothing from /usr
    #    on sys.path and no library outside the payload but the C library's.
    env -i PATH=/usr/bin:/bin "$venv/bin/python" -P -c '
import sys
import migrt.cli.main, migrt.shim.__main__, pycriu, google.protobuf, psutil, yaml, zstandard, pynvml
import ssl, hashlib, sqlite3, ctypes, lzma, bz2, zlib, uuid, decimal, readline
bad = [p for p in sys.path if p and not p.startswith(sys.argv[1] + "/")]
assert not bad, "sys.path outside the payload: %s" % bad
' "$prefix" || die "the payload's python cannot import what migrt needs"
    for f in "$pybin" "$pyd"/lib/python"$ver"/lib-dynload/*.so "$prefix/criu/sbin/criu"; do
        ldd "$f" | awk -v f="$f" '$2 == "=>" {print f ": " $1 " " $3}'
    done | while read -r f name path; do
        is_libc "$name" && continue
        case $path in "$prefix"/*) ;; *) die "$f loads $name from $path, outside the payload" ;; esac
    done
    "$prefix/bin/migrt" --version >/dev/null || die "$prefix/bin/migrt does not run"

    glibc=$(ldd --version | head -1 | awk '{print $NF}')
    {
        echo "payload: migrt $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("migrt"))') recipe $recipe"
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${PRETTY_NAME:-?}, glibc $glibc (nodes need glibc >= $glibc)"
        echo "prefix: $prefix"
        echo "python: $pybin $("$pybin" -c 'import sys; print(sys.version.split()[0])') (Debian $(dpkg-query -W -f '${Version}' "python$ver"))"
        echo "python libraries: $(cd "$pyd/lib" && ls | grep '\.so' | tr '\n' ' ')"
        echo "criu: $("$prefix/criu/sbin/criu" --version | sed -n 's/^Version: //p') ($(sed -n 's/^libraries: //p' "$prefix/criu/BUILD"))"
        echo "venv: $("$venv/bin/python" -c 'import importlib.metadata as m; print(" ".join(sorted("%s==%s" % (d.metadata["Name"], d.version) for d in m.distributions())))')"
    } > "$prefix/PAYLOAD"
    log "built $prefix ($(du -sh "$prefix" | cut -f1)): Python $ver, CRIU $("$prefix/criu/sbin/criu" --version | sed -n 's/^Version: //p'), glibc $glibc"
}

# The inputs of the payload from this checkout, as "sha256  path" lines (the cache key's basis).
input_sums() {
    (cd "$1" && find pyproject.toml packaging migrt hooks configs/config.yaml \
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
    printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["/opt/migrt/share/install-host.sh","--help"],"Labels":{"org.opencontainers.image.title":"migrt-installer"}},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
        "$lsum" > "$d/config"
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
            pyproject.toml README.md packaging migrt hooks configs | tar -C "$work/src" -xf -
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
-h|--help|'') sed -n '2,33p' "$0" ;;
*) die "unknown command $cmd (stage or image)" ;;
esac
