"""Run a function in a forked child (for work that changes the process: chroot, setns) and bring
its result or its error back through a pipe."""

from __future__ import annotations

import os
from collections.abc import Callable

from migrt.errors import RuntimeFailed


def run_forked(fn: Callable[[], bytes], what: str) -> bytes:
    """fn runs in the child and returns bytes; an exception there becomes RuntimeFailed here."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no Python-level clean-up; report through the pipe
        code = 0
        try:
            os.close(r)
            out = b"\x00" + fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out, code = b"\x01" + repr(exc).encode()[:4000], 1
        try:
            os.write(w, out)
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not data.startswith(b"\x00"):
        raise RuntimeFailed(f"{what} failed: {data[1:].decode(errors='replace') or 'child exited abnormally'}")
    return data[1:]
