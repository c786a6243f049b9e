"""Registry credentials from a docker-style auth file (`config.json`, the file `docker login`,
`podman login --authfile` and `oras login` write), named by the migrt config's `registry_auth_file`.

  {"auths": {"registry.example": {"auth": "<base64 user:password>"}}}
  {"auths": {"registry.example": {"username": "u", "password": "p"}}}

Keys are matched by host[:port], also in the `https://host/...` form docker writes (Docker Hub:
`https://index.docker.io/v1/`). Credential helpers (`credsStore`, `credHelpers`) run programs that
migrt does not run on a node: an entry found only there is reported, not guessed. Passwords never
come from the command line.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from migrt import jsonsafe, trust
from migrt.errors import ConfigError

MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic_header(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


def _keys(host: str) -> list[str]:
    keys = [host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"https://{host}/v2/"]
    if host in ("docker.io", "registry-1.docker.io", "index.docker.io"):
        keys += ["https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io"]
    return keys


def load(auth_file: str | None, host: str) -> Credentials | None:
    """Credentials for `host` (None: anonymous). ConfigError for an unreadable or malformed file."""
    if not auth_file:
        return None
    try:
        # like ssh with a private key: root's (or ours) alone, written and read by nobody else (migrt/trust.py)
        data = jsonsafe.loads(trust.read(auth_file, "registry auth file", secret=True, limit=MAX_BYTES))
    except FileNotFoundError as exc:
        raise ConfigError(f"registry auth file {auth_file} (registry_auth_file in the migrt config) does not "
                          "exist") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"registry auth file {auth_file} is unreadable or not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"registry auth file {auth_file}: a JSON object is expected")
    auths = data.get("auths") or {}
    if not isinstance(auths, dict):
        raise ConfigError(f"registry auth file {auth_file}: 'auths' must be an object")
    for key in _keys(host):
        entry = auths.get(key)
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise ConfigError(f"registry auth file {auth_file}: entry {key!r} must be an object")
        return _entry(entry, key, auth_file)
    helpers = data.get("credHelpers")
    if isinstance(helpers, dict) and any(k in helpers for k in _keys(host)):
        raise ConfigError(f"registry auth file {auth_file}: {host} uses a credential helper, which migrt does not "
                          "run; write the credentials into 'auths' (e.g. 'podman login --authfile')")
    return None


def _entry(entry: dict, key: str, auth_file: str) -> Credentials | None:
    if entry.get("identitytoken"):
        raise ConfigError(f"registry auth file {auth_file}: entry {key!r} holds an identity token (OAuth refresh "
                          "token), which migrt does not support; use a user name and password or robot token")
    if isinstance(entry.get("auth"), str) and entry["auth"]:
        try:
            user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ConfigError(f"registry auth file {auth_file}: entry {key!r}: 'auth' is not base64 of "
                              "user:password") from exc
        if not sep:
            raise ConfigError(f"registry auth file {auth_file}: entry {key!r}: 'auth' is not base64 of user:password")
        return Credentials(user, password)
    if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
        return Credentials(entry["username"], entry["password"])
    return None
