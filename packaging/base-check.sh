#!/bin/sh
# Did a set-up move the base system?
#   base-check.sh record FILE                    before it: every installed package with its version
#                                                (dpkg-query) and /etc/os-release's digest
#   base-check.sh compare FILE                   after the node set-up (setup-host.sh)
#   base-check.sh compare --point-updates FILE   after the test set-up (setup-test.sh)
# compare fails (exit 1, naming each) when:
#  - a package installed before is gone or another version. With --point-updates, a newer version built
#    for this release (+debNuM or ~debNuM, N its major version, e.g. login +deb12u1 -> +deb12u2, which
#    podman requires) is allowed and listed as such; never a downgrade or another release's version;
#  - a package it added, or a version it moved to, does not come from this release's own suites
#    (CODENAME, CODENAME-updates, CODENAME-security, per `apt-cache madison`): no other suite's package;
#  - /etc/os-release changed.
# Packages the set-up added from the release are listed, not failed.
set -eu
usage() { echo "usage: $0 record FILE | compare [--point-updates] FILE" >&2; exit 2; }
cmd=${1:-}; [ $# -eq 0 ] || shift
points=0
if [ "${1:-}" = --point-updates ]; then points=1; shift; fi
file=${1:-}
[ -n "$cmd" ] && [ -n "$file" ] || usage
major=$(. /etc/os-release; echo "${VERSION_ID%%.*}")
codename=$(. /etc/os-release; echo "${VERSION_CODENAME:-}")

snapshot() {
    dpkg-query -W -f '${db:Status-Abbrev} ${Package}:${Architecture} ${Version}\n' | awk '$1 ~ /^ii/ {print $2, $3}' | sort
    echo "os-release $(sha256sum /etc/os-release | cut -d' ' -f1) $(. /etc/os-release; echo "${PRETTY_NAME:-?}" | tr ' ' '_')"
}

# point OLD NEW: NEW is a later version built for this release.
point() {
    case $2 in *[+~]deb"$major"u[0-9]*) ;; *) return 1 ;; esac
    dpkg --compare-versions "$2" gt "$1"
}

# foreign: of the "pkg:arch version" lines on stdin, those whose version this release's suites do not carry.
foreign() {
    cat > "$tmp.in"
    [ -s "$tmp.in" ] || return 0
    # shellcheck disable=SC2046
    apt-cache madison $(sed 's/[: ].*//' "$tmp.in" | sort -u) 2>/dev/null | awk -F' [|] ' -v c="$codename" '
        {split($3, s, " "); suite = s[2]; sub("/.*", "", suite); gsub(/ /, "", $1); gsub(/ /, "", $2)
         if (suite == c || index(suite, c "-") == 1) print $1 " " $2}' > "$tmp.ok"
    while read -r name version; do
        grep -qxF "${name%%:*} $version" "$tmp.ok" || echo "$name $version"
    done < "$tmp.in"
}

case $cmd in
record) snapshot > "$file"; echo "base-check: recorded $(wc -l < "$file") entries in $file" >&2 ;;
compare)
    tmp=$(mktemp); trap 'rm -f "$tmp" "$tmp.ok" "$tmp.in"' EXIT
    snapshot > "$tmp"
    # "kind name old new" for each package that moved
    moves=$(awk 'NR == FNR {after[$1] = $2; next} $1 == "os-release" {if (after[$1] != $2) print "os-release", $1, $2, after[$1]; next}
                 !($1 in after) {print "removed", $1, $2, "-"; next}
                 after[$1] != $2 {print "changed", $1, $2, after[$1]}' "$tmp" "$file")
    bad= taken= landed=
    while read -r kind name old new; do
        [ -n "$kind" ] || continue
        if [ "$kind" = changed ] && [ "$points" = 1 ] && point "$old" "$new"; then
            taken="$taken  $name $old -> $new
"
            landed="$landed$name $new
"
        else
            bad="$bad  $kind: $name $old -> $new
"
        fi
    done <<EOF
$moves
EOF
    added=$(awk 'NR == FNR {before[$1] = 1; next} !($1 in before) {print $1 " " $2}' "$file" "$tmp")
    elsewhere=$(printf '%s\n%s' "$added" "$landed" | grep . | foreign)
    [ -z "$added" ] || echo "base-check: added by the set-up from ${codename:-the release}: $(printf '%s' "$added" | tr ' \n' '= ')" >&2
    [ -z "$taken" ] || printf 'base-check: same-release point updates apt required (allowed for the test set-up):\n%s' "$taken" >&2
    if [ -n "$elsewhere" ]; then
        bad="$bad$(printf '%s\n' "$elsewhere" | sed 's/^/  not from this release ('"$codename"'): /')
"
    fi
    if [ -n "$bad" ]; then
        printf 'base-check: the set-up moved the base system:\n%s' "$bad" >&2
        exit 1
    fi
    if [ "$points" = 1 ]; then
        echo "base-check: no installed package moved except the point updates above; /etc/os-release unchanged" >&2
    else
        echo "base-check: no installed package changed version, /etc/os-release unchanged" >&2
    fi ;;
*) usage ;;
esac
