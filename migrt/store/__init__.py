"""The checkpoint store: layout, manifest, atomic commit, verification, locks."""

from migrt.store.store import Checkpoint, Staging, Store

__all__ = ["Checkpoint", "Staging", "Store"]
