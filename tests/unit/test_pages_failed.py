"""A restore through the page filler that fails gives one answer whichever side saw the failure first
(migrt/ops/pages.py failed, called at restore's one boundary): a chunk that did not verify is the
reason (CheckpointInvalid, exit 4, the file and bytes) whether runc restore returned before the
filler's verdict or CRIU was killed by the filler's guard mid-restore (RuntimeFailed from runc)."""

from __future__ import annotations

from migrt.errors import CheckpointInvalid, RuntimeFailed
from migrt.ops import pages

MISMATCH = "checkpoint ck: sha256 mismatch in images/pages-1.img at bytes 67108864-134217727"


class _Fill:
    def __init__(self, status: dict) -> None:
        self._status = status
        self.aborted = False

    def status(self) -> dict:
        return dict(self._status)

    def abort(self) -> None:
        self.aborted = True


def test_criu_killed_mid_restore_by_a_failed_verification_reports_the_mismatch():
    fill = _Fill({"state": "failed", "error": "the page filler failed (exit 1)", "verify": {"error": MISMATCH}})
    exc = RuntimeFailed("runc restore failed: criu was killed")
    cause = pages.failed(fill, exc, "ck")
    assert isinstance(cause, CheckpointInvalid) and cause.exit_code == 4
    assert MISMATCH in str(cause) and "migrt inspect --verify ck" in str(cause)
    assert fill.aborted


def test_a_failure_that_is_no_verification_stays_what_it_was():
    fill = _Fill({"state": "failed", "error": "cannot map pages-1.img"})
    exc = RuntimeFailed("runc restore failed")
    assert pages.failed(fill, exc, "ck") is None and fill.aborted
    # already the verification's own error (from check/wait_all): nothing to replace
    fill = _Fill({"state": "failed", "verify": {"error": MISMATCH}})
    assert pages.failed(fill, pages.verify_failed("ck", MISMATCH), "ck") is None
