"""Shell workloads for small containers (busybox's, or the host's own tools: host_rootfs.py)."""

from __future__ import annotations

# Keeps ~400 KB of random data in a shell variable (process memory) and prints its hash with a
# counter every 0.2 s; exits with status 7 once /tmp/stop exists.
COUNTER = (
    'data=$(head -c 200000 /dev/urandom | od -An -tx1 | tr -d " \\n"); '
    'h=$(echo "$data" | sha256sum | cut -c1-16); i=0; '
    'while true; do i=$((i+1)); echo "tick $i $h $(echo "$data" | sha256sum | cut -c1-16)"; '
    '[ -f /tmp/stop ] && exit 7; sleep 0.2; done'
)


def parse_ticks(text: str) -> list[tuple[int, str, str]]:
    """[(counter, hash at start, hash now)] from COUNTER's output."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "tick" and parts[1].isdigit():
            out.append((int(parts[1]), parts[2], parts[3]))
    return out
