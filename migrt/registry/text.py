"""Text a registry controls (error bodies, reason phrases, headers) is printed through migrt.text
(the one escaping helper)."""

from __future__ import annotations

from migrt.text import printable

__all__ = ["printable"]
