"""The filler proper: copies a restored tree's lazy memory into its tasks with several threads of
UFFDIO_COPY straight from the mmap'ed pages images, serving page faults first. In a lazy migration
the pages are on the source node instead (remote.py): each thread fetches the range it copies over its
own stream, the event thread the faults' ranges over its own.

Threads: one event thread polls every task's userfaultfd and the guard's socket; N copy threads fill
the biggest remaining segment first, `chunk` bytes at a time, all of them on the same segment. A
process's `first` ranges (the GPU driver's host copy of its GPU memory: images.py) rank before every
other range, so the copy threads fill them first, one after the other, each over every thread; the
moment a process's first ranges are all in, the status says so (`first_done`) and its GPU restore
may start (ops/pages.py MemoryReady), while the rest of its memory follows. Correctness rests on one lock and on
owning ranges:
- A range is either remaining (in its task's list), in flight (a Job: taken out of the list, being
  fetched, then copied), or done. Fetching takes no lock (local pages: nothing to fetch; remote pages:
  a network round trip), so a fault never waits behind one.
- A copy (UFFDIO_COPY) holds the lock shared; reading a userfaultfd (and handling what was read) holds
  it exclusive. While a fork/mremap/madvise(DONTNEED)/munmap event is pending the kernel answers
  UFFDIO_COPY with EAGAIN (mmap_changing); a copy thread keeps its bytes and retries once the event was
  handled. An event that touches a range in flight kills the job and gives what is left of its range
  back to the list (cut, or moved for mremap): its bytes are dropped, never copied where the task now
  expects zeros or other data. A fork child inherits exactly the ranges still missing, in flight ones
  included.
- A fault on a remaining range is copied at once (a `fault_window` around it, fetched over the event
  thread's own stream); a fault on a range in flight is decided again once the copy thread landed it;
  a fault outside every range is a page no dump covered (UFFDIO_ZEROPAGE; EEXIST when it was just
  copied is harmless).
- A userfaultfd is closed only when its task has nothing left: the kernel then unregisters its VMAs
  and pages no dump covered fault in as zeros, as without lazy restore. Until then the guard keeps a
  duplicate open, so a dying filler leaves faults blocked, never zero-filled (see guard.py).
Errors other than EAGAIN/EEXIST (task gone: ESRCH) are fatal: the filler exits and the guard kills
the container rather than let it run on memory that was not restored.

Local images the restore hands over unverified (verify.py) are verified chunk by chunk: `_fetch`
returns a range's bytes only once every 64 MiB chunk under it matched the manifest (hashed by the
caller, or by the sweep threads that verify ahead of the copies, the chunks CRIU reads itself first);
a mismatch is fatal like a copy error, and no page of that chunk is ever copied.

Test seams (test-only, never set in production): MIGRT_FILL_FAULT=after_bytes:N makes the filler
SIGKILL itself once it has copied N bytes (N=0: at its first copy), to test the guard;
MIGRT_FILL_PACE_MIBS=N slows the background copy down to N MiB/s, so that a test's workload surely
forks, remaps and madvises while its memory is still arriving.

A pod-level pull's part (MIGRT_FILL_HOLD=<its pod's hold record>, set by podpull.TargetPart for its
restore) is held frozen until its pod's last part is in: until the hold lets go (released, given up
or past its deadline) its copy threads take only first ranges, so that the pod's next parts restore
without them on the CPUs; faults are served as always.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import heapq
import json
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from migrt.kernel import mm
from migrt.kernel.files import atomic_file
from migrt.kernel.libc import libc
from migrt.pagefill import held, uffd
from migrt.pagefill.images import PAGE, Plan, in_ranges
from migrt.pagefill.remote import FetchError, RemotePages
from migrt.pagefill.verify import Verifier, VerifyError, mmap_reader

CHUNK = 4 << 20
FAULT_WINDOW = 64 << 10
REMOTE_CHUNK = 2 << 20          # a fetch from the source: big enough to stream, small enough for faults
REMOTE_FAULT_WINDOW = 256 << 10
BACKGROUND_NICE = 10            # copy threads; the event thread (faults) keeps the process's priority
STATUS_EVERY_S = 0.5


class FillError(Exception):
    pass


class RWLock:
    """Many copies at once, or one event handler alone; a waiting event handler goes first."""

    def __init__(self) -> None:
        self._c = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._c:
            while self._writer or self._waiting:
                self._c.wait()
            self._readers += 1

    def release_shared(self) -> None:
        with self._c:
            self._readers -= 1
            if not self._readers:
                self._c.notify_all()

    def acquire_exclusive(self) -> None:
        with self._c:
            self._waiting += 1
            while self._writer or self._readers:
                self._c.wait()
            self._waiting -= 1
            self._writer = True

    def release_exclusive(self) -> None:
        with self._c:
            self._writer = False
            self._c.notify_all()


class PagesFile:
    """A pages-<id>.img mapped read-only: UFFDIO_COPY reads it straight from the page cache."""

    def address(self, _vpid: int, offset: int, _n: int) -> int:
        return self.base + offset

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            self.base = 0
            if self.size:
                addr = libc.mmap(None, self.size, mm.PROT_READ, mm.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise FillError(f"cannot map {path}: {os.strerror(ctypes.get_errno())}")
                self.base = addr
        finally:
            os.close(fd)


@dataclass(eq=False)
class Task:
    """One userfaultfd: a restored process, or a child it forked during the fill."""
    id: int
    vpid: int
    fd: int
    pages: PagesFile | RemotePages | None
    segs: list  # of Seg, sorted by start, never empty ones
    lazy_bytes: int
    copied: int = 0
    inflight: int = 0
    flight: list = field(default_factory=list)  # of Job: out of segs, being fetched or copied
    done: bool = False
    closed: bool = False
    forked_from: int | None = None
    t_done: float | None = None
    events: dict[str, int] = field(default_factory=dict)
    first: list = field(default_factory=list)  # [start, end) ranges copied before any other (images.py)
    first_bytes: int = 0
    first_done: bool = False
    t_first: float | None = None
    copied_at_first: int | None = None         # what had been copied into it when they were all in

    def remaining(self) -> int:
        return sum(s.length for s in self.segs)


class Seg:
    """A remaining range of one task: [start, end), filled from `offset` of its pages file. A range
    leaves its task's list (alive=False) when done, cut or moved; the heap may still hold it."""
    __slots__ = ("start", "end", "offset", "alive", "inherited")

    def __init__(self, start: int, end: int, offset: int, inherited: bool = True) -> None:
        self.start, self.end, self.offset, self.alive, self.inherited = start, end, offset, True, inherited

    @property
    def length(self) -> int:
        return self.end - self.start


