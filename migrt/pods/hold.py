"""The hold: the parts of one pod restored on this node stay frozen until the pod's last part is in,
then every part is thawed at once.

kubelet creates a pod's containers one after another and waits for each create; a pod-level pull
or restore makes each create restore its own part. A part that ran before its peers were restored
could talk to a peer that is not there yet: the two ends of a TCP connection over the pod's
loopback would run apart (the restored end's next segment finds no socket and gets a RST), a
shared-memory segment would be read half-written. So:

    each part's restore   CRIU's `pre-resume` action (every task restored and stopped, none resumed
                          yet) freezes the part's own cgroup (v1 freezer.state FROZEN, or v2
                          cgroup.freeze 1: whichever hierarchy holds the freezer the runtime uses),
                          the point where CRIU itself puts back a frozen container's freezer state;
                          the tasks then resume into the freezer. The create returns to kubelet with
                          the container frozen (runc state "paused"; containerd reports it running).
    arrived(part)         the part is recorded in the pod's hold record; the last expected part's
                          arrival returns True and its caller thaws them all (`release`, the lower
                          runtime's resume of each), in one pass.
    the deadline          a hold not complete by its deadline is abandoned: every part's owner sees
                          it (`wait`) and removes its own copy; a part arriving after it is refused.

The record, one per new pod (its sandbox id), beside runc's state directories (runc lists
directories only, like runtime/moved.py's records), written under an exclusive lock:

    <runc root>/.migrt-hold-<sandbox id>.json   {sandbox, expected, deadline, state, parts{name: {cid}}, netns}

Given the pod's network namespace (`join(..., netns)`), the hold also drops TCP on the pod's loopback
from the first part's join until the release (before the thaw) or the abandon (pods/netlock.py: a
frozen part's kernel still sends, and a segment to a peer not restored yet would reset it).

state: "holding" -> "released" | "abandoned"; never back. Released or abandoned records of pods
whose sandbox is gone are removed by `sweep`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from migrt.errors import Conflict, PreconditionFailed, RuntimeFailed, UsageError
from migrt.pagefill.held import HOLD_ENV, HOLDING
from migrt.pagefill.held import holding as holding  # read by a held part's filler; here for the hold's callers
from migrt.pods import netlock
from migrt.runtime import control

PREFIX = ".migrt-hold-"
# set for a held part's restore (podpull.TargetPart): its page filler's background copies wait while
# the hold record it names holds the pod (pagefill/engine.py; `holding`)
FILL_ENV = HOLD_ENV  # a held part's filler reads its record (pagefill/held.py)
RELEASED, ABANDONED = "released", "abandoned"
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,252}")

_FREEZE = """#!/bin/sh
# migrt pod hold (CRIU action script): at pre-resume (every task restored, none resumed) freeze the
# restored container's cgroup, so that it resumes frozen until the pod's last part is restored.
[ "$CRTOOLS_SCRIPT_ACTION" = pre-resume ] || exit 0
[ -n "$CRTOOLS_INIT_PID" ] || exit 1
v1=; v2=
while IFS=: read -r _ ctrl path; do
    case ",$ctrl," in *,freezer,*) v1=$path ;; ,,) v2=$path ;; esac
done < /proc/"$CRTOOLS_INIT_PID"/cgroup
# runc put CRIU (our parent) and so this script in the container's cgroup: both step out into a
# leaf of their own first, or the freeze would stop CRIU before it lets the tasks go
away() {{
    mkdir -p "$1"/migrt-hold && echo $$ > "$1"/migrt-hold/cgroup.procs && echo $PPID > "$1"/migrt-hold/cgroup.procs
}}
if [ -n {v1mnt} ] && [ -n "$v1" ] && [ -e {v1mnt}"$v1"/freezer.state ]; then
    away {v1mnt} || exit 1
    echo FROZEN > {v1mnt}"$v1"/freezer.state || exit 1
    echo "v1 {v1mnt}$v1" > {frozen}
elif [ -n {v2mnt} ] && [ -n "$v2" ] && [ -e {v2mnt}"$v2"/cgroup.freeze ]; then
    away {v2mnt} || exit 1
    echo 1 > {v2mnt}"$v2"/cgroup.freeze || exit 1
    echo "v2 {v2mnt}$v2" > {frozen}
