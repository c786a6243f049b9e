"""The marker migrt leaves for a container it restored at `create`: `<root>/<id>/migrt-restored`.

It lives inside the lower runtime's own state directory, which `runc delete` removes whole, so
nothing is left behind after delete. Stdlib only (the shim's `start` reads it).
"""

from __future__ import annotations

import json
import os

from migrt import names

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import Any

MARKER = "migrt-restored"
# Beside it, for a container created with GPU release on pause (migrt/ops/gpu_pause.py): the shim's
# pause/resume test, one stat on the fast path.
GPU_RELEASE_MARKER = "migrt-gpu-release-on-pause"
# migrt's record of a GPU suspend in place (migrt/ops/gpu_preempt.py): while it exists the container's
# CUDA processes hold their GPU state in host memory, and a checkpoint or migration must wait.
GPU_SUSPENDED_RECORD = "migrt-gpu-suspended.json"


def gpu_suspended(root: str, container_id: str) -> bool:
    if not names.is_container_id(container_id):
        return False
    return os.path.isfile(os.path.join(root, container_id, GPU_SUSPENDED_RECORD))


def gpu_suspended_message(container_id: str) -> str:
    return (f"container {container_id} is GPU-suspended (migrt gpu suspend, or paused with GPU release): its GPU "
            f"state is in host memory; run 'migrt gpu resume {container_id}' (or resume it) first")


def marker_path(root: str, container_id: str) -> str:
    return os.path.join(root, names.container_id(container_id), MARKER)


def is_restored(root: str, container_id: str) -> bool:
    if not names.is_container_id(container_id):
        return False
    return os.path.isfile(marker_path(root, container_id))


def write_marker(root: str, container_id: str, info: dict[str, Any]) -> None:
    path = marker_path(root, container_id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh)
