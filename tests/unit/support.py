"""Helpers for the unit tests (fixtures wrapping them are in conftest.py)."""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PY_SHIM = VENV_BIN / "migrt-runc-py"
SH_SHIM_SRC = REPO / "migrt" / "shim" / "migrt-runc.sh"


def make_executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@dataclass
class FakeRuntime:
    """An executable that appends one JSON line per call to `record`: its argv (as hex bytes, so any
    byte survives), cwd, open fds, MIGRT_*/FAKE_* environment and, with FAKE_READ_STDIN=1, its stdin.
    Exits with $FAKE_RC (default 0). Writes nothing to stdout or stderr."""

    path: Path
    record: Path

    def calls(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def argvs(self) -> list[list[bytes]]:
        return [[bytes.fromhex(a) for a in c["argv_hex"]] for c in self.calls()]


FAKE_SOURCE = """\
#!{python} -S
import json, os, sys
rec = {{
    "argv0": sys.argv[0],
    "argv_hex": [os.fsencode(a).hex() for a in sys.argv[1:]],
    "cwd": os.getcwd(),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "env": {{k: v for k, v in os.environ.items() if k.startswith(("MIGRT_", "FAKE_"))}},
}}
if os.environ.get("FAKE_READ_STDIN") == "1":
    rec["stdin"] = sys.stdin.read()
with open({record!r}, "a") as fh:
    fh.write(json.dumps(rec) + "\\n")
sys.exit(int(os.environ.get("FAKE_RC", "0")))
"""


def make_fake_runtime(directory: Path, name: str = "fake-runc") -> FakeRuntime:
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / f"{name}.calls.jsonl"
    path = make_executable(directory / name, FAKE_SOURCE.format(python=sys.executable, record=str(record)))
    return FakeRuntime(path=path, record=record)


@dataclass
class MigrtEnv:
    """A config file (MIGRT_CONFIG) naming the fake runtime, a store and a debug log under tmp_path."""

    config: Path
    store: Path
    log_file: Path
    fake: FakeRuntime
    env: dict[str, str]


def write_bundle(path: Path, env: list[str] | None = None, annotations: dict | None = None) -> Path:
    """A bundle directory with a minimal config.json (no rootfs: nothing runs it)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "args": ["sleep", "1000"], "env": ["PATH=/bin", *(env or [])], "cwd": "/"},
        "root": {"path": "rootfs"},
    }
    if annotations is not None:
        config["annotations"] = annotations
    (path / "config.json").write_text(json.dumps(config))
    return path


def is_private_dir(path: str | os.PathLike) -> bool:
    return stat.S_IMODE(os.stat(path).st_mode) == 0o700