else
    exit 1  # no freezer: never let a part run ahead of its pod
fi
exit 0
"""


def _mounts() -> tuple[str, str]:
    """(the cgroup v1 freezer's mount point, the cgroup2 mount point), "" where absent."""
    v1 = v2 = ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) < 5 or len(rfields) < 3:
                    continue
                if rfields[0] == "cgroup2" and not v2:
                    v2 = fields[4]
                elif rfields[0] == "cgroup" and "freezer" in rfields[2].split(",") and not v1:
                    v1 = fields[4]
    except OSError:
        pass
    return v1, v2


def freeze_script(work: str) -> str:
    """The CRIU action script of one part's restore, written into its work directory (returned)."""
    v1, v2 = _mounts()
    path = os.path.join(work, "pod-hold.sh")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(_FREEZE.format(v1mnt=shlex.quote(v1), v2mnt=shlex.quote(v2),
                                frozen=shlex.quote(os.path.join(work, "pod-hold.frozen"))))
    os.chmod(path, 0o700)
    return path


def criu_env(env: dict | None, work: str) -> dict:
    """runc's environment for one part's restore: CRIU_CONFIG_FILE with the freeze at pre-resume
    (after the config the environment already named, so its settings stay)."""
    return control.criu_config_env(env, work, [f"action-script {freeze_script(work)}"], "criu-pod-hold.conf")


@dataclass
class Part:
    name: str
    cid: str


def _check_name(kind: str, value: object, pattern: re.Pattern) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise UsageError(f"pod hold: invalid {kind} {value!r}")
    return value


