"""Writing the planned pages files with several threads.

Every new pages file is created beside CRIU's (suffix NEW_SUFFIX) at its final size, once the file
system's free space was found to hold them all (a full store says so before any copy). The files are
cut into pieces, the store's 64 MiB digest chunks (below); each thread takes the next piece of any file,
preallocates its blocks (fallocate: contiguous on disk file systems) and writes it at its planned offset: a task's
memory is read with process_vm_readv into the thread's own buffer and pwrite()n, CRIU's own pages are
moved with copy_file_range. The GIL is released in every one of those calls, so the threads copy in
parallel. The preallocation is per piece, in the writer threads: one fallocate of a whole 32 GiB file
would allocate its pages in one thread before any copy (0.4-0.7 s per 4 GiB of tmpfs measured here).

process_vm_readv cannot read a VMA without PROT_READ (EFAULT) where CRIU's parasite, running inside
the task, made it readable for the dump: such pages are read through /proc/PID/mem instead, whose
reads pass the VMA's protection for a tracer-capable reader (root here), one page at a time before
process_vm_readv is tried again (such memory is rare; the bulk stays on the fast path).

Where the new file can be mapped (every Linux file system here), a task's memory is instead read with
process_vm_readv straight into a shared mapping of the new file (`MIGRT_DUMP_WRITE=pwrite` keeps the
buffer + pwrite way): one copy instead of two, and no write(2) on the file, whose inode lock (tmpfs:
pwrite and fallocate alike) lets only one thread allocate the file's pages at a time. The pages are
then allocated by page faults, in every thread at once; the free space was checked before, and a
store that fills up meanwhile makes process_vm_readv fail (EFAULT in the kernel's copy, never a
signal to us), which is reported as ENOSPC when the store has no room left.

Each piece is one 64 MiB chunk of its file as the store digests it (store/fsutil.py TREE_CHUNK: the
file's manifest digest is the sha256 of its chunks' sha256), and the thread that writes a chunk hashes
it as it goes, 4 MiB at a time, each part read back from the file's mapping right after it was
written (or the buffer pwrite()n, or CRIU's pages copied and read back): the digest is of the bytes
now in the file, computed while they are still in the CPU's caches, and the store's commit takes it
instead of reading the whole memory again (`digests`, Staging.commit(known=...)).

Nothing is renamed over CRIU's files until every piece is written (install()); a failure removes the
new files and leaves CRIU's as they were.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import threading
import time

from migrt.kernel import mm
from migrt.kernel.files import TREE_CHUNK, atomic_file
from migrt.kernel.libc import Iovec, libc
from migrt.pagedump.images import NEW_SUFFIX, PAGE, DumpPlan, PagesFile

PIECE = TREE_CHUNK  # the unit of work a thread takes and hashes: the store's digest chunk
BUF = 4 << 20      # a thread's buffer (stays in the caches between the read and the write)

WRITE = os.environ.get("MIGRT_DUMP_WRITE", "mmap")  # "pwrite": the buffer + pwrite way (benchmarks)


class ReadError(Exception):
    """A task's memory could not be read (gone, or the images and the task disagree)."""


def reserve(fd: int, offset: int, length: int) -> None:
    """Allocate the blocks of [offset, offset + length) (ENOSPC before the copy); nothing where the file
    system has no fallocate."""
    if length and libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err))


def check_space(directory: str, needed: int) -> None:
    """The new files must fit beside CRIU's (which go only once the new ones are renamed over them)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise OSError(errno.ENOSPC, f"{directory} has {free >> 20} MiB free, the memory needs {needed >> 20} MiB")


class Reader:
    """One thread's way into the tasks: its buffer, and /proc/PID/mem descriptors opened on demand."""

    def __init__(self, pids: dict[int, int]) -> None:
        self.pids = pids
        self.buf = (ctypes.c_char * BUF)()
        self.view = memoryview(self.buf).cast("B")
        self.base = ctypes.addressof(self.buf)
        self.mem: dict[int, int] = {}
        self.via_mem = 0  # bytes read through /proc/PID/mem

    dest_failed = staticmethod(lambda _addr: None)  # set by the writer (mapped files)

    def close(self) -> None:
        for fd in self.mem.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def read(self, vpid: int, address: int, n: int, dest: int | None = None) -> None:
        """Fill buf[:n] (or n bytes at address `dest` of ours) with n bytes of task vpid at address."""
        pid = self.pids[vpid]
        got = 0
        base = self.base if dest is None else dest
        local, remote = Iovec(), Iovec()
        while got < n:
            local.base, local.len = base + got, n - got
            remote.base, remote.len = address + got, n - got
            k = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if k > 0:
                got += k
                continue
            err = ctypes.get_errno()
            if err != errno.EFAULT:
                raise ReadError(f"cannot read the memory of process {vpid} (pid {pid} here) at {address + got:#x}: "
                                   f"{os.strerror(err)}")
            if dest is not None:
                self.dest_failed(dest + got)  # ENOSPC, when our side of the copy could not be written
                k = self._read_mem(vpid, pid, address + got, 0, min(PAGE, n - got))
                ctypes.memmove(dest + got, self.base, k)
                got += k
                continue
            got += self._read_mem(vpid, pid, address + got, got, min(PAGE, n - got))  # then try again

    def _read_mem(self, vpid: int, pid: int, address: int, at: int, n: int) -> int:
        fd = self.mem.get(pid)
        try:
            if fd is None:
                fd = self.mem[pid] = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
            k = os.preadv(fd, [self.view[at:at + n]], address)
        except OSError as exc:
            raise ReadError(f"cannot read the memory of process {vpid} (pid {pid} here) at {address:#x}: "
                               f"{exc.strerror}") from exc
        if k <= 0:
            raise ReadError(f"cannot read the memory of process {vpid} (pid {pid} here) at {address:#x}: "
                               "end of its memory")
        self.via_mem += k
        return k


