"""Fault injection for live migration (real runc and CRIU, two network-namespace "hosts").

Every fault must end within seconds on both sides with exactly one copy of the container running
(the source resumed, or the target running and the source deleted: never both, never none), nothing
left behind (staging directories, runc state, guard processes, mounts), and the next migration must
succeed. Faults: SIGKILL of `migrt migrate` and of `migrt receive` at each phase (found from the
sender's progress events, MIGRT_PROGRESS=json, and from the processes the receiver runs), the
connection cut at chosen points by a proxy (tests/helpers/cutproxy.py), the target's page filler
killed during the restore, the source's page server killed while the pages flow, and a restore that hangs (CRIU stopped with SIGSTOP).
The config's `migration_stall_timeout` is 3 s here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tests.helpers.migration import (Counter, Receiver, assert_continues, env_of, hosts, lazy_capable,  # noqa: F401
                                     setup_nodes, start_source, teardown_nodes, visible, wait_ticks)
from tests.helpers.twohosts import ADDR_A, ADDR_B, in_ns
from tests.integration.conftest import CLI

pytestmark = pytest.mark.integration

STALL = 3
SETTLE = 5 * STALL  # the longest a fault may take to settle on both sides (a query waits 3 x STALL)
_ports = itertools.count(7950)


@pytest.fixture(scope="module")
def nodes(stack, tmp_path_factory):
    out = setup_nodes(tmp_path_factory.mktemp("faults"), f"migration_stall_timeout: {STALL}\n")
    yield out
    teardown_nodes(out)


class Migration:
    """`migrt migrate` in host A with its progress events read as they come (MIGRT_PROGRESS=json)."""

    def __init__(self, nodes, hosts, to: str, cid: str, *args: str) -> None:
        argv = in_ns(hosts["a"], CLI, "migrate", cid, "--to", to, "--root", nodes["a"]["root"], "--json", *args)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**env_of(nodes["a"]), "MIGRT_PROGRESS": "json"})
        self.events: list[dict] = []
        self.text: list[str] = []
        self.new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            with self.new:
                self.text.append(line)
                if line.startswith('{"progress"'):
                    self.events.append(json.loads(line))
                self.new.notify_all()
        with self.new:
            self.text.append("<eof>")
            self.new.notify_all()

    def wait_event(self, pred, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        with self.new:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                assert self.text[-1:] != ["<eof>"], "migrate ended before the event:\n" + "\n".join(self.text)
                left = deadline - time.monotonic()
                assert left > 0, "no such progress event:\n" + "\n".join(self.text)
                self.new.wait(left)

    def finish(self, timeout: float = SETTLE + 30) -> tuple[int, str, float]:
        """(exit status, stdout then stderr, seconds since the start)."""
        out, _ = self.proc.communicate(timeout=timeout)
        took = time.monotonic() - self.t0
        time.sleep(0.05)
        return self.proc.returncode, out.decode(errors="replace") + "\n".join(self.text), took


@contextlib.contextmanager
def throttled(hosts, rate: str = "8mbit"):
    """Host A's link slowed down (tc tbf), so that a transfer lasts long enough to be hit."""
    subprocess.run(in_ns(hosts["a"], "tc", "qdisc", "add", "dev", hosts["veth_a"], "root", "tbf", "rate", rate,
                         "burst", "32kbit", "latency", "400ms"), check=True)
    try:
        yield
    finally:
        subprocess.run(in_ns(hosts["a"], "tc", "qdisc", "del", "dev", hosts["veth_a"], "root"), capture_output=True)


def phase(name: str):
    return lambda ev: ev["progress"] == "phase" and ev.get("name") == name


def runc_state(root: str, cid: str) -> str | None:
    res = subprocess.run(["runc", "--root", root, "state", cid], capture_output=True, text=True)
    return json.loads(res.stdout)["status"] if res.returncode == 0 else None


def guards_alive(*tags: str) -> list[int]:
    from migrt.migration.guard import running_guards

    return [pid for tag in tags for pid in running_guards(tag)]


def pids_matching(*needles: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    argv = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if all(n in argv for n in needles):
                out.append(int(entry))
    return out


def in_netns(pids: list[int], ns: str) -> list[int]:
    """Those of `pids` in network namespace `ns` (ours: other sessions run migrations on this machine too)."""
    want = os.stat(f"/run/netns/{ns}").st_ino
    out = []
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino == want:
                out.append(pid)
        except OSError:
            pass
    return out


def criu_using(path: str) -> list[int]:
    """CRIU processes with their working directory or an open file under `path`."""
    import psutil

    out = []
    for proc in psutil.process_iter(["name"]):
        if not (proc.info["name"] or "").startswith("criu"):
            continue
        try:
            if any(p.startswith(path) for p in [proc.cwd()] + [f.path for f in proc.open_files()]):
                out.append(proc.pid)
        except psutil.Error:
            pass
    return out


class Case:
    """One source container, its target id and output file, and the checks every fault ends with."""

    def __init__(self, nodes, hosts, tag: str) -> None:
        self.nodes, self.hosts = nodes, hosts
        self.src, self.cid = start_source(nodes, tag)
        self.tcid = f"{self.cid}-b"
        self.name = f"{self.cid}-ck"
        self.out = nodes["base"] / f"{self.tcid}.out"
        self.port = next(_ports)
        self.to = f"{ADDR_B}:{self.port}"

    def receiver(self, *extra: str, once: bool = True, port: int | None = None) -> Receiver:
        return Receiver(self.nodes, self.hosts, port or self.port, "--restore", self.nodes["b"]["bundle"], "--root",
                        self.nodes["b"]["root"], "--container-id", self.tcid, "--output", str(self.out), *extra,
                        once=once)

    def migrate(self, *args: str, to: str | None = None) -> Migration:
        return Migration(self.nodes, self.hosts, to or self.to, self.cid, "--name", self.name, *args)

    def settle(self) -> str:
        """Wait until exactly one copy runs and every guard is done; return "source" or "target"."""
        deadline = time.monotonic() + SETTLE
        while True:
            s = runc_state(self.nodes["a"]["root"], self.cid)
            t = runc_state(self.nodes["b"]["root"], self.tcid)
            busy = guards_alive(f"source:{self.cid}", f"target:{self.name}")
            if not busy and (s, t) in (("running", None), (None, "running")):
                return "source" if s == "running" else "target"
            assert time.monotonic() < deadline, f"not settled after {SETTLE} s: source {s}, target {t}, guards {busy}"
            time.sleep(0.1)

    def check_clean(self, survivor: str) -> None:
        for node in ("a", "b"):
            staging = os.path.join(self.nodes[node]["store"], ".staging")
            assert not os.path.isdir(staging) or os.listdir(staging) == [], f"staging left on {node}"
        b_root = self.nodes["b"]["root"]
        assert (self.tcid in os.listdir(b_root)) == (survivor == "target"), os.listdir(b_root)
        assert not in_netns(pids_matching("migrt.pagefill.guard"), self.hosts["b"]), "a page filler was left"
        assert not in_netns(pids_matching("migrt.migration.pageserve"), self.hosts["a"]), "a page server was left"
        assert not pids_matching("restore --detach", self.tcid), "a runc restore was left"
        assert not criu_using(str(self.nodes["base"])), "a CRIU process was left"
        with open("/proc/self/mountinfo") as fh:
            left = [ln.split()[4] for ln in fh if str(self.nodes["base"]) in ln.split()[4]]
        assert not left, f"mounts left: {left}"
        if survivor == "source":  # it counts on, with its memory intact
            ticks = self.src.read_for(0.8)
            assert len(ticks) >= 2 and ticks[-1][1] == ticks[-1][2]
        else:
            before = self.src.read_for(0.3)
            assert_continues(before, wait_ticks(self.out))

    def next_migration_succeeds(self) -> None:
        """The survivor (the source) migrates normally afterwards."""
        port = next(_ports)
        recv = Receiver(self.nodes, self.hosts, port, "--restore", self.nodes["b"]["bundle"], "--root",
                        self.nodes["b"]["root"], "--container-id", f"{self.cid}-next",
                        "--output", str(self.nodes["base"] / f"{self.cid}-next.out"))
        try:
            res = Migration(self.nodes, self.hosts, f"{ADDR_B}:{port}", self.cid, "--name", f"{self.cid}-next")
            rc, text, _ = res.finish()
            assert rc == 0, text
            assert recv.wait() == 0
        finally:
            recv.stop()
        assert runc_state(self.nodes["b"]["root"], f"{self.cid}-next") == "running"
        assert runc_state(self.nodes["a"]["root"], self.cid) is None
        subprocess.run(["runc", "--root", self.nodes["b"]["root"], "delete", "--force", f"{self.cid}-next"],
                       capture_output=True)

    def close(self) -> None:
        for root, cid in ((self.nodes["a"]["root"], self.cid), (self.nodes["b"]["root"], self.tcid)):
            subprocess.run(["runc", "--root", root, "delete", "--force", cid], capture_output=True)
        self.src.close()


@pytest.fixture
def case(nodes, hosts, request):
    made = []

    def make(tag: str) -> Case:
        c = Case(nodes, hosts, tag)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# -- the target's CRIU ---------------------------------------------------------------------------

def test_page_filler_killed_during_restore(case, lazy_capable):
    """The target's page filler (its guard and the filler it forked) dies while `runc restore
    --lazy-pages` runs (where CRIU used to deadlock when its lazy-pages daemon died): the target kills
    the restore at once, cleans up and tells the source, which resumes."""
    c = case("lzkill")
    recv = c.receiver()
    try:
        mig = c.migrate("--lazy")
        mig.wait_event(phase("restore"))
        deadline = time.monotonic() + 20
        while (not (fillers := in_netns(pids_matching("migrt.pagefill.guard"), c.hosts["b"]))
               or not pids_matching("restore --detach", c.tcid)):
            assert time.monotonic() < deadline, "no restore with a page filler seen"
            time.sleep(0.005)
        t_kill = time.monotonic()
        for pid in fillers:
            os.killpg(pid, signal.SIGKILL)  # the guard and its filler (a session of their own)
        rc, text, _ = mig.finish()
        ended = time.monotonic() - t_kill
        recv.wait(SETTLE)
    finally:
        recv.stop()
    print(f"[page filler killed] the source ended {ended:.2f} s after the kill")
    assert rc != 0, text
    assert ended < 2 * STALL, f"the source took {ended:.1f} s to end"
    assert "resumed on this node" in text, text
    assert c.settle() == "source"
    c.check_clean("source")
    assert c.name not in visible(c.nodes)
    assert os.path.exists(os.path.join(c.nodes["b"]["bundle"], "rootfs", "bin", "busybox")), "rootfs damaged"
    c.next_migration_succeeds()


def test_stuck_restore_is_killed_on_the_progress_deadline(case):
    """CRIU's restore stops making progress (SIGSTOP): after migration_stall_timeout without I/O or CPU
    time the target kills it and cleans up; the source resumes."""
    c = case("stuck")
    recv = c.receiver()
    try:
        mig = c.migrate()
        mig.wait_event(phase("restore"))
        deadline = time.monotonic() + 20
        while not (criu := [p for p in pids_matching("criu") if p in _children_of(runc := pids_matching("restore --detach", c.tcid))]):
            assert time.monotonic() < deadline, "no CRIU restore seen"
            time.sleep(0.005)
        t_stop = time.monotonic()
        # runc too: on a quiet machine CRIU may finish its part before the stop lands, and runc would then
        # complete the restore; with both stopped the restore cannot end without the target's deadline
        for pid in [*criu, *runc]:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        rc, text, _ = mig.finish()
        ended = time.monotonic() - t_stop
        recv.wait(SETTLE)
    finally:
        recv.stop()
    print(f"[restore stopped] the source ended {ended:.2f} s after CRIU was stopped (stall {STALL} s)")
    assert rc == 5, text  # the target's RuntimeFailed, passed on
    assert "no progress for 3 s" in text and "resumed on this node" in text, text
    assert STALL <= ended < 3 * STALL, ended
    assert c.settle() == "source"
    c.check_clean("source")
    c.next_migration_succeeds()


def _children_of(pids: list[int]) -> set[int]:
    import psutil

    out = set()
    for pid in pids:
        try:
            out |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            pass
    return out


# -- SIGKILL of migrt migrate ------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["dump", "transfer", "commit", "restore", "restore+0.3s"])
def test_migrate_killed(case, when):
    """`migrt migrate` killed with SIGKILL at a phase: its guard resumes the source, or (once the target
    was asked to restore) asks the target and deletes or resumes the source accordingly."""
    c = case("mk")
    recv = c.receiver()
    try:
        with throttled(c.hosts) if when == "transfer" else contextlib.nullcontext():
            mig = c.migrate()
            mig.wait_event(phase(when.split("+")[0]))
            if "+" in when:
                time.sleep(float(when.split("+")[1].rstrip("s")))  # into the target's restore
            mig.proc.kill()
            mig.finish()
        survivor = c.settle()
        recv.wait(SETTLE)
    finally:
        recv.stop()
    if when in ("dump", "transfer", "commit"):
        assert survivor == "source"
    c.check_clean(survivor)
    if survivor == "source":
        c.next_migration_succeeds()


# -- SIGKILL of migrt receive -------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["transfer", "commit", "restore"])
def test_receive_killed(case, when):
    """`migrt receive` killed with SIGKILL at a phase; a supervisor restarts it (as systemd would). The
    source ends within seconds; the receiver's guard removed what it had received or was restoring;
    exactly one copy runs and the restarted receiver takes the next migration."""
    c = case("rk")
    recv = c.receiver()
    restarted = None
    slow = throttled(c.hosts) if when == "transfer" else contextlib.nullcontext()
    try:
        with slow:
            mig = c.migrate()
            mig.wait_event(phase(when))
            if when == "transfer":
                mig.wait_event(lambda ev: ev["progress"] == "bytes")
            if when == "restore":  # the target is restoring: runc restore runs there
                deadline = time.monotonic() + 20
                while not pids_matching("restore --detach", c.tcid):
                    assert time.monotonic() < deadline, "no restore seen on the target"
                    time.sleep(0.005)
            recv.proc.kill()
            recv.proc.wait()
        restarted = c.receiver(once=False)
        rc, text, took = mig.finish()
        survivor = c.settle()
    finally:
        if restarted:
            restarted.stop()
        recv.stop()
    print(f"[receive killed at {when}] migrate ended after {took:.2f} s (from its start), {survivor} runs")
    if when != "restore":
        assert survivor == "source" and rc == 9, text
    assert took < SETTLE + 10, text
    c.check_clean(survivor)
    assert c.name not in visible(c.nodes) or when == "restore" or survivor == "target"
    if survivor == "source":
        c.next_migration_succeeds()


# -- the connection cut by a proxy -----------------------------------------------------------------

CUTS = [
    # (spec, lazy, who runs it afterwards)
    ("bytes:40", False, "source"),                  # inside the handshake
    ("down:ready:before", False, "source"),         # the target accepted; the source never heard
    ("file:0.5", False, "source"),                  # half way through the memory pages
    ("down:committed:before", False, "source"),     # committed there; the source never heard
    ("up:restore:after", False, "target"),          # the target restores; the source never hears back
    ("down:restored:before", False, "target"),      # the target runs it; "restored" lost
    ("up:bye:before", False, "target"),             # the source deleted itself; "bye" lost
    ("up:commit:after", True, "target"),            # lazy: the target restores, pages flow on their own
    ("down:done:before", True, "target"),           # lazy: every page arrived; "done" lost
]


@pytest.mark.parametrize("spec,lazy,expected", CUTS, ids=[c[0] + (" lazy" if c[1] else "") for c in CUTS])
def test_connection_cut(case, spec, lazy, expected, request):
    if lazy:
        request.getfixturevalue("lazy_capable")
    c = case("cut")
    recv = c.receiver(once=False)
    proxy_port = next(_ports)
    # on host A, so that the receiver sees the sender's address (it checks a lazy page server against it)
    proxy = subprocess.Popen(in_ns(c.hosts["a"], sys.executable, os.path.join(os.path.dirname(__file__), "..",
                                   "helpers", "cutproxy.py"), f"{ADDR_A}:{proxy_port}", c.to, spec),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "listening"
        mig = c.migrate(*(["--lazy"] if lazy else []), to=f"{ADDR_A}:{proxy_port}")
        rc, text, took = mig.finish()
        survivor = c.settle()
    finally:
        proxy.kill()
        proxy.wait()
        recv.stop()
    cut = [json.loads(x) for x in proxy.stdout.read().splitlines() if x.startswith("{")]
    print(f"[cut {spec}{' lazy' if lazy else ''}] migrate ended after {took:.2f} s (from its start), exit {rc}, "
          f"{survivor} runs")
    assert cut and cut[0].get("cut"), f"the proxy did not cut: {cut}"
    assert survivor == expected, text
    assert (rc == 0) == (expected == "target"), text
    assert took < SETTLE + 10, text
    c.check_clean(survivor)
    if expected == "target" and spec.startswith("up:restore") or spec.startswith("down:restored"):
        assert '"handover"' in text or "handover" in text, text  # resolved by asking again
    if spec == "down:committed:before":
        c.next_migration_succeeds()


# -- lazy: kills while the memory pages flow -------------------------------------------------------

def test_migrate_killed_while_lazy_pages_flow(case, lazy_capable):
    """The target runs and fetches its pages from the source's page server when `migrt migrate` dies:
    the page server goes on (a process of its own, not migrate's to lose), the guard asks the target,
    which answers once every page has arrived, and deletes the source."""
    c = case("mkl")
    recv = c.receiver()
    try:
        with throttled(c.hosts):  # the pages take about a second instead of milliseconds
            mig = c.migrate("--lazy")
            mig.wait_event(phase("pages"))
            mig.proc.kill()
            mig.finish()
            survivor = c.settle()
        recv.wait(SETTLE)
    finally:
        recv.stop()
    assert survivor == "target"
    c.check_clean(survivor)


def test_page_server_killed_while_lazy_pages_flow(case, lazy_capable):
    """The source's page server dies while the target still fetches pages: the target's filler cannot
    complete the copy, so the target kills it (never a copy running on missing memory) and says so;
    the source resumes from the freeze."""
    c = case("pskill")
    recv = c.receiver()
    try:
        with throttled(c.hosts):
            mig = c.migrate("--lazy")
            mig.wait_event(phase("pages"))
            # the target's heartbeats carry its filler's progress: the source shows it
            mig.wait_event(lambda ev: ev["progress"] == "bytes" and ev.get("name") == "pages" and ev.get("bytes"))
            servers = in_netns(pids_matching("migrt.migration.pageserve"), c.hosts["a"])
            assert servers, "no page server seen"
            for pid in servers:
                os.kill(pid, signal.SIGKILL)
            rc, text, took = mig.finish()
            survivor = c.settle()
        recv.wait(SETTLE)
    finally:
        recv.stop()
    print(f"[page server killed] migrate ended after {took:.2f} s, exit {rc}")
    assert survivor == "source" and rc != 0, text
    assert "resumed on this node" in text and "memory pages" in text, text
    c.check_clean(survivor)


def test_receive_killed_while_lazy_pages_flow(case, lazy_capable):
    """`migrt receive` dies while its restored copy still fetches pages: its guard kills the copy (it
    would never get all its memory) and the page filler; the source, asking the restarted
    receiver, learns that nothing runs there and resumes."""
    c = case("rkl")
    recv = c.receiver()
    restarted = None
    try:
        with throttled(c.hosts):
            mig = c.migrate("--lazy")
            mig.wait_event(phase("pages"))
            recv.proc.kill()
            recv.proc.wait()
            restarted = c.receiver(once=False)
            rc, text, took = mig.finish()
            survivor = c.settle()
    finally:
        if restarted:
            restarted.stop()
        recv.stop()
    assert survivor == "source" and rc == 9, text
    assert took < SETTLE + 10, text
    c.check_clean(survivor)
