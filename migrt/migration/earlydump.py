"""A pod-level pull's early dumps (issue 29): at the cut, every container of the source pod is dumped
at once, so that each part's pull finds its images ready and the source pod stays frozen for the
target's creates alone, not for one dump after the other as kubelet's creates come.

The rule:
- right after the freeze, CRIU's lazy dump of every container of the cut starts, all at once (each
  a runc/CRIU process of its own; on 2 cores the dumps overlap the first part's transfer and
  restore). A container with CUDA processes is not dumped early: its part dumps it in its own pull,
  after its driver state (migrate.py), as before;
- a dump is the cut's until its part's pull takes it (take): the cut's guard for the container
  knows CRIU's page server meanwhile, so an agent killed mid-dump ends the dump before the guard
  resumes the container; a cut given up cancels its dumps (CRIU stopped, its directory removed)
  before it resumes any container, so a container is never thawed under a running dump;
- take() waits for the dump, then moves its images and CRIU's dump log into the part's staging
  directory (the same filesystem: the store's .tmp); a dump that failed fails that part's pull (the
  cut then resumes the pod, as for any part's failure). The memory stays in the frozen tasks and is
  served by the part's own page server (pageserve.py), started once its pull's channel is there.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

from migrt.criu.options import CriuOptions
from migrt.errors import Conflict, MigrtError, RuntimeFailed
from migrt.migration.guard import Guard
from migrt.pods.members import Member
from migrt.runtime import control

READY_TIMEOUT = 120.0  # as migrate.LAZY_READY_TIMEOUT


class EarlyDump:
    """One container's lazy dump, made at the cut in a thread of its own (start), taken by its part
    (take) or cancelled by the cut (cancel)."""

    def __init__(self, runtime: str, member: Member, options: CriuOptions, tmp_dir: str, guard: Guard,
                 env: dict | None = None) -> None:
        self.runtime, self.member, self.options, self.guard, self.env = runtime, member, options, guard, env
        self.dir = os.path.join(tmp_dir, f"early.{member.cid[:12]}.{os.getpid()}.{time.monotonic_ns()}")
        self.images, self.work = os.path.join(self.dir, "images"), os.path.join(self.dir, "work")
        self.error: MigrtError | None = None
        self.seconds: float | None = None  # the dump's own duration, once it ended
        self._dump: control.LazyCheckpoint | None = None
        self._cancelled = self._taken = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"early-dump-{member.name}")

    def start(self) -> EarlyDump:
        os.makedirs(self.images, mode=0o700)
        os.makedirs(self.work, mode=0o700)
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            crit = control.loopback_page_server()  # CRIU's page server: only ended, never used
            with self._lock:
                if self._cancelled:
                    crit.release()
                    return
                self.guard.arm({**self.guard.current, "page_server": crit})
                self._dump = control.LazyCheckpoint(self.runtime, self.member.root, self.member.cid,
                                                    image_path=self.images, work_path=self.work,
                                                    options=self.options, page_server=crit, env=self.env)
            self._dump.wait_ready(READY_TIMEOUT)
            self._dump.finish(READY_TIMEOUT)
            with self._lock:
                if not self._cancelled:
                    self.guard.arm({**self.guard.current, "page_server": None})
        except MigrtError as exc:
            self.error = exc
        except Exception as exc:  # noqa: BLE001 - the part's pull reports it
            self.error = RuntimeFailed(f"the early dump of {self.member.describe()} failed: {exc!r}")
        self.seconds = round(time.monotonic() - t0, 3)

    def take(self, images: str, work: str) -> float:
        """Wait for the dump; move its images into `images` and its dump log into `work`; the
        dump's seconds. Raises its failure, or Conflict when the cut cancelled it."""
        self._thread.join()
        with self._lock:
            if self._cancelled:
                raise Conflict(f"the early dump of {self.member.describe()} was cancelled: the pod-level pull was "
                               "given up")
            if self.error is not None:
                raise self.error
            try:
                for entry in os.listdir(self.images):
                    os.replace(os.path.join(self.images, entry), os.path.join(images, entry))
                log = os.path.join(self.work, "dump.log")
                if os.path.isfile(log):
                    os.replace(log, os.path.join(work, "dump.log"))
            except OSError as exc:
                raise RuntimeFailed(f"cannot move the early dump of {self.member.describe()} into the migration's "
                                    f"staging directory: {exc}") from exc
            self._taken = True
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.seconds or 0.0

    def cancel(self) -> None:
        """The cut is given up: CRIU stopped (it leaves the tasks frozen, as it found them), its
        directory removed; returns once the dump's thread has ended."""
        with self._lock:
            self._cancelled = not self._taken
            dump = self._dump
        if dump is not None and self._cancelled:
            dump.abort()
        self._thread.join(READY_TIMEOUT * 2)
        if self._cancelled:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_all(runtime: str, members: list[Member], preps: dict, guards: dict[str, Guard]) -> dict[str, EarlyDump]:
    """Every container's early dump started, keyed by its name: those prepared by migrate.prepare,
    running, without CUDA processes (the others dump in their own pulls)."""
    from migrt.migration.migrate import Prepared

    dumps = {}
    for m in members:
        prep = preps[m.name]
        if not isinstance(prep, Prepared) or prep.gpu_offer or not m.running:
            continue
        tmp = os.path.join(prep.store.root, ".tmp")
        try:
            dumps[m.name] = EarlyDump(runtime, m, prep.opts, tmp, guards[m.name], prep.gpu.env()).start()
        except OSError:  # its directory: this part dumps in its own pull, as a GPU part does
            continue
    return dumps
