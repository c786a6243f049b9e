"""The node agent (`migrt serve`): hands one of this node's containers over to a pod on another node
that pulls it (pull.py), and answers other nodes' questions about migrations that ended here.

A connection (authenticated like every migration: the migration key, inside TLS when configured)
carries one request:

    pull {source, namespace, pod, container, container_id, agent_port}
        the source is looked up (Kubernetes namespace/pod/container, or a container id: checked
        before it becomes a path), then the rules, before anything is touched:
          - an application container: a pod's sandbox (pause container) is never handed over, by
            name or by id;
          - opt-in: the source pod's annotation migrt.io/migratable=true, or the node setting
            `migrate_any_container: true`;
          - namespace: the pulling pod's Kubernetes namespace is the source's (or both nodes set
            `allow_cross_namespace_restore`; the target also applies its own binding, mounts and GPU
            checks to the offer);
          - running (asked of the runtime only for a container that passed the rules above);
          - one hand-over of a container at a time.
        A refusal is an `error` message that says the same whatever the rule (Refused): a pod learns
        nothing of containers it may not take, of another namespace or not; the reason goes to the
        agent's log and report. Otherwise the migration runs on this very connection, this
        node being the sender (migrate.send: freeze, lazy dump, images, pages from the page server,
        the handover rule and the guards, all as `migrt migrate --lazy`). Before the frozen source is
        destroyed, a record is left that refuses its restart on this node (runtime/moved.py). A
        lost connection after the target was asked to restore is resolved by asking the target's
        own agent (`agent_port` on the pulling node's address).
    query {name, container_id}
        does a container restored from checkpoint `name` run here (receive.py answers; a pull's
        guard still deciding is waited for).
    pull {source, namespace, init_ran {image, parts}}
        a pod-level pull's init container on the target: did the source pod's container of that name
        run to completion (initran.py)? Under the pull's rules (every container of the pod opted in,
        the namespace binding; the same refusal); answered `ran {ran, why}`.

Records of pods that have gone (moved containers, pod holds) are swept every minute.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from migrt import log as log_mod
from migrt.config import Config
from migrt.errors import Conflict, PreconditionFailed, UsageError
from migrt.migration import initran, migrate, podpull
from migrt.migration.channel import Channel
from migrt.migration.pull import describe
from migrt.migration.receive import ReceiveOptions, Receiver, Report
from migrt.oci.bundle import MIGRATABLE_ANNOTATION, Bundle
from migrt.pods import hold, members
from migrt.runtime import moved
from migrt.runtime.runc import LowerRuntime, candidate_roots

SWEEP_EVERY_S = 60.0
REFUSAL_TIME_S = 0.2  # every refused pull is answered this long after it came (at least)
_TRUE = ("true", "1", "yes")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,1023}")  # runc's container ids; never '.', '..' or a path


@dataclass
class Located:
    root: str
    cid: str
    bundle: Bundle

    def describe(self) -> str:
        meta = self.bundle.cri_metadata()
        if meta.get("pod_name") and meta.get("container_name"):
            return (f"container {meta['container_name']} of pod {meta.get('pod_namespace')}/{meta['pod_name']} "
                    f"({self.cid[:12]})")
        return f"container {self.cid}"


def _running(runtime: LowerRuntime, root: str, cid: str) -> bool:
    try:
        return runtime.state(root, cid).alive
    except Exception:  # noqa: BLE001 - gone meanwhile, unreadable: not a candidate
        return False


def _has_state(root: str, cid: str) -> bool:
    return os.path.exists(os.path.join(root, cid, "state.json"))


class Refused(PreconditionFailed):
    """A pull this agent does not serve. Its text is the same whatever the reason (absent, not
    running, not opted in, another namespace, a sandbox, not a container id), so that a pod learns
    nothing of other namespaces' containers; `reason` is for the agent's own log."""

    def __init__(self, source: dict, namespace: object, node: str, reason: str,
                 container_id: str | None = None) -> None:
        ns = f"namespace {namespace!r}" if isinstance(namespace, str) and namespace else "no namespace"
        super().__init__(
            f"no migratable {describe(source)} for a pod of {ns} on node {node}: a pull takes a running container "
            f"(never a pod's sandbox) whose pod opted in ({MIGRATABLE_ANNOTATION}=true) and is in the pulling pod's "
            "namespace; nothing was touched (the node agent's log says why)")
        self.reason = reason
        self.container_id = container_id


def _wanted(source: object) -> dict:
    """The source as the pull names it: {"container_id"} or {"namespace", "pod", "container"}, each a
    non-empty printable string of at most 1024 characters (they are echoed in the refusal)."""
    if isinstance(source, dict) and set(source) in ({"container_id"}, {"namespace", "pod", "container"}) \
            and all(isinstance(v, str) and v.isprintable() and 0 < len(v) <= 1024 for v in source.values()):
        return dict(source)
    raise UsageError(f"pull: malformed source {source!r}")


def _by_id(cfg: Config, cid: str) -> list[Located]:
    if not _ID.fullmatch(cid):
        return []  # never a path: '..', '.hidden', 'a/b'
    roots = [r for r in candidate_roots(cfg.runtime_roots) if os.path.isfile(os.path.join(r, cid, "state.json"))]
    return [Located(r, cid, b) for r in roots if (b := members.state_bundle(r, cid)) is not None]


def _by_name(cfg: Config, want: dict) -> list[Located]:
    key = (want["namespace"], want["pod"], want["container"])
    found = []
    for f in members.scan(cfg):
        meta = f.bundle.cri_metadata()
        if f.bundle.is_application_container and \
                (meta.get("pod_namespace"), meta.get("pod_name"), meta.get("container_name")) == key:
            found.append(Located(f.root, f.cid, f.bundle))
    return found


def ineligible(cfg: Config, bundle: Bundle, namespace: object) -> str | None:
    """Why this container may not be handed over to a pod of `namespace` (None: it may), from its
    state alone (nothing is run for a container that fails these: no timing tells them apart)."""
    if not bundle.is_application_container:
        return "it is a pod's sandbox (pause container), never handed over"
    if not cfg.migrate_any_container and bundle.annotations.get(MIGRATABLE_ANNOTATION, "").lower() not in _TRUE:
        return (f"its pod has not opted in to live migration (annotation {MIGRATABLE_ANNOTATION}=true, or "
                "'migrate_any_container: true' in this node's migrt config)")
    src_ns = bundle.cri_metadata().get("pod_namespace")
    if src_ns and src_ns != namespace and not cfg.allow_cross_namespace_restore:
        return (f"it is in Kubernetes namespace {src_ns!r}, the pulling pod in {namespace!r} (set "
                "'allow_cross_namespace_restore: true' on both nodes to allow it)")
    return None


def locate(cfg: Config, source: object, namespace: object, node: str,
           running: Callable[[str, str], bool] | None = None) -> Located:
    """The one running container of this node that the pull names and that a pod of `namespace` may
    take; Refused otherwise (one text whatever the reason). running(root, cid): a seam for tests."""
    want = _wanted(source)
    if running is None:
        runtime = LowerRuntime(cfg.runtime_path())
        running = functools.partial(_running, runtime)
    found = _by_id(cfg, want["container_id"]) if "container_id" in want else _by_name(cfg, want)
    eligible, reasons = [], []
    for src in found:
        why = ineligible(cfg, src.bundle, namespace) or (None if running(src.root, src.cid) else "it is not running")
        if why:
            reasons.append(f"container {src.cid} (runc root {src.root}): {why}")
        else:
            eligible.append(src)
    if not eligible:
        raise Refused(want, namespace, node, "; ".join(reasons) or "no such container on this node",
                      found[0].cid if len(found) == 1 else None)
    if len(eligible) > 1:
        ids = ", ".join(f.cid[:12] for f in eligible)
        raise Conflict(f"{describe(want)}: several running containers match ({ids}); pull one by its container id")
    return eligible[0]


class Agent:
    def __init__(self, cfg: Config, report: Report, listen: str | None = None) -> None:
        self.cfg = cfg
        self.listen = listen or cfg.agent_listen
        self.receiver = Receiver(cfg, ReceiveOptions(listen=self.listen, pulls=self.hand_over), report)
        self._busy: set[str] = set()
        self._cuts: dict[tuple, podpull.PodCut | None] = {}  # pod-level pulls under way: (ns, pod, new pod's sandbox)
        self._lock = threading.Lock()

    def bind(self):
        return self.receiver.bind()

    def serve(self, server) -> None:
        threading.Thread(target=self._sweeper, daemon=True, name="migrt-moved-sweep").start()
        self.receiver.serve(server)

    def _sweeper(self) -> None:
        while True:
            for root in candidate_roots(self.cfg.runtime_roots):
                moved.sweep(root)
                hold.sweep(root, live=functools.partial(_has_state, root))
            time.sleep(SWEEP_EVERY_S)

    def hand_over(self, ch: Channel, msg: dict, out: dict) -> None:
        t_start = time.monotonic()
        out.update(mode="pull", source=msg.get("source"))
        if msg.get("init_ran") is not None:  # a pod-level pull's init container: did it run here? (initran.py)
            self._answer_ran(ch, msg, out, t_start)
            return
        if msg.get("pod_pull") is not None:  # one part of a pod-level pull (podpull.py)
            self._hand_over_part(ch, msg, out, t_start)
            return
        try:
            src = locate(self.cfg, msg.get("source"), msg.get("namespace"), ch.local_host)
        except Refused as exc:  # the puller reads one text; the reason stays here
            self._refused(ch, msg, exc, t_start, out)
            raise
        out["container_id"] = src.cid
        to = self._target(ch, msg)
        req = migrate.MigrateRequest(container_id=src.cid, to=to, root=src.root, lazy=True,
                                     moved=self._moved_record(src.bundle, ch, msg))
        with self._busy_with(src.cid, src.describe()):
            prep = migrate.prepare(self.cfg, req)
            res = migrate.send(self.cfg, req, prep, ch, t_start=t_start, t_connect=t_start)
        self._report(out, to, res)

    def _hand_over_part(self, ch: Channel, msg: dict, out: dict, t_start: float) -> None:
        """The part of a pod-level pull this create asks for: the pod's cut made at its first part
        (every check first, then one freeze), the container handed to this part's migration."""
        want, pod = _wanted(msg.get("source")), msg["pod_pull"]
        if "container" not in want or not isinstance(pod, dict) or not isinstance(pod.get("sandbox"), str):
            raise UsageError(f"pull: malformed pod-level request {pod!r}")
        parts = members.listed_parts(pod.get("parts"))
        to = self._target(ch, msg)
        key = (want["namespace"], want["pod"], pod["sandbox"])
        cut = self._cut(ch, msg, key, parts, to, t_start, out, first=pod.get("first") is True)
        name = want["container"]
        member, prep = cut.take(name)
        out["container_id"] = member.cid
        req = migrate.MigrateRequest(container_id=member.cid, to=to, root=member.root, lazy=True,
                                     moved=self._moved_record(Bundle.load(member.bundle), ch, msg), prefrozen=True,
                                     on_frozen=functools.partial(cut.hand, name), early=cut.early.get(name))
        error: str | None = "interrupted"
        try:
            with self._busy_with(member.cid, member.describe(cut.pod)):
                res = migrate.send(self.cfg, req, prep, ch, t_start=t_start, t_connect=t_start)  # type: ignore[arg-type]
            error = None
        except BaseException as exc:
            error = str(exc)
            raise
        finally:
            if cut.end(name, error):
                with self._lock:
                    if self._cuts.get(key) is cut:
                        del self._cuts[key]
        self._report(out, to, res)
        out["pod"] = {"pod": cut.pod, "part": name, "parts": sorted(parts)}

    def _answer_ran(self, ch: Channel, msg: dict, out: dict, t_start: float) -> None:
        """Whether the source pod's container of that name ran to completion (initran.ran), under the
        pull's rules (the pod's containers opted in, bound to the namespace; one refusal text)."""
        want, query = _wanted(msg.get("source")), msg["init_ran"]
        if "container" not in want or not isinstance(query, dict) or not isinstance(query.get("image", ""), str):
            raise UsageError(f"pull: malformed init container request {query!r}")
        parts = members.listed_parts(query.get("parts"))
        try:
            found = members.pod_members(self.cfg, want["namespace"], want["pod"])
            why = next((f"container {m.name}: {w}" for m in found
                        if (w := ineligible(self.cfg, Bundle.load(m.bundle), msg.get("namespace")))), None)
        except PreconditionFailed as exc:
            why = str(exc)
        if why:
            refused = Refused(want, msg.get("namespace"), ch.local_host, why)
            self._refused(ch, msg, refused, t_start, out)
            raise refused
        ran, because = initran.ran(found, want["container"], query.get("image") or "", parts)
        out.update(init_ran=ran, reason=because)
        ch.send({"type": "ran", "ran": ran, "why": because})

    def _cut(self, ch: Channel, msg: dict, key: tuple, parts: dict, to: str, t_start: float, out: dict,
             first: bool) -> podpull.PodCut:
        """The pod's cut for this new pod (its sandbox): made by the first part's pull, found by the others."""
        with self._lock:
            if key in self._cuts and self._cuts[key] is None:
                raise Conflict(f"pod {key[0]}/{key[1]}: its first container's pull is being prepared already")
            cut = self._cuts.get(key)
            if cut is not None and not (first and cut.failed):
                return cut
            if not first:
                raise Conflict(f"no pod-level pull of pod {key[0]}/{key[1]} is under way for this pod here (its "
                               "first container's pull ended, or this node's agent restarted); nothing was touched")
            self._cuts[key] = cut = None  # reserved: one first part at a time
        try:
            cut = podpull.cut_pod(self.cfg, key[0], key[1], parts, to,
                                  eligible=lambda b: ineligible(self.cfg, b, msg.get("namespace")),
                                  prepare=lambda req: migrate.prepare(self.cfg, req))
        except podpull.NotEligible as exc:  # no such pod, not opted in, another namespace: one text
            with self._lock:
                self._cuts.pop(key, None)
            refused = Refused(dict(msg["source"]), msg.get("namespace"), ch.local_host, str(exc))
            self._refused(ch, msg, refused, t_start, out)
            raise refused from exc
        except BaseException:
            with self._lock:
                self._cuts.pop(key, None)
            raise
        cut.start_deadline(self.cfg.pod_pull_deadline)
        with self._lock:
            self._cuts[key] = cut
        return cut

    def _refused(self, ch: Channel, msg: dict, exc: Refused, t_start: float, out: dict) -> None:
        out.update(container_id=exc.container_id, reason=exc.reason)
        log_mod.get().warning("pull_refused", peer=ch.peer, source=msg.get("source"),
                              namespace=msg.get("namespace"), container=exc.container_id, reason=exc.reason)
        # and one time: an absent id costs a stat, another namespace's container its state and bundle read
        time.sleep(max(0.0, t_start + REFUSAL_TIME_S - time.monotonic()))

    @staticmethod
    def _target(ch: Channel, msg: dict) -> str:
        port = msg.get("agent_port")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise UsageError(f"pull: the target did not say where its agent listens ({port!r})")
        return f"[{ch.peer_host}]:{port}" if ":" in ch.peer_host else f"{ch.peer_host}:{port}"

    @staticmethod
    def _moved_record(bundle: Bundle, ch: Channel, msg: dict) -> dict | None:
        return moved.record(bundle.annotations, to=ch.peer_host, target_container_id=msg.get("container_id"),
                            target_pod=f"{msg.get('namespace')}/{msg.get('pod')}")

    @contextlib.contextmanager
    def _busy_with(self, cid: str, what: str):
        with self._lock:
            if cid in self._busy:
                raise Conflict(f"{what} is being handed over to another pull already")
            self._busy.add(cid)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(cid)

    @staticmethod
    def _report(out: dict, to: str, res: dict) -> None:
        out.update(name=res["name"], to=to, restored=res["restored"], target=res["target"],
                   downtime_s=res["downtime_s"], pages=res.get("pages"), handover=res.get("handover"),
                   timings={**res["phases"], "downtime_s": res["downtime_s"]})
        if res.get("gpu"):  # a GPU container: which GPUs it went to (the pairs), as `migrt migrate --json` says
            out["gpu"] = res["gpu"]
