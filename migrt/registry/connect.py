"""A Client for a reference, with the credentials and CA bundle the migrt config names."""

from __future__ import annotations

from migrt.config import Config
from migrt.registry import auth
from migrt.registry.client import Client, Deadline
from migrt.registry.reference import Reference


def client_for(cfg: Config, ref: Reference, *, push: bool = False, deadline: Deadline | None = None) -> Client:
    creds = auth.load(cfg.registry_auth_file, ref.registry) or (
        auth.load(cfg.registry_auth_file, ref.api_host) if ref.api_host != ref.registry else None)
    client = Client(ref, credentials=creds, ca_file=cfg.registry_ca_file, push=push, deadline=deadline)
    try:
        client.ping()
    except BaseException:
        client.close()
        raise
    return client