def _pwrite_all(fd: int, view, off: int) -> None:
    while len(view):
        k = os.pwrite(fd, view, off)
        view, off = view[k:], off + k


def _copy_file(reader: Reader, src: int, dst: int, length: int, src_off: int, dst_off: int) -> None:
    done = 0
    while done < length:
        try:
            k = os.copy_file_range(src, dst, length - done, src_off + done, dst_off + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            k = 0
        if k <= 0:  # no copy_file_range here (or EOF, which the plan's size check rules out): plain copy
            n = min(BUF, length - done)
            chunk = os.preadv(src, [reader.view[:n]], src_off + done)
            if chunk <= 0:
                raise OSError(errno.EIO, "CRIU's pages file is shorter than its pagemap says")
            _pwrite_all(dst, reader.view[:chunk], dst_off + done)
            k = chunk
        done += k


def _pieces(files: list[PagesFile], unit: int) -> list[tuple[int, int, int, list[tuple[int, int, int, int | None]]]]:
    """(file index, chunk offset, chunk length, its segments) for every `unit`-aligned chunk of every
    new file, biggest first; a segment is (dst, length, src, vpid): the part of one planned copy that
    falls into the chunk, in file order (the copies cover the file without gaps)."""
    out = []
    for i, f in enumerate(files):
        segs: dict[int, list] = {}
        for c in f.copies:
            off = 0
            while off < c.length:
                dst = c.dst + off
                n = min(c.length - off, unit - dst % unit)
                segs.setdefault(dst - dst % unit, []).append((dst, n, c.src + off, c.vpid))
                off += n
        for start in range(0, f.size, unit):
            out.append((i, start, min(unit, f.size - start), segs.get(start, [])))
    out.sort(key=lambda p: -p[2])
    return out


def new_path(f: PagesFile) -> str:
    return f.path + NEW_SUFFIX


def write(plan: DumpPlan, pids: dict[int, int], threads: int, progress=None, chunk: int | None = None) -> dict:
    """Write every new pages file (not yet installed). pids: pid inside the container -> host pid, for
    every process whose memory is read. progress(bytes) is called from this thread. Raises
    ReadError (a task's memory) or OSError (the files); the new files are removed then. The stats'
    `digests` map each pages file's name to the sha256 of its `chunk`-sized chunks (default PIECE: the
    store's TREE_CHUNK), in order, hashed from what was written (fsutil.fold_chunks of them is its
    manifest digest)."""
    chunk = chunk or PIECE
    missing = [v for v in plan.vpids if v not in pids]
    if missing:
        raise ReadError(f"the dumped processes {missing} are not in the container any more")
    files = plan.files
    t0 = time.monotonic()
    check_space(plan.images, plan.total_bytes)
    dst_fds: list[int] = []
    src_fds: list[int | None] = []
    try:
        for f in files:
            mode = 0o600
            try:
                st = os.stat(f.path)
                mode = st.st_mode & 0o777
                src_fds.append(os.open(f.path, os.O_RDONLY | os.O_CLOEXEC))
            except FileNotFoundError:
                src_fds.append(None)
            path = new_path(f)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            dst_fds.append(fd)
            os.ftruncate(fd, f.size)
        maps = _map(files, dst_fds) if WRITE == "mmap" else None
        try:
            stats = _run(files, _pieces(files, chunk), dst_fds, src_fds, pids, max(1, threads), progress, maps,
                         plan.images, chunk)
        finally:
            for (addr, size) in maps or []:
                if addr:
                    libc.munmap(addr, size)
    except BaseException:
        _close(dst_fds + src_fds)
        discard(plan)
        raise
    _close(dst_fds + src_fds)
    stats["seconds"] = round(time.monotonic() - t0, 3)
    return stats


def _map(files, dst_fds) -> list[tuple[int, int]]:
    """A shared writable mapping of each new file (0 where the file is empty), in huge pages where the
    store's tmpfs gives them (store/hugetmpfs.py)."""
    out: list[tuple[int, int]] = []
    for f, fd in zip(files, dst_fds, strict=True):  # one new file per source file
        addr = 0
        if f.size:
            addr = libc.mmap(None, f.size, mm.PROT_READ | mm.PROT_WRITE, mm.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                err = ctypes.get_errno()
                for a, size in out:
                    if a:
                        libc.munmap(a, size)
                raise OSError(err, f"cannot map {new_path(f)}: {os.strerror(err)}")
            libc.madvise(addr, f.size, mm.MADV_HUGEPAGE)  # 2 MiB pages where the store's tmpfs gives them
            # (store/hugetmpfs.advise: a tmpfs mounted huge=; EINVAL elsewhere, ignored)
        out.append((addr, f.size))
    return out


def _close(fds: list) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _view(addr: int, n: int) -> memoryview:
    """n bytes of our own memory at addr (a mapped file), read-only."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B").toreadonly()


def _run(files, pieces, dst_fds, src_fds, pids, threads, progress, maps=None, directory=".",
         chunk: int = PIECE) -> dict:
    lock = threading.Lock()
    todo = iter(pieces)
    failed = threading.Event()
    errors: list[BaseException] = []
    done = [0]
    via_mem = [0]
    digests: dict[tuple[int, int], bytes] = {}

    def no_room(_addr: int) -> None:
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < PIECE:
            raise OSError(errno.ENOSPC, f"{directory}: no space left while writing the memory")

    def work() -> None:
        reader = Reader(pids)
        reader.dest_failed = no_room
        try:
            while not failed.is_set():
                with lock:
                    piece = next(todo, None)
                if piece is None:
                    return
                i, start, length, segments = piece
                h = hashlib.sha256()
                for dst, n, src, vpid in segments:
                    _write_segment(reader, h, i, dst, n, src, vpid, maps, dst_fds, src_fds)
                with lock:
                    digests[(i, start)] = h.digest()
                    done[0] += length
        except BaseException as exc:  # noqa: BLE001 - raised in the calling thread
            with lock:
                errors.append(exc)
            failed.set()
        finally:
            with lock:
                via_mem[0] += reader.via_mem
            reader.close()

    n = max(1, min(threads, len(pieces)))
    workers = [threading.Thread(target=work, name="migrt-pagedump", daemon=True) for _ in range(n)]
    for t in workers:
        t.start()
    reported = 0
    try:
        while True:
            alive = [t for t in workers if t.is_alive()]
            if not alive:
                break
            alive[0].join(0.2)
            with lock:
                now = done[0]
            if progress and now > reported:
                progress(now - reported)
                reported = now
    finally:
        failed.set()  # done, or this thread was interrupted: no new pieces
        for t in workers:
            t.join()
    if errors:
        raise errors[0]
    if progress and done[0] > reported:
        progress(done[0] - reported)
    names = {}
    for i, f in enumerate(files):
        names[os.path.basename(f.path)] = [digests[(i, start)] for start in range(0, f.size, chunk)] \
            or [hashlib.sha256().digest()]
    return {"bytes": done[0], "threads": n, "via_proc_mem_bytes": via_mem[0], "digests": names}


def _write_segment(reader: Reader, h, i: int, dst: int, length: int, src: int, vpid: int | None, maps, dst_fds,
                   src_fds) -> None:
    """One segment of a chunk into file i at dst, BUF bytes at a time, each part hashed (h) from what is
    in the file right after it was written: the mapping, else the buffer pwrite() wrote, else (CRIU's
    pages, copied by the kernel) read back."""
    if maps is None or vpid is None:
        reserve(dst_fds[i], dst, length)
    off = 0
    while off < length:
        n = min(BUF, length - off)
        if vpid is not None and maps:
            reader.read(vpid, src + off, n, dest=maps[i][0] + dst + off)  # straight into the file
            h.update(_view(maps[i][0] + dst + off, n))
        elif vpid is not None:
            reader.read(vpid, src + off, n)
            _pwrite_all(dst_fds[i], reader.view[:n], dst + off)
            h.update(reader.view[:n])
        else:
            _copy_file(reader, src_fds[i], dst_fds[i], n, src + off, dst + off)
            if maps:
                h.update(_view(maps[i][0] + dst + off, n))
            else:
                got = os.preadv(dst_fds[i], [reader.view[:n]], dst + off)
                if got != n:
                    raise OSError(errno.EIO, "a pages file being written is shorter than what was written to it")
                h.update(reader.view[:n])
        off += n


def discard(plan: DumpPlan) -> None:
    for f in plan.files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(new_path(f))


def install(plan: DumpPlan) -> None:
    """Put the new pages files and pagemaps in place of CRIU's (a rename each; the commit fsyncs)."""
    for f in plan.files:
        os.replace(new_path(f), f.path)
        st_mode = 0o600
        with contextlib.suppress(OSError):
            st_mode = os.stat(f.pagemap_path).st_mode & 0o777
        with atomic_file(f.pagemap_path, st_mode, durable=False) as fh:
            fh.write(f.pagemap)
