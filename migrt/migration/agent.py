"""The node agent (`migrt serve`): hands one of this node's containers over to a pod on another node
that pulls it (pull.py), and answers other nodes' questions about migrations that ended here.

A connection (authenticated like every migration: the migration key, inside TLS when configured)
carries one request:

    pull {source, namespace, pod, container, container_id, agent_port}
        the source is looked up (Kubernetes namespace/pod/container, or a container id), then the
        rules, before anything is touched:
          - opt-in: the source pod's annotation migrt.io/migratable=true, or the node setting
            `migrate_any_container: true`;
          - namespace: the pulling pod's Kubernetes namespace is the source's (or both nodes set
            `allow_cross_namespace_restore`; the target also applies its own binding, mounts and GPU
            checks to the offer);
          - one hand-over of a container at a time.
        A refusal is an `error` message; otherwise the migration runs on this very connection, this
        node being the sender (migrate.send: freeze, lazy dump, images, pages from the page server,
        the handover rule and the guards, all as `migrt migrate --lazy`). Before the frozen source is
        destroyed, a record is left that refuses its restart on this node (runtime/moved.py). A
        lost connection after the target was asked to restore is resolved by asking the target's
        own agent (`agent_port` on the pulling node's address).
    query {name, container_id}
        does a container restored from checkpoint `name` run here (receive.py answers; a pull's
        guard still deciding is waited for).

Records of pods that have gone are swept every minute.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

from migrt.config import Config
from migrt.errors import Conflict, NotFound, PreconditionFailed, UsageError
from migrt.migration import migrate
from migrt.migration.channel import Channel
from migrt.migration.receive import ReceiveOptions, Receiver, Report
from migrt.oci.bundle import MIGRATABLE_ANNOTATION, Bundle
from migrt.runtime import moved
from migrt.runtime.runc import LowerRuntime, candidate_roots, find_root

SWEEP_EVERY_S = 60.0
_TRUE = ("true", "1", "yes")


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
        return runtime.state(root, cid).get("status") in ("running", "paused")
    except Exception:  # noqa: BLE001 - gone meanwhile, unreadable: not a candidate
        return False


def _state_bundle(root: str, cid: str) -> Bundle | None:
    try:
        with open(os.path.join(root, cid, "state.json"), encoding="utf-8") as fh:
            return Bundle.of_state(json.load(fh))
    except (OSError, ValueError):
        return None


def locate(cfg: Config, source: object) -> Located:
    """The running container a pull names, on this node."""
    if not isinstance(source, dict):
        raise UsageError(f"pull: malformed source {source!r}")
    runtime = LowerRuntime(cfg.runtime_path())
    if source.get("container_id"):
        cid = str(source["container_id"])
        root = find_root(cid, cfg.runtime_roots)
        bundle = _state_bundle(root, cid)
        if bundle is None or not _running(runtime, root, cid):
            raise NotFound(f"container {cid} is not running on this node")
        return Located(root, cid, bundle)
    want = (source.get("namespace"), source.get("pod"), source.get("container"))
    if not all(isinstance(x, str) and x for x in want):
        raise UsageError(f"pull: malformed source {source!r}")
    found = []
    for root in candidate_roots(cfg.runtime_roots):
        try:
            entries = os.listdir(root)
        except OSError:
            continue
        for cid in entries:
            bundle = _state_bundle(root, cid) if not cid.startswith(".") else None
            if bundle is None or not bundle.is_application_container:
                continue
            meta = bundle.cri_metadata()
            if (meta.get("pod_namespace"), meta.get("pod_name"), meta.get("container_name")) == want \
                    and _running(runtime, root, cid):
                found.append(Located(root, cid, bundle))
    what = f"container {want[2]} of pod {want[0]}/{want[1]}"
    if not found:
        raise NotFound(f"{what} is not running on this node (nothing to hand over)")
    if len(found) > 1:
        raise Conflict(f"{what}: several running containers match ({', '.join(f.cid[:12] for f in found)}); "
                       "pull one by its container id")
    return found[0]


def check_rules(cfg: Config, src: Located, msg: dict, node: str) -> None:
    """Refusals, before anything is touched."""
    what = src.describe()
    if not cfg.migrate_any_container and src.bundle.annotations.get(MIGRATABLE_ANNOTATION, "").lower() not in _TRUE:
        raise PreconditionFailed(
            f"{what} has not opted in to live migration: give its pod the annotation {MIGRATABLE_ANNOTATION}=true "
            f"(or set 'migrate_any_container: true' in the migrt config of node {node}); it was not touched")
    src_ns, dst_ns = src.bundle.cri_metadata().get("pod_namespace"), msg.get("namespace")
    if src_ns and src_ns != dst_ns and not cfg.allow_cross_namespace_restore:
        raise PreconditionFailed(
            f"{what} is in Kubernetes namespace {src_ns!r} and may only move into a pod of that namespace (the pulling "
            f"pod is in {dst_ns or 'no namespace'!r}); set 'allow_cross_namespace_restore: true' on both nodes to "
            "allow it; it was not touched")


class Agent:
    def __init__(self, cfg: Config, report: Report, listen: str | None = None) -> None:
        self.cfg = cfg
        self.listen = listen or cfg.agent_listen
        self.receiver = Receiver(cfg, ReceiveOptions(listen=self.listen, pulls=self.hand_over), report)
        self._busy: set[str] = set()
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
            time.sleep(SWEEP_EVERY_S)

    def hand_over(self, ch: Channel, msg: dict, out: dict) -> None:
        t_start = time.monotonic()
        out.update(mode="pull", source=msg.get("source"))
        src = locate(self.cfg, msg.get("source"))
        out["container_id"] = src.cid
        check_rules(self.cfg, src, msg, ch.local_host)
        port = msg.get("agent_port")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise UsageError(f"pull: the target did not say where its agent listens ({port!r})")
        to = f"[{ch.peer_host}]:{port}" if ":" in ch.peer_host else f"{ch.peer_host}:{port}"
        with self._lock:
            if src.cid in self._busy:
                raise Conflict(f"{src.describe()} is being handed over to another pull already")
            self._busy.add(src.cid)
        try:
            rec = moved.record(src.bundle.annotations, to=ch.peer_host, target_container_id=msg.get("container_id"),
                               target_pod=f"{msg.get('namespace')}/{msg.get('pod')}")
            req = migrate.MigrateRequest(container_id=src.cid, to=to, root=src.root, lazy=True, moved=rec)
            prep = migrate.prepare(self.cfg, req)
            res = migrate.send(self.cfg, req, prep, ch, t_start=t_start, t_connect=t_start)
        finally:
            with self._lock:
                self._busy.discard(src.cid)
        out.update(name=res["name"], to=to, restored=res["restored"], target=res["target"],
                   downtime_s=res["downtime_s"], pages=res.get("pages"), handover=res.get("handover"),
                   timings={**res["phases"], "downtime_s": res["downtime_s"]})
        if res.get("gpu"):  # a GPU container: which GPUs it went to (the pairs), as `migrt migrate --json` says
            out["gpu"] = res["gpu"]
