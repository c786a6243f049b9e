"""Which node agents a pod may make this node pull from (`migrt.io/migrate-from`,
`MIGRT_MIGRATE_FROM`): the entries of the config's `migrate_peers`, checked before anything is
resolved or contacted. Stdlib only.

The rule:
  - An entry is ADDRESS[:PORT]. ADDRESS is an IP address, a CIDR block (10.0.0.0/24, fd00::/64; an
    IPv6 one in brackets when a port follows: [fd00::/64]:7171), a host name (node-a.example), or
    every name under a domain (*.nodes.example: one or more labels before it). PORT is a number or
    '*' (any); without one, 7070, the agent's default port (as in a migrate-from value).
  - A pod's address matches by what it is written as. An IP literal matches address and CIDR
    entries only (an IPv4-mapped IPv6 address as its IPv4 address; a scoped IPv6 address,
    fe80::1%eth0, never). A host name matches name entries only, compared as written (any case, a
    trailing dot ignored): it is never resolved to be checked, so the check makes no DNS query; it
    is resolved only when the pull connects, once it matched. Numbers that only the C resolver
    reads as addresses (127.1, 0x7f000001, 2130706433) are names here and match nothing: a name
    entry's last label starts with a letter.
  - No entry (the default) refuses every pull.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

DEFAULT_PORT = 7070  # pull.DEFAULT_AGENT_PORT
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NAME = re.compile(rf"(?:{_LABEL}\.)*[A-Za-z](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?")
_POD_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Peer:
    net: Network | None  # an address (a /32 or /128) or a block
    name: str | None     # lower case; "*.domain" for every name under domain
    port: int | None     # None: any port


def _split(text: str) -> tuple[str, str | None]:
    """(host, port or None) of host[:port], [v6][:port] or a bare IPv6 address or block."""
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise ValueError("an unclosed '[' or text after ']'")
        return host, rest[1:] if rest else None
    if text.count(":") > 1:
        return text, None
    host, sep, port = text.partition(":")
    return host, port if sep else None


def _port(port: str | None) -> int | None:
    if port is None:
        return DEFAULT_PORT
    if port == "*":
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"port {port!r} is not a number from 1 to 65535 or '*'")
    return int(port)


def parse_entry(text: object) -> Peer:
    """One migrate_peers entry; ValueError saying what is wrong with it."""
    if not isinstance(text, str) or not text:
        raise ValueError("not a non-empty string")
    host, port = _split(text)
    if "%" in host:
        raise ValueError("a scoped IPv6 address (with '%') cannot be matched")
    if host and (host[0].isdigit() or ":" in host or "/" in host):
        try:
            return Peer(ipaddress.ip_network(host, strict=True), None, _port(port))
        except ValueError as exc:
            if "/" in host or ":" in host or host.replace(".", "").isdigit():
                raise ValueError(f"{host!r} is not an IP address or CIDR block ({exc})") from None
    name = host.lower().rstrip(".")
    bare = name[2:] if name.startswith("*.") else name
    if not _NAME.fullmatch(bare) or len(bare) > 253:
        raise ValueError(f"{host!r} is not an IP address, a CIDR block or a host name (a name's last label "
                         "starts with a letter; '*.' may lead it)")
    return Peer(None, name, _port(port))


def _pod_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def allowed(address: str, entries: list[str]) -> bool:
    """Whether a pod may name the agent at `address` ("host:port", "[v6]:port"), by the rule above.
    Looks nothing up."""
    try:
        host, port_text = _split(address)
        port = int(port_text) if port_text and port_text.isdigit() else None
    except ValueError:
        return False
    if not host or port is None or "%" in host:
        return False
    ip = _pod_ip(host)
    name = host.lower().rstrip(".") if ip is None and _POD_NAME.fullmatch(host.rstrip(".")) else None
    for entry in entries:
        try:
            peer = parse_entry(entry)
        except ValueError:
            continue  # config.py refuses these; never a match
        if peer.port is not None and peer.port != port:
            continue
        if ip is not None and peer.net is not None and ip.version == peer.net.version and ip in peer.net:
            return True
        if name is not None and peer.name is not None and _name_matches(name, peer.name):
            return True
    return False


def _name_matches(name: str, pattern: str) -> bool:
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern
