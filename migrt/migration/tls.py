"""Optional TLS around migration connections (stdlib ssl): mutual authentication with a private CA,
TLS 1.2 or newer. The HMAC handshake still runs inside it, so a node needs both the shared key and a
certificate from the CA; what TLS adds is confidentiality. Nodes are addressed by IP, so certificates
are not matched against host names: membership of the CA is the identity.

Config (both nodes):

    migration_tls:
      cert: /etc/migrt/tls/node.crt      this node's certificate (PEM)
      key: /etc/migrt/tls/node.key       its private key (PEM)
      ca: /etc/migrt/tls/ca.crt          the CA that signed every node's certificate
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

from migrt import trust
from migrt.errors import ConfigError
from migrt.migration.protocol import TransferError

FIELDS = ("cert", "key", "ca")


@dataclass(frozen=True)
class TLSFiles:
    cert: str
    key: str
    ca: str


def check_files(files: TLSFiles) -> None:
    """The key is a secret; the certificate and the CA decide whom this node talks to: all three must
    be files only root (or we) could have written (migrt/trust.py), the key readable by nobody else."""
    trust.check(files.cert, "migration_tls certificate")
    trust.check(files.key, "migration_tls private key", secret=True)
    trust.check(files.ca, "migration_tls CA")


def _context(files: TLSFiles, purpose: int) -> ssl.SSLContext:
    check_files(files)
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(files.cert, files.key)
        ctx.load_verify_locations(files.ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"migration_tls: cannot load {files.cert} / {files.key} / {files.ca}: {exc}") from exc
    return ctx


def wrap_client(sock: socket.socket, files: TLSFiles, peer: str) -> ssl.SSLSocket:
    ctx = _context(files, ssl.PROTOCOL_TLS_CLIENT)
    try:
        return ctx.wrap_socket(sock)
    except (ssl.SSLError, OSError) as exc:
        raise TransferError(f"TLS handshake with {peer} failed: {exc}; both nodes need 'migration_tls' with "
                            "certificates signed by the same CA") from exc


def wrap_server(sock: socket.socket, files: TLSFiles, peer: str) -> ssl.SSLSocket:
    ctx = _context(files, ssl.PROTOCOL_TLS_SERVER)
    try:
        return ctx.wrap_socket(sock, server_side=True)
    except (ssl.SSLError, OSError) as exc:
        raise TransferError(f"TLS handshake with {peer} failed: {exc} (a peer without TLS, or with a "
                            "certificate from another CA)") from exc
