#!/bin/sh
# migrt-runc fast path (POSIX sh; written by `migrt install runtime`, which packaging/setup-host.sh runs).
#
# Starting a Python interpreter costs ~15-20 ms; containerd calls the runtime several times per pod
# and probes call `exec` every few seconds. So this script parses runc's global flags itself and
# execs the lower runtime straight away for every call that needs no decision. It hands the call,
# argv untouched, to the Python shim (migrt.shim) only when a decision is needed:
#   - `create` whose bundle's config.json mentions MIGRT_RESTORE, migrt.io/restore, a live migration
#     from another node (MIGRT_MIGRATE_FROM, migrt.io/migrate-from) or GPU release on pause (the
#     Python shim parses the JSON and decides; the text test only ever lets ordinary containers skip it);
#   - every `create` while the runc root holds a record of a pod container migrated away from this
#     node (.migrt-moved-*: its restart is refused; one glob, the records go with their pods);
#   - `checkpoint` and `restore` (GPU-aware in the Python shim);
#   - `pause` and `resume` of a container whose runc state directory holds the marker written at
#     create for GPU release on pause (one `test -f`; every other pause/resume passes straight through);
#   - a global flag this script does not know.
# `start` of a container carrying migrt's restore marker exits 0 here (it already runs).
# Builtins only on the pass-through path, except one `stat` (the config and the runtime must be
# root's and written by nobody else: see trusted()) and one `grep` for create.
#
# The hand-over checks that migrt's interpreter is there, and BOOT (migrt/node/launchers.py) turns
# "migrt does not import with it" (a venv whose python moved to a newer version) into one error: a
# runc-style JSON line in --log (containerd shows it as "OCI runtime create failed: <msg>") and one
# line on stderr, each naming the repair command. Never a traceback; exit status 127.
PYTHON=@MIGRT_PYTHON@
REPAIR=@MIGRT_REPAIR@
BOOT=@MIGRT_BOOT@

py() {
    [ -x "$PYTHON" ] || broken "migrt's Python interpreter $PYTHON is missing" "$@"
    exec "$PYTHON" -P -c "$BOOT" "$0" "$REPAIR" "$@"
}

json_escape() {  # backslashes and double quotes (the message is ours: no control characters)
    _s=$1 _o=
    while :; do
        case $_s in
        *[\\\"]*) _p=${_s%%[\\\"]*}; _s=${_s#"$_p"}; _o="$_o$_p\\${_s%"${_s#?}"}"; _s=${_s#?} ;;
        *) break ;;
        esac
    done
    printf '%s' "$_o$_s"
}

broken() {  # broken WHAT ARGV...: error line in --log (runc's format), one line on stderr, exit 127
    _msg="${0##*/}: $1; repair: $REPAIR"; shift
    _log= _fmt=text _next=
    for _a in "$@"; do
        case $_next in log) _log=$_a; _next=; continue ;; fmt) _fmt=$_a; _next=; continue ;; esac
        case $_a in
        --log|-log) _next=log ;;
        --log=*|-log=*) _log=${_a#*=} ;;
        --log-format|-log-format) _next=fmt ;;
        --log-format=*|-log-format=*) _fmt=${_a#*=} ;;
        --) break ;;
        esac
    done
    if [ -n "$_log" ]; then
        _t=$(date -u +%Y-%m-%dT%H:%M:%S.%N 2>/dev/null) || _t=
        case $_t in  # busybox date has no %N
        *.[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]) _t=${_t}Z ;;
        ?*) _t=${_t%%.*}.000000000Z ;;
        esac
        _e=$(json_escape "$_msg")
        if [ "$_fmt" = json ]; then
            printf '{"level":"error","msg":"%s","time":"%s"}\n' "$_e" "$_t" >> "$_log"
        else
            printf 'time="%s" level=error msg="%s"\n' "$_t" "$_e" >> "$_log"
        fi 2>/dev/null
    fi
    printf '%s\n' "$_msg" >&2
    exit 127
}

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

# Trust (migrt/trust.py's rule): the config names what runs as root, so it, the runtime, and every
# directory above them must be root's (or, run by another user, that user's: `test -O`) and not
# writable by group or others (a sticky directory may be), with no symbolic link on the way. sh cannot
# test permission bits: one `stat` reads them all. Anything else goes to Python, which follows links
# that pass the same rule and refuses the rest with a message in --log; never is an untrusted
# `runtime:` exec'd here.
trusted() {  # PATH...
    for _f in "$@"; do
        case $_f in /*) ;; *) return 1 ;; esac
        _p=$_f
        while [ -n "$_p" ]; do
            if [ -h "$_p" ]; then return 1; fi
            set -- "$@" "$_p"
            _p=${_p%/*}
        done
    done
    set -- / "$@"
    _st=$(stat -c '%u %a %F' "$@" 2>/dev/null) || return 1
    _IFS=$IFS; IFS='
'
    for _l in $_st; do  # "uid mode type" of $1: root's (or ours); group/other write only on a sticky directory
        case $_l in 0\ *) ;; *) if [ -O "$1" ]; then _l="0 ${_l#* }"; fi ;; esac
        shift
        case $_l in
        "0 "*[2367]?" directory"|"0 "*[2367]" directory") case $_l in "0 "[1357]???" "*) ;; *) _st= ;; esac ;;
        "0 "*[2367]?" "*|"0 "*[2367]" "*) _st= ;;
        "0 "*) ;;
        *) _st= ;;
        esac
        [ -n "$_st" ] || break
    done
    IFS=$_IFS
    [ -n "$_st" ]
}
if [ -r "$cfg" ]; then trusted "$cfg" "$lower" || py "$@"; else trusted "$lower" || py "$@"; fi

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

default_root() {
    if [ -z "$root" ]; then case ${lower##*/} in *crun*) root=/run/crun ;; *) root=/run/runc ;; esac; fi
}
marked() {  # $1: a marker file in the container's runc state directory
    default_root
    case $last in ''|*/*|.|..) return 1 ;; esac
    [ -f "$root/$last/$1" ]
}
moved_away() {  # a record of a container pulled to another node (migrt/runtime/moved.py)
    default_root
    for _m in "$root"/.migrt-moved-*; do [ -e "$_m" ] && return 0; break; done
    return 1
}
case $sub in
create)
    if grep -qsF -e MIGRT_RESTORE -e migrt.io/restore -e MIGRT_MIGRATE_FROM -e migrt.io/migrate-from \
        -e MIGRT_GPU_RELEASE_ON_PAUSE -e migrt.io/gpu-release-on-pause "${bundle:-.}/config.json"; then py "$@"; fi
    if moved_away; then py "$@"; fi ;;
start)
    if marked migrt-restored; then exit 0; fi ;;
pause|resume)
    if marked migrt-gpu-release-on-pause; then py "$@"; fi ;;
checkpoint|restore) py "$@" ;;
esac
exec "$lower" "$@"
