"""Checks that run WHILE CRIU restores, and the gate that holds the restored tree until they pass.

A restore used to verify the checkpoint (sha256 of every file) and run the GPU preflight (NVML,
libcuda) before starting runc; at 32 GiB that is ~3 s in front of CRIU. Now the slow checks (the
large files' hashes, the GPU preflight and the driver's load) run in threads while runc and CRIU
restore, and nothing restored runs before they have passed:

CRIU runs action scripts at fixed points of a restore. At `post-restore` every task is restored
but none has been resumed yet; a script that exits non-zero there makes CRIU kill the whole tree
and fail the restore (`runc restore` then fails and leaves no container). migrt writes a small sh
script into the restore's private work directory that waits there for the checks' verdict: a file
`checks.ok` (go on) or `checks.failed` (abort). CRIU finds the script through an extra config file
named by CRIU_CONFIG_FILE in runc's environment (runc passes its environment to `criu swrk`, and
CRIU reads that file in swrk mode too); a CRIU_CONFIG_FILE the caller already had is copied into
ours, so its settings stay. No config.json, /etc/criu or node-wide setting changes.

What runs in front stays in front: every file's presence and size, the hashes of every file that
is not a large image file (CRIU's metadata, the rootfs layer that is applied before runc runs), so
a checkpoint with a missing or resized file is refused before anything is touched; the large
image files (pages) are hashed in the background (a restore through the page filler leaves the pages
images whose chunk digests the manifest records to the filler, which verifies each 64 MiB chunk before
it copies from it, and the gate waits only for the chunks CRIU reads itself: ops/pages.py
verify_as_filled, EagerVerified). The verdict is also checked by migrt itself
after runc returns (belt and braces: should CRIU ever skip the script, a failed check still
removes the container before its GPU is unlocked), and a restore that failed for any reason
reports a failed check as its cause, since a tampered image can make CRIU fail first.
"""

from __future__ import annotations

import os
import shlex
import threading
import time
from collections.abc import Callable

from migrt.errors import MigrtError
from migrt.runtime import control

BACKGROUND_MIN_BYTES = 1 << 20  # image files at least this large are hashed while CRIU restores
GATE_TIMEOUT_S = 1800  # the gate gives up (abort) if migrt never gives a verdict (or at once if it is gone)

_GATE = """#!/bin/sh
# migrt restore gate (CRIU action script): holds the restored tree at post-restore until migrt's
# checks (checkpoint verify, GPU preflight) have a verdict; non-zero aborts the restore.
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
: > {ran}
i=0
while [ ! -e {ok} ]; do
    [ -e {failed} ] && exit 1
    [ -e /proc/{owner} ] || exit 1  # the migrt that owes the verdict was killed: abort, never hang
    i=$((i + 1))
    [ $i -gt {polls} ] && exit 1
    sleep 0.01 2>/dev/null || {{ sleep 1; i=$((i + 99)); }}  # a sleep without fractions: whole seconds
done
exit 0
"""


class RestoreChecks:
    """Named checks run in threads; `gate_env()` arms the CRIU gate; `result()` waits for all and
    returns {name: seconds} or raises the first failure (in the order the checks were added)."""

    def __init__(self, work: str) -> None:
        self.work = work
        self._ok = os.path.join(work, "checks.ok")
        self._failed = os.path.join(work, "checks.failed")
        self._ran = os.path.join(work, "gate.ran")
        self._threads: list[tuple[str, threading.Thread]] = []
        self._errors: dict[str, BaseException] = {}
        self._seconds: dict[str, float] = {}
        self._values: dict[str, object] = {}
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._go = threading.Event()  # deferred checks wait for release()
        self._cancelled = False
        self.ended = threading.Event()  # the restore is over (failure() was called): a check waiting on it stops

    def add(self, name: str, fn: Callable[[], object], *, deferred: bool = False) -> None:
        """deferred: the check waits for release() (the caller's last step before runc), so that
        its Python work does not hold the GIL while the caller still prepares; it never runs if the
        restore stops before that."""
        def run() -> None:
            if deferred:
                self._go.wait()
                if self._cancelled:
                    return
            t0 = time.monotonic()
            try:
                self._values[name] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by result()
                self._errors[name] = exc
            self._seconds[name] = round(time.monotonic() - t0, 3)

        t = threading.Thread(target=run, name=f"migrt-check-{name}", daemon=True)
        self._threads.append((name, t))
        t.start()

    def release(self) -> None:
        """The deferred checks may run now."""
        self._go.set()

    def start(self) -> None:
        """Every check added: a watcher writes the verdict for the gate once they have all ended."""

        def watch() -> None:
            for _, t in self._threads:
                t.join()
            path = self._failed if self._errors else self._ok
            try:
                with open(path, "w"):
                    pass
            except OSError:
                pass  # the gate then times out (abort), and result() still raises or returns
            self._done.set()

        self._watcher = threading.Thread(target=watch, name="migrt-check-verdict", daemon=True)
        self._watcher.start()

    def gate_env(self, base: dict[str, str] | None) -> dict[str, str]:
        """runc's environment with the gate armed (base None: ours)."""
        env = dict(os.environ if base is None else base)
        gate = os.path.join(self.work, "restore-gate.sh")
        with open(gate, "w", encoding="utf-8") as fh:
            fh.write(_GATE.format(ok=shlex.quote(self._ok), failed=shlex.quote(self._failed),
                                  ran=shlex.quote(self._ran), polls=GATE_TIMEOUT_S * 100, owner=os.getpid()))
        os.chmod(gate, 0o700)
        return control.criu_config_env(env, self.work, [f"action-script {gate}"], "criu-gate.conf")

    @property
    def pending(self) -> bool:
        """Whether any check was added (no checks: no gate)."""
        return bool(self._threads)

    @property
    def gate_ran(self) -> bool:
        return os.path.exists(self._ran)

    @property
    def ran_path(self) -> str | None:
        """The file the gate creates when CRIU reaches post-restore (every task restored, none
        resumed); None without a gate. The page filler starts copying when it appears."""
        return self._ran if self.pending else None

    def value(self, name: str):
        return self._values.get(name)

    def failure(self) -> MigrtError | None:
        """Wait for every check; the first failure (in the order added) as a MigrtError, or None."""
        self.ended.set()
        if not self._go.is_set():  # the restore stopped before runc: deferred checks never run
            self._cancelled = True
            self._go.set()
        if self._watcher is not None:
            self._done.wait()
        else:  # the restore stopped before start(): no verdict to write, but the threads must end
            for _, t in self._threads:
                t.join()
        for name, _ in self._threads:
            exc = self._errors.get(name)
            if exc is None:
                continue
            if isinstance(exc, MigrtError):
                return exc
            err = MigrtError(f"restore check {name} failed: {exc!r}")
            err.__cause__ = exc
            return err
        return None

    def raise_failure(self) -> None:
        exc = self.failure()
        if exc is not None:
            raise exc

    def seconds(self) -> dict[str, float]:
        return dict(self._seconds)


def split_for_background(files: dict, top: str) -> tuple[list[str], list[str]]:
    """(hashed up front, hashed while CRIU restores): large files under images/ go to the background."""
    front: list[str] = []
    back: list[str] = []
    for rel, meta in files.items():
        size = meta.get("size") or 0
        (back if rel.startswith("images/") and size >= BACKGROUND_MIN_BYTES else front).append(rel)
    return sorted(front), sorted(back)
