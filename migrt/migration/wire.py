"""The wire between two nodes (stdlib only): a framed TCP protocol, HMAC challenge-response
authentication with a shared key (optionally inside mutual TLS), and file streaming with sha256
computed on the fly.

The public surface: `Channel` (an authenticated connection), `connect`, `accept`, `parse_address`,
`load_key`, and `TransferError` (a network or protocol failure, raised at this boundary only).
"""

from migrt.migration.channel import Channel, accept, connect, parse_address
from migrt.migration.protocol import PROTOCOL, TransferError, load_key

__all__ = ["PROTOCOL", "Channel", "TransferError", "accept", "connect", "load_key", "parse_address"]
