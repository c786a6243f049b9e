#!/bin/sh
# Puts a self-contained migrt on a Kubernetes node (what packaging/daemonset.yaml runs, from a
# container that has the host's / mounted at --root). Idempotent. Restarts nothing unless told to.
#
#   install-host.sh [--root DIR] [--source DIR] [--prefix DIR] [--bindir DIR] [--no-check]
#                   [--containerd-config PATH] [--no-containerd] [--restart-containerd]
#
#   --root DIR       where the host's / is mounted (default /; the DaemonSet uses /host)
#   --source DIR     the payload to copy (default /opt/migrt, the image's; packaging/build-payload.sh):
#                    libc/ (Debian 12's C library and dynamic loader, the interpreter of the two
#                    executables), python/ (Debian 12's CPython with its libraries), venv/ (migrt),
#                    criu/ (migrt's CRIU 4.2 with its libraries), bin/migrt and bin/migrt-runc
#                    (launchers bound to the venv's python), libexec/cuda-criu-action (the CRIU GPU
#                    hook), share/config.yaml
#   --prefix DIR     where migrt goes, as a host path (default /opt/migrt). The payload is built for
#                    /opt/migrt; another prefix gets the copy's absolute paths rewritten (the venv's
#                    pyvenv.cfg, links and script headers, the launchers, `interpreter`, the ELF
#                    interpreter of python and criu: packaging/elf-interp.sh, at most 255 bytes)
#   --bindir DIR     where the links migrt and migrt-runc go, as a host path (default /usr/local/bin)
#   --no-check       do not try the payload's python and CRIU in the root first (a root that cannot run
#                    programs: e.g. a node image being assembled, without /proc)
#   --containerd-config PATH   containerd's main config as a host path (default /etc/containerd/config.toml)
#   --no-containerd  leave containerd's configuration alone
#   --restart-containerd, or env MIGRT_RESTART_CONTAINERD=1: restart containerd if its config changed
#                    (env MIGRT_RESTART_COMMAND overrides how: default `nsenter -t 1 -m -u -i -n -p --
#                    systemctl restart containerd`, i.e. in the host's namespaces; needs hostPID)
#
# On the host (paths below are host paths, all under --root):
#   PREFIX/                      the copy of --source (replaced as a whole when it differs), checked
#                                first on the host itself: its python and its CRIU must run there
#   BINDIR/migrt                 -> PREFIX/bin/migrt
#   BINDIR/migrt-runc            -> PREFIX/bin/migrt-runc
#   /etc/migrt/config.yaml       only if absent
#   /var/lib/migrt (0700)        the checkpoint store; /var/log/migrt
#   containerd's config          `migrt install containerd` (a drop-in naming BINDIR/migrt-runc;
#                                backups of changed files), run by the source's migrt (the image's),
#                                or with --root / by the one just installed
# The node needs nothing else from its distribution but runc >= 1.1, containerd >= 1.6 and iptables
# (CRIU's network lock): the payload carries its own C library, so the node's (any glibc, or none) does
# not matter. Refused, with nothing changed: a node of another architecture than the payload's, a kernel
# older than the payload's floor (its PAYLOAD's `needs:` line), a root where the payload's python or
# CRIU does not run. Its own criu and python3, if any, are not used.
set -eu
here=$(cd "$(dirname "$0")" && pwd)

prefix=/opt/migrt
bindir=/usr/local/bin
root=/
source=/opt/migrt
ctd_config=/etc/containerd/config.toml
do_containerd=1
check=1
restart=${MIGRT_RESTART_CONTAINERD:-0}

log() { printf 'install-host: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
[ -f "$here/elf-interp.sh" ] || die "$here/elf-interp.sh is missing (it comes with install-host.sh: packaging/, or the payload's share/)"
. "$here/elf-interp.sh"

while [ $# -gt 0 ]; do
    case $1 in
    --root) root=$2; shift 2 ;;
    --root=*) root=${1#*=}; shift ;;
    --source) source=$2; shift 2 ;;
    --source=*) source=${1#*=}; shift ;;
    --prefix) prefix=$2; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --bindir) bindir=$2; shift 2 ;;
    --bindir=*) bindir=${1#*=}; shift ;;
    --containerd-config) ctd_config=$2; shift 2 ;;
    --containerd-config=*) ctd_config=${1#*=}; shift ;;
    --no-containerd) do_containerd=0; shift ;;
    --no-check) check=0; shift ;;
    --restart-containerd) restart=1; shift ;;
    -h|--help) sed -n '2,42p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
    esac
done

