"""The lower runtime's errors as users read them: runc's logfmt stderr reduced to its message."""

from __future__ import annotations

import pytest

from migrt.errors import NotFound
from migrt.runtime.runc import LowerRuntime, runc_message


def test_runc_message_takes_the_msg_of_a_logfmt_line():
    line = 'time="2026-11-24T07:47:11Z" level=error msg="container \\"x\\" does not exist"'
    assert runc_message(line) == 'container "x" does not exist'
    assert runc_message("plain text from another runtime") == "plain text from another runtime"


def test_state_of_a_missing_container_names_it_and_the_root_without_runc_noise(tmp_path):
    fake = tmp_path / "runc"
    fake.write_text('#!/bin/sh\necho \'time="2026-11-24T07:47:11Z" level=error msg="container does not exist"\' >&2\n'
                    "exit 1\n")
    fake.chmod(0o755)
    with pytest.raises(NotFound) as exc:
        LowerRuntime(str(fake)).state(str(tmp_path / "root"), "web")
    assert str(exc.value) == f"container web under {tmp_path / 'root'}: container does not exist (runc state)"
