"""CRIU options as one flat value. They must match between dump and restore, so the manifest
records them and restore reuses them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class CriuOptions:
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    file_locks: bool = False

    def runc_flags(self) -> list[str]:
        """The runc flags (checkpoint and restore spell them the same)."""
        return [f"--{f.name.replace('_', '-')}" for f in fields(self) if getattr(self, f.name)]

    def to_dict(self) -> dict[str, bool]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> CriuOptions:
        data = data or {}
        return cls(**{f.name: bool(data.get(f.name, False)) for f in fields(cls)})

    def merged(self, **overrides: bool) -> CriuOptions:
        base = self.to_dict()
        base.update({k: v for k, v in overrides.items() if v})
        return CriuOptions(**base)
