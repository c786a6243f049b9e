"""Pods with owners: what the copy of a moved pod keeps, so that the source's controller neither
duplicates it nor kills it, and what the operator does next (`migrt k8s move-manifest`).

The rule, per controller, from the controllers' own code (kube-controller-manager):
- A ReplicaSet (or ReplicationController) claims every pod of its namespace that its selector matches
  and no other controller owns (ControllerRefManager.ClaimPods adopts orphans), counts the active ones
  and deletes the surplus, not-Ready pods first. A copy it selected would be adopted while it is still
  being created and deleted first: the copy drops the controller's ownerReference and a label of the
  selector. A Deployment's ReplicaSet always selects `pod-template-hash`; a bare ReplicaSet's selector
  is not in the pod, so the operator names a label of it (--drop-label).
- A StatefulSet claims only pods whose name is `<set>-<ordinal>` (isMemberOf) and recreates a deleted
  ordinal at once, under the same name and claims. Two pods of one name cannot exist in a namespace
  and the pull needs the source running, so the identity comes back in two pulls: to `<name>-moving`
  on the target node (hostname, subdomain, labels and claims kept; the final name recorded in the
  annotation migrt.io/move-name), then, once the source is deleted, to `<name>` on the same node. The
  StatefulSet is deleted with --cascade=orphan first and recreated at the end, and then adopts it.
- A Job claims orphans its selector matches (generated: `batch.kubernetes.io/controller-uid=<uid>`),
  adding its ownerReference and the `batch.kubernetes.io/job-tracking` finalizer, deletes active pods
  beyond min(parallelism, completions - succeeded), not-Ready first, and replaces a pod whose
  container ends while it is still owned. The Job is deleted with --cascade=orphan first (its
  controller then removes the tracking finalizer from the orphans); the copy drops the selector's
  labels and the finalizer, so no Job adopts it unless the operator labels it back for a recreated Job.
- A DaemonSet places its own pod on every node it selects, and a static pod is a file on its node:
  neither is moved. Other controllers are unknown here: refused unless --any-owner.
Nothing here talks to an API server: these are the steps, printed for the operator, and what the
controllers do at each is on paper (docs/kubernetes.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from migrt.errors import UsageError

MOVE_NAME = "migrt.io/move-name"  # on the first pod of a StatefulSet's move: the name the second takes
MOVE_SET = "migrt.io/move-statefulset"  # ... and the StatefulSet to recreate at the end
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
TEMPLATE_HASH = "pod-template-hash"
JOB_UID_LABELS = ("batch.kubernetes.io/controller-uid", "controller-uid")
JOB_FINALIZER = "batch.kubernetes.io/job-tracking"
SAME_NODE_PEER = (
    "the second pull ({moving} -> {name}) runs on one node, from that node's own agent: the node's migrate_peers "
    "must list its own agent's address, or the pull is refused before anything is contacted and {moving} runs on; "
    "recreate the StatefulSet only once {name} runs (before, it would start a fresh {name} on the same claims)")
_REFUSED = {
    "DaemonSet": "a DaemonSet runs its own pod on every node it selects: it would start one on the target node "
                 "anyway and replace this one where it is; change which nodes it selects instead",
    "Node": "it is a static pod (a manifest file on its node, mirrored by kubelet): move the file instead",
}


class MoveRefused(UsageError):
    """The source pod cannot be moved as asked; the message names the option or the step that can."""


@dataclass
class Plan:
    """What the owner's rule decided: labels the copy drops, its name by default, the steps after."""

    kind: str  # "Deployment", "ReplicaSet", "StatefulSet", "StatefulSet (second pull)", "Job", "none", ...
    owner: str | None              # the controller's name (for a Deployment: the Deployment's)
    drop_labels: list[str] = field(default_factory=list)
    default_name: str = ""
    final_name: str | None = None  # StatefulSet, first pull: recorded in MOVE_NAME
    steps: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Names:
    """What the steps talk about: namespace, source pod, target pod, the file the copy is written to."""

    ns: str
    source: str
    target: str
    file: str
    to_node: str


def controller_of(meta: dict) -> dict | None:
    refs = meta.get("ownerReferences") or []
    return next((r for r in refs if isinstance(r, dict) and r.get("controller")), None)


