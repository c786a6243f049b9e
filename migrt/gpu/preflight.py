"""Before a GPU checkpoint is restored: may it go onto these GPUs, and how do old GPUs map to new?

Checks, each a PreconditionFailed naming what differs (nothing has been touched yet):
  - this node has an NVIDIA driver, not older than the one the checkpoint was taken with;
  - the new container gets as many GPUs as the checkpoint's container had, all on this node;
  - pair by pair the same model;
  - each new GPU has the free memory the checkpoint's processes held on its old GPU.
Pairing: both sides in PCI bus order, which is CUDA's device order for GPUs of one model, so that
`cuda:0` of the process is `cuda:0` again. The pairs cover every GPU the process could see, as the
driver demands.
"""

from __future__ import annotations

from dataclasses import dataclass

from migrt.errors import PreconditionFailed
from migrt.gpu.backend import Remap, uuid_bytes
from migrt.gpu.inventory import Inventory, parse_version

GIB = 1 << 30


@dataclass
class Placement:
    pairs: list[tuple[str, str]]  # (old UUID, new UUID), text form

    @property
    def moved(self) -> bool:
        return any(o.lower() != n.lower() for o, n in self.pairs)

    def remap(self) -> Remap | None:
        """The driver's pairs, or None when every GPU stays (no remap needed)."""
        if not self.moved:
            return None
        return [(uuid_bytes(o), uuid_bytes(n)) for o, n in self.pairs]

    def to_dict(self) -> list[dict]:
        return [{"old": o, "new": n} for o, n in self.pairs]


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def memory_per_gpu(section: dict) -> dict[str, int]:
    """GPU UUID -> bytes the checkpoint's processes held on it (known amounts only)."""
    out: dict[str, int] = {}
    for p in section.get("processes") or []:
        for uuid, n in (p.get("gpu_memory") or {}).items():
            if isinstance(n, int):
                out[uuid.lower()] = out.get(uuid.lower(), 0) + n
    return out


def check(section: dict, inv: Inventory, targets: list[str] | None, *, what: str,
          keep_order: bool = False) -> Placement:
    """keep_order: pair the checkpoint's GPUs, in their recorded order, with targets in the order given
    (a person naming GPUs for `migrt gpu resume --gpus`), instead of both in PCI order."""
    nproc = len(section.get("processes") or [])
    old = [g for g in section.get("gpus") or [] if isinstance(g, dict) and g.get("uuid")]
    if not inv.available:
        raise PreconditionFailed(f"{what} holds the GPU state of {nproc} CUDA process(es), but this node has no "
                                 f"usable NVIDIA driver ({inv.error}); restore it on a GPU node")
    need_v, have_v = section.get("driver_version"), inv.driver_version
    if parse_version(need_v) and parse_version(have_v) and parse_version(have_v) < parse_version(need_v):
        raise PreconditionFailed(f"{what} was taken with NVIDIA driver {need_v}; this node has {have_v}, which is "
                                 f"older; restore on a node with driver {need_v} or newer")
    if targets is None:
        missing = [g["uuid"] for g in old if inv.by_uuid(g["uuid"]) is None]
        if missing:
            raise PreconditionFailed(
                f"{what}: the new container's config.json does not say which GPUs it gets (no /dev/nvidiaN "
                f"device, NVIDIA_VISIBLE_DEVICES or CDI annotation), and the checkpoint's GPU(s) "
                f"{', '.join(missing)} are not on this node; give the container its GPUs")
        targets = [g["uuid"] for g in old]
    unknown = [t for t in targets if inv.by_uuid(t) is None]
    if unknown:
        raise PreconditionFailed(f"{what}: GPU(s) {', '.join(unknown)} of the new container are not on this node")
    new = [g for g in map(inv.by_uuid, targets) if g is not None]  # all of them: unknown is empty
    if len(new) != len(old):
        raise PreconditionFailed(
            f"{what} ran on {len(old)} GPU(s) ({', '.join(str(g.get('name')) for g in old) or 'none recorded'}); "
            f"the new container gets {len(new)} ({', '.join(g.name for g in new) or 'none'}); "
            "give it as many GPUs as the checkpoint had")
    if keep_order:
        old_sorted, new_sorted = old, new
    else:
        old_sorted = sorted(old, key=lambda g: str(g.get("pci_bus_id") or "").lower())
        new_sorted = sorted(new, key=lambda g: g.pci_bus_id.lower())
    for i, (o, n) in enumerate(zip(old_sorted, new_sorted, strict=True)):
        if o.get("name") and o["name"] != n.name:
            raise PreconditionFailed(f"{what}: GPU model mismatch: checkpoint GPU {i} was {o['name']} ({o['uuid']}), "
                                     f"the new container's GPU {i} is {n.name} ({n.uuid}); restore onto the same model")
    need = memory_per_gpu(section)
    for o, n in zip(old_sorted, new_sorted, strict=True):
        want = need.get(o["uuid"].lower())
        if want and n.memory_free is not None and n.memory_free < want:
            raise PreconditionFailed(f"{what}: GPU {n.uuid} has {_gib(n.memory_free)} free; the checkpoint's "
                                     f"processes held {_gib(want)} on their GPU {o['uuid']}; free memory there first")
    return Placement(pairs=[(o["uuid"], n.uuid) for o, n in zip(old_sorted, new_sorted, strict=True)])
