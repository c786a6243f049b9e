"""Many processes at one checkpoint or one container: readers share, writers exclude, nothing is
deleted under a reader. Real runc and CRIU."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.integration

REPLICAS = 20


def test_twenty_concurrent_restores_of_one_checkpoint(node):
    cid = node.run()
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "warm", "--leave-running")
    procs = {node.id(f"r{i:02d}"): node.spawn("restore", "warm", node.id(f"r{i:02d}"), "--bundle",
                                              f"{node.base}/bundle-{cid}", "--root", node.root, "--output",
                                              f"{node.base}/{node.id(f'r{i:02d}')}.out")
             for i in range(REPLICAS)}
    failed = {}
    for rid, p in procs.items():
        out, err = p.communicate(timeout=240)
        node.outputs[rid] = f"{node.base}/{rid}.out"
        if p.returncode != 0:
            failed[rid] = err
    assert failed == {}, failed  # none "being used by another process"
    for rid in procs:
        assert node.state(rid) == "running", rid
    node.wait_ticks(node.id("r00"), 3)
    node.wait_ticks(node.id(f"r{REPLICAS - 1:02d}"), 3)
    node.assert_clean_store()
    assert node.listed() == ["warm"]
    node.migrt("inspect", "--verify", "warm")
    node.migrt("rm", "warm")  # no reader left: removed at once
    assert node.listed() == []


def test_two_checkpoints_of_one_container_at_once(node):
    """The second is refused while the first holds the container (frozen); the first completes."""
    cid = node.run(mb=20)
    first = node.spawn("checkpoint", cid, "--root", node.root, "--name", "one", "--leave-running",
                       fault="checkpoint:dumping:sleep1.5")
    node.wait_phase("checkpoint", "dumping", pid=first.pid)
    second = node.migrt("checkpoint", cid, "--root", node.root, "--name", "two", "--leave-running", check=False)
    assert second.returncode == 6, second.stderr
    assert re.search(rf"container {cid} is being checkpointed by another process \(pid {first.pid} ", second.stderr), \
        second.stderr
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert node.listed() == ["one"]
    node.assert_clean_store()
    node.assert_running(cid)
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "two")  # the next one succeeds
    assert sorted(node.listed()) == ["one", "two"]


def test_same_name_from_two_containers_at_once(node):
    a, b = node.run(), node.run()
    first = node.spawn("checkpoint", a, "--root", node.root, "--name", "ck", "--leave-running",
                       fault="checkpoint:dumping:sleep1.5")
    node.wait_phase("checkpoint", "dumping", pid=first.pid)
    second = node.migrt("checkpoint", b, "--root", node.root, "--name", "ck", "--leave-running", check=False)
    assert second.returncode == 6 and "checkpoint ck is being written by another process" in second.stderr, \
        second.stderr
    assert first.wait(120) == 0
    node.assert_running(a)
    node.assert_running(b)
    node.assert_clean_store()
    assert node.listed() == ["ck"]


def test_rm_during_restore_waits_or_refuses(node):
    cid = node.run(mb=5)
    node.migrt("checkpoint", cid, "--root", node.root, "--name", "ck", "--leave-running")
    restore = node.spawn("restore", "ck", node.id("dst"), "--bundle", f"{node.base}/bundle-{cid}", "--root", node.root,
                         "--output", f"{node.base}/dst.out", fault="restore:restoring:sleep3")
    node.outputs[node.id("dst")] = f"{node.base}/dst.out"
    node.wait_phase("restore", "restoring", pid=restore.pid)
    refused = node.migrt("rm", "ck", "--wait", "0.5", check=False)
    assert refused.returncode == 6, refused.stderr
    assert f"checkpoint ck is being read or written by another process (held by pid {restore.pid} " in refused.stderr
    assert "after waiting 0.5 s" in refused.stderr
    assert node.listed() == ["ck"]
    waited = node.migrt("rm", "ck", "--wait", "60")  # waits for the restore, then removes
    assert restore.wait(60) == 0, restore.stderr.read()
    assert "removed ck" in waited.stderr
    node.assert_running(node.id("dst"))  # restored from a checkpoint that was not deleted under it
    assert node.listed() == []
    node.assert_clean_store()
    assert not os.path.exists(os.path.join(node.store, "ck"))
