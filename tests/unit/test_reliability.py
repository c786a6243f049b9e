"""Pieces of crash safety and store hygiene that need no container: the journal's staleness rule,
collapsed runtime errors, CRIU's first error, the size estimate's verdict, the fault seam."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from migrt import faults
from migrt.criu.logs import error_lines
from migrt.errors import PreconditionFailed
from migrt.ops import space
from migrt.runtime.runc import collapse_lines
from migrt.store import journal

ENOSPC_LINE = ('time="2026-11-24T06:40:0{}Z" level=error msg="Failed to write to log, write '
               '/s/work/runc.log: no space left on device"')


def test_repeated_runtime_lines_collapse_into_one_with_a_count():
    text = "\n".join([ENOSPC_LINE.format(i % 10) for i in range(40)] + ["criu failed: type DUMP errno 0"])
    out = collapse_lines(text)
    assert out.count("Failed to write to log") == 1 and "(x40)" in out
    assert out.endswith("criu failed: type DUMP errno 0")


def test_many_distinct_lines_are_bounded():
    out = collapse_lines("\n".join(f"line {i}" for i in range(50)))
    assert out.startswith("line 0 | line 1") and "46 more distinct line(s)" in out


def test_criu_first_error_is_always_quoted(tmp_path):
    log = tmp_path / "dump.log"
    lines = ["(00.1) Error (criu/page-xfer.c:1): Can't write pages: No space left on device"]
    lines += [f"(00.{i}) Error (criu/cr-dump.c:{i}): consequence {i}" for i in range(2, 12)]
    log.write_text("\n".join(lines) + "\n")
    out = error_lines(str(log))
    assert out[0].endswith("No space left on device") and "more error line(s)" in out[1]
    assert out[-1].endswith("consequence 11") and len(out) == 7


def test_criu_repeated_errors_collapse(tmp_path):
    log = tmp_path / "dump.log"
    log.write_text("(00.05) Error (criu/page-xfer.c:263): page-xfer: Unable to spice data: No space left on device\n"
                   + "".join(f"(00.0{i}) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device\n"
                             for i in range(6, 9))
                   + "(00.11) Error (criu/cr-dump.c:1975): Dumping FAILED.\n")
    out = error_lines(str(log))
    assert len(out) == 3 and out[1].endswith("Error flushing image: No space left on device (x3)")
    assert out[0].endswith("Unable to spice data: No space left on device") and out[2].endswith("Dumping FAILED.")


def test_space_check_names_the_numbers(tmp_path):
    est = space.Estimate(memory=900 << 20, tmpfs=50 << 20, gpu=0, processes=3)
    free = space.free_bytes(str(tmp_path))
    space.check(str(tmp_path), space.Estimate(memory=1 << 20), "checkpoint of container c")  # fits
    huge = space.Estimate(memory=free * 2)
    with pytest.raises(PreconditionFailed, match=r"checkpoint of container c: the store .* has \d+ MiB free, the "
                                                 r"checkpoint needs about \d+ MiB \(memory \d+ MiB, tmpfs 0 MiB.*"
                                                 r"nothing was frozen") as info:
        space.check(str(tmp_path), huge, "checkpoint of container c")
    assert info.value.exit_code == 8
    assert est.needed == int((950 << 20) * 1.1) + space.SLACK


def test_estimate_of_a_process_tree_counts_its_anonymous_memory():
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 << 20); import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        import time

        deadline = time.monotonic() + 10
        est = space.estimate(child.pid)
        while est.memory < (60 << 20) and time.monotonic() < deadline:
            time.sleep(0.05)
            est = space.estimate(child.pid)
        assert (60 << 20) <= est.memory < (200 << 20), est
    finally:
        child.stdin.close()
        child.wait(10)


def test_journal_entry_is_stale_once_its_owner_is_gone(tmp_path):
    store = str(tmp_path)
    live = journal.begin(store, "checkpoint", container="c1")
    assert [(e["op"], e["stale"]) for e in journal.entries(store)] == [("checkpoint", False)]
    assert list(journal.take_stale(store)) == []  # a live owner's entry is never taken
    pid = os.fork()
    if pid == 0:
        journal.begin(store, "restore", container="c2")
        os._exit(0)  # dies holding it: the kernel drops the lock, the record stays
    os.waitpid(pid, 0)
    stale = {e["op"]: e["stale"] for e in journal.entries(store)}
    assert stale == {"checkpoint": False, "restore": True}
    [taken] = list(journal.take_stale(store))
    assert taken.data["container"] == "c2" and taken.phase == "started"
    taken.end()
    live.end()
    assert journal.entries(store) == [] and os.listdir(os.path.join(store, journal.DIR)) == []


def test_fault_seam_kills_fails_or_sleeps_only_where_named(monkeypatch):
    monkeypatch.setenv(faults.ENV, "checkpoint:dumped:fail,restore:x:sleep0.01")
    faults.point("checkpoint:dumping")  # not named: nothing
    faults.point("restore:x")
    with pytest.raises(faults.InjectedFault, match="checkpoint:dumped"):
        faults.point("checkpoint:dumped")
    code = subprocess.run([sys.executable, "-c", "from migrt import faults; faults.point('a:b'); print('alive')"],
                          env={**os.environ, faults.ENV: "a:b:kill"}, capture_output=True, text=True)
    assert code.returncode == -9 and code.stdout == ""