# Paths go into sed expressions and sh-quoted launcher lines: plain characters only.
for v in prefix bindir; do
    eval "val=\$$v"
    case $val in
    /*) ;;
    *) die "--$v $val: give an absolute (host) path" ;;
    esac
    case $val in
    *[!A-Za-z0-9._/+-]*) die "--$v $val: only letters, digits and . _ / + - please" ;;
    esac
done
prefix=${prefix%/}
bindir=${bindir%/}
root=${root%/}
dest=$root$prefix
[ -d "$root/" ] || die "--root $root is not a directory"
for f in venv/bin/python venv/pyvenv.cfg python/bin/python3 criu/sbin/criu bin/migrt bin/migrt-runc interpreter share/config.yaml; do
    [ -e "$source/$f" ] || [ -L "$source/$f" ] || die "$source is not a migrt payload: $f missing (packaging/build-payload.sh builds one)"
done
# The prefix the payload was built for: its venv's home is <built>/python/bin.
home=$(sed -n 's/^home *= *//p' "$source/venv/pyvenv.cfg")
built=${home%/python/bin}
case $built in /*[!A-Za-z0-9._/+-]*|[!/]*) die "$source/venv/pyvenv.cfg: home = $home is no plain absolute path" ;; esac
[ "$built/python/bin" = "$home" ] && [ -n "$built" ] ||
    die "$source/venv was not made by the payload's own python (home = $home): rebuild it with packaging/build-payload.sh"

# What the payload cannot run without (PAYLOAD's "needs: ARCH, Linux >= X.Y"; none in a payload from
# before its own C library): the node's architecture and kernel, checked before anything is written.
needs=$(sed -n 's/^needs: \([A-Za-z0-9_]*\), Linux >= \([0-9]*\.[0-9]*\)$/\1 \2/p' "$source/PAYLOAD" 2>/dev/null || true)
if [ -n "$needs" ]; then
    arch=$(uname -m) kernel=$(uname -r)
    [ "$arch" = "${needs% *}" ] ||
        die "this node is $arch, the payload in $source is built for ${needs% *}: use the $arch image (packaging/build-payload.sh on an $arch host); nothing changed"
    floor=${needs#* } k=${kernel%%[!0-9.]*}
    kmaj=${k%%.*} kmin=${k#*.}; kmin=${kmin%%.*}
    if [ "${kmaj:-0}" -lt "${floor%.*}" ] || { [ "$kmaj" -eq "${floor%.*}" ] && [ "${kmin:-0}" -lt "${floor#*.}" ]; }; then
        die "this node's kernel $kernel is older than Linux $floor, below which the payload cannot run (CRIU's floor); nothing changed"
    fi
fi

# relocate DIR: rewrite the absolute paths of a copy of the payload from $built to $prefix. Every
# pattern is anchored where the path starts (a new prefix may end with the old one: /tmp/x/opt/migrt).
relocate() {
    d=$1
    o=$(printf '%s' "$built" | sed 's/[.[\*^$]/\\&/g')
    sed -i "s#\\([ =]\\)$o/#\\1$prefix/#g" "$d/venv/pyvenv.cfg"             # home, executable, command
    sed -i "s#^$o/#$prefix/#" "$d/interpreter"
    for f in "$d"/venv/bin/*; do
        if [ -L "$f" ]; then
            t=$(readlink "$f")
            case $t in "$built"/*) ln -sfn "$prefix/${t#"$built"/}" "$f" ;; esac
        elif [ -f "$f" ]; then                                                 # script headers, activate*
            sed -i "1s#^\\#!$o/venv/#\\#!$prefix/venv/#; s#\"$o/venv\"#\"$prefix/venv\"#g" "$f"
        fi
    done
    for f in "$d/bin/migrt" "$d/bin/migrt-runc" "$d/libexec/cuda-criu-action"; do   # the launchers
        [ ! -f "$f" ] || sed -i "s#^PYTHON='$o/#PYTHON='$prefix/#; s#^HOOK='$o/#HOOK='$prefix/#" "$f"
    done
    for f in "$d"/python/bin/python3* "$d/criu/sbin/criu"; do                       # ELF interpreters
        [ ! -L "$f" ] && t=$(elf_interp "$f") || continue
        case $t in "$built"/libc/*) ;; *) continue ;; esac
        set_elf_interp "$f" "$prefix/${t#"$built"/}" || die "could not move the payload from $built to $prefix (see above)"
        [ "$(elf_interp "$f")" = "$prefix/${t#"$built"/}" ] || die "$f: its interpreter is $(elf_interp "$f") after rewriting"
    done
    left=$({ grep -l -e "[ =]$o/" "$d/venv/pyvenv.cfg"; grep -l -e "^$o/" "$d/interpreter"
             grep -lI -e "^#!$o/" -e "\"$o/venv\"" "$d"/venv/bin/*
             grep -l -e "^PYTHON='$o/" -e "^HOOK='$o/" "$d/bin/migrt" "$d/bin/migrt-runc" "$d/libexec/cuda-criu-action"
           } 2>/dev/null || true)
    [ -z "$left" ] || die "could not move the payload from $built to $prefix: $(echo $left) still name $built"
}

# 1. PREFIX: the payload copied beside it, relocated, checked on the host, then swapped in whole, so
#    that no half-copied tree is ever in use (a node's containerd may run migrt-runc at any moment).
#    A copy that differs from the installed one only in bytecode caches is "up to date".
same() { [ -d "$2" ] && diff -r -q --no-dereference -x __pycache__ "$1" "$2" >/dev/null 2>&1; }
mkdir -p "$(dirname "$dest")"
new="$(dirname "$dest")/.migrt.new.$$"
old="$(dirname "$dest")/.migrt.old.$$"
trap 'rm -rf "$new"' EXIT
if [ "$built" = "$prefix" ] && same "$source" "$dest"; then
    log "$prefix is up to date"
elif ! { rm -rf "$new" && cp -a "$source" "$new" && { [ "$built" = "$prefix" ] || relocate "$new"; }; }; then
    die "could not copy $source to $new"
elif same "$new" "$dest"; then
    rm -rf "$new"
    log "$prefix is up to date"
else
    # The payload's python and CRIU run from any directory (found by their own location): try them on
    # the host, in its root, before anything is replaced. Their ELF interpreter names the prefix, where
    # the copy is not yet (or an older payload is): the copy's own loader runs them by name instead.
    at=${new#"$root"}
    run_host() { if [ "$check" = 0 ]; then return 0; elif [ -z "$root" ]; then "$@"; else chroot "$root" "$@"; fi; }
    run_copy() {  # PATH ARG...: the copy's PATH (relative), on the copy's loader if it has its own
        f=$1; shift
        [ ! -L "$new/$f" ] || f=$(dirname "$f")/$(readlink "$new/$f")
        t=$(elf_interp "$new/$f" 2>/dev/null) || t=
        case $t in "$prefix"/libc/*) run_host "$at/libc/${t##*/}" "$at/$f" "$@" ;; *) run_host "$at/$f" "$@" ;; esac
    }
    out=$(run_copy python/bin/python3 -P -c 'import ssl, ctypes, sqlite3, sys; print(sys.version.split()[0])' 2>&1) ||
        die "the payload's python does not run on this node ($(printf '%s' "$out" | tail -1)); nothing changed"
    out=$(run_copy criu/sbin/criu --version 2>&1) ||
        die "the payload's CRIU does not run on this node ($(printf '%s' "$out" | tail -1)); nothing changed"
    if [ -e "$dest" ]; then mv "$dest" "$old"; fi
    mv "$new" "$dest"
    rm -rf "$old"
    log "installed $prefix (from a payload built for $built)"
