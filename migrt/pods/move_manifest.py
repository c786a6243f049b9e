"""The target pod of a live move, written from the source pod's manifest (`migrt k8s move-manifest`):
pure functions, no API server.

The rule: the copy is the source's pod as its owner would have made it, less what the API server and
the controllers own, plus what makes it pull:
- Pinned with `spec.nodeName`: the scheduler is bypassed, as a move wants (exactly that node, which
  lists the source's agent in migrate_peers; no wait for a scheduling cycle, no preemption of other
  pods, no other node chosen). What it skips: the scheduler's filters (NoSchedule taints, inter-pod
  affinity, topology spread, volume binding, scheduling gates: refused with nodeName). kubelet's own
  admission still applies (resources, host ports, required node affinity and nodeSelector,
  NoExecute taints): a target that fails them is rejected (pod Failed), never left Pending.
- `migrt.io/migrate-from` as the pull reads it (migrt/oci/bundle.py, migration/pull.py). One running
  container: `<agent>/<ns>/<pod>/<container>`. Several (native sidecars count): the pod-level pull,
  `<agent>/<ns>/<pod>` with `migrt.io/migrate-pod` listing every application container and native
  sidecar with its image as the spec gives it (`name=image,...`: what kubelet passes containerd as
  the user's image, io.kubernetes.cri.image-name), so that the source pod is cut at one instant
  (migration/podpull.py); regular init containers are not listed: each is created as an immediate
  exit 0 on the target once the source's agent says its namesake ran (migration/initran.py).
  --container NAME writes the per-container form (only that one pulls; the others start fresh);
  --separate-cuts writes `<agent>/<ns>/<pod>` without the list (each container pulls its namesake
  with a freeze of its own), refused with init containers that are not sidecars (the annotation
  reaches them too, and their namesakes have exited).
- Stripped: status, uid, resourceVersion, creationTimestamp, deletion fields, generation, selfLink,
  managedFields, generateName, the controller's ownerReference, finalizers, kubectl's
  last-applied-configuration, ephemeral containers, scheduling gates, priority and preemptionPolicy
  (admission recomputes them from priorityClassName), the source's nodeName; a previous
  migrate-from/restore request (annotations and MIGRT_* env, which would take precedence).
- Kept: the containers, volumes (same destinations: the pull checks them), runtimeClassName (the
  pull needs migrt-runc on both nodes), labels but those the owner's selector uses (move_owners.py),
  the hostname the application saw (spec.hostname set to the source's when it had none).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field

import yaml

from migrt import jsonsafe
from migrt.errors import UsageError
from migrt.oci.bundle import (
    FALLBACK_ANNOTATION,
    FALLBACK_ENV,
    MIGRATABLE_ANNOTATION,
    MIGRATE_FROM_ANNOTATION,
    MIGRATE_FROM_ENV,
    MIGRATE_POD_ANNOTATION,
    RESTORE_ANNOTATION,
    RESTORE_ENV,
)
from migrt.pods import move_owners
from migrt.pods.move_owners import MOVE_NAME, MOVE_SET, Names, Plan

MAX_BYTES = 4 << 20  # a pod's manifest; the API server's own limit on an object is 1.5 MiB
_META_DROPPED = ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                 "generation", "selfLink", "managedFields", "generateName", "finalizers")
_ANN_DROPPED = (MIGRATE_FROM_ANNOTATION, MIGRATE_POD_ANNOTATION, RESTORE_ANNOTATION, FALLBACK_ANNOTATION, MOVE_NAME,
                MOVE_SET, move_owners.DELETION_COST, "kubectl.kubernetes.io/last-applied-configuration")
_SPEC_DROPPED = ("nodeName", "ephemeralContainers", "schedulingGates", "priority", "preemptionPolicy")
_ENV_DROPPED = (MIGRATE_FROM_ENV, RESTORE_ENV, FALLBACK_ENV)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_TRUE = ("true", "1", "yes")  # as the agent reads the opt-in (migration/agent.py)
KEEP = object()  # MoveOptions.runtime_class: the source's


class ManifestError(UsageError):
    """The input is not a pod manifest that can be moved; the message says what to pass instead."""


@dataclass
class MoveOptions:
    to_node: str
    from_node: str | None = None      # the source's agent, ADDRESS[:PORT]; default status.hostIP, else nodeName
    name: str | None = None           # default: the owner's rule (move_owners.plan)
    container: str | None = None      # move only this container of a pod of several
    separate_cuts: bool = False       # pull every container, each with its own freeze
    runtime_class: object = KEEP      # a name, "" for none, KEEP for the source's
    drop_labels: tuple[str, ...] = ()
    any_owner: bool = False


@dataclass
class Move:
    pod: dict
    source: str                       # namespace/name
    migrate_from: str
    containers: list[str]             # the containers that pull
    plan: Plan
    warnings: list[str] = field(default_factory=list)
    migrate_pod: str | None = None    # the pod-level pull's list (migrt.io/migrate-pod), if one

    def report(self) -> dict:
        p = self.plan
        return {"pod": self.pod, "source": self.source, "target": f"{self.pod['metadata']['namespace']}/"
                f"{self.pod['metadata']['name']}", "node": self.pod["spec"]["nodeName"], "migrate_from":
                self.migrate_from, "migrate_pod": self.migrate_pod, "containers": self.containers,
                "owner": {"kind": p.kind, "name": p.owner}, "dropped_labels": p.drop_labels, "steps": p.steps,
                "warnings": self.warnings + p.warnings}


def read(text: str) -> tuple[dict, str]:
    """(the object, "json" or "yaml") of a manifest as kubectl prints it; a one-item List is its item."""
    one_pod = "pass one pod (kubectl get pod NAME -o yaml)"
    if len(text.encode()) > MAX_BYTES:
        raise ManifestError(f"the manifest is larger than {MAX_BYTES >> 20} MiB: {one_pod}")
    fmt = "json" if text.lstrip()[:1] in ("{", "[") else "yaml"
    try:
        obj = jsonsafe.loads(text) if fmt == "json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ManifestError(f"the manifest is not valid {fmt.upper()}: {str(exc).splitlines()[0]}") from exc
    if isinstance(obj, dict) and obj.get("kind") == "List":
        items = obj.get("items") or []
        if len(items) != 1:
            raise ManifestError(f"the manifest is a List of {len(items)} objects: {one_pod}")
        obj = items[0]
    if not isinstance(obj, dict):
        raise ManifestError(f"the manifest is not a Kubernetes object: {one_pod}")
    return obj, fmt


def render(obj: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(obj, indent=2) + "\n"
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)


def _checked(obj: dict) -> tuple[dict, dict]:
    """(metadata, spec) of a pod manifest, or a ManifestError saying what is missing."""
    kind = obj.get("kind")
    if kind != "Pod":
        what = f"a {kind}" if isinstance(kind, str) and kind else "an object without a kind"
        raise ManifestError(f"the manifest is {what}, not a Pod: pass the pod itself (kubectl get pod NAME -o yaml)")
    meta, spec = obj.get("metadata"), obj.get("spec")
    if not isinstance(meta, dict) or not meta.get("name") or not meta.get("namespace"):
        raise ManifestError("the pod has no metadata.name or metadata.namespace: pass it as the API server returns "
                            "it (kubectl get pod NAME -n NAMESPACE -o yaml)")
    where = f"pod {meta['namespace']}/{meta['name']}"
    if not isinstance(spec, dict):
        raise ManifestError(f"{where} has no spec: pass it as the API server returns it (kubectl get pod NAME -o yaml)")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers or not all(
            isinstance(c, dict) and c.get("name") for c in containers + list(spec.get("initContainers") or [])):
        raise ManifestError(f"{where}: spec.containers is missing, empty or has a container without a name")
    phase = (obj.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        raise ManifestError(f"{where} has ended ({phase}): there is no running container to move")
    return meta, spec


def _sidecars(spec: dict) -> list[str]:
    return [c["name"] for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"]


def _movers(where: str, spec: dict, opts: MoveOptions) -> tuple[list[str], bool]:
    """(the containers that pull, whether the annotation names the pod rather than one container)."""
    running = [c["name"] for c in spec["containers"]] + _sidecars(spec)
    if opts.container:
        if opts.container not in running:
            raise ManifestError(f"{where} has no running container {opts.container!r} (it has {', '.join(running)})")
        return [opts.container], False
    if len(running) == 1:
        return running, False
    if not opts.separate_cuts:  # the pod-level pull: every running container, one cut (_pod_list)
        return _sidecars(spec) + [c["name"] for c in spec["containers"]], True
    inits = [c["name"] for c in spec.get("initContainers") or [] if c.get("restartPolicy") != "Always"]
    if inits:
        raise ManifestError(
            f"{where} has init containers ({', '.join(inits)}): a pod-wide migrate-from reaches them too and their "
            "namesakes on the source have exited, so they would fail; pass --container NAME to move one container")
    return running, True


def _agent(obj: dict, opts: MoveOptions) -> str:
    """The source's agent as the annotation names it: --from-node, else the node's IP, else its name."""
    value = opts.from_node or (obj.get("status") or {}).get("hostIP") or obj["spec"].get("nodeName")
    if not value:
        raise ManifestError(f"pod {obj['metadata']['namespace']}/{obj['metadata']['name']} shows no node "
                            "(status.hostIP, spec.nodeName): pass --from-node ADDRESS[:PORT], its node's agent")
    if "/" in value or any(ch.isspace() for ch in value):
        raise ManifestError(f"--from-node {value!r}: expected ADDRESS[:PORT] of the source node's agent")
    return f"[{value}]" if value.count(":") > 1 and not value.startswith("[") else value


def _metadata(meta: dict, plan: Plan, name: str) -> tuple[dict, list[str]]:
    out = {k: copy.deepcopy(v) for k, v in meta.items() if k not in _META_DROPPED}
    out["name"] = name
    notes = []
    refs = [r for r in meta.get("ownerReferences") or [] if r is not move_owners.controller_of(meta)]
    if refs:
        out["ownerReferences"] = copy.deepcopy(refs)
        notes.append("kept ownerReferences that are not the controller's (the copy goes when they go): "
                     + ", ".join(f"{r.get('kind')} {r.get('name')}" for r in refs))
    else:
        out.pop("ownerReferences", None)
    others = [f for f in meta.get("finalizers") or [] if f != move_owners.JOB_FINALIZER]
    if others:
        notes.append(f"finalizers not copied: {', '.join(others)} (their controllers add them if they want them)")
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in plan.drop_labels}
    out["labels"] = labels
    ann = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in _ANN_DROPPED}
    if plan.final_name:
        ann.update({MOVE_NAME: plan.final_name, MOVE_SET: plan.owner or ""})
    out["annotations"] = ann
    return out, notes


def _env_cleaned(containers: list) -> list[str]:
    notes = []
    for c in containers:
        env = c.get("env")
        if isinstance(env, list) and any(isinstance(e, dict) and e.get("name") in _ENV_DROPPED for e in env):
            c["env"] = [e for e in env if not (isinstance(e, dict) and e.get("name") in _ENV_DROPPED)]
            notes.append(f"container {c['name']}: removed {', '.join(_ENV_DROPPED)} from its env (it would take "
                         f"precedence over the pull's annotation)")
    return notes


def _spec(src: dict, where: str, opts: MoveOptions, source_name: str) -> tuple[dict, list[str]]:
    spec = {k: copy.deepcopy(v) for k, v in src.items() if k not in _SPEC_DROPPED}
    spec["nodeName"] = opts.to_node
    notes = []
    if src.get("ephemeralContainers"):
        notes.append("ephemeral containers (kubectl debug) are not copied: a pod cannot be created with them")
    rc = src.get("runtimeClassName") if opts.runtime_class is KEEP else opts.runtime_class
    if rc is None:
        raise ManifestError(f"{where} has no runtimeClassName: a pull needs migrt-runc on both nodes (README step 2); "
                            "pass --runtime-class NAME (configs/kubernetes/runtimeclass.yaml: migrt), or "
                            "--runtime-class '' where migrt-runc is the nodes' default runtime")
    spec.pop("runtimeClassName", None)
    if rc:
        spec["runtimeClassName"] = rc
    if not spec.get("hostname"):
        host = source_name[:63].rstrip("-.")
        if _DNS_LABEL.fullmatch(host):
            spec["hostname"] = host  # what kubelet gave the source (its name, cut at 63): the app sees no change
        else:
            notes.append(f"the source's hostname {host!r} is not a DNS label: the copy's is its own name")
    notes += _env_cleaned(spec["containers"] + list(spec.get("initContainers") or []))
    return spec, notes


def _volume_notes(spec: dict, moving_node: bool) -> list[str]:
    notes = []
    claims = [v["persistentVolumeClaim"].get("claimName") for v in spec.get("volumes") or []
              if isinstance(v, dict) and isinstance(v.get("persistentVolumeClaim"), dict)]
    if claims and moving_node:
        notes.append(f"claims {', '.join(map(str, claims))}: the copy mounts them on the target while the source "
                     "still runs, so a ReadWriteOnce volume that must be attached to one node (most block storage) "
                     "keeps the copy in ContainerCreating until the source is gone, and the pull then fails; only "
                     "volumes both nodes can mount at once (ReadWriteMany, ReadOnlyMany, NFS) move live")
    fresh = [v.get("name") for v in spec.get("volumes") or [] if isinstance(v, dict)
             and ("emptyDir" in v or "ephemeral" in v)]
    if fresh:
        notes.append(f"volumes {', '.join(map(str, fresh))} (emptyDir, generic ephemeral) are new and empty on the "
                     "target: volumes do not move, only what the processes hold in memory and their writable layer")
    return notes


def _target_name(opts: MoveOptions, plan: Plan) -> str:
    name = opts.name or plan.default_name
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise ManifestError(f"pod name {name!r} is not a valid Kubernetes name (lower case letters, digits, '-', '.', "
                            "at most 253): pass --name NAME")
    return name


def move(obj: dict, opts: MoveOptions, fmt: str = "yaml") -> Move:
    """The target pod for moving the pod `obj` to node opts.to_node, with the owner's steps."""
    if not opts.to_node or not _DNS_SUBDOMAIN.fullmatch(opts.to_node):
        raise ManifestError(f"--to-node {opts.to_node!r}: expected the target node's name (kubectl get nodes)")
    meta, src_spec = _checked(obj)
    ns, src = meta["namespace"], meta["name"]
    where = f"pod {ns}/{src}"
    plan = move_owners.plan(meta, tuple(opts.drop_labels), opts.any_owner)
    name = _target_name(opts, plan)
    if name == src:
        raise ManifestError(f"the copy cannot be named {src!r}: the source runs under that name until the pull is "
                            "over; pass another --name (a StatefulSet's pod gets its name back in a second pull)")
    movers, whole = _movers(where, src_spec, opts)
    agent = _agent(obj, opts)
    value = f"{agent}/{ns}/{src}" + ("" if whole else f"/{movers[0]}")
    metadata, notes = _metadata(meta, plan, name)
    metadata["annotations"][MIGRATE_FROM_ANNOTATION] = value
    listed = _pod_list(where, src_spec, movers) if whole and not opts.separate_cuts else None
    if listed is not None:
        metadata["annotations"][MIGRATE_POD_ANNOTATION] = listed
    spec, spec_notes = _spec(src_spec, where, opts, src)
    notes += spec_notes + _volume_notes(src_spec, src_spec.get("nodeName") != opts.to_node)
    notes += _opt_in_notes(meta, where, src_spec, movers, whole and listed is None, listed is not None)
    pod = {"apiVersion": obj.get("apiVersion") or "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
    names = Names(ns, src, name, f"{name}.{fmt}", opts.to_node)
    job_uid = (move_owners.controller_of(meta) or {}).get("uid") if plan.kind == "Job" else None
    plan.steps = move_owners.steps(plan, names, meta.get("labels") or {}, job_uid)
    return Move(pod, f"{ns}/{src}", value, movers, plan, notes, listed)


def _pod_list(where: str, spec: dict, movers: list[str]) -> str:
    """migrt.io/migrate-pod's value: `name=image` of every container that pulls, as the spec names its
    image (kubelet passes containerd that string as the user's image)."""
    images = {c["name"]: c.get("image") for c in list(spec.get("initContainers") or []) + spec["containers"]}
    missing = [n for n in movers if not isinstance(images.get(n), str) or not images[n]]
    if missing:
        raise ManifestError(f"{where}: containers {', '.join(missing)} have no image; the pod-level pull lists each "
                            "container with its image (pass the pod as kubectl get pod NAME -o yaml prints it)")
    return ",".join(f"{n}={images[n]}" for n in movers)


def _opt_in_notes(meta: dict, where: str, spec: dict, movers: list[str], separate: bool,
                   pod_level: bool = False) -> list[str]:
    notes = []
    if str((meta.get("annotations") or {}).get(MIGRATABLE_ANNOTATION, "")).lower() not in _TRUE:
        notes.append(f"{where} has not opted in ({MIGRATABLE_ANNOTATION}: \"true\"): its node's agent refuses the "
                     "pull unless its config has migrate_any_container: true; the opt-in counts only if the pod "
                     "carried it when its containers were created")
    if separate:
        notes.append(f"containers {', '.join(movers)} pull one after the other, each frozen and dumped on its own: "
                     "state they share is not cut at one instant")
    rest = [c["name"] for c in spec["containers"]] + _sidecars(spec)
    fresh = [c for c in rest if c not in movers]
    inits = [c["name"] for c in spec.get("initContainers") or [] if c.get("restartPolicy") != "Always"]
    if fresh:
        notes.append(f"containers {', '.join(fresh)} start fresh on the target (only {movers[0]} pulls)")
    if inits and pod_level:
        notes.append(f"init containers {', '.join(inits)} are not run again on the target: each exits 0 at once "
                     "if the source's agent says its namesake ran (else it runs); what they wrote into volumes "
                     "does not move")
    elif inits:
        notes.append(f"init containers {', '.join(inits)} run again on the target before the pull (kubelet runs "
                     "them first): they must be safe to re-run")
    return notes
