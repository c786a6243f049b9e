"""A pod container that was pulled to another node (migration/agent.py) must not start again here.

Once its state runs on the target, the source container is destroyed; kubelet on this node sees it
exit and, by the pod's restart policy, creates a fresh copy of it: two copies of one workload, the
fresh one without its state. So before destroying it, the agent leaves a record beside runc's state
directories, keyed by the pod's sandbox id and the container's name:

    <runc root>/.migrt-moved-<sandbox id>.<container name>     JSON: {pod, container, to, at, ...}

and every `create` of a container of that sandbox with that name is refused with a message naming
where it went (kubelet shows it as the container's error: `kubectl describe pod`). A new pod, even
of the same name (a StatefulSet's), has another sandbox id and starts normally. The record goes when
the pod does: a record whose sandbox has no runc state any more is removed (`sweep`, by the shim and
the agent). runc ignores files in its root (it lists directories).

Standard library only: the shim reads it before deciding anything (migrt-runc.sh hands a create to
Python while any such record exists in the root).
"""

from __future__ import annotations

import json
import os
import re
import time

from migrt import jsonsafe

PREFIX = ".migrt-moved-"
SANDBOX_ID = "io.kubernetes.cri.sandbox-id"
CONTAINER_NAME = "io.kubernetes.cri.container-name"
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def _name(sandbox_id: object, container: object) -> str | None:
    if not isinstance(sandbox_id, str) or not isinstance(container, str):
        return None
    if not _SAFE.fullmatch(sandbox_id) or not _SAFE.fullmatch(container) or "." in sandbox_id:
        return None
    return f"{PREFIX}{sandbox_id}.{container}"


def record(annotations: dict, **info) -> dict | None:
    """The record for a pod container (None for a container of no pod: nothing restarts it)."""
    sandbox, container = annotations.get(SANDBOX_ID), annotations.get(CONTAINER_NAME)
    if _name(sandbox, container) is None:
        return None
    pod = "/".join(x for x in (annotations.get("io.kubernetes.cri.sandbox-namespace"),
                               annotations.get("io.kubernetes.cri.sandbox-name")) if x)
    return {"sandbox_id": sandbox, "container": container, "pod": pod,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **info}


def leave(root: str, rec: dict | None) -> None:
    """Write the record (atomically; best effort: the migration must not fail on it)."""
    name = _name((rec or {}).get("sandbox_id"), (rec or {}).get("container"))
    if name is None:
        return
    from migrt.kernel.files import atomic_file  # here: the shim imports this module before it decides

    try:  # under /run (tmpfs): nothing to fsync
        with atomic_file(os.path.join(root, name), text=True, durable=False) as fh:
            json.dump(rec, fh)
    except OSError:
        pass


def find(root: str, annotations: dict) -> dict | None:
    """The record that refuses a create of this container here, or None."""
    name = _name(annotations.get(SANDBOX_ID), annotations.get(CONTAINER_NAME))
    if name is None:
        return None
    try:
        fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, encoding="utf-8") as fh:
            rec = jsonsafe.load(fh, max_bytes=1 << 20)
    except (OSError, ValueError):
        rec = {}
    return rec if isinstance(rec, dict) else {}


def refusal(rec: dict, container: str | None = None) -> str:
    """The message kubelet shows for the refused create."""
    who = f"container {rec.get('container') or container or '?'}" + (f" of pod {rec['pod']}" if rec.get("pod") else "")
    there = f" (container {rec['target_container_id']})" if rec.get("target_container_id") else ""
    return (f"{who} was migrated to node {rec.get('to') or '?'}{there} at {rec.get('at') or '?'} and runs there; "
            "it is not started again on this node. Delete this pod (the copy runs in the pod that pulled it)")


def present(root: str) -> list[str]:
    try:
        return [n for n in os.listdir(root) if n.startswith(PREFIX) and not n.endswith(".tmp")]
    except OSError:
        return []


def sweep(root: str) -> list[str]:
    """Remove the records whose pod is gone (its sandbox has no runc state here any more)."""
    removed = []
    for name in present(root):
        sandbox = name[len(PREFIX):].split(".", 1)[0]
        if os.path.exists(os.path.join(root, sandbox, "state.json")):
            continue
        try:
            os.unlink(os.path.join(root, name))
            removed.append(name)
        except OSError:
            pass
    return removed
