#!/bin/sh
# Puts a self-contained migrt on a Kubernetes node (what packaging/daemonset.yaml runs, from a
# container that has the host's / mounted at --root). Idempotent. Restarts nothing unless told to.
#
#   install-host.sh [--root DIR] [--source DIR] [--containerd-config PATH] [--no-containerd]
#                   [--restart-containerd]
#
#   --root DIR       where the host's / is mounted (default /; the DaemonSet uses /host)
#   --source DIR     the self-contained migrt to copy (default /opt/migrt, the image's): python/ (a
#                    relocatable CPython), venv/ (migrt installed, built for the prefix /opt/migrt),
#                    bin/migrt-runc and bin/migrt (launchers bound to that venv's python: `migrt
#                    install runtime`), libexec/cuda-criu-action (the CRIU GPU hook), share/config.yaml
#   --containerd-config PATH   containerd's main config as a host path (default /etc/containerd/config.toml)
#   --no-containerd  leave containerd's configuration alone
#   --restart-containerd, or env MIGRT_RESTART_CONTAINERD=1: restart containerd if its config changed
#                    (env MIGRT_RESTART_COMMAND overrides how: default `nsenter -t 1 -m -u -i -n -p --
#                    systemctl restart containerd`, i.e. in the host's namespaces; needs hostPID)
#
# On the host (paths below are host paths, all under --root):
#   /opt/migrt/                  the copy of --source (replaced as a whole when it differs)
#   /usr/local/bin/migrt         -> /opt/migrt/bin/migrt
#   /usr/local/bin/migrt-runc    -> /opt/migrt/bin/migrt-runc
#   /etc/migrt/config.yaml       only if absent
#   /var/lib/migrt (0700)        the checkpoint store
#   containerd's config          `migrt install containerd` (a drop-in; backups of changed files)
# Not installed here: CRIU (>= 4.2) and runc, which must come from the host's own packages.
set -eu

prefix=/opt/migrt
root=/
source=/opt/migrt
ctd_config=/etc/containerd/config.toml
do_containerd=1
restart=${MIGRT_RESTART_CONTAINERD:-0}

log() { printf 'install-host: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

while [ $# -gt 0 ]; do
    case $1 in
    --root) root=$2; shift 2 ;;
    --root=*) root=${1#*=}; shift ;;
    --source) source=$2; shift 2 ;;
    --source=*) source=${1#*=}; shift ;;
    --containerd-config) ctd_config=$2; shift 2 ;;
    --containerd-config=*) ctd_config=${1#*=}; shift ;;
    --no-containerd) do_containerd=0; shift ;;
    --restart-containerd) restart=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
    esac
done

root=${root%/}
dest=$root$prefix
[ -d "$root/" ] || die "--root $root is not a directory"
for f in venv/bin/migrt venv/bin/python bin/migrt bin/migrt-runc venv/pyvenv.cfg; do
    [ -e "$source/$f" ] || [ -L "$source/$f" ] || die "$source is not a migrt payload: $f missing"
done
# The venv's paths are absolute: it only works at the prefix it was built for.
home=$(sed -n 's/^home *= *//p' "$source/venv/pyvenv.cfg")
case $home in
"$prefix"/*) ;;
*) die "$source/venv was built for another location (home = $home); build it under $prefix" ;;
esac

# 1. /opt/migrt: copy the payload as a whole, swapping directories so that no half-copied tree is
#    ever in use (a node's containerd may run migrt-runc at any moment).
if [ -d "$dest" ] && diff -r -q --no-dereference "$source" "$dest" >/dev/null 2>&1; then
    log "$prefix is up to date"
else
    mkdir -p "$(dirname "$dest")"
    new="$(dirname "$dest")/.migrt.new.$$"
    old="$(dirname "$dest")/.migrt.old.$$"
    rm -rf "$new"
    cp -a "$source" "$new"
    if [ -e "$dest" ]; then mv "$dest" "$old"; fi
    mv "$new" "$dest"
    rm -rf "$old"
    log "installed $prefix"
fi

# 2. links in /usr/local/bin
mkdir -p "$root/usr/local/bin"
link() {  # link TARGET NAME
    if [ "$(readlink "$root/usr/local/bin/$2" 2>/dev/null || true)" != "$1" ]; then
        ln -sfn "$1" "$root/usr/local/bin/.$2.new.$$"
        mv -f "$root/usr/local/bin/.$2.new.$$" "$root/usr/local/bin/$2"
        log "linked /usr/local/bin/$2 -> $1"
    fi
}
link "$prefix/bin/migrt" migrt
link "$prefix/bin/migrt-runc" migrt-runc

# 3. configuration and store
if [ ! -e "$root/etc/migrt/config.yaml" ]; then
    install -d -m 0755 "$root/etc/migrt"
    install -m 0644 "$source/share/config.yaml" "$root/etc/migrt/config.yaml"
    log "wrote /etc/migrt/config.yaml"
fi
install -d -m 0700 "$root/var/lib/migrt"
install -d -m 0755 "$root/var/log/migrt"

# 4. containerd: runtime handler `migrt`
changed=0
if [ "$do_containerd" = 1 ]; then
    out=$("$source/venv/bin/migrt" install containerd --root "$root/" --config "$ctd_config" --json) ||
        die "migrt install containerd failed (see above); nothing restarted"
    case $out in *'"changed": true'*) changed=1 ;; esac
fi
if [ "$changed" = 1 ]; then
    if [ "$restart" = 1 ]; then
        log "restarting containerd (running containers keep running)"
        sh -c "${MIGRT_RESTART_COMMAND:-nsenter -t 1 -m -u -i -n -p -- systemctl restart containerd}"
    else
        log "containerd's config changed: restart containerd on this node to load handler migrt" \
            "(not done: set MIGRT_RESTART_CONTAINERD=1 to let the installer do it)"
    fi
fi
command -v "$root/usr/bin/criu" >/dev/null 2>&1 || command -v "$root/usr/sbin/criu" >/dev/null 2>&1 ||
    command -v "$root/usr/local/sbin/criu" >/dev/null 2>&1 ||
    log "warning: no criu found on the host; install CRIU >= 4.2 there (checkpoints need it)"
log "done"
