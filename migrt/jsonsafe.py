"""Bounded JSON: the one reader for JSON that migrt did not write itself in this process (a
container's or an application hook's answer, a peer's message, a registry's manifest, a checkpoint
archive's metadata, a state file under /run or in the store).

The rule: text longer than `max_bytes`, or nested deeper than `max_depth` arrays and objects, is
refused before the standard decoder sees it (the C decoder recurses once per level: 60,000 `[` raise
RecursionError, which no caller expects). Depth is counted in one linear pass over the text with
its strings blanked, so a hostile text costs time in proportion to its length, never stack.

Refusals are `JSONRejected`, a `json.JSONDecodeError` (so a `ValueError`): every caller's existing
"not JSON" branch takes them. Standard library only (the shim and the CRIU hook use it).
"""

from __future__ import annotations

import json
import re

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import IO, Any

MAX_DEPTH = 64
MAX_BYTES = 16 << 20
# a JSON string (escapes included); what is inside cannot open or close a level. One unterminated
# runs to the end of the text (possessive, never failing): a failed match would be retried from
# every later quote, quadratic in an opening quote and escaped quotes (80 KB took 21 s)
_STRING = re.compile(r'"(?:[^"\\]|\\.?)*+(?:"|\Z)', re.DOTALL)
_LEVEL = re.compile(r"[\[\]{}]")


class JSONRejected(json.JSONDecodeError):
    """Text refused for its size or depth before it was decoded."""

    def __init__(self, msg: str, doc: str = "", pos: int = 0) -> None:
        super().__init__(msg, doc[:0], pos)  # not the (possibly huge, hostile) document itself


def depth(text: str, limit: int = MAX_DEPTH) -> int:
    """How deep arrays and objects nest in `text` (JSONRejected once past `limit`)."""
    level = peak = 0
    for m in _LEVEL.finditer(_STRING.sub('""', text)):
        if m.group() in "[{":
            level += 1
            if level > limit:
                raise JSONRejected(f"nested deeper than {limit} levels", "", m.start())
            peak = max(peak, level)
        else:
            level -= 1
    return peak


def loads(data: str | bytes | bytearray, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads with a size and a depth limit (JSONRejected beyond them; JSONDecodeError, a
    ValueError, for text that is not JSON; UnicodeDecodeError, also one, for bytes not UTF-8)."""
    if len(data) > max_bytes:
        raise JSONRejected(f"{len(data)} bytes; at most {max_bytes} accepted")
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    if text.count("[") + text.count("{") > max_depth:  # fewer openings cannot nest deeper: no pass needed
        depth(text, max_depth)
    return json.loads(text)


def load(fh: IO, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """json.load of an open file (text or binary) under the same limits; reads at most max_bytes + 1."""
    data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise JSONRejected(f"more than {max_bytes} bytes; at most {max_bytes} accepted")
    return loads(data, max_bytes=max_bytes, max_depth=max_depth)