class Job:
    """A range taken out of its task's list to be fetched and copied (a background chunk, or the window
    around a fault). It stays in the task's `flight` until copied; an event that changes its range
    (remove, unmap, remap) kills it and gives what is left of it back to the list, so the bytes fetched
    for it are dropped instead of landing where the task no longer expects them."""
    __slots__ = ("t", "start", "end", "offset", "inherited", "alive")

    def __init__(self, t: Task, start: int, end: int, offset: int, inherited: bool) -> None:
        self.t, self.start, self.end, self.offset, self.inherited, self.alive = t, start, end, offset, inherited, True


def _start(s: Seg) -> int:
    return s.start


def _drop(segs: list[Seg], a: int, b: int) -> list[Seg]:
    """The ranges of segs outside [a, b), as new objects."""
    out = []
    for s in segs:
        if s.end <= a or s.start >= b:
            out.append(Seg(s.start, s.end, s.offset, s.inherited))
            continue
        if s.start < a:
            out.append(Seg(s.start, a, s.offset, s.inherited))
        if s.end > b:
            out.append(Seg(b, s.end, s.offset + (b - s.start), s.inherited))
    return out


def _remap(segs: list[Seg], frm: int, to: int, length: int) -> list[Seg]:
    """mremap moved [frm, frm+length) to `to`: so do the ranges inside it."""
    end, delta = frm + length, to - frm
    out = _drop(segs, frm, end)
    for s in segs:
        a, b = max(s.start, frm), min(s.end, end)
        if a < b:
            out.append(Seg(a + delta, b + delta, s.offset + (a - s.start), s.inherited))
    return sorted(out, key=_start)