fi

# 2. links in BINDIR
mkdir -p "$root$bindir"
link() {  # link TARGET NAME
    if [ "$(readlink "$root$bindir/$2" 2>/dev/null || true)" != "$1" ]; then
        ln -sfn "$1" "$root$bindir/.$2.new.$$"
        mv -f "$root$bindir/.$2.new.$$" "$root$bindir/$2"
        log "linked $bindir/$2 -> $1"
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

# 4. containerd: runtime handler `migrt`. On the host itself (--root /) the migrt just installed does it
#    (relocated for this host); from a container, the image's own (at the prefix it was built for).
changed=0
if [ "$do_containerd" = 1 ]; then
    if [ -z "$root" ]; then migrt=$prefix/venv/bin/migrt; else migrt=$source/venv/bin/migrt; fi
    out=$("$migrt" install containerd --root "$root/" --config "$ctd_config" --binary "$bindir/migrt-runc" --json) ||
        die "migrt install containerd (by $migrt) failed (see above); nothing restarted. From outside the" \
            "installer image, with --root other than /, the payload's migrt runs only at $built: pass --no-containerd"
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
found=
for d in /usr/sbin /sbin /usr/bin /bin; do
    [ -x "$root$d/iptables-restore" ] && found=1 && break
done
[ -n "$found" ] || log "warning: no iptables-restore on the host: CRIU locks a container's network with iptables; install iptables there"
log "done: migrt in $prefix (its own Python $(sed -n 's/^python: [^ ]* \([^ ]*\).*/\1/p' "$source/PAYLOAD" 2>/dev/null)," \
    "CRIU $(sed -n 's/^criu: \([^ ]*\).*/\1/p' "$source/PAYLOAD" 2>/dev/null) in $prefix/criu), $bindir/migrt, $bindir/migrt-runc"
