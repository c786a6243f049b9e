# Sourced (sh) by setup-host.sh and setup-test.sh: packages from the node's OWN release, quietly.
#   apt_absent PKG...             prints those of PKGs that are not installed (" a b")
#   apt_release_install MODE PKG...
#       installs PKGs (apt-get, no recommends, the node's configuration files kept). Package lists are
#       fetched first where there are none (a fresh root) and once more when the install fails; apt's
#       own output is shown only when it failed. apt's plan is read first (apt-get -s) and refused,
#       nothing installed, when it would change an installed package other than as MODE allows:
#         node   no installed package changes version or goes (a node's base never moves);
#         test   same-release point updates only (apt requires them, e.g. podman takes login and
#                passwd +deb12u2 where +deb12u1 is installed): each one a newer version built for this
#                release (+debNuM or ~debNuM, N this release's major version), listed on stderr; a
#                removal, a downgrade or another release's version is refused.
# The caller defines log() and die().
apt_absent() {
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || printf ' %s' "$p"; done
}

# apt_point_update OLD NEW: true when NEW is a later version of this release (its +debNuM/~debNuM).
apt_point_update() {
    major=$(. /etc/os-release 2>/dev/null; echo "${VERSION_ID%%.*}")
    case $2 in *[+~]deb"$major"u[0-9]*) ;; *) return 1 ;; esac
    dpkg --compare-versions "$2" gt "$1"
}

# apt_plan_check MODE PLAN: what apt's simulated plan changes among installed packages; fails if not allowed.
apt_plan_check() {
    bad= updates=
    while read -r verb pkg old new _; do
        case $verb in
        Remv) bad="$bad $pkg (removed)" ;;
        Inst)
            case $old in \[*\]) ;; *) continue ;; esac  # a new package: "Inst pkg (version ...)"
            old=${old#[}; old=${old%]}; new=${new#(}
            if [ "$1" = test ] && apt_point_update "$old" "$new"; then
                updates="$updates $pkg $old -> $new;"
            else
                bad="$bad $pkg ($old -> $new)"
            fi ;;
        esac
    done <<PLAN
$2
PLAN
    [ -z "$bad" ] || { log "error: installing$pkgs would change installed packages:$bad; nothing installed" \
        "(the $1 set-up takes no such change: upgrade the node from its release first, or install these yourself)"; return 1; }
    [ -z "$updates" ] || log "same-release point updates apt requires (taken):${updates%;}"
}

apt_release_install() {
    mode=$1; shift
    pkgs=" $*"
    export DEBIAN_FRONTEND=noninteractive
    out=$(mktemp)
    ls /var/lib/apt/lists/ 2>/dev/null | grep -q '_Packages' || apt-get update -qq >"$out" 2>&1 ||
        { cat "$out" >&2; rm -f "$out"; die "apt-get update failed"; }
    if ! plan=$(apt-get install -s --no-install-recommends "$@" 2>"$out"); then
        apt-get update -qq >>"$out" 2>&1 && plan=$(apt-get install -s --no-install-recommends "$@" 2>>"$out") ||
            { tail -20 "$out" >&2; rm -f "$out"; die "apt-get install$pkgs failed"; }
    fi
    apt_plan_check "$mode" "$(printf '%s\n' "$plan" | grep -E '^(Inst|Remv) ')" || { rm -f "$out"; exit 1; }
    apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold "$@" >"$out" 2>&1 ||
        { tail -20 "$out" >&2; rm -f "$out"; die "apt-get install$pkgs failed"; }
    rm -f "$out"
}
