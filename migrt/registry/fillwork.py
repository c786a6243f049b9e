"""The fetching processes of a lazy fill from a registry (registry/fill.py): whole chunks fetched,
hashed against their digests and written into the pull's partial directory by processes of their
own, so that receiving TLS and hashing are not bound to the filler's one interpreter (one filler
process fetched at 0.6-0.75 GB/s on a 16-core GPU host whatever its connections; docs/registry.md).

The filler starts `registry_parallel` of them (`python -m migrt.registry.fillwork`), each with one
connection, and hands each a chunk at a time over a pipe: one JSON line per request and per answer.
A process's answer is the same as the in-filler fetch's: the chunk is on disk and its bytes matched
the digest ("ok"), or why not ("invalid": the bytes did not match; "registry": the registry did not
serve it within the client's retries and the fill's deadline; "other": anything else, e.g. the store
full). Only the filler journals a chunk or counts it as present, on an "ok".

A fetching process lives as long as the filler: it ends at the end of its pipe (the filler closed it,
or died), and a watch of its parent ends it should the filler die while it waits on the network.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import IO, TYPE_CHECKING

from migrt.errors import CheckpointInvalid, MigrtError, RegistryError

if TYPE_CHECKING:
    from migrt.registry.client import Client, Deadline

ANSWER_MAX = 1 << 20  # a fetching process's answer line is never longer
PARENT_WATCH_S = 0.5


class FetchFailed(MigrtError):
    """A fetching process failed for a reason of neither the registry nor the data (or died)."""


class _Proc:
    """A fetching process: its requests on its stdin, its answers on a pipe of their own (whatever it
    prints goes to our stderr, never into an answer)."""

    def __init__(self, argv: list[str], env: dict) -> None:
        r, w = os.pipe()
        try:
            self.popen = subprocess.Popen([*argv, str(w)], env=env, stdin=subprocess.PIPE, stdout=2,
                                          pass_fds=(w,), close_fds=True)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        assert self.popen.stdin is not None
        self.stdin: IO[bytes] = self.popen.stdin
        self.stdout: IO[bytes] = os.fdopen(r, "rb")


class Workers:
    """`n` fetching processes for the image of `spec` (the hand-over's registry section) under the
    fill's `deadline` (registry/client.py Deadline: its end is on the system's monotonic clock, the
    same in every process), each at nice `nice` at least (a lazy fill's: the restore and the restored
    container first where the CPU is short)."""

    def __init__(self, spec: dict, deadline, n: int, *, nice: int = 0) -> None:
        head = {"spec": {k: spec.get(k) for k in ("registry", "repository", "digest", "auth_file", "ca_file")},
                "deadline": asdict(deadline), "nice": int(nice)}
        self._idle: queue.SimpleQueue[_Proc] = queue.SimpleQueue()
        self._all: list[_Proc] = []
        # they import migrt from where we did (a venv, a checkout, a launcher's own path); -P: never from
        # the working directory (containerd's is the bundle's)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pkg_parent, os.environ.get("PYTHONPATH")) if p)}
        try:
            for _ in range(n):
                proc = _Proc([sys.executable, "-P", "-m", "migrt.registry.fillwork"], env)
                self._all.append(proc)
                proc.stdin.write(json.dumps(head).encode() + b"\n")
                proc.stdin.flush()
                self._idle.put(proc)
        except OSError as exc:
            self.close()
            raise FetchFailed(f"cannot start the fill's fetching processes: {exc}") from exc

    def fetch(self, digest: str, size: int, path: str, offset: int) -> int:
        """The blob `digest` into path at offset, verified (and on its way to disk); CheckpointInvalid,
        RegistryError, OSError (writing the file) or FetchFailed with the fetching process's reason.
        Returns the bytes the process received for it (retries included)."""
        proc = self._idle.get()
        try:  # (a process that died stays in: the next fetch on it fails as this one does)
            job = {"digest": digest, "size": size, "path": path, "offset": offset}
            try:
                proc.stdin.write(json.dumps(job).encode() + b"\n")
                proc.stdin.flush()
                line = proc.stdout.readline(ANSWER_MAX)
            except (OSError, ValueError) as exc:
                raise self._died(proc, exc) from exc
            if not line.endswith(b"\n"):
                raise self._died(proc, None)
            try:
                answer = json.loads(line)
            except ValueError as exc:
                raise FetchFailed(f"a fetching process of the fill (pid {proc.popen.pid}) answered "
                                  f"{line[:80]!r}") from exc
        finally:
            self._idle.put(proc)
        answer = answer if isinstance(answer, dict) else {}
        _raise(answer)
        return int(answer.get("received") or 0)

    def _died(self, proc: _Proc, exc: BaseException | None) -> FetchFailed:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=1)
        code = proc.popen.returncode
        how = f"exit status {code}" if code is not None and code >= 0 else \
            f"signal {-code}" if code is not None else f"{exc or 'no answer'}"
        return FetchFailed(f"a fetching process of the fill (pid {proc.popen.pid}) ended ({how})")

    def close(self) -> None:
        """Close every pipe (each process ends at its end) and reap them; one still busy is killed."""
        for proc in self._all:
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()
        for proc in self._all:
            try:
                proc.popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()


def _raise(answer: dict) -> None:
    kind, message = answer.get("answer"), str(answer.get("message") or "")[:4000]
    if kind == "ok":
        return
    if kind == "invalid":
        raise CheckpointInvalid(message)
    if kind == "registry":
        raise RegistryError(message)
    if kind == "oserror":  # writing the file (the store full): the caller's to say
        raise OSError(int(answer.get("errno") or 0), message)
    raise FetchFailed(message or f"a fetching process answered {kind!r}")


def fill_deadline(spec: dict, total: int) -> Deadline:
    """The fill's whole deadline: registry_timeout plus the pages at connect.WHOLE_RATE."""
    from migrt.registry.client import Deadline
    from migrt.registry.connect import WHOLE_RATE

    deadline = Deadline.after(float(spec.get("timeout") or 60), "registry_timeout in the migrt config, plus the "
                              f"pages at {WHOLE_RATE >> 20} MiB/s", rate=WHOLE_RATE,
                              then="what arrived is kept and the next restore of the image resumes it")
    deadline.allow(total)
    return deadline