class Hold:
    """One pod's hold record in runc root `root`. resume(root, cid) thaws one part (a seam for
    tests; the lower runtime's resume by default)."""

    def __init__(self, root: str, sandbox: str, runtime: str = "runc",
                 resume: Callable[[str, str], None] | None = None) -> None:
        self.root = root
        self.sandbox = _check_name("sandbox id", sandbox, _SAFE)
        self.path = os.path.join(root, f"{PREFIX}{sandbox}.json")
        self._resume = resume or (lambda r, cid: control.resume(runtime, r, cid))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        """The record, read under an exclusive lock and written back (atomically) when changed."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 1 << 20, 0)
            rec = json.loads(raw) if raw else {}
            before = json.dumps(rec, sort_keys=True)
            yield rec
            after = json.dumps(rec, sort_keys=True)
            if after != before:
                os.ftruncate(fd, 0)
                os.pwrite(fd, after.encode(), 0)
                os.fsync(fd)
        finally:
            os.close(fd)

    def join(self, expected: list[str], deadline_s: float, netns: str | None = None) -> dict:
        """Create the record (the pod's first part) or check that this part expects the same pod;
        with the pod's network namespace, its loopback TCP is dropped from here on until the release
        or the abandon (pods/netlock.py says why)."""
        names = sorted({_check_name("container name", n, _NAME) for n in expected})
        if not names:
            raise UsageError("pod hold: no containers expected")
        with self._locked() as rec:
            if not rec:
                rec.update(sandbox=self.sandbox, expected=names, deadline=time.time() + deadline_s,
                           state=HOLDING, parts={}, netns=netns)
            elif rec.get("expected") != names:
                raise Conflict(f"pod hold {self.sandbox}: this part expects containers {names}, the pod's first "
                               f"part {rec.get('expected')}; give every container the same list")
            if rec.get("state") == HOLDING and rec.get("netns"):
                netlock.lock(rec["netns"])
            return dict(rec)

    def arrived(self, name: str, cid: str) -> bool:
        """This part is restored (frozen); True when it is the pod's last: the caller then releases.
        Refused (PreconditionFailed) when the hold was abandoned or its deadline passed: the caller
        removes its own copy."""
        with self._locked() as rec:
            self._expire(rec)
            if rec.get("state") != HOLDING:
                raise PreconditionFailed(self._ended(rec))
            if name not in rec["expected"]:
                raise UsageError(f"pod hold {self.sandbox}: container {name!r} is not one of {rec['expected']}")
            rec["parts"][name] = {"cid": _check_name("container id", cid, _SAFE)}
            return sorted(rec["parts"]) == rec["expected"]

    def release(self) -> list[Part]:
        """Thaw every part (the last one's caller, once): the record says released first, so that a
        part whose owner waits sees it; a part that cannot be thawed is named in the error."""
        with self._locked() as rec:
            if rec.get("state") != HOLDING or sorted(rec.get("parts", {})) != rec.get("expected"):
                raise Conflict(f"pod hold {self.sandbox}: not every part is in ({rec.get('state')})")
            rec["state"] = RELEASED
            parts = [Part(n, p["cid"]) for n, p in sorted(rec["parts"].items())]
            netns = rec.get("netns")
        if netns:  # first: the frozen sockets' retransmissions now find their peers
            netlock.unlock(netns)
        failed = []
        for part in parts:
            try:
                self._resume(self.root, part.cid)
            except RuntimeFailed as exc:
                failed.append(f"{part.name} ({part.cid[:12]}): {exc}")
        if failed:
            raise RuntimeFailed(f"pod hold {self.sandbox}: could not thaw {'; '.join(failed)}; run 'runc --root "
                                f"{self.root} resume ID' for each")
        return parts

    def abandon(self, reason: str) -> bool:
        """Give the pod up (False when it was released already: then it runs, and stays)."""
        with self._locked() as rec:
            if rec.get("state") == RELEASED:
                return False
            if rec.get("state") != ABANDONED:
                rec.update(state=ABANDONED, reason=reason)
            netns = rec.get("netns")
        if netns:
            netlock.unlock(netns)
        return True

    def state(self) -> str:
        with self._locked() as rec:
            self._expire(rec)
            return rec.get("state") or ABANDONED

    def wait(self, poll: float = 0.05) -> str:
        """Until the hold is released or abandoned (its deadline included): the state."""
        while (st := self.state()) == HOLDING:
            time.sleep(poll)
        if st == ABANDONED:
            self.abandon("")  # the deadline's: the pod's loopback is let go too
        return st

    def reason(self) -> str:
        with self._locked() as rec:
            self._expire(rec)
            return str(rec.get("reason") or rec.get("state") or "no record")

    def _expire(self, rec: dict) -> None:
        if rec.get("state") == HOLDING and time.time() > rec.get("deadline", 0):
            missing = sorted(set(rec["expected"]) - set(rec["parts"]))
            rec.update(state=ABANDONED, reason=f"deadline passed without containers {missing}")

    def _ended(self, rec: dict) -> str:
        return (f"pod hold {self.sandbox}: the pod's restore was given up ({rec.get('reason') or rec.get('state')}); "
                "the parts restored here are removed, the source keeps the pod")


def sweep(root: str, live: Callable[[str], bool]) -> None:
    """Remove records of ended holds whose sandbox is gone (live(sandbox id) False)."""
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for entry in entries:
        if not (entry.startswith(PREFIX) and entry.endswith(".json")):
            continue
        sandbox = entry[len(PREFIX):-len(".json")]
        if _SAFE.fullmatch(sandbox) and not live(sandbox):
            with contextlib.suppress(OSError, ValueError, UsageError):
                if Hold(root, sandbox).state() != HOLDING:
                    os.unlink(os.path.join(root, entry))


def wait_for_part(root: str, cid: str, timeout: float) -> str | None:
    """If container `cid` (runc root `root`) is a part of a pod's hold: wait until the hold is
    released or abandoned (at most `timeout` s) and return its state; None for any other container.
    A source that lost its target asks whether its part runs there: a held part does not count as
    running until its pod is whole (an abandoned pod's parts are removed)."""
    from migrt.pods.members import state_bundle

    bundle = state_bundle(root, cid)
    sandbox = bundle.cri_metadata().get("sandbox_id") if bundle is not None else None
    if not isinstance(sandbox, str) or not _SAFE.fullmatch(sandbox) or \
            not os.path.exists(os.path.join(root, f"{PREFIX}{sandbox}.json")):
        return None
    end = time.monotonic() + timeout
    h = Hold(root, sandbox)
    while (st := h.state()) == HOLDING and time.monotonic() < end:
        time.sleep(0.05)
    return st