def plan(meta: dict, drop: tuple[str, ...], any_owner: bool) -> Plan:
    """The owner's rule for a source pod's metadata (labels, annotations, ownerReferences)."""
    name, labels, ann = meta["name"], meta.get("labels") or {}, meta.get("annotations") or {}
    ref = controller_of(meta) or ({"kind": "Node"} if "kubernetes.io/config.mirror" in ann else None)
    if ref is None:
        if ann.get(MOVE_NAME):
            out = Plan("StatefulSet (second pull)", ann.get(MOVE_SET), list(drop), ann[MOVE_NAME])
            out.warnings.append(SAME_NODE_PEER.format(moving=name, name=ann[MOVE_NAME]))
            return out
        return Plan("none", None, list(drop), f"{name}-moved")
    kind = ref.get("kind")
    if kind in _REFUSED:
        raise MoveRefused(f"pod {meta.get('namespace')}/{name} is not moved: {_REFUSED[kind]}")
    if kind in ("ReplicaSet", "ReplicationController"):
        return _replicaset(ref, labels, name, drop)
    if kind == "StatefulSet":
        out = Plan("StatefulSet", ref.get("name"), list(drop), f"{name}-moving", final_name=name)
        out.warnings.append(SAME_NODE_PEER.format(moving=f"{name}-moving", name=name))
        return out
    if kind == "Job":
        return _job(ref, labels, name, drop)
    if not any_owner:
        raise MoveRefused(
            f"pod {meta.get('namespace')}/{name} is controlled by {kind} {ref.get('name')}: migrt does not know "
            "how that controller treats a copy of its pod or the end of the source's container; pass --any-owner "
            "to write the copy without its ownerReference (and --drop-label for the labels its selector uses)")
    out = Plan(str(kind), ref.get("name"), list(drop), f"{name}-moved")
    out.warnings.append(f"owner {kind} {ref.get('name')} is not one migrt knows: check what it does with the copy "
                        "and when the source's container ends before going on")
    return out


def _replicaset(ref: dict, labels: dict, name: str, drop: tuple[str, ...]) -> Plan:
    rs = str(ref.get("name"))
    hash_ = labels.get(TEMPLATE_HASH)
    if ref.get("kind") == "ReplicaSet" and hash_ and rs.endswith(f"-{hash_}"):
        return Plan("Deployment", rs[: -len(hash_) - 1], [TEMPLATE_HASH, *drop], f"{name}-moved")
    if not drop:
        raise MoveRefused(
            f"pod {name} is controlled by {ref.get('kind')} {rs}, whose selector the pod does not show: the copy "
            f"must drop a label the selector matches or {rs} adopts it and deletes it as one pod too many; run "
            f"`kubectl get {ref.get('kind', '').lower()} {rs} -o jsonpath='{{.spec.selector}}'` and pass "
            "--drop-label KEY for a key of its matchLabels")
    return Plan(str(ref.get("kind")), rs, list(drop), f"{name}-moved")


def _job(ref: dict, labels: dict, name: str, drop: tuple[str, ...]) -> Plan:
    uid_labels = [k for k in JOB_UID_LABELS if k in labels]
    if not uid_labels and not drop:
        raise MoveRefused(
            f"pod {name} belongs to Job {ref.get('name')} with a manual selector (the pod has no controller-uid "
            f"label): run `kubectl get job {ref.get('name')} -o jsonpath='{{.spec.selector}}'` and pass --drop-label "
            "KEY for a key of its matchLabels, so that the Job does not adopt the copy")
    return Plan("Job", ref.get("name"), [*uid_labels, *drop], f"{name}-moved")


def steps(p: Plan, n: Names, labels: dict, job_uid: str | None) -> list[str]:
    """The operator's steps, commands included, for the plan `p` of a move named by `n`; once the copy
    runs, its pull request goes (a restart of its container would pull again from a source that is gone)."""
    out = _owner_steps(p, n, labels, job_uid)
    at = next(i for i, s in enumerate(out) if f" create -f {n.file};" in s)
    out.insert(at + 1, f"kubectl -n {n.ns} annotate pod {n.target} migrt.io/migrate-from-   (once it runs: a "
                       "restart of its container would pull again, from a source that is gone, and fail; kubelet "
                       "sends the pod's current annotations with each CreateContainer)")
    return out


def _owner_steps(p: Plan, n: Names, labels: dict, job_uid: str | None) -> list[str]:
    k = f"kubectl -n {n.ns}"
    create = (f"{k} create -f {n.file}; {k} wait --for=condition=Ready pod/{n.target} --timeout=5m   "
              f"(the pull: the source freezes once, the copy runs on {n.to_node}; the source's container ends, "
              "its restart on its node is refused)")
    if p.kind == "Deployment":
        return _deployment_steps(p, n, k, create, labels.get(TEMPLATE_HASH, ""))
    if p.kind in ("ReplicaSet", "ReplicationController"):
        return _rs_steps(p, n, k, create)
    if p.kind == "StatefulSet":
        return _statefulset_steps(p, n, k, create)
    if p.kind == "StatefulSet (second pull)":
        return [create, f"{k} delete pod {n.source}",
                f"{k} create -f {p.owner or 'STATEFULSET'}.yaml   (saved before the first pull: "
                f"it adopts {n.target}, a member by name, and keeps it while its controller-revision-hash "
                "label is the template's revision)"]
    if p.kind == "Job":
        return _job_steps(p, n, k, create, job_uid)
    return [create, f"{k} delete pod {n.source}"]