def make_client(spec: dict, deadline: Deadline) -> Client:
    """A registry client for the image pinned by digest, with the node's credentials and CA bundle, under
    the fill's deadline (in the filler, and in each of its fetching processes)."""
    from migrt.registry.client import Client
    from migrt.registry.connect import credentials_for
    from migrt.registry.reference import Reference

    ref = Reference(spec["registry"], spec["repository"], None, spec["digest"])
    return Client(ref, credentials=credentials_for(spec.get("auth_file"), ref), ca_file=spec.get("ca_file"),
                  deadline=deadline)


# -- the fetching process ----------------------------------------------------------------------------

def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_WATCH_S)
        if os.getppid() != parent:
            os._exit(1)


def _serve(inp: IO[bytes], out: IO[bytes]) -> int:
    from migrt.registry import transfer
    from migrt.registry.client import Deadline

    head = json.loads(inp.readline() or b"null")
    if not isinstance(head, dict):
        return 1
    if head.get("nice"):  # (an absolute value: the starting thread may be niced already)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, max(int(head["nice"]), os.getpriority(os.PRIO_PROCESS, 0)))
    client = make_client(head["spec"], Deadline(**head["deadline"]))
    try:
        for line in inp:
            job = json.loads(line)
            blob = transfer.Blob(job["digest"], int(job["size"]), job["path"], int(job["offset"]))
            before = client.stats.received
            try:
                transfer.fetch(client, [blob], 1, on_blob=lambda _b: None, pool=transfer.InThread(),
                               write_behind=True)  # (the fill's commit fsyncs the image)
                answer = {"answer": "ok", "received": client.stats.received - before}
            except CheckpointInvalid as exc:
                answer = {"answer": "invalid", "message": exc.message}
            except RegistryError as exc:
                answer = {"answer": "registry", "message": exc.message}
            except OSError as exc:
                answer = {"answer": "oserror", "errno": exc.errno, "message": exc.strerror or str(exc)}
            except Exception as exc:  # noqa: BLE001 - told to the filler, which stops the fill
                answer = {"answer": "other", "message": getattr(exc, "message", None) or repr(exc)}
            out.write(json.dumps(answer).encode() + b"\n")
            out.flush()
    finally:
        client.close()
    return 0


def main(argv: list[str]) -> int:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m migrt.registry.fillwork ANSWER_FD (started by a lazy fill or a pull)", file=sys.stderr)
        return 2
    # the answers go out on a descriptor of their own: whatever writes to stdout (a log line of the
    # client's, a warning, a site hook) never lands in the middle of an answer
    return _serve(sys.stdin.buffer, os.fdopen(int(argv[0]), "wb"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
