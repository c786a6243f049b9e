"""runc-shaped log lines. containerd reports the last `"level":"error"` line of `--log` as
"OCI runtime create failed: <msg>". Never write to stdout/stderr: they belong to the container."""

from __future__ import annotations

import json
import os
import time


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def append(path: str | None, level: str, msg: str, *, log_format: str = "json") -> None:
    if not path:
        return
    if log_format == "json":
        line = json.dumps({"level": level, "msg": msg, "time": _now()}, ensure_ascii=False)
    else:
        line = f'time="{_now()}" level={level} msg={json.dumps(msg, ensure_ascii=False)}'
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass
