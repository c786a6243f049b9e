"""migrt killed (SIGKILL) at every phase of a checkpoint and of a restore, with the real runc and CRIU.

The phases are those migrt records in its journal before each step (migrt/store/journal.py); the
fault seam MIGRT_FAULT=<op>:<phase>:kill kills migrt right after it recorded one. Two more tests kill
it from outside, timed from the journal, while runc/CRIU are at work (their orphans finish first).
Each asserts: the workload runs (or, past the commit, its checkpoint is whole), nothing partial is
listed, and the next operation succeeds.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.faults.conftest import kill9

pytestmark = pytest.mark.integration

BEFORE_COMMIT = ["started", "freezing", "dumping", "dumped", "committing"]
AFTER_COMMIT = ["committed", "stopping"]


@pytest.mark.parametrize("phase", BEFORE_COMMIT + AFTER_COMMIT)
def test_checkpoint_killed_at_phase(node, phase):
    cid = node.run(mb=20)
    res = node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck", fault=f"checkpoint:{phase}:kill",
                     check=False)
    assert res.returncode == -9, (res.returncode, res.stderr)
    stale = node.journal()
    assert [e["phase"] for e in stale] == [phase]
    # the next migrt command (any) recovers first
    ls = node.migrt("ls", "--json")
    assert "recovered interrupted checkpoint" in ls.stderr, ls.stderr
    node.assert_clean_store()
    if phase in BEFORE_COMMIT:
        assert json.loads(ls.stdout) == []  # nothing partial listed
        node.assert_running(cid)  # thawed, ticking again
        node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck")  # the next operation succeeds
    else:
        assert [c["name"] for c in json.loads(ls.stdout)] == ["ck"]
        assert node.state(cid) is None  # committed: the stop was finished by recovery
    node.migrt("inspect", "--verify", "ck")
    node.restore("ck", node.id("back"), bundle_of=cid)
    node.assert_running(node.id("back"))


# migrt's parallel dump (dump_pages: parallel, ops/dump.py): CRIU's lazy dump, then migrt writes the memory
PARALLEL_PHASES = ["dumping", "lazy-ready", "writing-pages", "dumped"]


@pytest.mark.parametrize("phase", PARALLEL_PHASES)
def test_parallel_dump_killed_at_phase(node, phase):
    """lazy-ready (a fault point, not a journal phase): CRIU's lazy dump serves pages and waits for an
    end that the killed migrt will never send; recovery must end it before it can thaw."""
    node.write_config(dump_pages="parallel")
    cid = node.run(mb=20)
    res = node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck", fault=f"checkpoint:{phase}:kill",
                     check=False)
    assert res.returncode == -9, (res.returncode, res.stderr)
    assert [e["phase"] for e in node.journal()] == ["dumping" if phase == "lazy-ready" else phase]
    # held: frozen by migrt, or (lazy-ready) stopped by the CRIU that waits (it thaws the cgroup while
    # it holds the tasks, and freezes it again when it ends)
    before = node.ticks(cid)
    time.sleep(0.5)
    assert node.ticks(cid) == before and node.state(cid) in ("paused", "running")
    rec = node.migrt("recover", "--wait", "30")
    assert "thawed container" in rec.stdout, rec.stdout
    if phase == "lazy-ready":
        assert "ended the interrupted lazy dump" in rec.stdout, rec.stdout
    node.assert_clean_store()
    assert node.listed() == []
    node.assert_running(cid)
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck")
    data = json.loads(node.migrt("inspect", "ck", "--json").stdout)
    assert data["manifest"]["dump_pages"]["mode"] == "parallel", data["manifest"].get("dump_pages")
    node.restore("ck", node.id("back"), bundle_of=cid)
    node.assert_running(node.id("back"))


def test_parallel_dump_killed_from_outside_during_the_lazy_dump(node):
    """A real SIGKILL while CRIU's lazy dump runs: CRIU either dies with its status pipe or waits on
    its page server; recovery ends it if needed, then thaws the container."""
    node.write_config(dump_pages="parallel")
    cid = node.run(mb=150)
    proc = node.spawn("checkpoint", cid, "--root", node.root, "--name", "ck")
    node.wait_phase("checkpoint", "dumping", pid=proc.pid)
    time.sleep(0.2)
    kill9(proc)
    rec = node.migrt("recover", "--wait", "30")
    assert "thawed container" in rec.stdout or node.state(cid) == "running", rec.stdout
    node.assert_clean_store()
    assert node.listed() == []
    node.assert_running(cid)
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck")
    node.restore("ck", node.id("back"), bundle_of=cid)
    node.assert_running(node.id("back"))


@pytest.mark.parametrize("phase", ["started", "verifying", "preparing", "restoring", "restored"])
def test_restore_killed_at_phase(node, phase):
    cid = node.run(mb=5)
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck", "--leave-running")
    res = node.restore("ck", node.id("dst"), bundle_of=cid, check=False, fault=f"restore:{phase}:kill")
    assert res.returncode == -9, (res.returncode, res.stderr)
    assert [e["phase"] for e in node.journal()] == [phase]
    rec = node.migrt("recover")
    assert "interrupted restore" in rec.stdout, rec.stdout
    node.assert_clean_store()
    assert node.listed() == ["ck"]  # a restore never harms its checkpoint
    node.migrt("inspect", "--verify", "ck")
    if phase == "restored":  # it had finished: the restored container is kept
        node.assert_running(node.id("dst"))
        node.restore("ck", node.id("dst2"), bundle_of=cid)
        node.assert_running(node.id("dst2"))
    else:
        assert node.state(node.id("dst")) is None  # a half-restored container is removed
        node.restore("ck", node.id("dst"), bundle_of=cid)  # the same id works again
        node.assert_running(node.id("dst"))
    node.assert_running(cid)


def test_checkpoint_killed_from_outside_during_the_dump(node):
    """A real SIGKILL while CRIU dumps (timed from the journal): CRIU outlives runc and finishes;
    recovery waits for it, then thaws the container."""
    cid = node.run(mb=150)
    proc = node.spawn("checkpoint", cid, "--root", node.root, "--name", "ck")
    node.wait_phase("checkpoint", "dumping", pid=proc.pid)
    kill9(proc)
    assert node.state(cid) == "paused"  # frozen by migrt: recoverable, not lost
    rec = node.migrt("recover")
    assert "thawed container" in rec.stdout and "removed the uncommitted images" in rec.stdout, rec.stdout
    node.assert_clean_store()
    assert node.listed() == []
    node.assert_running(cid)
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck")
    node.restore("ck", node.id("back"), bundle_of=cid)
    node.assert_running(node.id("back"))


def test_checkpoint_killed_from_outside_during_the_commit(node):
    cid = node.run(mb=150)
    proc = node.spawn("checkpoint", cid, "--root", node.root, "--name", "ck")
    node.wait_phase("checkpoint", "committing", pid=proc.pid)
    kill9(proc)
    rec = node.migrt("recover")
    node.assert_clean_store()
    if "checkpoint ck is complete" in rec.stdout:  # the rename had happened: the job is finished
        assert node.state(cid) is None and node.listed() == ["ck"]
        node.restore("ck", node.id("back"), bundle_of=cid)
        node.assert_running(node.id("back"))
    else:
        assert "thawed container" in rec.stdout, rec.stdout
        assert node.listed() == []
        node.assert_running(cid)


def test_restore_killed_from_outside_while_criu_restores(node):
    cid = node.run(mb=150)
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck")
    proc = node.spawn("restore", "ck", node.id("dst"), "--bundle", f"{node.base}/bundle-{cid}", "--root", node.root,
                      "--output", f"{node.base}/dst.out")
    node.wait_phase("restore", "restoring", pid=proc.pid)
    kill9(proc)
    rec = node.migrt("recover")
    assert "interrupted restore" in rec.stdout, rec.stdout
    node.assert_clean_store()
    assert node.state(node.id("dst")) is None and node.listed() == ["ck"]
    node.restore("ck", node.id("dst"), bundle_of=cid)
    node.assert_running(node.id("dst"))
