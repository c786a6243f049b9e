"""A Client for a reference, with the credentials and CA bundle the migrt config names, and the
whole-operation deadline every push and pull runs under (no registry operation runs without one).

The deadline of `migrt push` / `migrt pull`: `--timeout SECONDS` as a plain wall-clock budget; without
it, `registry_timeout` (the create path's budget, 60 s) for the exchange of manifests, tokens and
configs, plus the data's size at WHOLE_RATE, added once that size is known and before any of it moves
(a pull: after its manifest and config, from what remains to fetch; a push: the checkpoint's size).
A registry that trickles a manifest is cut at registry_timeout, as a create's pull is; a 16 GiB image
gets 60 s + 34 min.
"""

from __future__ import annotations

from migrt.config import Config
from migrt.registry import auth
from migrt.registry.client import Client, Deadline
from migrt.registry.reference import Reference

WHOLE_RATE = 8 << 20  # bytes/s: the slowest whole push or pull the default deadline carries


def deadline_for(cfg: Config, command: str, timeout: float | None = None) -> Deadline:
    """The whole deadline of a CLI push or pull (module docstring)."""
    then = ("blobs already sent stay in the registry and the next push skips them" if command.endswith("push")
            else None)
    if timeout:
        return Deadline.after(timeout, f"{command} --timeout", then=then)
    return Deadline.after(cfg.registry_timeout, f"{command} --timeout; by default registry_timeout in the migrt "
                          f"config, plus the image's size at {WHOLE_RATE >> 20} MiB/s", rate=WHOLE_RATE, then=then)


def credentials_for(auth_file: str | None, ref: Reference) -> auth.Credentials | None:
    """The node's credentials for the registry of `ref`: by its name, else by its API host."""
    return auth.load(auth_file, ref.registry) or (
        auth.load(auth_file, ref.api_host) if ref.api_host != ref.registry else None)


def client_for(cfg: Config, ref: Reference, *, deadline: Deadline, push: bool = False) -> Client:
    creds = credentials_for(cfg.registry_auth_file, ref)
    client = Client(ref, credentials=creds, ca_file=cfg.registry_ca_file, push=push, deadline=deadline)
    try:
        client.ping()
    except BaseException:
        client.close()
        raise
    return client
