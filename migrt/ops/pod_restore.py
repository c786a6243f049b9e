"""A pod checkpoint read back, and a create's restore of its part of it (issue 29).

The layout (ops/pod_checkpoint.py writes it): <store>/<name>/manifest.json lists the parts in its `pod`
section {namespace, name, parts: [{name, image, kind, container_id, size_bytes}]} and every part's files
in `files`; each part is a checkpoint's files under parts/<container>/ with its own manifest.json, read
as a checkpoint of its own (`part`: the pod's name and lock, the part's directory, manifest, images).

The rule of a pod-level restore (`migrt.io/restore=<pod checkpoint or oci:REF>` on a new pod: containerd
copies it into every container), at each container's create:
  1. with migrt.io/migrate-pod (the new pod's containers that take a part, `<name>=<image>,...`) the
     whole new pod is checked against the parts, names and images, so the first create refuses a pod
     that does not match before anything is restored; a container it leaves out starts fresh
     (oci/bundle.py); without it each create checks only itself;
  2. the part of the container's own name, refused when the checkpoint has none or had another image;
     a refusal gives up the pod's hold (it can never be whole);
  3. with several parts the pod is held (pods/hold.py): the part resumes frozen (CRIU's pre-resume
     action; a GPU part, whose driver restores through its threads, is paused after its GPU restore),
     the pod's loopback TCP is dropped meanwhile (pods/netlock.py), and the create that brings the
     last part thaws them all. A part created again once the pod was released restores on its own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from migrt import names
from migrt.config import Config
from migrt.errors import CheckpointInvalid, MigrtError, PreconditionFailed, UsageError
from migrt.oci.bundle import MIGRATE_POD_ANNOTATION, Bundle
from migrt.pods.members import Member, mismatch, parse_listed
from migrt.runtime.runc import LowerRuntime
from migrt.store import manifest as mf
from migrt.store.store import Checkpoint

PARTS = "parts"
HOLD_DEADLINE_S = 300.0  # a pod restore whose last container is not created by then is given up (pods/hold.py)


def is_pod(manifest: mf.Manifest) -> bool:
    return isinstance(manifest.raw.get("pod"), dict)


def parts_of(manifest: mf.Manifest) -> list[dict]:
    """The pod checkpoint's parts [{name, image, kind, container_id}], as recorded."""
    parts = (manifest.raw.get("pod") or {}).get("parts")
    return [p for p in parts if isinstance(p, dict) and isinstance(p.get("name"), str)] \
        if isinstance(parts, list) else []


def _members(manifest: mf.Manifest) -> list[Member]:
    """The parts as the source pod's members were (name, image), for members.mismatch."""
    return [Member(p.get("container_id") or "", p["name"], p.get("image") or "", "", "", True)
            for p in parts_of(manifest)]


def part(ckpt: Checkpoint, container: str) -> Checkpoint:
    """Part `container` of pod checkpoint `ckpt`, read as a checkpoint of its own (same name and lock:
    the pod's); CheckpointInvalid/NotFound-like errors name both."""
    have = [p["name"] for p in parts_of(ckpt.manifest)]
    if container not in have:
        raise PreconditionFailed(f"pod checkpoint {ckpt.name} has no container {container!r} (it has "
                                 f"{', '.join(have) or 'none'}); the new pod's containers must be the checkpointed "
                                 "pod's, by name")
    sub = Checkpoint(ckpt.store, ckpt.name)
    sub.path = os.path.join(ckpt.path, PARTS, names.validate(container))
    sub.images = os.path.join(sub.path, "images")
    try:
        sub._manifest = mf.load(sub.path, container)  # a part's manifest names its container
    except CheckpointInvalid as exc:
        raise CheckpointInvalid(f"pod checkpoint {ckpt.name}, part {container}: {exc.message}") from exc
    return sub


