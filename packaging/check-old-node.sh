#!/bin/sh
# Checks that the node payload (packaging/build-payload.sh) runs on a node whose C library is older than
# the payload's own (Debian 12's glibc 2.36): a fresh Debian 11 root (glibc 2.31) made by mmdebstrap, the
# payload installed there by its own installer (share/install-host.sh, run in the root), then in the root:
#   - the install: its time, and a second run's ("up to date": a DaemonSet pod restarting);
#   - `migrt doctor` (its criu, lower runtime and kernel checks ok) and `criu check` ("Looks good");
#   - the payload's python (packaging/check-old-node.py): every library it maps is the payload's (its
#     libseccomp too), a node library still loads through ctypes (libacl.so.1, found by the node's
#     /etc/ld.so.cache, as the driver's libcuda.so.1 is), names
#     resolve (localhost, a name in /etc/hosts, with nsswitch.conf naming modules the payload lacks),
#     C.UTF-8 and an absent locale, an https request to a local server whose CA is only in the node's
#     store (Debian's path, then RHEL's), and a child (the node's cat) that starts on the node's C
#     library with no LD_* variable inherited;
#   - a runc container (busybox, counting with 400 KB of data in memory) checkpointed by the installed
#     migrt and restored by it: the count goes on with the same data.
#
#   check-old-node.sh [--image OCI_TAR | --payload DIR] [--runc PATH] [--suite SUITE] [--keep]
#
#   --image OCI_TAR  the installer image (build-payload.sh image's oci.tar); default: build it, or reuse
#                    the build cached in $MIGRT_PAYLOAD_CACHE (default $MIGRT_DEPS/payload, /opt/migrt-deps)
#   --payload DIR    a payload already unpacked (the image's /opt/migrt) instead
#   --runc PATH      runc >= 1.1 for the root (default: runc on PATH). Debian 11's own runc (1.0) is too
#                    old for migrt. A runc whose ELF interpreter lies outside the system's (the tests'
#                    runc 1.3 with sid's C library, /opt/migrt-deps) gets that directory copied along
#   --suite SUITE    the old release (default bullseye: glibc 2.31)
#   --keep           leave the root (its path is printed)
# Needs root, mmdebstrap, openssl (the test CA) and the network to a Debian mirror (MIGRT_OLD_MIRROR, default
# deb.debian.org). Loopback traffic only; the root shares this machine's network namespace.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
image= payload= runc=$(command -v runc || true) suite=bullseye keep=0
log() { printf 'check-old-node: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
while [ $# -gt 0 ]; do
    case $1 in
    --image) image=$2; shift 2 ;;
    --payload) payload=$2; shift 2 ;;
    --runc) runc=$2; shift 2 ;;
    --suite) suite=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
    esac
done
[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap, chroot, runc)"
command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (apt-get install mmdebstrap)"
command -v openssl >/dev/null || die "openssl is not installed (the test CA; apt-get install openssl)"
[ -n "$runc" ] && [ -x "$runc" ] || die "no runc: give --runc PATH (runc >= 1.1)"
. "$here/elf-interp.sh"
if [ -n "$payload" ]; then
    [ -f "$payload/PAYLOAD" ] || die "--payload $payload: no PAYLOAD there (an unpacked /opt/migrt of the image)"
elif [ -z "$image" ]; then
    image=$(sh "$here/build-payload.sh" image --cache "${MIGRT_PAYLOAD_CACHE:-${MIGRT_DEPS:-/opt/migrt-deps}/payload}" | tail -1) ||
        die "the payload build failed"
fi
[ -n "$payload" ] || [ -f "$image" ] || die "--image $image: no such file"

