#!/usr/bin/env python3
"""migrt's stop-and-copy transfer against the wire: a bare socket pump and migrt, side by side.

    python bench/transfer.py [--gib 2] [--streams 1,2,4,8] [--runs 3] [--no-release] [--floor] [--known] [--v1]
                             [--store tmpfs|huge] [--recv-write auto|map|pwrite] [--dir /dev/shm] [--json-out PATH]

For each stream count, in the same run and alternating their order:
  pump     the raw wire: N connections over loopback, one thread per connection at each end (4 MiB
           buffers, sendall / recv_into), nothing read from or written to files, nothing checked;
  migrt    a checkpoint directory (one GiB-sized pages image and a few small images, on tmpfs) sent
           by migrt's stop-and-copy sender (migration/bulk.py over N streams, as `migrt migrate
           --streams N` sends it) to a real `migrt receive --once --streams N`, which writes every
           file into its store (tmpfs), checks the sha256 of every 64 MiB chunk as it arrives and
           commits the checkpoint: timed from the first byte until the receiver says `committed`;
  floor    (--floor) the pump whose receiver writes what arrives into a tmpfs file (mapped): the wire
           plus the store's writes, no hashing: what no integrity-checked transfer into a store beats;
  known    (--known) migrt as it sends after a parallel dump (dump_pages: parallel, the default on 4+
           CPUs): the sender has the chunk digests the dump's threads computed as they wrote the pages
           (computed here before the clock starts) and does not hash; the receiver checks as always;
  v1       (--v1, one stream) migrt before bulk.py: one file after the other on the migration
           connection (Channel.send_file), the same receiver.
Every side runs in its own process (two nodes' worth of GIL), on this machine's loopback.

Where the files live (--store): `tmpfs` (default), a directory under --dir (/dev/shm: a tmpfs in 4 KiB
pages unless mounted otherwise); `huge`, a private tmpfs mounted for the run with huge=within_size
(2 MiB pages: store/hugetmpfs.py) on a temporary directory, unmounted at the end whatever happens:
the source, the receiver's store and the floor's file (then the floor in huge pages) all in it.
--recv-write map|pwrite makes the receiver write through mappings, or with pwrite, with any number of
streams (MIGRT_BULK_WRITE; auto: bulk.py's choice).

By default the sender gives each sent range back to the file system as `migrt migrate` does
(release: a tmpfs store does not hold the checkpoint twice), so its bytes are copied into the
socket; --no-release lets the kernel send the page cache's pages (sendfile) and keeps the source.

Prints a table (GiB/s, medians of the runs, ratio migrt / pump with as many streams, CPU seconds of
both processes per GiB), writes JSON (every run; default bench/results/transfer.json) and ends with

    transfer gib=<G> store=<tmpfs|huge> streams=<list> ratio=<migrt/pump per stream count> [ratio_known=<known/pump>]

Target (issue 18): migrt >= 80 % of the raw pump with as many streams, on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import log, machine  # noqa: E402

BUF = 4 << 20
DEFAULT_JSON = os.path.join(REPO, "bench", "results", "transfer.json")
SMALL_FILES = {"images/core-1.img": 20_000, "images/mm-1.img": 8_000, "images/pagemap-1.img": 60_000,
               "images/inventory.img": 100, "images/fs-1.img": 50, "rootfs-diff.tar": 10_240}


# -- roles (each in its own process) -------------------------------------------------------------

def role_pump_recv(port: int, streams: int, write_to: str | None, size: int, host: str = "127.0.0.1") -> None:
    srv = socket.create_server((host, port))
    print("ready", flush=True)
    conns = [srv.accept()[0] for _ in range(streams)]
    per = size // streams
    mm = None
    if write_to:
        import mmap

        fd = os.open(write_to, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, per * streams)
        mm = mmap.mmap(fd, per * streams)
        mm.madvise(mmap.MADV_HUGEPAGE)  # as migrt's writers do: 2 MiB pages where the tmpfs gives them

    def recv(i: int, s: socket.socket) -> None:
        if mm is not None:
            view = memoryview(mm)[i * per:(i + 1) * per]
            got = 0
            while got < per:
                k = s.recv_into(view[got:], min(BUF, per - got))
                if not k:
                    break
                got += k
            view.release()
            s.recv(1)
        else:
            buf = memoryview(bytearray(BUF))
            while s.recv_into(buf):
                pass
        s.close()

    threads = [threading.Thread(target=recv, args=(i, s)) for i, s in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if write_to:
        os.unlink(write_to)


def role_pump_send(port: int, streams: int, size: int, host: str = "127.0.0.1") -> None:
    socks = [socket.create_connection((host, port)) for _ in range(streams)]
    per = size // streams

    def send(s: socket.socket) -> None:
        buf = memoryview(bytearray(BUF))
        left = per
        while left > 0:
            n = min(BUF, left)
            s.sendall(buf[:n])
            left -= n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the receiver closes once it has read everything
        s.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=send, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"seconds": time.monotonic() - t0, "bytes": per * streams}), flush=True)


def role_migrt_send(address: str, key_file: str, src: str, name: str, streams: int, release: bool, v1: bool,
                    known: bool = False) -> None:
    from migrt.migration import bulk
    from migrt.migration.wire import connect, load_key
    from migrt.store import manifest as mf

    digests = None
    if known:  # what the parallel dump's threads hand over: the pages file's chunk digests, hashed by the
        # orchestrator before this process started (off its CPU time)
        with open(os.path.join(os.path.dirname(src), "known.json")) as fh:
            digests = {rel: [bytes.fromhex(d) for d in ds] for rel, ds in json.load(fh).items()}

    ch = connect(address, load_key(key_file), stall=60)
    ch.send({"type": "offer", "name": name, "mode": "stop-and-copy", "container_id": "bench", "schema": mf.SCHEMA})
    ready = ch.recv("ready")
    files = [(rel, os.path.join(src, rel)) for rel in mf.list_payload(src)]
    total = sum(os.path.getsize(p) for _, p in files)
    t0 = time.monotonic()
    if v1:
        meta = {rel: ch.send_file(path, rel, release=release) for rel, path in files}
        used = 1
    else:
        extra = bulk.open_streams(ch, ready["bulk"], streams - 1, tls=None, stall=60)
        used = 1 + len(extra)
        meta = bulk.send([ch, *extra], files, release=release, known=digests)
        for c in extra:
            c.close()
    t_sent = time.monotonic() - t0
    ch.send({"type": "commit", "manifest": {"created": "2026-01-01T00:00:00Z", "source": {"container_id": "bench"},
                                            "files": meta}})
    ch.recv("committed")
    seconds = time.monotonic() - t0
    ch.send({"type": "bye"})
    ch.close()
    print(json.dumps({"seconds": seconds, "sent_s": t_sent, "bytes": total, "streams": used}), flush=True)


# -- orchestration -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen) -> tuple[int, float]:
    """(exit status, CPU seconds) of a child, reaped here (os.wait4 gives its rusage)."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, ru.ru_utime + ru.ru_stime


