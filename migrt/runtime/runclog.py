"""runc-shaped log lines. containerd reports the last `"level":"error"` line of `--log` as
"OCI runtime create failed: <msg>". Otherwise never write to stdout/stderr: they belong to the
container. The one exception is runc's own: called without --log (podman's conmon), runc writes its
error to stderr, where conmon reads it as the reason a create failed; so does migrt."""

from __future__ import annotations

import json
import os
import time

from migrt.text import printable

MAX_MSG = 8192  # characters of one message (CRIU's error lines quoted in it included)


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def append(path: str | None, level: str, msg: str, *, log_format: str = "json") -> None:
    """One line in the --log file `path`; with no --log, an error goes to stderr as runc's text line.
    The message is escaped (migrt.text): containerd and kubectl show it on terminals, and parts of it
    may come from a container, a registry or a peer."""
    msg = printable(msg, MAX_MSG)
    if not path:
        if level == "error":
            try:
                os.write(2, f'time="{_now()}" level=error msg={json.dumps(msg, ensure_ascii=False)}\n'.encode())
            except OSError:
                pass
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
