"""What the benchmarks share: stderr logging, /proc/meminfo, version lines, the machine record."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes (0 if absent)."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def first_line(argv: list[str]) -> str | None:
    """First line a command prints (stdout, else stderr); None if it cannot run."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "cpu": cpu,
            "mem_gib": round(meminfo("MemTotal") / 2**30, 1), "runc": first_line(["runc", "--version"]),
            "criu": first_line(["criu", "--version"]), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"), "loadavg_start": os.getloadavg()[0]}


def config_lines(items: list[str] | None, error) -> list[str]:
    """`--config KEY=VALUE` arguments as lines of a migrt config (`KEY: VALUE`); error(message) for
    one that is not KEY=VALUE (argparse's ap.error)."""
    lines = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            error(f"--config wants KEY=VALUE, got {item!r}")
        lines.append(f"{key}: {value}")
    return lines
