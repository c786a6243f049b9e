"""Text from outside migrt (a registry's error body, an application hook's answer, a peer's message,
a container id from a command line), made safe to put into a message: a terminal must never receive
escape sequences or control characters through a CLI error, a runc log line that containerd shows,
or a JSON log read with `less`; and a message stays one readable line. The one helper for that.
Standard library only."""

from __future__ import annotations


def printable(text: object, limit: int = 300) -> str:
    """At most `limit` characters of str(text), every non-printable character (control characters,
    ESC, newlines, bidirectional overrides) written as a \\x.. / \\u.... escape; '...' marks a cut."""
    s = text if isinstance(text, str) else str(text)
    cut = len(s) > limit
    s = s[:limit]
    out = "".join(c if c.isprintable() else _escape(c) for c in s)
    return out + ("..." if cut else "")


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
