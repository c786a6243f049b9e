"""A dead man's switch for one migration: a small process that outlives `migrt migrate` or `migrt
receive` when they are killed (SIGKILL, OOM killer, a node agent) and does what the migration's
current phase needs, so that exactly one copy of the container runs and nothing is left behind:

    source, frozen, target not asked to restore yet   resume the container (after any dump ends)
    source, target asked to restore, no answer yet    ask the target (handover.resolve_source)
    source, target runs it                            delete the frozen source
    target, receiving files                           remove the staging directory
    target, restoring                                 kill runc restore / CRIU / criu lazy-pages, clean
                                                      up, remove the container

A source container with CUDA processes (migration/gpu.py): whenever the guard leaves it running
(resumed, or never frozen), it also brings the processes' GPU state back (`gpu_pids`).

The owner writes the current instruction as one JSON line on the guard's stdin (`arm`); `disarm`
writes "nothing" and closes the pipe. The guard acts on the last instruction when the pipe closes,
which happens whether the owner exits or is killed. It runs in its own session, so signals aimed at
the owner's process group (Ctrl-C) do not reach it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

NOTHING = {"do": "nothing"}


class Guard:
    def __init__(self, tag: str, log_file: str | None = None) -> None:
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-m", "migrt.migration.guard", tag], stdin=r, cwd="/",
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._w = w
        self.log_file = log_file
        self.current: dict = NOTHING

    def arm(self, action: dict) -> None:
        self.current = {**action, "log": self.log_file}
        if self._w >= 0:
            try:
                os.write(self._w, (json.dumps(self.current) + "\n").encode())
            except OSError:
                pass

    def release(self, wait: float = 5.0) -> None:
        """Close the pipe: the guard acts on the last instruction (none after `arm(NOTHING)`); wait
        up to `wait` seconds for it to finish."""
        if self._w < 0:
            return
        os.close(self._w)
        self._w = -1
        try:
            self.proc.wait(wait if self.current.get("do", "nothing") != "nothing" else 5.0)
        except subprocess.TimeoutExpired:
            pass

    def disarm(self) -> None:
        self.arm(NOTHING)
        self.release()


def running_guards(tag: str) -> list[int]:
    """Pids of guards for `tag` still alive (acting on a dead owner's last instruction)."""
    out = []
    needle = b"migrt.migration.guard\0" + tag.encode() + b"\0"
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if needle in fh.read():
                        out.append(int(entry))
            except OSError:
                pass
    return out


def wait_for_guards(tag: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while running_guards(tag) and time.monotonic() < deadline:
        time.sleep(0.05)


# -- the guard process ---------------------------------------------------------------------------

def _log(action: dict, outcome: str) -> None:
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "level": "warning",
           "event": "migration_guard", "do": action.get("do"), "container": action.get("cid"), "outcome": outcome}
    sys.stderr.write(json.dumps(rec) + "\n")
    if action.get("log"):
        try:
            with open(action["log"], "a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec) + "\n")
        except OSError:
            pass


def _kill(pid: int | None, group: bool = False) -> None:
    if not pid:
        return
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def act(action: dict) -> str:
    from migrt.migration import handover, watchdog

    do = action.get("do")
    rt, root, cid = (str(action.get(k) or "") for k in ("runtime", "root", "cid"))  # '' when not given
    ps = tuple(action["page_server"]) if action.get("page_server") else None
    outcome = "cleaned up"
    if do in ("resume", "settle"):  # settle: the container was paused before the migration; it stays so
        handover.settle_dump(rt, cid, ps, finish=False, pages_pid=action.get("pages_pid"))
        outcome = handover.resume_source(rt, root, cid) if do == "resume" else f"container {cid} left paused"
    elif do == "destroy":
        handover.settle_dump(rt, cid, ps, finish=True, pages_pid=action.get("pages_pid"))
        outcome = handover.destroy_source(rt, root, cid, action.get("moved"))
    elif do == "resolve":
        from migrt.config import load

        _, outcome = handover.resolve_source(load(action["config"]), runtime=rt, root=root, cid=cid, to=action["to"],
                                             name=action["name"], target_cid=action.get("target_cid"), page_server=ps,
                                             was_paused=bool(action.get("was_paused")),
                                             pages_pid=action.get("pages_pid"), moved=action.get("moved"))
    if action.get("gpu_pids") and (do == "remove" or "was resumed" in outcome):  # running again: its GPU too
        from migrt.migration.gpu import resume_pids

        outcome += resume_pids(action["gpu_pids"])
    for pid in action.get("pids") or []:  # kill-restore, remove: runc restore, CRIU, criu lazy-pages
        for proc in watchdog.tree(pid):
            _kill(proc.pid)
        _kill(pid, group=True)
    if action.get("work"):
        watchdog.kill_users(action["work"])
        watchdog.unmount_under(action["work"])
    if do == "kill-restore" and cid:
        watchdog.clear_container(rt, root, cid)
        outcome = f"killed the unfinished restore of {cid} and removed it"
    removed = False
    for path in action.get("remove") or []:
        if path and os.path.exists(path):
            watchdog.unmount_under(path)
            shutil.rmtree(path, ignore_errors=True)
            removed = True
    if do == "remove" and not removed and not action.get("pids") and not action.get("name"):
        outcome = "nothing to do"
    if action.get("store") and action.get("name"):
        from migrt.store import Store

        try:
            Store(action["store"]).remove(action["name"])
        except Exception:  # noqa: BLE001 - best effort, the next receiver's gc sweeps the rest
            pass
    return outcome


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    action: dict = NOTHING
    for line in sys.stdin:
        try:
            action = json.loads(line)
        except ValueError:
            continue
    if action.get("do", "nothing") == "nothing":
        return 0
    try:
        outcome = act(action)
    except Exception as exc:  # noqa: BLE001 - the owner is gone: say what failed, in its log
        outcome = f"failed: {exc!r}"
    if outcome != "nothing to do":
        _log(action, outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