def _me(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def run_pump(streams: int, size: int, write_dir: str | None, *, host: str = "127.0.0.1",
             recv_in: list[str] | None = None, send_in: list[str] | None = None) -> dict:
    """The raw pump over `host` (loopback by default); recv_in/send_in: a command prefix each side
    runs under (e.g. nsenter into a network namespace: bench/gpu_migration.py's veth pair)."""
    port = _free_port()
    where = ["--host", host]
    recv = subprocess.Popen([*(recv_in or []), *_me("--role", "pump-recv", "--port", str(port), "--n", str(streams),
                                                    "--size", str(size), *where,
                                                    *(["--write-to", os.path.join(write_dir, "pump.dst")]
                                                      if write_dir else []))],
                            stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "ready"
    send = subprocess.Popen([*(send_in or []), *_me("--role", "pump-send", "--port", str(port), "--n", str(streams),
                                                    "--size", str(size), *where)],
                            stdout=subprocess.PIPE, text=True)
    out = json.loads(send.stdout.readline())
    rc_s, cpu_s = _wait(send)
    rc_r, cpu_r = _wait(recv)
    if rc_s or rc_r:
        raise RuntimeError(f"pump failed ({rc_s}, {rc_r})")
    return {**out, "gibps": out["bytes"] / out["seconds"] / 2**30, "cpu_send_s": cpu_s, "cpu_recv_s": cpu_r}


class Lab:
    """The receiver's config, key and store; the sender's checkpoint directory (all under --dir)."""

    def __init__(self, base: str, size: int) -> None:
        self.base = base
        self.size = size
        self.key = os.path.join(base, "key")
        with open(self.key, "w") as fh:
            fh.write(os.urandom(32).hex())
        os.chmod(self.key, 0o600)
        self.store = os.path.join(base, "store")
        self.config = os.path.join(base, "config.yaml")
        with open(self.config, "w") as fh:
            fh.write(f"runtime: runc\nstore: {self.store}\nlog_file: {base}/migrt.log\nlog_level: info\n"
                     f"migration_key_file: {self.key}\n")
        self.src = os.path.join(base, "src")
        self.env = {**os.environ, "MIGRT_CONFIG": self.config, "PYTHONPATH": REPO}
        self.made = False

    def make_source(self) -> None:
        """A checkpoint-shaped directory: images/pages-1.img of `size` bytes (no zero pages) and small files."""
        shutil.rmtree(self.src, ignore_errors=True)
        os.makedirs(os.path.join(self.src, "images"), mode=0o700)
        block = bytearray(os.urandom(64 << 20))
        with open(os.path.join(self.src, "images", "pages-1.img"), "wb") as fh:
            left, i = self.size, 0
            while left > 0:
                block[:8] = i.to_bytes(8, "little")
                n = min(len(block), left)
                fh.write(memoryview(block)[:n])
                left -= n
                i += 1
        for rel, n in SMALL_FILES.items():
            with open(os.path.join(self.src, rel), "wb") as fh:
                fh.write(os.urandom(n))
        self.made = True
        self.known_digests = None

    def write_known(self) -> None:
        """The pages file's chunk digests, as a parallel dump would hand them to the sender."""
        if self.known_digests is None:
            from migrt.store import fsutil

            chunks = fsutil.hash_chunks(self.src, ["images/pages-1.img"])
            self.known_digests = {rel: [c[2].hex() for c in cs] for rel, cs in chunks.items()}
        with open(os.path.join(self.base, "known.json"), "w") as fh:
            json.dump(self.known_digests, fh)

    def run(self, streams: int, release: bool, v1: bool, n: int, known: bool = False) -> dict:
        if release or not self.made:
            self.make_source()
        if known:
            self.write_known()
        port = _free_port()
        name = f"bench-{n}"
        recv = subprocess.Popen([sys.executable, "-c", "from migrt.cli.main import main; main()", "receive",
                                 "--listen", f"127.0.0.1:{port}", "--once", "--streams", str(streams)],
                                env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        line = recv.stderr.readline()
        if "listening" not in line:
            raise RuntimeError(f"migrt receive did not start: {line}{recv.stderr.read()}")
        send = subprocess.Popen(_me("--role", "migrt-send", "--address", f"127.0.0.1:{port}", "--key", self.key,
                                    "--src", self.src, "--name", name, "--n", str(streams),
                                    *(["--send-release"] if release else []), *(["--v1"] if v1 else []),
                                    *(["--known"] if known else [])),
                                env=self.env, stdout=subprocess.PIPE, text=True)
        raw = send.stdout.readline()
        rc_s, cpu_s = _wait(send)
        rc_r, cpu_r = _wait(recv)
        err = recv.stderr.read()
        if rc_s or rc_r or not raw:
            raise RuntimeError(f"migrt transfer failed (sender {rc_s}, receiver {rc_r}): {err[-2000:]}")
        out = json.loads(raw)
        shutil.rmtree(os.path.join(self.store, name))
        return {**out, "gibps": out["bytes"] / out["seconds"] / 2**30, "cpu_send_s": cpu_s, "cpu_recv_s": cpu_r}


@contextlib.contextmanager
def store_dir(kind: str, parent: str, size: int):
    """The directory the run's files live in: under `parent` (tmpfs), or (huge) a private tmpfs with
    huge=within_size mounted on a temporary directory, room for the source, the store's copy and the
    floor's file; unmounted and removed when the block ends, whichever way (SIGTERM included)."""
    if kind != "huge":
        yield parent, {"kind": kind, "dir": parent}
        return
    point = tempfile.mkdtemp(prefix="migrt-bench-huge-")
    room = 3 * size + (1 << 30)
    opts = f"huge=within_size,size={room >> 20}m,mode=0700"
    mounted = False
    term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "migrt-bench-huge", point], check=True)
        mounted = True
        from migrt.store import hugetmpfs

        m = hugetmpfs.mount_of(point)
        if m is None or m.point != os.path.realpath(point) or not m.huge_pages:
            raise RuntimeError(f"the tmpfs mounted on {point} gives no huge pages ({m})")
        yield point, {"kind": kind, "dir": point, "options": opts, "shmem_enabled": m.shmem_enabled}
    finally:
        if mounted:
            subprocess.run(["umount", point], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(point)
        signal.signal(signal.SIGTERM, term)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-release", dest="release", action="store_false")
    ap.add_argument("--floor", action="store_true", help="also the pump writing into a tmpfs file")
    ap.add_argument("--v1", action="store_true", help="also migrt's file-by-file transfer (one stream)")
    ap.add_argument("--known", action="store_true", help="also migrt with the dump's digests (no sender hashing)")
    ap.add_argument("--dir", default="/dev/shm", help="where the source, the store and the floor's file live")
    ap.add_argument("--store", choices=("tmpfs", "huge"), default="tmpfs",
                    help="huge: in a private tmpfs mounted with huge=within_size for the run")
    ap.add_argument("--recv-write", choices=("auto", "map", "pwrite"), default="auto",
                    help="how the receiver writes (auto: pwrite up to bulk.MAPPED_FROM streams, then mappings)")
    ap.add_argument("--json-out", default=DEFAULT_JSON)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    for a in ("--port", "--n", "--size"):
        ap.add_argument(a, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    for a in ("--write-to", "--address", "--key", "--src", "--name"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    ap.add_argument("--send-release", action="store_true", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()
    if args.role == "pump-recv":
        role_pump_recv(args.port, args.n, args.write_to, args.size, args.host)
        return 0
    if args.role == "pump-send":
        role_pump_send(args.port, args.n, args.size, args.host)
        return 0
    if args.role == "migrt-send":
        role_migrt_send(args.address, args.key, args.src, args.name, args.n, args.send_release, args.v1, args.known)
        return 0
    release = args.release
    size = int(args.gib * 2**30)
    counts = [int(x) for x in args.streams.split(",")]
    if args.recv_write != "auto":
        os.environ["MIGRT_BULK_WRITE"] = args.recv_write  # the receiver's environment (Lab.env)
    info = machine()
    with store_dir(args.store, args.dir, size) as (parent, store):
        results = measure(args, counts, size, parent, info)
    table, ratios, known_ratios = summarize(results, counts, size)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as fh:
        json.dump({"machine": {**info, "loadavg_end": os.getloadavg()[0]}, "gib": args.gib, "release": release,
                   "store": store, "recv_write": args.recv_write, "runs": results}, fh, indent=2)
    print(f"transfer gib={args.gib:g} store={args.store} streams={','.join(map(str, counts))} "
          f"ratio={','.join(f'{ratios[n]:.2f}' for n in counts)}"
          + (f" ratio_known={','.join(f'{known_ratios[n]:.2f}' for n in counts)}" if args.known else ""))
    return 0


def measure(args, counts: list[int], size: int, parent: str, info: dict) -> list[dict]:
    """Every run of every kind, in a temporary directory under `parent` (removed at the end)."""
    release = args.release
    base = tempfile.mkdtemp(prefix="migrt-bench-transfer-", dir=parent)
    os.chmod(base, 0o700)
    lab = Lab(base, size)
    log(f"transfer: {args.gib} GiB, streams {counts}, {args.runs} runs, release={release}, store {args.store} "
        f"(receiver writes: {args.recv_write}), in {base}; {info['cpus']} CPUs, load {info['loadavg_start']:.1f}")
    results: list[dict] = []
    try:
        for run in range(args.runs):
            for n in counts:
                kinds = ["pump", "migrt"] + (["known"] if args.known else []) + (["floor"] if args.floor else []) + \
                    (["v1"] if args.v1 and n == 1 else [])
                if run % 2:
                    kinds.reverse()
                for kind in kinds:
                    if kind == "pump":
                        r = run_pump(n, size, None)
                    elif kind == "floor":
                        r = run_pump(n, size, base)
                    else:
                        r = lab.run(n, release, kind == "v1", len(results), known=kind == "known")
                    r.update(kind=kind, streams=n, run=run, loadavg=os.getloadavg()[0])
                    results.append(r)
                    log(f"  run {run} streams {n} {kind:5s} {r['gibps']:6.2f} GiB/s  cpu send {r['cpu_send_s']:.2f} s "
                        f"recv {r['cpu_recv_s']:.2f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def summarize(results: list[dict], counts: list[int], size: int) -> tuple[str, dict, dict]:
    gib = size / 2**30
    lines = ["| streams | kind | GiB/s (median) | runs | CPU s per GiB, sender | receiver | x pump |",
             "|---:|---|---:|---|---:|---:|---:|"]
    ratios, known_ratios = {}, {}
    for n in counts:
        med = {}
        for kind in ("pump", "floor", "migrt", "known", "v1"):
            rs = [r for r in results if r["streams"] == n and r["kind"] == kind]
            if not rs:
                continue
            med[kind] = statistics.median(r["gibps"] for r in rs)
            cs = statistics.median(r["cpu_send_s"] for r in rs) / gib
            cr = statistics.median(r["cpu_recv_s"] for r in rs) / gib
            runs = " ".join(f"{r['gibps']:.2f}" for r in rs)
            x = med[kind] / med["pump"] if "pump" in med else float("nan")
            lines.append(f"| {n} | {kind} | {med[kind]:.2f} | {runs} | {cs:.2f} | {cr:.2f} | {x:.2f} |")
        ratios[n] = med.get("migrt", 0) / med["pump"] if med.get("pump") else float("nan")
        known_ratios[n] = med.get("known", 0) / med["pump"] if med.get("pump") else float("nan")
    return "\n".join(lines), ratios, known_ratios


if __name__ == "__main__":
    sys.exit(main())
