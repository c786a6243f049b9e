"""Bundle: a read-only view of an OCI bundle's config.json. Stdlib only (used on the hot path).
config.json is never rewritten."""

from __future__ import annotations

import os
from dataclasses import dataclass

from migrt import jsonsafe
from migrt.errors import MigrtError

RESTORE_ENV = "MIGRT_RESTORE"
FALLBACK_ENV = "MIGRT_RESTORE_FALLBACK"
RESTORE_ANNOTATION = "migrt.io/restore"
FALLBACK_ANNOTATION = "migrt.io/restore-fallback"
CONTAINER_TYPE = "io.kubernetes.cri.container-type"
GPU_RELEASE_ANNOTATION = "migrt.io/gpu-release-on-pause"
GPU_RELEASE_ENV = "MIGRT_GPU_RELEASE_ON_PAUSE"
# Live migration into a new pod (migration/pull.py): "<source node's address>/<source>", where <source>
# is namespace/pod/container, namespace/pod (the container of this one's name) or a container id.
MIGRATE_FROM_ENV = "MIGRT_MIGRATE_FROM"
MIGRATE_FROM_ANNOTATION = "migrt.io/migrate-from"
MIGRATABLE_ANNOTATION = "migrt.io/migratable"  # the source pod's opt-in
# A pod-level pull (migration/podpull.py): with migrate-from naming a pod (namespace/pod), the new pod's
# containers that pull their namesakes with one cut of the source pod, "<name>=<image>,..."; a
# container of the pod not listed (an init container) starts fresh.
MIGRATE_POD_ANNOTATION = "migrt.io/migrate-pod"

CRI_ANNOTATIONS = {
    "pod_namespace": "io.kubernetes.cri.sandbox-namespace",
    "pod_name": "io.kubernetes.cri.sandbox-name",
    "pod_uid": "io.kubernetes.cri.sandbox-uid",
    "container_name": "io.kubernetes.cri.container-name",
    "image_name": "io.kubernetes.cri.image-name",
    "sandbox_id": "io.kubernetes.cri.sandbox-id",
}


class BundleError(MigrtError):
    exit_code = 2


@dataclass(frozen=True)
class RestoreRequest:
    name: str
    fallback: str | None  # "fresh" | "fail" | None (use the configured policy)
    source: str  # "env" or "annotation"


@dataclass(frozen=True)
class MigrateFrom:
    value: str   # as written: "<node address>/<source>"
    origin: str  # "env" or "annotation"
    pod: str | None = None  # migrt.io/migrate-pod as written: this container is one part of a pod-level pull


