"""Wire format and authentication of migrt's transfer protocol (version 2).

A connection carries frames and, after a `file` message, that file's raw bytes:

    frame     = type (u8) | length (u32, big endian) | payload
    type 1    = HELLO/AUTH JSON (before authentication; payload is UTF-8 JSON)
    type 2    = sealed JSON: payload = HMAC-SHA256(session key, direction | seq (u64) | json) | json

Handshake (the receiver is the server, the sender the client; key = the shared secret):

    C -> S  {"type": "hi", "proto": 2}      (without TLS; with TLS the client's first bytes are its ClientHello)
    S -> C  {"type": "hello", "proto": 2, "challenge": cs}
    C -> S  {"type": "auth", "proto": 2, "challenge": cc, "mac": HMAC(key, "migrt-client" | cs | cc)}
    S -> C  {"type": "welcome", "mac": HMAC(key, "migrt-server" | cs | cc)}     (or an error, then close)

Both sides prove they hold the key; neither sends it. session key = HMAC(key, "migrt-session" | cs | cc);
every later JSON message is sealed with it and numbered, so it cannot be altered, replayed or reordered.
File bytes are not sealed one by one: the sealed `commit` message carries the sha256 of every file,
and the receiver checks what it received against them before anything becomes visible.
Without TLS the bytes travel in clear (authenticated, not secret).

Version 2 added `alive` messages (a busy side's heartbeat; see Channel.busy) and `query` (a source
that lost its connection asks the receiver, on a new one, whether it runs the container); version 1
peers are refused at the handshake with a clear message.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

from migrt import jsonsafe, trust
from migrt.errors import ConfigError, MigrtError
from migrt.text import printable

PROTOCOL = 2
HEADER = struct.Struct("!BI")
PLAIN, SEALED = 1, 2
MAX_JSON = 8 << 20  # a manifest of many files stays far below this
MAX_HANDSHAKE = 4096  # frames before authentication (hi, hello, auth, welcome, a refusal): a few hundred bytes
MAC_LEN = 32
MIN_KEY = 16


class TransferError(MigrtError):
    """The peer is unreachable, refused us, failed authentication, or the stream broke."""

    exit_code = 9


class AuthError(TransferError):
    pass


def load_key(path: str | None) -> bytes:
    """The shared secret from `migration_key_file`: at least 16 bytes, in a file only root (or we) could
    have written and nobody else can read (migrt/trust.py; links are followed when they are ours too)."""
    if not path:
        raise ConfigError("no migration key: set 'migration_key_file:' in the config (a file holding a shared "
                          "secret, e.g. 'head -c 32 /dev/urandom | base64 > /etc/migrt/migration.key; "
                          "chmod 600 /etc/migrt/migration.key') on both nodes")
    try:
        # the file and every directory and link on its way: root's (or ours), written and read by nobody else
        data = trust.read(path, "migration key file", secret=True, limit=1 << 16).strip()
    except OSError as exc:
        raise ConfigError(f"migration key file {path} (migration_key_file in the migrt config): "
                          f"{exc.strerror or exc}") from exc
    if len(data) < MIN_KEY:
        raise ConfigError(f"migration key file {path}: the key must be at least {MIN_KEY} bytes")
    return data


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def client_proof(key: bytes, cs: bytes, cc: bytes) -> bytes:
    return _mac(key, b"migrt-client", cs, cc)


def server_proof(key: bytes, cs: bytes, cc: bytes) -> bytes:
    return _mac(key, b"migrt-server", cs, cc)


def session_key(key: bytes, cs: bytes, cc: bytes) -> bytes:
    return _mac(key, b"migrt-session", cs, cc)


def encode(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes) -> dict:
    try:
        obj = jsonsafe.loads(raw, max_bytes=MAX_JSON)  # bounded: ours nest a few levels at most
    except jsonsafe.JSONRejected as exc:
        raise TransferError(f"peer sent JSON nested too deeply or too large ({exc.msg})") from exc
    except ValueError as exc:
        raise TransferError(f"peer sent malformed JSON: {printable(exc, 200)}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise TransferError("peer sent a message without a type")
    return obj


class Sealer:
    """Seals (MAC + sequence number) the JSON messages of one direction of a connection."""

    def __init__(self, key: bytes, direction: bytes) -> None:
        self.key = key
        self.direction = direction
        self.seq = 0

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self.key, self.direction + struct.pack("!Q", self.seq) + body, hashlib.sha256).digest()

    def seal(self, body: bytes) -> bytes:
        tag = self._tag(body)
        self.seq += 1
        return tag + body

    def open(self, payload: bytes) -> bytes:
        tag, body = payload[:MAC_LEN], payload[MAC_LEN:]
        if len(tag) != MAC_LEN or not hmac.compare_digest(tag, self._tag(body)):
            raise AuthError("a message from the peer failed its integrity check (tampered, replayed or "
                            "from another session); transfer aborted")
        self.seq += 1
        return body
