"""Who runs the container after a failure: the rule both sides follow, and the steps that apply it.

The rule (exactly one copy runs, whatever breaks and wherever the connection is cut):

- The target keeps a copy it restored unless that copy fails on its own side (the restore, or for a
  lazy migration the page transfer); it then kills it before saying so. A cut connection changes
  nothing on the target.
- The source resumes its frozen container only when it knows the target has no copy: the failure came
  before it asked the target to restore (stop-and-copy `restore`, lazy `commit`), or the target
  said it failed. Between asking and hearing the answer it cannot know, so it asks again on a new
  connection (`query`): the receiver answers once that migration is decided, from what runs there.
  Running there: the source is destroyed. Nothing there: resumed. No answer within the deadline:
  the source stays frozen (nothing runs twice, nothing is lost) and the error gives both commands.

`resolve_source` applies the rule on the source; the migrate command and its guard (guard.py, when
the command itself was killed) both call it.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from migrt.config import Config
from migrt.errors import MigrtError
from migrt.migration.tls import TLSFiles
from migrt.migration.wire import connect, load_key
from migrt.runtime import control
from migrt.runtime import moved as moved_marks

RUNNING, ABSENT = "running", "absent"
ASK_STALLS = 3  # how long a source in doubt keeps asking, in migration_stall_timeouts


def ask_target(cfg: Config, to: str, name: str, container_id: str | None, wait: float) -> str | None:
    """Ask the receiver at `to` whether it runs the container restored from checkpoint `name`:
    RUNNING, ABSENT, or None when no answer came within `wait` seconds (retried meanwhile)."""
    key = load_key(cfg.migration_key_file)
    tls = TLSFiles(**cfg.migration_tls) if cfg.migration_tls else None
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            ch = connect(to, key, tls=tls, timeout=max(1.0, min(5.0, left)), stall=cfg.migration_stall_timeout)
            try:
                ch.send({"type": "query", "name": name, "container_id": container_id})
                state = ch.recv("answer").get("state")
            finally:
                ch.close()
            if state in (RUNNING, ABSENT):
                return state
        except MigrtError:
            pass
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def runtime_procs(runtime: str, cid: str, verbs: tuple[bytes, ...] = (b"pause", b"checkpoint")) -> list[int]:
    """Pids of `RUNTIME ... pause|checkpoint ... CID` processes (a freeze or a dump of this container
    still running: a resume must wait for them)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if (any(v in argv for v in verbs) and argv[-2:-1] == [cid.encode()]
                and os.path.basename(argv[0]) == os.path.basename(runtime).encode()):
            out.append(int(entry))
    return out


def abort_page_server(page_server: tuple[str, int] | None) -> None:
    """A bogus request makes CRIU's page server fail the transfer and put the tasks back (a
    connection closed without a request would count as a finished transfer)."""
    if not page_server:
        return
    try:
        with socket.create_connection((page_server[0], page_server[1]), timeout=2) as sk:
            sk.sendall(b"\xff" * 64)
    except OSError:
        pass


def _is_page_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"migrt.migration.pageserve" in fh.read()
    except OSError:
        return False


def settle_pages(pages_pid: int | None, *, finish: bool, timeout: float = 120.0) -> None:
    """migrt's page server of a lazy migration (pageserve.py): with finish=False it is stopped at once
    (the source resumes); with finish=True it is left to serve the target's last pages (it ends when
    the target has them all, or once nobody asks for anything)."""
    if not pages_pid:
        return
    deadline = time.monotonic() + timeout
    if finish:
        while _is_page_server(pages_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    if _is_page_server(pages_pid):
        try:
            os.kill(pages_pid, signal.SIGKILL)
        except OSError:
            pass


def settle_dump(runtime: str, cid: str, page_server: tuple[str, int] | None, *, finish: bool, timeout: float = 120.0,
                pages_pid: int | None = None) -> None:
    """Wait until no dump of `cid` runs any more. A lazy dump serves pages until told otherwise:
    with finish=False it is aborted; with finish=True it is left to serve its last pages. The same
    for migrt's page server (pages_pid)."""
    settle_pages(pages_pid, finish=finish, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        pids = runtime_procs(runtime, cid)
        if not pids:
            return
        if time.monotonic() > deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
            time.sleep(1)
            return
        if not finish:
            abort_page_server(page_server)
        time.sleep(0.2)


def resume_source(runtime: str, root: str, cid: str) -> str:
    try:
        control.resume(runtime, root, cid)
    except MigrtError as exc:
        return (f"container {cid} could NOT be resumed ({exc}); it is frozen with its state intact: "
                f"run 'runc --root {root} resume {cid}'")
    return f"container {cid} was resumed on this node"


def destroy_source(runtime: str, root: str, cid: str, moved: dict | None = None) -> str:
    """moved: a pulled pod container's record (runtime/moved.py), left before it dies."""
    moved_marks.leave(root, moved)
    try:
        control.destroy(runtime, root, cid)
    except MigrtError as exc:
        return f"the frozen source {cid} could not be deleted ({exc}): run 'runc --root {root} delete --force {cid}'"
    return f"the frozen source {cid} was deleted"


def resolve_source(cfg: Config, *, runtime: str, root: str, cid: str, to: str, name: str,
                   target_cid: str | None, page_server: tuple[str, int] | None = None,
                   was_paused: bool = False, pages_pid: int | None = None,
                   moved: dict | None = None) -> tuple[str | None, str]:
    """After losing the target between the handover request and its answer: ask it, then resume or
    delete the frozen source. Returns (the target's state or None, a sentence for the error)."""
    state = ask_target(cfg, to, name, target_cid, wait=ASK_STALLS * cfg.migration_stall_timeout)
    if state == RUNNING:
        settle_dump(runtime, cid, page_server, finish=True, pages_pid=pages_pid)
        return state, f"the target runs it as {target_cid}; " + destroy_source(runtime, root, cid, moved)
    if state == ABSENT:
        settle_dump(runtime, cid, page_server, finish=False, pages_pid=pages_pid)
        if was_paused:
            return state, f"the target has no copy; container {cid} was left paused, as it was"
        return state, "the target has no copy; " + resume_source(runtime, root, cid)
    settle_dump(runtime, cid, page_server, finish=True, pages_pid=pages_pid)
    return None, (f"the target {to} did not answer, so it is unknown whether it runs the container: {cid} stays "
                  f"FROZEN here with its state intact (never two copies). If the target runs {target_cid}, run "
                  f"'runc --root {root} delete --force {cid}' here; otherwise 'runc --root {root} resume {cid}'")