def for_container(ckpt: Checkpoint, bundle: Bundle) -> Checkpoint:
    """What a create restores from `ckpt`: itself, or for a pod checkpoint the part named as this
    container is (CRI's container name), refused before anything is touched when the checkpoint has no
    such container or had another image in it."""
    if not is_pod(ckpt.manifest):
        return ckpt
    meta = bundle.cri_metadata()
    container = meta.get("container_name")
    if not container:
        raise PreconditionFailed(f"checkpoint {ckpt.name} is a pod's (containers "
                                 f"{', '.join(p['name'] for p in parts_of(ckpt.manifest))}): it restores into a "
                                 "pod's containers, by name; this container has no CRI container name")
    entry = next((p for p in parts_of(ckpt.manifest) if p["name"] == container), None)
    if entry is None:
        return part(ckpt, container)  # refused there, naming the containers the checkpoint has
    found = mismatch([m for m in _members(ckpt.manifest) if m.name == container],
                     {container: meta.get("image_name", "")})
    if found:
        raise PreconditionFailed(f"pod checkpoint {ckpt.name}, {found[0]}; a pod restores into the same containers "
                                 "and images; nothing was restored")
    return part(ckpt, container)


def _whole_pod(ckpt: Checkpoint, bundle: Bundle) -> None:
    """With migrt.io/migrate-pod (the new pod's containers that take a part, `<name>=<image>,...`), every
    create checks the whole new pod against the checkpoint's parts, so the first one refuses a pod that
    does not match before anything of it is restored. Without it each create checks only itself."""
    listed = bundle.annotations.get(MIGRATE_POD_ANNOTATION)
    if listed is None:
        return
    lines = mismatch(_members(ckpt.manifest), parse_listed(listed))
    if lines:
        raise PreconditionFailed(f"pod checkpoint {ckpt.name} does not match the new pod ({MIGRATE_POD_ANNOTATION}): "
                                 + "; ".join(lines) + "; nothing was restored")


def restore_part(cfg: Config, ckpt: Checkpoint, target: Any, run: Callable[[Checkpoint, Any], dict]) -> dict:
    """A create's restore of its part of pod checkpoint `ckpt` (`run(part, target)` restores one
    checkpoint). With several parts the pod is held (pods/hold.py): this part resumes frozen, and the
    create that brings the pod's last part thaws them all. A part created again once the pod was
    released (a restart) is restored on its own."""
    from migrt.pods import hold, netlock

    expected = [p["name"] for p in parts_of(ckpt.manifest)]
    sandbox = target.bundle.cri_metadata().get("sandbox_id")
    request = target.bundle.restore_request()
    alone = request is not None and request.source == "env"  # one container asked for its part: no pod to wait for
    pod_hold = hold.Hold(target.root, sandbox, runtime=cfg.runtime_path()) \
        if len(expected) > 1 and sandbox and not alone else None
    try:
        _whole_pod(ckpt, target.bundle)
        sub = for_container(ckpt, target.bundle)
    except (PreconditionFailed, UsageError) as exc:  # this pod can never be whole: parts held already are given up
        if pod_hold is not None and os.path.exists(pod_hold.path):
            pod_hold.abandon(exc.message)
        raise
    if pod_hold is None:
        return run(sub, target)
    netns = netlock.netns_path(target.bundle)  # its loopback's TCP dropped by the hold meanwhile (netlock.py)
    rec = pod_hold.join(expected, HOLD_DEADLINE_S, netns=netns)
    if rec.get("state") == hold.RELEASED:
        return run(sub, target)
    if rec.get("state") != hold.HOLDING:
        raise PreconditionFailed(f"pod checkpoint {ckpt.name}: this pod's restore was given up ({rec.get('reason')}); "
                                 "delete the pod and create it again")
    gpu = bool((sub.manifest.get("gpu") or {}).get("processes"))
    if gpu:  # the driver restores through a thread of each process: frozen by the hold after its GPU restore
        res = run(sub, target)
        LowerRuntime(cfg.runtime_path()).pause(target.root, target.container_id)
    else:
        res = run(sub, dataclasses.replace(target, seams=dataclasses.replace(target.seams, criu_env=hold.criu_env)))
    name = target.bundle.cri_metadata().get("container_name", "")
    try:
        last = pod_hold.arrived(name, target.container_id)
    except MigrtError:
        if netns:  # given up (its deadline): nothing will release it
            netlock.unlock(netns)
        raise
    if last:
        res["pod_hold"] = {"released": [p.name for p in pod_hold.release()]}  # the loopback first, then the parts
    else:
        res["pod_hold"] = {"held": name, "waiting_for": sorted(set(expected) - set(rec.get("parts") or {}) - {name})}
    return res