work=$(mktemp -d "${TMPDIR:-/var/tmp}/migrt-old-node.XXXXXX")
root=$work/root
ct1=migrt-old-node-$$-1 ct2=migrt-old-node-$$-2
cleanup() {
    if [ -f "$work/enter" ] && mountpoint -q "$root/run"; then
        for c in $ct1 $ct2; do in_node runc delete --force "$c" >/dev/null 2>&1 || true; done
    fi
    for m in run sys dev proc; do
        if mountpoint -q "$root/$m" 2>/dev/null; then umount -R "$root/$m" 2>/dev/null || umount -R -l "$root/$m"; fi
    done
    if [ "$keep" = 1 ]; then log "root kept in $root"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. The old root: minbase, iptables (CRIU's network lock), busybox-static (the container's rootfs),
#    libseccomp2 (runc's).
mirror=${MIGRT_OLD_MIRROR:-http://deb.debian.org/debian}
log "making a $suite root (mmdebstrap minbase)"
mmdebstrap --quiet --mode=root --variant=minbase --include=iptables,busybox-static,libseccomp2 \
    "$suite" "$root" "deb $mirror $suite main" >"$work/mmdebstrap.log" 2>&1 ||
    { tail -20 "$work/mmdebstrap.log" >&2; die "mmdebstrap $suite failed"; }
glibc=$(chroot "$root" ldd --version | head -1 | awk '{print $NF}')
log "$suite root: glibc $glibc"

# 2. runc, with its private C library if it has one.
interp=$(elf_interp "$runc" 2>/dev/null || true)
case $interp in
''|/lib/*|/lib64/*|/usr/lib/*|/usr/lib64/*) ;;
*) d=$(dirname "$interp"); mkdir -p "$root$d"; cp -a "$d/." "$root$d/" ;;
esac
install -m 0755 "$runc" "$root/usr/local/sbin/runc"
out=$(chroot "$root" /usr/local/sbin/runc --version 2>&1) ||
    die "$runc does not run in the $suite root (give --runc: a static runc, or one with its own C library): $(echo "$out" | head -2)"
rv=$(echo "$out" | sed -n 's/^runc version //p')
case $rv in 1.0.*|0.*|'') die "runc $rv in the root: migrt needs runc >= 1.1 (give --runc)" ;; esac

# 3. The node's mounts: /proc, /sys (cgroups with it), /dev, a fresh /run. Slaves: unmounting them
#    later never reaches this machine's own.
mount -t proc proc "$root/proc"
for m in sys dev; do mount --rbind "/$m" "$root/$m"; mount --make-rslave "$root/$m"; done
mount -t tmpfs -o mode=0755 tmpfs "$root/run"

# 4. The payload, from the image's one layer, installed by its own installer, run in the root.
if [ -n "$payload" ]; then
    cp -a "$payload" "$root/tmp/migrt-payload"
else
    mkdir -p "$work/oci"
    tar -xf "$image" -C "$work/oci" index.json
    mdigest=$(sed -n 's/.*"digest":"sha256:\([0-9a-f]*\)".*/\1/p' "$work/oci/index.json")
    tar -xf "$image" -C "$work/oci" "blobs/sha256/$mdigest"
    ldigest=$(sed -n 's/.*"layers":\[{[^}]*"digest":"sha256:\([0-9a-f]*\)".*/\1/p' "$work/oci/blobs/sha256/$mdigest")
    [ -n "$ldigest" ] || die "$image: no layer in its manifest"
    tar -xOf "$image" "blobs/sha256/$ldigest" | tar -x -C "$work/oci" ./opt/migrt
    mv "$work/oci/opt/migrt" "$root/tmp/migrt-payload"
fi
path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
in_root() { chroot "$root" env -i PATH=$path HOME=/root LANG=C.UTF-8 "$@"; }
# in_node CMD...: CMD with the root as the / of a mount namespace of its own (pivot_root), as on a node:
# CRIU reads the mount tree, which a chroot cuts off from its root.
cat > "$work/enter" <<'EOF_ENTER'
r=$1 p=$2; shift 2
mount --rbind "$r" "$r" && cd "$r" && mkdir -p .oldroot && pivot_root . .oldroot || exit 1
exec /usr/sbin/chroot . /bin/sh -c 'umount -l /.oldroot && rmdir /.oldroot &&
    exec env -i PATH="$0" HOME=/root LANG=C.UTF-8 "$@"' "$p" "$@"
EOF_ENTER
in_node() { unshare --mount --propagation private -- sh "$work/enter" "$root" "$path" "$@"; }
install_once() {
    t0=$(date +%s%N)
    in_root sh /tmp/migrt-payload/share/install-host.sh --source /tmp/migrt-payload --no-containerd 2>&1 ||
        die "install-host.sh failed in the $suite root"
    echo "$(( ($(date +%s%N) - t0) / 1000000 ))"
}
out=$(install_once); ms1=$(echo "$out" | tail -1)
echo "$out" | grep -q "installed /opt/migrt" || die "the first install did not install: $out"
out=$(install_once); ms2=$(echo "$out" | tail -1)
echo "$out" | grep -q "/opt/migrt is up to date" || die "the second install was not 'up to date': $out"
[ "$ms2" -lt 5000 ] || die "an install over the same payload took $ms2 ms (5 s at most)"
log "installed in the $suite root: $ms1 ms; again (up to date): $ms2 ms; $(du -sh "$root/opt/migrt" | cut -f1) unpacked"

# 5. doctor, criu check, the payload's python on this node (packaging/check-old-node.py).
in_node migrt doctor --json > "$root/tmp/doctor.json" || true
in_node /opt/migrt/criu/sbin/criu check > "$work/criu-check.log" 2>&1 ||
    { cat "$work/criu-check.log" >&2; die "criu check failed in the $suite root"; }
grep -q "Looks good" "$work/criu-check.log" || { cat "$work/criu-check.log" >&2; die "criu check: no 'Looks good'"; }
log "criu check: $(tail -1 "$work/criu-check.log")"
# The test CA and a certificate for localhost (made here: the root has no openssl).
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=migrt-check-ca -keyout "$work/ca.key" \
    -out "$root/tmp/ca.pem" >/dev/null 2>&1 || die "openssl: the test CA"
openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout "$root/tmp/server.key" -out "$work/server.csr" >/dev/null 2>&1 &&
    printf 'subjectAltName=DNS:localhost\n' > "$work/san" &&
    openssl x509 -req -in "$work/server.csr" -CA "$root/tmp/ca.pem" -CAkey "$work/ca.key" -CAcreateserial -days 2 \
        -extfile "$work/san" -out "$root/tmp/server.pem" >/dev/null 2>&1 || die "openssl: the server certificate"
echo "10.254.254.7 migrt-check-host" >> "$root/etc/hosts"
printf 'passwd: compat\ngroup: files\nhosts: files mdns4_minimal [NOTFOUND=return] resolve myhostname dns\n' > "$root/etc/nsswitch.conf"
cp "$here/check-old-node.py" "$root/tmp/check-old-node.py"
in_node /opt/migrt/venv/bin/python -P /tmp/check-old-node.py /tmp/doctor.json ||
    die "the payload's python in the $suite root (above)"

# 6. A runc container: checkpointed and restored by the installed migrt.
in_node sh -c '
set -e
b=/srv/ct; mkdir -p $b/rootfs/bin $b/rootfs/tmp $b/rootfs/proc $b/rootfs/dev $b/rootfs/sys
cp /bin/busybox $b/rootfs/bin/busybox
for a in $(/bin/busybox --list); do [ -e $b/rootfs/bin/$a ] || ln -s busybox $b/rootfs/bin/$a; done
cd $b && runc spec'
in_node /opt/migrt/venv/bin/python -P /tmp/check-old-node.py --bundle /srv/ct/config.json
ctr_log=$root/srv/ct/rootfs/tmp/ticks
in_node sh -c 'cd /srv/ct && exec runc run -d "$0" </dev/null >/dev/null 2>&1' "$ct1" || die "runc run $ct1 failed in the $suite root"
ticks() { n=$(grep -c '^tick ' "$ctr_log" 2>/dev/null) || true; echo "${n:-0}"; }
wait_ticks() {  # N: until the log holds N ticks (15 s at most)
    i=0; while [ "$(ticks)" -lt "$1" ] && [ $i -lt 150 ]; do sleep 0.1; i=$((i + 1)); done
    [ "$(ticks)" -ge "$1" ] || die "the container wrote $(ticks) ticks, $1 awaited ($ctr_log)"
}
wait_ticks 3
t0=$(date +%s%N)
in_node migrt checkpoint $ct1 --root /run/runc --name old-node-ck >/dev/null || die "migrt checkpoint $ct1 failed in the $suite root"
t1=$(date +%s%N)
last=$(grep '^tick ' "$ctr_log" | tail -1)
in_node runc delete --force $ct1 >/dev/null 2>&1 || true
in_node migrt restore old-node-ck $ct2 --bundle /srv/ct --root /run/runc >/dev/null || die "migrt restore failed in the $suite root"
t2=$(date +%s%N)
n=$(ticks)
wait_ticks $((n + 3))
after=$(grep '^tick ' "$ctr_log" | tail -1)
in_node runc delete --force $ct2 >/dev/null 2>&1 || true
set -- $last; lastn=$2 hash=$3
set -- $after
[ "$2" -gt "$lastn" ] && [ "$3" = "$hash" ] && [ "$4" = "$hash" ] ||
    die "the restored container did not go on from '$last' with its memory: '$after'"
log "runc $rv: checkpoint $(( (t1 - t0) / 1000000 )) ms, restore $(( (t2 - t1) / 1000000 )) ms; the count went on from $lastn to $2, same data"
log "ok: the payload (its own glibc) runs in a $suite root (glibc $glibc)"
