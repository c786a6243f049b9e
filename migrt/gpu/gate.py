"""Before the GPU lock, the same two questions on every path that takes a container's GPU state
(migrt checkpoint, migrt-runc checkpoint, migrt gpu suspend, pause with GPU release, migrate, the
CRIU hook); nothing is frozen when either says no:

  1. peer state (gpu/peers.py): a CUDA process holding what the driver cannot restore is refused,
     the processes that registered the application hook counted as clean for now;
  2. the application hook (gpu/apphooks.py): every registered process answers "pre-checkpoint" ok
     in time, or the checkpoint is refused (and the processes asked are told "aborted").
The peer rule runs first, so that a job refused anyway never tears its communicators down. When
both pass, the registered processes have acknowledged, which is what (1) assumed of them.
Standard library only (the CRIU hook uses it).
"""

from __future__ import annotations

from dataclasses import dataclass

from migrt.gpu import apphooks, peers


@dataclass
class Gate:
    notified: apphooks.Notified
    verdict: peers.Verdict

    def record(self) -> dict:
        """What the GPU record keeps of it: findings let through (and why), the processes told."""
        out: dict = {}
        if self.verdict.findings:
            out["peer_findings"] = [f.to_dict() for f in self.verdict.findings]
        if self.notified.endpoints:
            out["app_hook"] = self.notified.to_dict()
        return out

    def after(self, reason: str, what: str) -> list[str]:
        """post-restore to the processes told pre-checkpoint (resumed here, or aborted)."""
        return self.notified.after(reason, what=what) if self.notified.endpoints else []


def check_peers(pids: list[int], *, what: str, driver_version: str | None, config: dict | None = None,
                peer_check: str = "refuse", registered: set[int] | None = None,
                contexts: dict[int, list[str]] | None = None, proc: str | None = None) -> peers.Verdict:
    """(1) alone: PeerStateRefused, or the verdict (findings let through included). contexts: the
    driver's GPUs per process (Inventory.contexts()), None when not known."""
    if registered is None:
        registered = {p for ep in apphooks.find(pids, proc) for p in ep.holders}
    verdict = peers.assess(pids, driver_version=driver_version, hooked=registered, registered=registered,
                           declared_off=peer_check == "warn" or peers.annotation_off(config), contexts=contexts,
                           proc=proc)
    peers.refuse(verdict, what, driver_version)
    return verdict


def before_lock(pids: list[int], *, what: str, driver_version: str | None, config: dict | None = None,
                peer_check: str = "refuse", timeout_s: float = apphooks.DEFAULT_TIMEOUT_S,
                contexts: dict[int, list[str]] | None = None, proc: str | None = None) -> Gate:
    """(1) then (2); raises PeerStateRefused or HookRefused (both PreconditionFailed, exit 8)."""
    endpoints = apphooks.find(pids, proc)
    registered = {p for ep in endpoints for p in ep.holders}
    verdict = check_peers(pids, what=what, driver_version=driver_version, config=config, peer_check=peer_check,
                          registered=registered, contexts=contexts, proc=proc)
    notified = apphooks.before_checkpoint(pids, what=what, timeout_s=timeout_s, proc=proc, endpoints=endpoints)
    return Gate(notified=notified, verdict=verdict)
