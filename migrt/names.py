"""Checkpoint names: lower-case letters, digits, '.', '_', '-'; start and end with a letter or digit;
at most 128 characters. Anything else (paths, '..', absolute paths) is refused. Stdlib only."""

from __future__ import annotations

import re

from migrt.errors import InvalidName

MAX_LEN = 128
_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,126}[a-z0-9])?$")


def validate(name: str) -> str:
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
