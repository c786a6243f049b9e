"""CRIU's image files read without pycriu: the framing (magic words, then u32 size + protobuf
message, repeated) and the protobuf wire format (varint keys; varint, 64-bit, length-delimited and
32-bit values). Callers pick fields by number from the .proto files of CRIU's images/. Stdlib only:
importing pycriu (and protobuf) costs ~0.3 s on the restore path; the unit tests check the readers
built on this against pycriu on images CRIU and pycriu wrote.
"""

from __future__ import annotations

import os
import struct

MAGIC_COMMON, MAGIC_SERVICE = 0x54564319, 0x55105940


class ImageError(Exception):
    """A CRIU image migrt cannot read (the page filler also raises it for images it cannot fill)."""


def varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf):
            raise ImageError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 70:
            raise ImageError("overlong varint")


def _need(buf: bytes, i: int, n: int) -> None:
    if i + n > len(buf):
        raise ImageError("truncated protobuf field")


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) for every field; repeated fields appear several times."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wt = key >> 3, key & 7
        val: int | bytes
        if wt == 0:
            val, i = varint(buf, i)
        elif wt == 1:
            _need(buf, i, 8)
            val, i = struct.unpack_from("<Q", buf, i)[0], i + 8
        elif wt == 2:
            n, i = varint(buf, i)
            _need(buf, i, n)
            val, i = buf[i:i + n], i + n
        elif wt == 5:
            _need(buf, i, 4)
            val, i = struct.unpack_from("<I", buf, i)[0], i + 4
        else:
            raise ImageError(f"unsupported protobuf wire type {wt}")
        out.append((num, val))
    return out


def read_entries(path: str) -> list[bytes]:
    """The protobuf entries of a CRIU image file (magic(s), then u32 size + message, repeated)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ImageError(f"cannot read {os.path.basename(path)}: {exc.strerror}") from exc
    return split_entries(data, os.path.basename(path))[1]


def split_entries(data: bytes, name: str) -> tuple[bytes, list[bytes]]:
    """(the magic header, the entries) of a CRIU image's bytes: magic(s), then u32 size + message,
    repeated. ImageError naming `name` when it is cut short."""
    if len(data) < 4:
        raise ImageError(f"{name} is too short")
    head = 8 if struct.unpack_from("<I", data)[0] in (MAGIC_COMMON, MAGIC_SERVICE) else 4
    out = []
    i = head
    while i < len(data):
        if i + 4 > len(data):
            raise ImageError(f"{name}: truncated entry header")
        (n,) = struct.unpack_from("<I", data, i)
        if i + 4 + n > len(data):
            raise ImageError(f"{name}: truncated entry")
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return data[:head], out
