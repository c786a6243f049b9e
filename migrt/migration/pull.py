"""Live migration into the pod that kubelet creates, target side: the new pod's container `create`
pulls the running container from the source node's agent (agent.py), lazily.

The new pod (same spec, scheduled onto this node) asks with `migrt.io/migrate-from` (pod
annotation) or `MIGRT_MIGRATE_FROM` (container env): `<source node>[:port]/<source>`, where <source>
is `namespace/pod/container`, `namespace/pod` (the container of this one's name) or a container id;
the port defaults to the agent's (7070). containerd runs migrt-runc `create` for it inside kubelet's
StartContainer; that create:

    the source's agent must be one of the node's `migrate_peers` (migrate_peers.py): checked on the address
    as written, before any name is resolved or any connection made; a refusal names the setting
    connect to the source's agent, authenticate    (migration key; TLS when configured)
    pull {source, this pod's namespace}    -> the agent checks the rules (opt-in, namespace) and
                                              then offers, as `migrt migrate` would
    offer  -> ready | error                   this side checks the namespace binding, the mounts,
                                              the GPUs of THIS bundle, before the source freezes
    the source freezes, dumps lazily, sends the images; this side restores into the NEW pod's bundle
    (its sandbox's namespaces, volumes by destination, hostname) under containerd's own flags
    restored -> returns to kubelet             `start` is then a no-op (the restored marker)
    pages follow from the source's page server; done -> the source is destroyed

The create must return once the copy runs, while the pages still arrive, so the pull runs in a
worker process forked at the start; the create waits for its verdict ("running", or why not) and
exits with it. The worker carries on alone with the pages. containerd kills the create when
kubelet's deadline passes (SIGKILL, the create's pid only): the worker notices (its pipe from the
create closes without the create's "ok") and kills itself, so that its guards apply the migration's
rule as for a killed `migrt receive` (guard.py): what was received or restored here is removed, and
the source, which asks this node's agent (`query`), resumes. A failure before the copy runs resumes
the source and fails the create with `OCI runtime create failed: migrt: ...`; a pull is never
retried here and never falls back to a fresh start (the source would run beside it).

What the pod reads (runc's log, so kubelet's events) of a failure to reach or authenticate the agent
is one line, "cannot pull from ADDRESS (see the node's migrt log)", whatever the network answered
(refused, reset, silence, TLS, another protocol's bytes): that goes to the node's log alone. Once the
agent proved it holds the migration key, its answers (its refusals, which say the same whatever the
reason: agent.py) and the migration's own failures reach the pod as they are.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import TYPE_CHECKING

from migrt import migrate_peers as peers
from migrt.errors import MigrtError, PreconditionFailed, UsageError
from migrt.migration.protocol import TransferError
from migrt.runtime.argv import Call, CreateFlags

if TYPE_CHECKING:
    from migrt.config import Config
    from migrt.oci.bundle import Bundle, MigrateFrom

DEFAULT_AGENT_PORT = 7070
CONNECT_TIMEOUT = 5.0  # an unreachable source fails the create within seconds, long before kubelet's deadline
_PART_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._")


def parse(value: str, own_container: str | None) -> tuple[str, dict]:
    """("host:port" of the source's agent, the source as the agent looks it up)."""
    addr, sep, rest = (value or "").strip().partition("/")
    usage = (f"migrate-from {value!r}: expected <node address>[:port]/<namespace>/<pod>[/<container>] or "
             "<node address>[:port]/<container id>")
    if not sep or not addr or not rest:
        raise UsageError(usage)
    if addr.startswith("["):
        host, close, port = addr[1:].partition("]")
        if not close or (port and not port.startswith(":")):
            raise UsageError(usage)
        port = port[1:]
        shown = f"[{host}]"
    elif addr.count(":") == 1:
        host, port = addr.split(":")
        shown = host
    else:  # a name, an IPv4 address, or an IPv6 address without brackets (and so without a port)
        host, port, shown = addr, "", f"[{addr}]" if ":" in addr else addr
    if not host or (port and (not port.isdigit() or not 0 < int(port) < 65536)):
        raise UsageError(usage)
    parts = rest.split("/")
    if not all(p and set(p) <= _PART_CHARS and p.strip(".") for p in parts) or len(parts) > 3:
        raise UsageError(usage)
    if len(parts) == 1:
        source = {"container_id": parts[0]}
    else:
        container = parts[2] if len(parts) == 3 else own_container
        if not container:
            raise UsageError(f"{usage} (this container has no name to look for in pod {parts[0]}/{parts[1]})")
        source = {"namespace": parts[0], "pod": parts[1], "container": container}
    return f"{shown}:{port or DEFAULT_AGENT_PORT}", source


class PeerUnreachable(TransferError):
    """The source's agent could not be reached or did not authenticate; the detail is in the node's log."""

    def __init__(self, address: str) -> None:
        super().__init__(f"cannot pull from {address} (see the node's migrt log)")


def admit_peer(cfg: Config, address: str) -> None:
    """A pod may name only an agent of the node's migrate_peers: refused here, before any name is
    resolved or any connection made (migrate_peers.py says how addresses and names match)."""
    if peers.allowed(address, cfg.migrate_peers):
        return
    why = "lists no node, so every pull is refused" if not cfg.migrate_peers else "does not list it"
    raise PreconditionFailed(
        f"{address} is not a node agent this node may pull from: migrate_peers in the node's migrt config "
        f"({cfg.path}) {why}; ask the cluster's administrators to add the source node's agent; nothing was "
        "contacted")


def describe(source: dict) -> str:
    if "container_id" in source:
        return f"container {source['container_id']}"
    return f"container {source['container']} of pod {source['namespace']}/{source['pod']}"


class PullFailed(MigrtError):
    """The pull's worker process failed: its error's message, and its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def pull_on_create(call: Call, bundle: Bundle, request: MigrateFrom) -> int:
    """The shim's create for a bundle that asks for a pull: returns only when it failed (PullFailed);
    once the copy runs this process ends at once (os._exit(0)) and the worker carries on."""
    verdict_r, verdict_w = os.pipe()
    ack_r, ack_w = os.pipe()
    try:
        pid = os.fork()  # single-threaded here: nothing started yet
    except OSError as exc:
        raise MigrtError(f"cannot start the pull of {request.value!r}: {exc}") from exc
    if pid == 0:  # the worker
        code = 1
        try:
            os.close(verdict_r)
            os.close(ack_w)
            code = _worker(call, bundle, request, verdict_w, ack_r)
        except BaseException:  # noqa: BLE001 - never unwind into the shim's code in a forked child
            pass
        finally:
            os._exit(code)
    os.close(verdict_w)
    os.close(ack_r)
    verdict = _read_verdict(verdict_r)
    if verdict.get("running"):
        # The worker may carry on alone. From its "ok" to this process's end nothing may take time
        # (containerd could still kill it): no interpreter teardown. The shim writes no stdio.
        _ack(ack_w)
        os._exit(0)
    _ack(ack_w)
    raise PullFailed(verdict.get("error") or f"the pull of {request.value!r} ended without a verdict (see migrt's log)",
                     verdict.get("exit_code") or 1)


def _ack(fd: int) -> None:
    try:
        os.write(fd, b"ok")
    except OSError:  # the worker has ended already (after a failure)
        pass


def _read_verdict(fd: int) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    os.close(fd)
    try:
        verdict = json.loads(data)
    except ValueError:
        return {}
    return verdict if isinstance(verdict, dict) else {}


def _say(fd: int, verdict: dict) -> None:
    try:
        os.write(fd, (json.dumps(verdict) + "\n").encode())
        os.close(fd)
    except OSError:
        pass


def _watch_create(ack_r: int, log, acked: threading.Event) -> None:
    """The create went away without its "ok": containerd killed it (kubelet's deadline). Nothing of
    this pull may stay: die the way a killed receiver dies; the guards undo it, the source resumes."""
    try:
        data = os.read(ack_r, 16)
    except OSError:
        data = b""
    if data == b"ok":
        acked.set()
    else:
        log.warning("pull_cancelled", reason="the create was killed (kubelet's deadline?)")
        os.kill(os.getpid(), signal.SIGKILL)


def _worker(call: Call, bundle: Bundle, request: MigrateFrom, verdict_w: int, ack_r: int) -> int:
    os.setsid()  # signals to the create's group are not ours
    from migrt import config as config_mod
    from migrt import log as log_mod

    try:
        cfg = config_mod.load()
    except MigrtError as exc:  # fail closed: never guess a store, a key or a policy
        _say(verdict_w, {"error": str(exc), "exit_code": exc.exit_code})
        return exc.exit_code
    log = log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-runc").bind(pull=request.value)
    acked = threading.Event()  # the create returned to containerd: this copy is kubelet's
    threading.Thread(target=_watch_create, args=(ack_r, log, acked), daemon=True, name="migrt-create-watch").start()
    if call.lower_warning:
        log.warning("lower_runtime_fallback", detail=call.lower_warning)
    said = {"running": False}
    cid = call.container_id or None
    what = f"pull of {request.value!r}"
    part = None
    try:
        address, source = parse(request.value, bundle.cri_metadata().get("container_name"))
        what = f"pull of {describe(source)} from {address}"
        admit_peer(cfg, address)
        flags = call.create_flags()  # refused: no container id, a flag restore cannot honour
        for flag in flags.dropped:
            log.debug("create_flag_dropped", flag=flag)
        cfg.runtime = call.lower  # the shim already resolved it (same rules)
        if request.pod is not None:  # one part of a pod-level pull (podpull.py)
            from migrt.migration.podpull import TargetPart

            part = TargetPart(cfg, bundle, flags.root, request.pod, source)
            what = f"pod-level pull of {describe(source)} from {address}"
        result = _pull(cfg, log, flags, bundle, address, source, verdict_w, said, _Part(part, acked, log))
    except MigrtError as exc:
        result = {"error": str(exc), "exit_code": exc.exit_code}
    except Exception as exc:  # never a traceback in kubelet's events
        log.exception("pull_crashed", container=cid)
        result = {"error": f"internal error: {exc!r}", "exit_code": 1}
    if result.get("error"):
        log.error("pull_failed", container=cid, **result)
        if part is not None:  # the pod's other parts restored here go too; the source keeps the pod
            part.abandon(f"container {part.name}: {result['error']}")
        if not said["running"]:
            _say(verdict_w, {"error": f"{what} failed: {result['error']}", "exit_code": result.get("exit_code") or 1})
        return result.get("exit_code") or 1
    log.info("pulled", container=cid, **result)
    return 0


class _Part:
    """What a pull does differently as one part of a pod-level pull (none: a single pull)."""

    def __init__(self, part, acked: threading.Event, log) -> None:
        self.part, self.acked, self.log = part, acked, log

    def arrived(self, cid: str | None) -> bool:
        """The copy is restored (held frozen): True when it is the pod's last part."""
        return self.part.arrived(cid) if self.part is not None else False

    def release(self) -> None:
        """The last part's create has returned: thaw the whole pod together."""
        if not self.acked.wait(60):  # the create was killed meanwhile: _watch_create ends this process
            return
        try:
            self.part.release()
        except MigrtError as exc:  # the pod's parts are in: thaw by hand what would not thaw
            self.log.error("pod_release_failed", error=str(exc))

    def message(self) -> dict:
        return {"pod_pull": self.part.message()} if self.part is not None else {}

    def offer(self, offer: dict) -> None:
        """The source's offer: a GPU part is restored running, then paused (TargetPart.unheld)."""
        if self.part is not None and offer.get("gpu"):
            self.part.unheld()

    @property
    def before_done(self):
        return self.part.wait if self.part is not None else None


def _pull(cfg: Config, log, flags: CreateFlags, bundle: Bundle, address: str, source: dict, verdict_w: int,
          said: dict, part: _Part) -> dict:
    from migrt.migration.receive import ReceiveOptions, Receiver
    from migrt.migration.tls import TLSFiles
    from migrt.migration.wire import connect, load_key, parse_address

    def restored(res: dict) -> None:
        """The copy runs (a pod's part: held frozen until the pod's last part): kubelet may have it.
        Our stdio are containerd's pipes: let them go."""
        last = part.arrived(cid)  # a pod given up meanwhile: refused here, the copy then removed
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        said["running"] = True
        _say(verdict_w, {"running": True, "pid": res.get("pid")})
        if last:
            part.release()

    cid = flags.container_id
    receiver = Receiver(cfg, ReceiveOptions(listen="", once=True, restore_bundle=bundle.path, root=flags.root,
                                            container_id=cid, create=flags, on_restored=restored,
                                            before_done=part.before_done, on_offer=part.offer),
                        report=lambda out: log.info("pull_session", **out))
    key = load_key(cfg.migration_key_file)
    meta = bundle.cri_metadata()
    try:
        tls = TLSFiles(**cfg.migration_tls) if cfg.migration_tls else None
        ch = connect(address, key, timeout=CONNECT_TIMEOUT, tls=tls, stall=cfg.migration_stall_timeout)
    except TransferError as exc:  # what the network answered: the node's log only
        log.warning("pull_unreachable", address=address, detail=str(exc),
                    hint="nothing was touched there; is the node agent 'migrt serve' running there, and do the "
                         "two nodes share the migration key (and TLS settings)?")
        raise PeerUnreachable(address) from exc
    ch.send({"type": "pull", "source": source, "namespace": meta.get("pod_namespace"), "pod": meta.get("pod_name"),
             "container": meta.get("container_name"), "container_id": cid,
             "agent_port": parse_address(cfg.agent_listen)[1], **part.message()})
    out = receiver.converse(ch)
    if out.get("error"):
        return {"error": out["error"], "exit_code": out.get("exit_code") or 1}
    return {"source": source, "from": address, "timings": out.get("timings"), "pages": out.get("pages")}