class Bundle:
    def __init__(self, path: str, config: dict) -> None:
        self.path = path
        self.config = config

    @classmethod
    def load(cls, path: str) -> Bundle:
        cfg_path = os.path.join(path, "config.json")
        try:
            with open(cfg_path, "rb") as fh:
                config = jsonsafe.load(fh)  # bounded: a pod's spec becomes this file
        except FileNotFoundError as exc:
            raise BundleError(f"bundle {path}: config.json not found") from exc
        except (OSError, ValueError) as exc:
            raise BundleError(f"bundle {path}: cannot read config.json: {exc}") from exc
        if not isinstance(config, dict):
            raise BundleError(f"bundle {path}: config.json is not a JSON object")
        return cls(path, config)

    @classmethod
    def of_state(cls, state: dict | None) -> Bundle | None:
        """A container's bundle, through the `bundle=` label runc keeps in its state.json; None when the
        label is absent or the bundle's config.json cannot be read."""
        labels = ((state or {}).get("config") or {}).get("labels") or []
        path = next((lb[len("bundle="):] for lb in labels if isinstance(lb, str) and lb.startswith("bundle=")), "")
        if not path:
            return None
        try:
            return cls.load(path)
        except MigrtError:
            return None

    def _section(self, key: str) -> dict:
        """A top-level object of config.json, {} when absent or malformed (runc reports that)."""
        value = self.config.get(key)
        return value if isinstance(value, dict) else {}

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        env = self._section("process").get("env")
        for item in env if isinstance(env, list) else []:
            if isinstance(item, str):
                key, _, value = item.partition("=")
                out[key] = value
        return out

    @property
    def annotations(self) -> dict[str, str]:
        ann = self._section("annotations")
        return {k: v for k, v in ann.items() if isinstance(k, str) and isinstance(v, str)}

    @property
    def container_type(self) -> str | None:
        return self.annotations.get(CONTAINER_TYPE)

    @property
    def is_application_container(self) -> bool:
        return self.container_type in (None, "container")

    @property
    def terminal(self) -> bool:
        return bool((self.config.get("process") or {}).get("terminal"))

    @property
    def rootfs(self) -> str:
        root = (self.config.get("root") or {}).get("path") or "rootfs"
        return root if os.path.isabs(root) else os.path.join(self.path, root)

    @property
    def mounts(self) -> list[dict]:
        return [m for m in self.config.get("mounts") or [] if isinstance(m, dict)]

    @property
    def namespaces(self) -> list[dict]:
        return [n for n in (self.config.get("linux") or {}).get("namespaces") or [] if isinstance(n, dict)]

    @property
    def gpu_release_on_pause(self) -> bool:
        """Suspend the GPU state when paused (docs/gpu.md "Preemption in place")."""
        return (self.annotations.get(GPU_RELEASE_ANNOTATION, "").lower() in ("true", "1", "yes")
                or self.env.get(GPU_RELEASE_ENV, "").lower() in ("1", "true", "yes"))

    def cri_metadata(self) -> dict[str, str]:
        ann = self.annotations
        return {key: ann[a] for key, a in CRI_ANNOTATIONS.items() if a in ann}

    def restore_request(self) -> RestoreRequest | None:
        """The restore request, if any; never for a pod sandbox (or any non-application container)."""
        env, ann = self.env, self.annotations
        if env.get(RESTORE_ENV):
            name, source = env[RESTORE_ENV], "env"
        elif ann.get(RESTORE_ANNOTATION):
            name, source = ann[RESTORE_ANNOTATION], "annotation"
        else:
            return None
        if not self.is_application_container:
            return None
        if source == "annotation" and not self._listed(ann):  # a pod-level restore: an init container starts fresh
            return None
        fallback = env.get(FALLBACK_ENV) or ann.get(FALLBACK_ANNOTATION) or None
        return RestoreRequest(name=name, fallback=fallback, source=source)

    @staticmethod
    def _listed(ann: dict[str, str]) -> bool:
        """Whether this container is one of migrt.io/migrate-pod's (the new pod's containers that take a
        part of a pod: a pod-level pull's or restore's); True where the pod lists none."""
        pod = ann.get(MIGRATE_POD_ANNOTATION)
        if pod is None:
            return True
        return ann.get(CRI_ANNOTATIONS["container_name"]) in {e.partition("=")[0].strip() for e in pod.split(",")}

    def unlisted_pod_part(self) -> MigrateFrom | None:
        """A pod-level pull's (annotations migrt.io/migrate-from=<node>/<ns>/<pod> and migrt.io/migrate-pod)
        container that the list leaves out (a regular init container: migration/initran.py), else None."""
        ann = self.annotations
        value, pod = ann.get(MIGRATE_FROM_ANNOTATION), ann.get(MIGRATE_POD_ANNOTATION)
        if not value or pod is None or self.env.get(MIGRATE_FROM_ENV) or not self.is_application_container \
                or self._listed(ann) or len(value.split("/")) != 3:
            return None
        return MigrateFrom(value, "annotation", pod)

    def migrate_request(self) -> MigrateFrom | None:
        """The pull asked for by this container, if any; never for a pod sandbox. The annotation is
        pod-wide (containerd copies pod annotations into every container): one naming a container
        (namespace/pod/container) is for the container of that name only."""
        env, ann = self.env, self.annotations
        if env.get(MIGRATE_FROM_ENV):
            req = MigrateFrom(env[MIGRATE_FROM_ENV], "env")
        elif ann.get(MIGRATE_FROM_ANNOTATION):
            req = MigrateFrom(ann[MIGRATE_FROM_ANNOTATION], "annotation")
        else:
            return None
        if not self.is_application_container:
            return None
        parts = req.value.split("/")
        if req.origin == "annotation" and len(parts) == 4 and parts[3] != ann.get(CRI_ANNOTATIONS["container_name"]):
            return None
        pod = ann.get(MIGRATE_POD_ANNOTATION)
        if req.origin == "annotation" and pod is not None:  # a part, or a container that starts fresh
            if not self._listed(ann):
                return None
            return MigrateFrom(req.value, req.origin, pod)
        return req
