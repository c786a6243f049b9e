#!/bin/sh
# migrt-runc fast path (POSIX sh; installed as /usr/local/bin/migrt-runc by packaging/setup-host.sh).
#
# Starting a Python interpreter costs ~15-20 ms; containerd calls the runtime several times per pod
# and probes call `exec` every few seconds. So this script parses runc's global flags itself and
# execs the lower runtime straight away for every call that needs no decision. It hands the call,
# argv untouched, to the Python shim (migrt.shim) only when a decision is needed:
#   - `create` whose bundle's config.json mentions MIGRT_RESTORE, migrt.io/restore or GPU release
#     on pause (the Python shim parses the JSON and decides; the text test only ever lets ordinary
#     containers skip it);
#   - `checkpoint` and `restore` (GPU-aware in the Python shim);
#   - `pause` and `resume` of a container whose runc state directory holds the marker written at
#     create for GPU release on pause (one `test -f`; every other pause/resume passes straight through);
#   - a global flag this script does not know.
# `start` of a container carrying migrt's restore marker exits 0 here (it already runs).
# Builtins only on the pass-through path, except one `grep` for create.
PYSHIM='@MIGRT_PY_SHIM@'

py() { exec "$PYSHIM" "$@"; }

# Lower runtime: the top-level `runtime:` line of the config (plain scalar), else runc on PATH.
# A missing or broken config never breaks pass-through (same rule as migrt/runtime/lower.py).
lower=
cfg=${MIGRT_CONFIG:-/etc/migrt/config.yaml}
if [ -r "$cfg" ]; then
    while IFS= read -r line || [ -n "$line" ]; do
        case $line in
        runtime:*)
            v=${line#runtime:}
            v=${v%% \#*}
            v=${v#"${v%%[![:space:]]*}"}
            v=${v%"${v##*[![:space:]]}"}
            case $v in \"*\") v=${v#\"}; v=${v%\"} ;; \'*\') v=${v#\'}; v=${v%\'} ;; esac
            lower=$v
            break ;;
        esac
    done < "$cfg"
fi
self_like() { case ${1##*/} in migrt-runc|migrt-runc-py) return 0 ;; esac; [ "$1" -ef "$0" ]; }
find_path() {
    _IFS=$IFS; IFS=:
    for d in ${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}; do
        if [ -f "$d/$1" ] && [ -x "$d/$1" ] && ! self_like "$d/$1"; then IFS=$_IFS; lower=$d/$1; return 0; fi
    done
    IFS=$_IFS; return 1
}
case $lower in
'') find_path runc || py "$@" ;;
*/*) if [ ! -f "$lower" ] || [ ! -x "$lower" ] || self_like "$lower"; then py "$@"; fi ;;
*) find_path "$lower" || py "$@" ;;
esac

sub= root= bundle= last= expect=
for a in "$@"; do
    if [ -n "$expect" ]; then
        case $expect in root) root=$a ;; bundle) bundle=$a ;; esac
        expect=; continue
    fi
    if [ -z "$sub" ]; then
        case $a in
        --root=*|-root=*) root=${a#*=} ;;
        --root|-root) expect=root ;;
        --log|-log|--log-format|-log-format|--criu|-criu|--rootless|-rootless) expect=skip ;;
        --log=*|-log=*|--log-format=*|-log-format=*|--criu=*|-criu=*|--rootless=*|-rootless=*) ;;
        --debug|-debug|--debug=*|-debug=*|--systemd-cgroup|-systemd-cgroup|--systemd-cgroup=*|-systemd-cgroup=*) ;;
        --version|-version|-v|--help|-help|-h) ;;
        --) break ;;
        -*) py "$@" ;;
        *) sub=$a
           case $sub in create|start|checkpoint|restore|pause|resume) ;; *) break ;; esac ;;
        esac
    else
        case $a in
        --bundle|-bundle|-b) expect=bundle ;;
        --bundle=*|-bundle=*|-b=*) bundle=${a#*=} ;;
        --console-socket|-console-socket|--pid-file|-pid-file|--pidfd-socket|-pidfd-socket|--preserve-fds|-preserve-fds) expect=skip ;;
        esac
        last=$a
    fi
done

marked() {  # $1: a marker file in the container's runc state directory
    if [ -z "$root" ]; then case ${lower##*/} in *crun*) root=/run/crun ;; *) root=/run/runc ;; esac; fi
    case $last in ''|*/*|.|..) return 1 ;; esac
    [ -f "$root/$last/$1" ]
}
case $sub in
create)
    if grep -qsF -e MIGRT_RESTORE -e migrt.io/restore -e MIGRT_GPU_RELEASE_ON_PAUSE -e migrt.io/gpu-release-on-pause \
        "${bundle:-.}/config.json"; then py "$@"; fi ;;
start)
    if marked migrt-restored; then exit 0; fi ;;
pause|resume)
    if marked migrt-gpu-release-on-pause; then py "$@"; fi ;;
checkpoint|restore) py "$@" ;;
esac
exec "$lower" "$@"
