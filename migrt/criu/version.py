"""Versions of CRIU, the lower runtime and the kernel, for manifests and `migrt doctor`."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

from migrt.criu.binary import criu_binary  # one rule for which CRIU (migrt.criu.binary)

MIN_CRIU = (4, 2)
# The oldest lower runtime and containerd migrt supports (Debian 12's runc 1.1.5 and containerd 1.6.20
# are tested: tests/integration/test_oldest.py); `migrt doctor` fails below them.
MIN_RUNC = (1, 1)
MIN_CONTAINERD = (1, 6)


def run_query(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """A CRIU query (`criu check`, `--version`...), run from an empty private directory removed
    afterwards: CRIU reads the node's config files (/etc/criu/default.conf, CRIU_CONFIG_FILE), and a
    relative `log-file` there (runc's test suite leaves `log-file=runc-criu-log-XXXXXX.log`) would be
    written into the caller's current directory. OSError, TimeoutExpired as subprocess.run raises them."""
    with tempfile.TemporaryDirectory(prefix="migrt-criu-query.") as cwd:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd)


def _first_line(argv: list[str]) -> str | None:
    try:
        out = run_query(argv, 20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None




def criu_version() -> str | None:
    crit = criu_binary()
    line = _first_line([crit, "--version"]) if crit else None
    m = re.search(r"Version:\s*([0-9][0-9.]*)", line or "")
    return m.group(1) if m else None


def parse_version(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    m = re.match(r"(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def runtime_version(path: str) -> str | None:
    line = _first_line([path, "--version"])
    m = re.search(r"version\s+(\S+)", line or "")
    return m.group(1) if m else line


def kernel_version() -> str:
    return os.uname().release


def versions(runtime_path: str) -> dict[str, str | None]:
    from migrt import __version__

    return {
        "migrt": __version__,
        "runtime": runtime_version(runtime_path),
        "runtime_path": runtime_path,
        "criu": criu_version(),
        "kernel": kernel_version(),
    }
