"""One exception tree; each class carries the exit code the CLI and the shim use.

Exit codes (also in README "Exit codes"):
  0 ok | 1 unexpected error | 2 usage error | 3 not found | 4 checkpoint invalid or corrupted
  5 runtime or CRIU failed | 6 conflict (exists, locked, container state) | 7 configuration error
  8 precondition not met (e.g. GPU preflight) | 9 transfer failed (migration peer or registry:
  unreachable, refused, credentials denied, connection broken)
migrt-runc only, as a shell says it of a command: 126 the lower runtime could not be executed,
127 none found; after a failure of its own, the lower runtime's exit status (LowerRuntimeFailed).
"""

from __future__ import annotations


class MigrtError(Exception):
    exit_code = 1

    def __init__(self, message: str, *, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or []

    def __str__(self) -> str:  # message plus quoted details (e.g. CRIU error lines)
        if not self.details:
            return self.message
        return self.message + ": " + " | ".join(self.details)


class UsageError(MigrtError):
    exit_code = 2


class InvalidName(UsageError):
    pass


class NotFound(MigrtError):
    exit_code = 3


class CheckpointInvalid(MigrtError):
    exit_code = 4


class RuntimeFailed(MigrtError):
    exit_code = 5


class Conflict(MigrtError):
    exit_code = 6


class ConfigError(MigrtError):
    exit_code = 7


class PreconditionFailed(MigrtError):
    exit_code = 8


class StoreFull(PreconditionFailed):
    """The store's file system cannot hold what a writer is about to write (store/reserve.py): free
    and reserved (by other live writers) bytes, and who reserved them, for callers' own messages."""
    free = reserved = 0
    others: dict[str, dict[str, object]] = {}  # writer -> its entry (bytes, slack, pid, what)


class RegistryError(MigrtError):
    exit_code = 9


class LowerRuntimeFailed(RuntimeFailed):
    """migrt-runc ran the lower runtime and reports its failure with the lower runtime's exit status
    (containerd reads runc's): 126 when it could not be executed at all."""

    def __init__(self, message: str, *, exit_code: int = 126, details: list[str] | None = None) -> None:
        super().__init__(message, details=details)
        self.exit_code = exit_code


class NoLowerRuntime(MigrtError):
    """migrt-runc found no lower runtime to run (neither the config's `runtime:` nor runc on PATH)."""

    exit_code = 127
