#!/bin/sh
# Did a set-up move the base system?  record FILE  before it; compare FILE  after it.
# FILE holds every installed package with its version (dpkg-query) and /etc/os-release's digest.
# compare fails (exit 1, naming each) when a package that was installed before is now another version
# or gone, or when /etc/os-release changed. Packages installed by the set-up are listed, not failed:
# a set-up may add packages from the node's own release, never upgrade or remove one.
set -eu
cmd=${1:-}; file=${2:-}
[ -n "$cmd" ] && [ -n "$file" ] || { echo "usage: $0 record|compare FILE" >&2; exit 2; }
snapshot() {
    dpkg-query -W -f '${db:Status-Abbrev} ${Package}:${Architecture} ${Version}\n' | awk '$1 ~ /^ii/ {print $2, $3}' | sort
    echo "os-release $(sha256sum /etc/os-release | cut -d' ' -f1) $(. /etc/os-release; echo "${PRETTY_NAME:-?}" | tr ' ' '_')"
}
case $cmd in
record) snapshot > "$file"; echo "base-check: recorded $(wc -l < "$file") entries in $file" >&2 ;;
compare)
    now=$(mktemp); trap 'rm -f "$now"' EXIT
    snapshot > "$now"
    moved=$(awk 'NR == FNR {after[$1] = $2; next} !($1 in after) {print "  removed: " $1 " " $2; next}
                 after[$1] != $2 {print "  changed: " $1 " " $2 " -> " after[$1]}' "$now" "$file")
    added=$(awk 'NR == FNR {before[$1] = 1; next} !($1 in before) {print $1 "=" $2}' "$file" "$now" | tr '\n' ' ')
    [ -z "$added" ] || echo "base-check: added by the set-up: $added" >&2
    if [ -n "$moved" ]; then
        printf 'base-check: the set-up moved the base system:\n%s\n' "$moved" >&2
        exit 1
    fi
    echo "base-check: no installed package changed version, /etc/os-release unchanged" >&2 ;;
*) echo "usage: $0 record|compare FILE" >&2; exit 2 ;;
esac
