"""Ending a child process: SIGTERM, a grace period to exit cleanly, then SIGKILL; always reaped."""

from __future__ import annotations

import subprocess


def end_child(proc: subprocess.Popen[bytes], grace: float) -> None:
    """Terminate `proc` (if it still runs) and wait for it: killed when it outlives `grace` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