def _deployment_steps(p: Plan, n: Names, k: str, create: str, hash_: str) -> list[str]:
    replicas = f"$({k} get deployment {p.owner} -o jsonpath='{{.spec.replicas}}')"
    return [
        create + f"; ReplicaSet {p.owner}-{hash_} neither adopts nor counts the copy (no {TEMPLATE_HASH} label); "
        "the source still counts (its phase stays Running), so no replacement is made",
        f"{k} annotate pod {n.source} {DELETION_COST}=-2147483648 --overwrite; "
        f"{k} scale deployment {p.owner} --replicas=$(({replicas} - 1))   "
        "(the ReplicaSet deletes one pod: the source, not Ready and the cheapest; an HPA on the Deployment "
        "must allow the lower count)",
        f"optional, to hand the copy back: {k} annotate pod {n.target} {DELETION_COST}=2147483647 --overwrite; "
        f"{k} scale deployment {p.owner} --replicas=$(({replicas} + 1)); "
        f"{k} label pod {n.target} {TEMPLATE_HASH}={hash_}; "
        f"{k} annotate pod {n.target} {DELETION_COST}-   (the ReplicaSet adopts the copy, has one pod too many "
        "and deletes a not-Ready or cheaper one, never the copy; without this the copy is no one's: rollouts "
        "leave it, delete it yourself)",
    ]


def _rs_steps(p: Plan, n: Names, k: str, create: str) -> list[str]:
    what = "rs" if p.kind == "ReplicaSet" else "rc"
    replicas = f"$({k} get {what} {p.owner} -o jsonpath='{{.spec.replicas}}')"
    return [
        create + f"; {p.kind} {p.owner} does not select the copy (labels {', '.join(p.drop_labels)} dropped)",
        f"{k} annotate pod {n.source} {DELETION_COST}=-2147483648 --overwrite; "
        f"{k} scale {what} {p.owner} --replicas=$(({replicas} - 1))   (it deletes the source: not Ready, cheapest)",
    ]


def _statefulset_steps(p: Plan, n: Names, k: str, create: str) -> list[str]:
    return [
        f"before anything else: {k} get statefulset {p.owner} -o yaml > {p.owner}.yaml (remove status, uid, "
        f"resourceVersion, creationTimestamp from it); {k} delete statefulset {p.owner} --cascade=orphan   "
        f"(the StatefulSet goes, its pods stay: the garbage collector removes their ownerReferences, and "
        f"nothing recreates {n.source} when it is deleted)",
        create + f"; {n.target} keeps hostname {n.source}, the subdomain, the labels and the claims",
        f"{k} delete pod {n.source}   (its claims' volumes are now used by {n.target} alone)",
        f"the second pull, on the same node: {k} get pod {n.target} -o yaml | migrt k8s move-manifest --to-node "
        f"{n.to_node} > {n.source}.yaml, then follow what it prints ({n.to_node}'s migrate_peers must list its own "
        "agent)",
    ]


def _job_steps(p: Plan, n: Names, k: str, create: str, job_uid: str | None) -> list[str]:
    uid = job_uid or "UID"
    return [
        f"before anything else: {k} get job {p.owner} -o yaml > {p.owner}.yaml; {k} delete job {p.owner} "
        "--cascade=orphan   (the Job controller stops: nothing replaces the source when its container ends "
        "and nothing counts it failed; suspend a CronJob that owns the Job first)",
        create + "; no Job selects the copy (its controller-uid labels and tracking finalizer dropped)",
        f"{k} delete pod {n.source}",
        f"optional, while the copy runs, for a Job of one pod (completions 1): {k} label pod {n.target} "
        + " ".join(f"{lb}={uid}" for lb in JOB_UID_LABELS)
        + f"; recreate the Job from {p.owner}.yaml without status, uid, resourceVersion, creationTimestamp and "
        f"with spec.manualSelector: true (its selector and template keep controller-uid {uid}): it adopts the "
        "running copy (ownerReference, tracking finalizer), counts one active pod, creates none, and completes "
        "when the copy succeeds; with more completions it starts counting from 0 and redoes finished work",
        f"the copy runs to its end (as the recreated Job's pod, or as a pod of its own): {k} wait "
        f"--for=jsonpath='{{.status.phase}}'=Succeeded pod/{n.target}",
    ]
