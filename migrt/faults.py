"""Test seam: named fault points. NOT for production use.

`MIGRT_FAULT=<point>:<action>[,<point>:<action>...]` makes migrt act at a named point of its work.
Points are the phases migrt records in its journal (store/journal.py: e.g. `checkpoint:frozen`,
`checkpoint:dumped`, `restore:restoring`) plus a few explicit ones. Actions:
  kill   SIGKILL this process (what an OOM kill, a node agent or containerd's cancelled call does)
  fail   raise an error (the ordinary failure path)
  sleepN sleep N seconds there (holds the operation at that phase, e.g. to run a second one meanwhile)
The fault-injection suite (tests/faults/) uses it to stop migrt at every phase deterministically;
it also kills migrt from outside, timed from the journal, to check that the seam is not the reason
recovery works. Unset (the normal case) costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
import time

from migrt.errors import MigrtError

ENV = "MIGRT_FAULT"


class InjectedFault(MigrtError):
    """Raised by the `fail` action (caught by the callers' ordinary error paths)."""


def point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        where, _, action = item.strip().rpartition(":")
        if where != name:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "fail":
            raise InjectedFault(f"injected fault at {name} ({ENV})")
        elif action.startswith("sleep"):
            time.sleep(float(action[5:] or 1))
