"""Image references: `[registry[:port]/]repository[:tag][@sha256:<hex>]`, as docker and the
distribution spec write them. Stdlib only.

Where a checkpoint *name* is expected (MIGRT_RESTORE, migrt.io/restore), an image reference is
written with the prefix `oci:` (`oci:registry.example/team/ckpt:v3`). Checkpoint names can never
contain ':' (migrt.names), so the two cannot be mistaken for each other.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from migrt.errors import UsageError

PREFIX = "oci:"
DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?")


@dataclass(frozen=True)
class Reference:
    registry: str          # host[:port] as written (docker.io for Docker Hub)
    repository: str        # team/ckpt
    tag: str | None
    digest: str | None     # sha256:...

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def target(self) -> str:
        """What goes after /manifests/: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def is_reference(text: str) -> bool:
    """True for a restore request that names an image (`oci:...`) rather than a checkpoint."""
    return isinstance(text, str) and text.startswith(PREFIX)


def parse(text: str) -> Reference:
    """Parse an image reference (with or without the `oci:` prefix); UsageError when malformed."""
    if not isinstance(text, str) or not text:
        raise UsageError("image reference is empty")
    raw = text[len(PREFIX):] if text.startswith(PREFIX) else text
    bad = UsageError(f"invalid image reference {text!r}: expected [registry[:port]/]repository[:tag][@sha256:<hex>], "
                     "e.g. registry.example/team/ckpt:v3")
    if len(raw) > 1024 or any(c.isspace() for c in raw):
        raise bad
    digest = None
    if "@" in raw:
        raw, digest = raw.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise bad
    tag = None
    slash = raw.rfind("/")
    colon = raw.rfind(":")
    if colon > slash:
        raw, tag = raw[:colon], raw[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise bad
    first, _, rest = raw.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, repo = first, rest
    else:
        registry, repo = DOCKER_HUB, raw
        if "/" not in repo:
            repo = f"library/{repo}"
    if not _HOST.fullmatch(registry) or not repo or len(repo) > 255:
        raise bad
    if not all(_COMPONENT.fullmatch(c) for c in repo.split("/")):
        raise bad
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry=registry, repository=repo, tag=tag, digest=digest)


def _host_port(hostport: str) -> tuple[str, str]:
    """('host', 'port') of host[:port] or [v6][:port]; the port defaults to https's 443."""
    if hostport.startswith("["):
        host, _, rest = hostport.partition("]")
        return host + "]", rest[1:] if rest.startswith(":") else "443"
    host, sep, port = hostport.rpartition(":")
    return (host, port) if sep else (hostport, "443")


def registry_allowed(ref: Reference, patterns: list[str]) -> bool:
    """Whether a reference's registry is one of `patterns` (the node's restore_registries): entries
    host[:port] or [v6-address][:port], where the host may hold shell-style wildcards ('*' matches any
    characters, dots included) and the port may be '*'; no port means 443. Docker Hub is 'docker.io'."""
    names = {ref.registry, ref.api_host}
    for pattern in patterns:
        p_host, p_port = _host_port(pattern.lower())
        for name in names:
            host, port = _host_port(name.lower())
            if (p_port == "*" or p_port == port) and (
                    host == p_host if p_host.startswith("[") else fnmatch.fnmatchcase(host, p_host)):
                return True
    return False
