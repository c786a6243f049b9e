"""A post-restore the application did not answer is logged, and the resume goes on. The log line's
field was named `event`, which is the logger's own first argument: every such resume raised
TypeError (found by mypy, tests/unit/test_lint.py)."""

from __future__ import annotations

import json

from migrt import log
from migrt.gpu import apphooks
from migrt.gpu.fake import FakeGpuBackend
from migrt.ops.gpu_steps import GpuSuspension


class _Unanswered:
    """A gate whose processes did not answer post-restore."""

    def after(self, reason: str, what: str) -> list[str]:
        return ["pid 42: no answer in 1 s"]


def test_an_unanswered_post_restore_is_logged_and_the_resume_finishes(tmp_path):
    path = tmp_path / "migrt.log"
    log.setup(str(path), "info")
    try:
        sus = GpuSuspension(pids=[], backend=FakeGpuBackend(), section={}, gate=_Unanswered(), what="web-1")
        sus.resume()
    finally:
        log.setup(None)
    assert sus.gate is None
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    warned = [x for x in lines if x["event"] == "app_hook_unanswered"]
    assert warned and warned[0]["hook_event"] == apphooks.POST
    assert warned[0]["problems"] == ["pid 42: no answer in 1 s"] and warned[0]["container"] == "web-1"
