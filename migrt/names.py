"""Checkpoint names: lower-case letters, digits, '.', '_', '-'; start and end with a letter or digit;
at most 128 characters. Anything else (paths, '..', absolute paths) is refused.

Container ids, before any of them becomes a path (`<runc root>/<id>/...`): runc's own rule
(libcontainer's validateID: `^[\\w+-\\.]+$`, ASCII, i.e. letters, digits and `_ + , - .`; not `.` or
`..`), and at most 255 characters (one path component). An id runc would refuse to create cannot
name a container, so a refused one never hides a real container. Stdlib only."""

from __future__ import annotations

import re

from migrt.errors import InvalidName
from migrt.text import printable

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import TypeGuard

MAX_LEN = 128
_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,126}[a-z0-9])?$")
MAX_ID_LEN = 255
_ID = re.compile(r"[\w+,\-.]+", re.ASCII)  # runc: ^[\w+-\.]+$ (the class's '+-.' is the range + , - .)


def is_container_id(cid: object) -> TypeGuard[str]:
    """Whether cid is an id runc accepts (module docstring): safe as one path component."""
    return (isinstance(cid, str) and 0 < len(cid) <= MAX_ID_LEN and cid not in (".", "..")
            and _ID.fullmatch(cid) is not None)


def container_id(cid: object) -> str:
    """cid, checked before it becomes a path; InvalidName (exit 2) naming it, escaped, otherwise."""
    if is_container_id(cid):
        return cid
    raise InvalidName(f"invalid container id {printable(repr(cid), 100)}: runc's container ids are ASCII letters, "
                      "digits and '_', '+', ',', '-', '.' (not '.' or '..', no '/'); 'runc list' (with its --root) "
                      "shows the ids of this node")


def validate(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidName("checkpoint name is empty")
    if len(name) > MAX_LEN:
        raise InvalidName(f"checkpoint name is {len(name)} characters long; at most {MAX_LEN} allowed")
    if not _NAME.fullmatch(name) or ".." in name:  # fullmatch: `$` would accept a trailing newline
        raise InvalidName(
            f"invalid checkpoint name {name!r}: use lower-case letters, digits, '.', '_' and '-', "
            "starting and ending with a letter or digit (no paths)"
        )
    return name


def sanitize(text: str) -> str:
    """Turn free text (a container id) into a valid name fragment."""
    out = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("._-")
    out = re.sub(r"\.{2,}", ".", out)
    return out[:100].strip("._-") or "ckpt"