class Filler:
    def __init__(self, plan: Plan, *, threads: int, guard: socket.socket, status_path: str | None,
                 post_restore: str | None = None, remote: RemotePages | None = None,
                 verifier: Verifier | None = None) -> None:
        self.plan = plan
        self.remote = remote           # pages on the source node (lazy migration), else the local images
        # local images handed over unverified: each 64 MiB chunk is verified before a page of it is
        # copied, the chunks CRIU reads itself (eager) first (verify.py)
        self.verifier = None if remote else verifier
        self.verify_news = False
        self.chunk = REMOTE_CHUNK if remote else CHUNK
        self.fault_window = REMOTE_FAULT_WINDOW if remote else FAULT_WINDOW
        self.nthreads = max(1, threads)
        self.guard = guard
        self.status_path = status_path
        self.rw = RWLock()
        self.state = threading.Lock()
        self.work = threading.Condition(self.state)
        self.tasks: dict[int, Task] = {}
        self.files: dict[str, PagesFile] = {}
        self.finished = False          # CRIU said the restore is complete: tasks may be closed
        self.rest_after = threading.Event()  # set with `finished` (or the stop): a source's sweep fetches the rest
        self.copying = False           # background copies may run: finished, or every task restored
        self.told_all_in = False       # the status said that nothing is left to copy
        self.post_restore = post_restore  # appears when CRIU reaches post-restore (all VMAs registered)
        self.stop = False
        self.fatal: str | None = None
        self.pull_error: str | None = None  # a lazy pull's chunk that failed after every page was in
        self.heap: list = []           # (rank, -length, seq, task, seg): first ranges, then biggest first
        self.seq = 0
        self.current: tuple[Task, Seg, int] | None = None  # the segment the copy threads cut, and its rank
        self.first_news = False        # a task's first ranges just came in: the status says so at once
        self.to_close: list[Task] = []
        self.retry: list[tuple[Task, int]] = []
        self.copied = 0
        self.next_id = 1 << 20         # ids for fork children (the guard numbers the first ones)
        self.t0 = time.monotonic()
        self.t_finished: float | None = None
        self.t_done: float | None = None
        self.counts: dict[str, int | float] = {"faults": 0, "zero_faults": 0, "eagain": 0, "eexist": 0, "forks": 0,
                                               "removes": 0, "unmaps": 0, "remaps": 0}
        self.fault_after = _fault_seam()
        self.pace = int(os.environ.get("MIGRT_FILL_PACE_MIBS", "0") or 0) << 20
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._last_status = 0.0
        # a pod's part held frozen until its pod is whole (pods/hold.py): background copies wait
        self.hold_path: str | None = os.environ.get(held.HOLD_ENV) or None
        self._hold_read = 0.0

    # -- ranges (all under self.state) -------------------------------------------------------------
    def _set_segs(self, t: Task, segs: list[Seg]) -> None:
        for s in t.segs:
            s.alive = False
        t.segs = segs
        for s in segs:
            self._push(t, s)
        if self.current is not None and self.current[0] is t:
            self.current = None  # (another task's range being cut stays: it is out of the heap)

    def _push(self, t: Task, s: Seg) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self._rank(t, s.start, s.end), -s.length, self.seq, t, s))

    @staticmethod
    def _rank(t: Task, start: int, end: int) -> int:
        """0 for a range in the task's first ranges (copied before any other), 1 otherwise."""
        return 0 if t.first and not t.first_done and in_ranges(t.first, start, end) else 1

    def _first_left(self, t: Task) -> bool:
        """Under self.state: whether any of the task's first ranges is still to copy (remaining or in flight)."""
        for a, b in t.first:
            i = bisect.bisect_right(t.segs, a, key=_start) - 1
            if i >= 0 and t.segs[i].end > a:
                return True
            if i + 1 < len(t.segs) and t.segs[i + 1].start < b:
                return True
        return any(j.alive and in_ranges(t.first, j.start, j.end) for j in t.flight)

    def _remove(self, t: Task, s: Seg) -> None:
        s.alive = False
        i = bisect.bisect_left(t.segs, s.start, key=_start)
        while i < len(t.segs):
            if t.segs[i] is s:
                del t.segs[i]
                return
            i += 1

    def _insert(self, t: Task, s: Seg) -> None:
        bisect.insort(t.segs, s, key=_start)
        self._push(t, s)

    def _find(self, t: Task, addr: int) -> Seg | None:
        i = bisect.bisect_right(t.segs, addr, key=_start) - 1
        if i >= 0 and t.segs[i].start <= addr < t.segs[i].end:
            return t.segs[i]
        return None

    # -- tasks -----------------------------------------------------------------------------------
    def add_task(self, tid: int, vpid: int, fd: int) -> None:
        proc = self.plan.processes.get(vpid)
        if proc is None:
            raise FillError(f"CRIU sent the userfaultfd of pid {vpid}, which the images do not list")
        pages: PagesFile | RemotePages | None = None
        if proc.segments and self.remote:
            pages = self.remote
        elif proc.segments:
            pages = self._map(proc.pages_file)
            if pages.size < max(s.offset + s.length for s in proc.segments):
                raise FillError(f"{proc.pages_file} is shorter than its pagemap says")
        with self.state:
            t = Task(id=tid, vpid=vpid, fd=fd, pages=pages, segs=[], lazy_bytes=proc.lazy_bytes,
                     first=list(proc.first), first_bytes=proc.first_bytes)
            self.tasks[tid] = t
            self._set_segs(t, [Seg(s.start, s.end, s.offset, s.inherited) for s in proc.segments])
            self._check_done(t)

    def _map(self, path: str) -> PagesFile:
        pages = self.files.get(path)
        if pages is None:
            pages = self.files[path] = PagesFile(path)
            if self.verifier is not None and self.verifier.checks(path) and pages.size:
                self.verifier.reader(path, mmap_reader(pages.base))  # the very bytes UFFDIO_COPY reads
        return pages

    def _all_copied(self) -> bool:
        with self.state:
            return bool(self.tasks) and all(t.done or t.closed or (not t.segs and not t.flight)
                                            for t in self.tasks.values())

    def _check_done(self, t: Task) -> None:
        """Under self.state."""
        if t.first and not t.first_done and not self._first_left(t):
            t.first_done, t.t_first, t.copied_at_first = True, time.monotonic(), t.copied
            self.first_news = True
            self._wake()
        if not t.done and self.finished and not t.segs and not t.inflight:
            t.done, t.t_done = True, time.monotonic()
            self.to_close.append(t)
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass

    # -- copy threads ----------------------------------------------------------------------------
    def _take(self) -> Job | None:
        """Under self.state: the next background chunk: first ranges before any other, then the
        biggest remaining range first."""
        if not self.copying:
            return None
        if self._held() and not ((self.heap and self.heap[0][0] == 0) or
                                 (self.current is not None and self.current[2] == 0)):
            return None  # only first ranges (a GPU process's host copy) go before the release
        cur = self.current
        if cur is not None and cur[1].alive and cur[1].length > 0 and self.heap and self.heap[0][0] < cur[2]:
            self._push(cur[0], cur[1])  # a first range came (a task added late): it goes before this one
            cur = None
        while cur is None or not cur[1].alive or cur[1].length <= 0:
            if cur is not None and cur[1].alive:
                self._remove(cur[0], cur[1])
            if not self.heap:
                self.current = None
                return None
            rank, _, _, t, s = heapq.heappop(self.heap)
            cur = (t, s, rank) if s.alive and not t.done else None
        self.current = cur
        t, s, _ = cur
        n = min(self.chunk, s.length)
        job = self._fly(t, s.start, s.start + n, s.offset, s.inherited)
        s.start += n
        s.offset += n
        if s.length <= 0:
            self._remove(t, s)
            self.current = None
        return job

    def _held(self) -> bool:
        """Under self.state: the restored tasks are a pod's part still held frozen (pods/hold.py):
        no fault can come, and background copies would compete with the restores of the pod's next
        parts. The record is read at most every 50 ms; once the hold has let go, never again."""
        if self.hold_path is None:
            return False
        now = time.monotonic()
        if now - self._hold_read >= 0.05:
            self._hold_read = now
            if not held.holding(self.hold_path):
                self.hold_path = None
                self.counts["held_s"] = round(now - self.t0, 3)
                return False
        return True

    def _fly(self, t: Task, start: int, end: int, offset: int, inherited: bool) -> Job:
        """Under self.state."""
        job = Job(t, start, end, offset, inherited)
        t.flight.append(job)
        t.inflight += 1
        return job

    def _finish(self, job: Job) -> None:
        """Under self.state: the job is over (copied, dropped or given back)."""
        t = job.t
        t.flight.remove(job)
        t.inflight -= 1
        self._check_done(t)

    def _ground(self, t: Task, a: int, b: int) -> list[Seg]:
        """Under self.state and the exclusive lock: the live jobs of t that overlap [a, b) die; their
        ranges come back as segments (to be cut or moved with the task's list, then fetched again)."""
        back = []
        for job in t.flight:
            if job.alive and job.start < b and job.end > a:
                job.alive = False
                back.append(Seg(job.start, job.end, job.offset, job.inherited))
        return back

    def _fetch(self, job: Job) -> int | None:
        """Without any lock: where the job's bytes are (remote pages: fetched into this thread's
        buffer). None after a fetch failure (fatal)."""
        t, pages = job.t, job.t.pages
        assert pages is not None  # a task with ranges to copy has pages to copy them from
        try:
            if self.verifier is not None:  # a chunk not verified yet: hashed now (or waited for), once
                assert isinstance(pages, PagesFile)  # local images only: no verifier with remote pages
                self.verifier.ensure(pages.path, job.offset, job.end - job.start)
            return pages.address(t.vpid, job.offset, job.end - job.start)
        except (FetchError, VerifyError) as exc:
            with self.state:
                self._fail(str(exc) if isinstance(exc, VerifyError) else f"pid {t.vpid}: {exc}")
                self._finish(job)
            return None

    def _sweeper(self) -> None:
        """Verify the handed-over chunks ahead of the copies: the eager ones (the restore's gate waits
        for them) at the process's priority, the rest at the copy threads' (verify.py)."""
        niced, verifier = False, self.verifier
        if verifier is None:
            return  # started only with a verifier
        try:
            while not self.stop:
                # (a registry source's sweep keeps the process's priority until the GPU host copy is in)
                if not niced and verifier.eager_done and (verifier.source is None or verifier.t_first is not None):
                    niced = True
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
                if not verifier.sweep_one():
                    return
        except VerifyError as exc:
            with self.state:
                if self.t_done is None:
                    self._fail(str(exc))
                else:  # every page is in: only the pull behind the fill failed, the container is fine
                    self.pull_error = str(exc)

    def _eager_verified(self) -> None:
        with self.state:
            self.verify_news = True
        self._wake()

    def _land(self, job: Job, src: int, *, patient: bool) -> int:
        """Copy a fetched job into its task, holding the lock shared for each attempt. EAGAIN (an event
        pending): a patient caller (a copy thread, whose buffer is its own) retries after the event was
        handled; the event thread gives the rest back and returns EAGAIN. Returns the last errno."""
        t = job.t
        while True:
            self.rw.acquire_shared()
            try:
                with self.state:
                    if not job.alive:  # an event took the range back: the bytes go nowhere
                        self._finish(job)
                        return 0
                if self.fault_after is not None and self.copied >= self.fault_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # test seam: the filler dies mid-way
                n = job.end - job.start
                err, done = 0, n
                try:
                    uffd.copy(t.fd, job.start, src, n)
                except uffd.UffdError as exc:
                    err, done = exc.errno, exc.done
                with self.state:
                    t.copied += done
                    self.copied += done
                    job.start += done
                    job.offset += done
                    src += done
                    if err == errno.EEXIST:  # a page already there (a fault's zero page, or copied): skip it
                        self.counts["eexist"] += 1
                        job.start += PAGE
                        job.offset += PAGE
                        src += PAGE
                        err = 0 if job.start >= job.end else errno.EEXIST
                    if not err:
                        self._finish(job)
                        return 0
                    if err == errno.EEXIST:
                        continue
                    if err == errno.EAGAIN:  # the address space is changing
                        self.counts["eagain"] += 1
                        if not patient:
                            job.alive = False
                            self._insert(t, Seg(job.start, job.end, job.offset, job.inherited))
                            self._finish(job)
                            return err
                    else:
                        if err == errno.ENOENT and t.forked_from is not None:
                            # a fork child without this mapping (MADV_DONTFORK set after the restore)
                            self.counts["child_unmapped"] = self.counts.get("child_unmapped", 0) + 1
                        elif err in (errno.ESRCH, errno.ENOSPC):  # the task has exited
                            self._set_segs(t, [])
                        else:
                            self._fail(f"pid {t.vpid}: UFFDIO_COPY of {n - done} bytes at {job.start:#x}: "
                                       f"{os.strerror(err)}")
                        self._finish(job)
                        return err
            finally:
                self.rw.release_shared()
            time.sleep(0.0005)  # EAGAIN: let the event thread read what changes the address space

    def _fail(self, msg: str) -> None:
        if self.fatal is None:
            self.fatal = msg
        self.stop = True
        self.work.notify_all()
        self._wake()

    def _connect(self, background: bool = False) -> bool:
        """Remote pages: this thread's stream to the source, opened before anything waits on it."""
        if self.remote is None:
            return True
        try:
            self.remote.connect(background)
            return True
        except FetchError as exc:
            with self.state:
                self._fail(str(exc))
            return False

    def _worker(self) -> None:
        """Take the next chunk, fetch it without any lock (remote pages: over this thread's stream),
        then copy it holding the lock shared: a fault never waits behind a fetch."""
        with contextlib.suppress(OSError):  # background copies yield the CPU to the tasks and to faults
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        if not self._connect(background=True):
            return
        while True:
            with self.state:
                while not self.stop and not self.copying:
                    self.work.wait()
                if self.stop:
                    return
                job = self._take()
                if job is None:
                    self.work.wait(0.05)
                    continue
            src = self._fetch(job)
            if src is None:
                return
            self._land(job, src, patient=True)
            if self.pace and self.t_finished:  # test seam (see the module doc)
                ahead = self.copied / self.pace - (time.monotonic() - self.t_finished)
                if ahead > 0:
                    time.sleep(ahead)

    # -- events ----------------------------------------------------------------------------------
    def _read_events(self, t: Task) -> list[tuple]:
        """Holding the lock exclusive: read what the task's userfaultfd has, handle it; the copies
        that faults need are returned, to be run holding the lock shared."""
        jobs: list[tuple] = []
        try:
            buf = os.read(t.fd, uffd.MSG_SIZE * 64)
        except BlockingIOError:
            return jobs
        except OSError as exc:
            with self.state:
                self._fail(f"pid {t.vpid}: reading its userfaultfd: {exc.strerror}")
            return jobs
        for m in uffd.parse(buf):
            with self.state:
                if m.event == uffd.EVENT_PAGEFAULT:
                    self.counts["faults"] += 1
                    jobs.append(self._decide(t, m.a & ~(PAGE - 1)))
                elif m.event in (uffd.EVENT_REMOVE, uffd.EVENT_UNMAP):
                    self._on_remove(t, m)
                elif m.event == uffd.EVENT_REMAP:
                    self.counts["remaps"] += 1
                    back = self._ground(t, m.a, m.a + m.c)
                    self._set_segs(t, _remap(sorted(t.segs + back, key=_start), m.a, m.b, m.c))
                elif m.event == uffd.EVENT_FORK:
                    self._on_fork(t, m.a)
                else:
                    self._fail(f"pid {t.vpid}: unexpected userfaultfd event {m.event:#x}")
        return jobs

    def _decide(self, t: Task, addr: int) -> tuple:
        """Under self.state, holding the lock exclusive (no copy running; fetches may be): what a fault
        at addr needs. ("copy", job, addr) for a range still missing (taken out of the task's list),
        ("wait", t, addr) for one a copy thread is fetching (decided again once it landed), ("zero", t,
        addr) for a page no dump covered (or copied already: EEXIST then)."""
        seg = self._find(t, addr) if not t.done else None
        if seg is None:
            if any(j.alive and j.start <= addr < j.end for j in t.flight):
                return ("wait", t, addr)
            return ("zero", t, addr)
        w = self.fault_window
        a = max(seg.start, addr & ~(w - 1))
        b = min(seg.end, a + w)
        if b <= addr:
            a, b = addr, min(seg.end, addr + w)
        off = seg.offset + (a - seg.start)
        if b < seg.end:
            self._insert(t, Seg(b, seg.end, seg.offset + (b - seg.start), seg.inherited))
        seg.end = a
        if seg.length <= 0:
            self._remove(t, seg)
        return ("copy", self._fly(t, a, b, off, seg.inherited), addr)

    def _on_remove(self, t: Task, m: uffd.Msg) -> None:
        """Under self.state and the exclusive lock. REMOVE (madvise DONTNEED/REMOVE) keeps the VMA:
        unregister the range, so the task faults in zeros there as it expects; UNMAP: the VMA is gone."""
        if m.event == uffd.EVENT_REMOVE:
            self.counts["removes"] += 1
            try:
                uffd.unregister(t.fd, m.a, m.b - m.a)
            except uffd.UffdError as exc:
                if exc.errno not in (errno.ENOMEM, errno.ESRCH):  # ENOMEM: the task has gone
                    self._fail(f"pid {t.vpid}: unregistering {m.a:#x}-{m.b:#x}: {exc.strerror}")
        else:
            self.counts["unmaps"] += 1
        back = self._ground(t, m.a, m.b)
        self._set_segs(t, _drop(sorted(t.segs + back, key=_start), m.a, m.b))
        self._check_done(t)

    def _on_fork(self, parent: Task, fd: int) -> None:
        """Under self.state and the exclusive lock (no copy running): the child misses exactly what the
        parent still misses, its ranges in flight included. Its userfaultfd goes to the guard first
        (see module doc)."""
        self.counts["forks"] += 1
        tid = self.next_id
        self.next_id += 1
        os.set_blocking(fd, False)
        try:
            self.guard.sendmsg([f"K {tid}".encode()],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))])
        except OSError:
            pass  # the guard is gone: we are the only holder now
        # (the child holds no GPU state: no first ranges)
        # MADV_DONTFORK ranges: the child has no such mapping; MADV_WIPEONFORK ones: the child must
        # read zeros there (its faults get zero pages, as ranges outside every segment do)
        segs = [Seg(s.start, s.end, s.offset, True) for s in parent.segs if s.inherited]
        segs += [Seg(j.start, j.end, j.offset, True) for j in parent.flight if j.alive and j.inherited]
        segs.sort(key=_start)
        child = Task(id=tid, vpid=parent.vpid, fd=fd, pages=parent.pages, segs=[],
                     lazy_bytes=sum(s.length for s in segs), forked_from=parent.id)
        self.tasks[tid] = child
        self._set_segs(child, segs)
        self._check_done(child)

    def _serve(self, jobs: list[tuple]) -> None:
        """The copies and zero pages that faults need (each takes the lock shared itself)."""
        for job in jobs:
            if job[0] == "copy":
                _, j, addr = job
                src = self._fetch(j)
                if src is not None and self._land(j, src, patient=False) == errno.EAGAIN:
                    with self.state:
                        self.retry.append((j.t, addr))  # decided again after the pending event
                continue
            _, t, addr = job
            if job[0] == "wait":
                with self.state:
                    self.retry.append((t, addr))
                continue
            with self.state:
                self.counts["zero_faults"] += 1
            self.rw.acquire_shared()
            try:
                uffd.zeropage(t.fd, addr, PAGE)
            except uffd.UffdError as exc:
                if exc.errno == errno.EAGAIN:
                    with self.state:
                        self.retry.append((t, addr))
                elif exc.errno not in (errno.EEXIST, errno.ENOENT, errno.ESRCH, errno.ENOSPC):
                    with self.state:
                        self._fail(f"pid {t.vpid}: UFFDIO_ZEROPAGE at {addr:#x}: {exc.strerror}")
            finally:
                self.rw.release_shared()

    # -- guard messages --------------------------------------------------------------------------
    def _from_guard(self) -> bool:
        """False when the guard has gone away."""
        try:
            msg, anc, _flags, _addr = self.guard.recvmsg(256, socket.CMSG_SPACE(4 * 4))
        except OSError:
            return False
        if not msg:
            return False
        fds = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data) - len(data) % 4, 4)]
        words = msg.decode().split()
        if words[0] == "T" and fds:
            os.set_blocking(fds[0], False)
            try:
                self.add_task(int(words[1]), int(words[2]), fds[0])
            except FillError as exc:
                with self.state:
                    self._fail(str(exc))
        elif words[0] == "F":
            self.rest_after.set()
            with self.state:
                self.finished = True
                if not self.copying:
                    self.copying, self.t_finished = True, time.monotonic()
                for t in self.tasks.values():
                    self._check_done(t)
                self.work.notify_all()
            self.write_status("filling")  # restore_finished: what the restore's waits look at
        elif words[0] == "A":
            self.rest_after.set()
            with self.state:
                self.stop = True
                self.work.notify_all()
        return True

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> int:
        """The event thread: serve the faults, close finished tasks, retry what waited, watch the guard
        and CRIU's post-restore gate, until every task is done or the fill stops; 1 on a failure."""
        workers = self._start_workers()
        self._connect()  # this (event) thread's stream serves the faults
        guard_ok = True
        self.write_status("filling")
        while True:
            news = self._take_news()
            if news is None:
                break
            retry, all_done = news
            if all_done:
                with self.state:
                    self.t_done = time.monotonic()
                break
            jobs = self._redecide(retry) if retry else []
            guard_ok = self._poll_once(jobs, guard_ok)
            if time.monotonic() - self._last_status > STATUS_EVERY_S:
                self.write_status("filling")
        if self.t_done is not None and self.verifier is not None and self.verifier.source is not None:
            self._finish_pull(workers)
        return self._wind_down(workers)

    def _finish_pull(self, workers: list[threading.Thread]) -> None:
        """A lazy restore by reference whose memory is all in: the sweep fetches what is left (chunks of
        processes that exited), then the partial directory is committed as the pulled checkpoint
        (registry.py). Nothing here can fail the container any more; the node's log says how it went."""
        source = self.verifier.source if self.verifier is not None else None
        assert source is not None
        for w in workers:
            if w.name.startswith("verify-"):
                w.join()
        st = self.verifier.snapshot() if self.verifier is not None else {}
        fetched = source.summary()  # in the final status: `migrt restore oci:REF --wait-pages` reports them
        self.counts.update(registry_fetched_bytes=fetched["fetched_bytes"], registry_fetched_chunks=fetched[
            "fetched_chunks"], registry_taken_chunks=fetched["taken_chunks"])
        error = self.pull_error or st.get("error")
        if error is None and st.get("verified") != st.get("chunks"):
            error = "not every chunk was fetched"
        if error is not None:
            source.close()
            source.log("registry_fill_incomplete", error=error, **source.summary())
            return
        try:
            committed = source.commit()
        except Exception as exc:  # noqa: BLE001 - the container runs on; the next restore pulls again
            source.log("registry_fill_incomplete", error=f"committing the pulled checkpoint failed: {exc!r}",
                       **source.summary())
            return
        self.counts["pull_committed"] = 0 if committed.get("joined") else 1
        memory_in = round(self.t_done - self.t0, 3) if self.t_done is not None else None
        source.log("registry_fill_done", checkpoint=committed["name"], fill_s=round(time.monotonic() - self.t0, 3),
                   memory_in_s=memory_in, joined=bool(committed.get("joined")), **source.summary())

    def _start_workers(self) -> list[threading.Thread]:
        """The copying threads, and with a verifier its sweepers (the pages images mapped first)."""
        workers = [threading.Thread(target=self._worker, name=f"fill-{i}", daemon=True) for i in range(self.nthreads)]
        if self.verifier is not None:
            try:
                for path in self.verifier.files:
                    self._map(path)
            except (OSError, FillError) as exc:
                with self.state:
                    self._fail(f"cannot map the pages images to verify them: {exc}")
            self.verifier.on_eager_done = self._eager_verified
            if self.verifier.source is not None:  # the rest fetched once the restore finished ("F")
                self.verifier.rest_after = self.rest_after
            # a source's sweep threads each hold a connection: as many as it may open (registry_parallel)
            sweepers = self.verifier.source.parallel if self.verifier.source is not None else self.nthreads
            workers += [threading.Thread(target=self._sweeper, name=f"verify-{i}", daemon=True)
                        for i in range(sweepers)]
        for w in workers:
            w.start()
        return workers

    def _take_news(self) -> tuple[list, bool] | None:
        """What the workers left for this thread, taken under the state lock: the tasks to close (closed
        here), the faults to decide again, whether everything is done; None once the fill stops."""
        with self.state:
            if self.stop:
                return None
            closing, self.to_close = self.to_close, []
            retry, self.retry = self.retry, []
            all_done = self.finished and all(t.done for t in self.tasks.values())
            first_news, self.first_news = self.first_news, False
            first_news, self.verify_news = first_news or self.verify_news, False
        for t in closing:
            self._close(t)
        if first_news:  # a GPU restore waits for this (ops/pages.py MemoryReady), the gate for verify
            self.write_status("filling")
        return retry, all_done

    def _redecide(self, retry: list) -> list[tuple]:
        time.sleep(0.0005)
        self.rw.acquire_exclusive()
        try:
            with self.state:
                return [self._decide(t, addr) for t, addr in retry if not t.closed]
        finally:
            self.rw.release_exclusive()

    def _poll_once(self, jobs: list[tuple], guard_ok: bool) -> bool:
        """One wait on the tasks' userfaultfds, the guard and the wake pipe, then the faults served;
        whether the guard is still there."""
        poller = select.poll()
        by_fd = {}
        for t in list(self.tasks.values()):
            if not t.closed:
                poller.register(t.fd, select.POLLIN)
                by_fd[t.fd] = t
        if guard_ok:
            poller.register(self.guard.fileno(), select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        waiting_gate = not self.copying and self.post_restore
        # copying at a held gate (before CRIU's end of restore): say so at once when all is in, the
        # restore waits for it (a direct migration: ops/pages.py FilledFirst)
        held = self.copying and not self.finished
        if held and not self.told_all_in and self._all_copied():
            self.told_all_in = True
            self.write_status("filling")
        ready = poller.poll(0 if jobs else 10 if waiting_gate or held else 200)
        t_ready = time.monotonic()
        if waiting_gate and self.post_restore and os.path.exists(self.post_restore):
            # CRIU's post-restore: every task restored, every lazy VMA registered, none resumed
            with self.state:
                self.copying, self.t_finished = True, time.monotonic()
                self.counts["early_start"] = 1
                self.work.notify_all()
        guard_ok = self._read_ready(ready, by_fd, jobs, guard_ok)
        if jobs:
            self._serve(jobs)
            took = round((time.monotonic() - t_ready) * 1000, 1)  # reading the faults + serving them
            with self.state:
                self.counts["fault_max_ms"] = max(self.counts.get("fault_max_ms", 0), took)
        return guard_ok

    def _read_ready(self, ready: list[tuple[int, int]], by_fd: dict[int, Task], jobs: list[tuple],
                    guard_ok: bool) -> bool:
        """The descriptors poll found ready: the wake pipe drained, the guard's messages, the tasks'
        faults (added to `jobs`); whether the guard is still there."""
        for fd, _ev in ready:
            if fd == self.wake_r:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
            elif guard_ok and fd == self.guard.fileno():
                guard_ok = self._from_guard()
                if not guard_ok and not self.finished:
                    with self.state:
                        self._fail("the guard went away before the restore finished")
            elif fd in by_fd:
                self.rw.acquire_exclusive()
                try:
                    jobs += self._read_events(by_fd[fd])
                finally:
                    self.rw.release_exclusive()
        return guard_ok

    def _wind_down(self, workers: list[threading.Thread]) -> int:
        """Workers stopped, descriptors closed, the outcome written and told to the guard."""
        with self.state:
            self.stop = True
            self.work.notify_all()
        for w in workers:
            w.join(5)
        for t in self.tasks.values():  # what exiting would do (the guard still holds its copies)
            if not t.closed:
                t.closed = True
                os.close(t.fd)
        if self.remote:
            self.remote.close(done=self.fatal is None and self.t_done is not None)
        if self.fatal:
            self.write_status("failed", error=self.fatal)
            try:
                self.guard.send(f"E {self.fatal}".encode()[:4000])
            except OSError:
                pass
            return 1
        if self.t_done is None:  # aborted (the restore failed): nothing to report as done
            self.write_status("aborted")
            return 0
        self.write_status("done")
        try:
            self.guard.send(b"Z")
        except OSError:
            pass
        return 0

    def _close(self, t: Task) -> None:
        if t.closed:
            return
        t.closed = True
        os.close(t.fd)
        try:
            self.guard.send(f"D {t.id}".encode())
        except OSError:
            pass
        self.write_status("filling")

    # -- status ----------------------------------------------------------------------------------
    def snapshot(self, state: str, error: str | None = None) -> dict:
        with self.state:
            pids = {}
            forks = []
            left = 0
            for t in self.tasks.values():
                # still to copy (ranges not taken yet and those being copied): 0 for a process whose memory
                # is all in, also before CRIU's end of restore (a direct migration's check: ops/pages.py)
                t_left = 0 if t.done or t.closed else t.remaining() + sum(j.end - j.start for j in t.flight)
                left += t_left
                rec = {"lazy_bytes": t.lazy_bytes, "copied_bytes": t.copied, "done": t.done, "left_bytes": t_left,
                       "seconds": round(t.t_done - self.t0, 3) if t.t_done else None}
                if t.first:
                    rec.update(first_bytes=t.first_bytes, first_done=t.first_done,
                               first_s=round(t.t_first - self.t0, 3) if t.t_first else None,
                               copied_at_first=t.copied_at_first)
                if t.forked_from is None:
                    pids[str(t.vpid)] = rec
                else:
                    forks.append({"vpid": t.vpid, **rec})
            now = self.t_done or time.monotonic()
            out = {"state": state, "threads": self.nthreads, "lazy_bytes": self.plan.lazy_bytes,
                   "copied_bytes": self.copied, "left_bytes": left, "restore_finished": self.finished,
                   "seconds": round(now - self.t0, 3),
                   "fill_s": round(now - self.t_finished, 3) if self.t_finished else None,
                   "pids": pids, "forks": forks, "counts": dict(self.counts), "filler_pid": os.getpid(),
                   "held": self.hold_path is not None}
        if self.verifier is not None:
            out["verify"] = self.verifier.snapshot()
        if error:
            out["error"] = error
        return out

    def write_status(self, state: str, error: str | None = None) -> None:
        self._last_status = time.monotonic()
        if self.status_path:
            write_json(self.status_path, self.snapshot(state, error))


def write_json(path: str, data: dict) -> None:
    with contextlib.suppress(OSError), atomic_file(path, 0o644, text=True, durable=False) as fh:
        json.dump(data, fh)


def _fault_seam() -> int | None:
    spec = os.environ.get("MIGRT_FILL_FAULT", "")
    if spec.startswith("after_bytes:"):
        try:
            return int(spec.split(":", 1)[1])
        except ValueError:
            return None
    return None
