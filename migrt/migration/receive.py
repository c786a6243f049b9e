"""Live migration, target side: `migrt receive` accepts authenticated senders and imports what they
send into the local store, then restores it when started with a bundle to restore into.

One connection = one migration:
    hello/auth                         a peer without the key is refused here
    offer   -> ready | error           refusals (bad name, name taken, container id taken, lazy without
                                       --restore) happen before the source freezes anything
    file... -> staging, sha256 on the fly
    commit  -> verify against the sender's manifest, atomic commit -> committed
    restore -> restored                (stop-and-copy; lazy restores right at commit, pages then flow
                                       until `done`)
    or, on a new connection:
    query   -> answer                  does a container restored from that checkpoint run here?
Any failure before the commit discards the staging directory: nothing becomes visible.

A restored copy is kept unless it fails here (its restore, or a lazy copy's pages), in which case it
is killed before the sender hears about it; a cut connection changes nothing (handover.py has the
rule). runc restore and a lazy copy's page filler are watched: no progress for `migration_stall_timeout`
seconds (or the filler failed) and they are killed and cleaned up (watchdog.py). A guard process
(guard.py) does the same cleaning if the receiver itself is killed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from migrt import faults, jsonsafe, names
from migrt.config import Config
from migrt.criu import lazy as lazy_mod
from migrt.errors import Conflict, MigrtError, RuntimeFailed, UsageError
from migrt.migration import bulk, handover, watchdog
from migrt.migration.admission import Admission
from migrt.migration.gpu import target_preflight
from migrt.migration.guard import Guard, wait_for_guards
from migrt.migration.protocol import AuthError
from migrt.migration.tls import TLSFiles
from migrt.migration.wire import Channel, TransferError, accept, load_key, parse_address
from migrt.oci.bundle import Bundle
from migrt.ops.restore import RestoreSeams, RestoreTarget, check_target, restore_checkpoint
from migrt.pagefill import PageFill
from migrt.pods import hold
from migrt.runtime.argv import CreateFlags
from migrt.runtime.lower import default_root
from migrt.runtime.markers import marker_path
from migrt.runtime.runc import LowerRuntime, candidate_roots
from migrt.store import Store
from migrt.store import manifest as mf
from migrt.store.importer import Import, check_relpath, importing

PAGES_PROTOCOL = "migrt-pages/1"  # lazy pages from migrt's page server (pageserve.py, pagefill/remote.py)

MODES = ("stop-and-copy", "lazy", "direct")
PAGE_MODES = ("lazy", "direct")  # the memory comes from the source's page server (direct: before anything runs)
DECIDE_TIMEOUT = 3600.0  # a query waits for the migration it asks about (which progress deadlines bound)

Report = Callable[[dict], None]


@dataclass
class ReceiveOptions:
    listen: str
    once: bool = False
    restore_bundle: str | None = None  # restore each migration into this OCI bundle
    root: str | None = None            # runc root for those restores (default: the runtime's)
    container_id: str | None = None    # id of the restored container (default: the source's id)
    output: str = os.devnull           # restored container's stdout and stderr
    # A restore inside the lower runtime's `create` (a pod's pull, pull.py): what the create's command
    # line says (global flags, pid file, console socket, log: runtime/argv.py); stdio inherited.
    create: CreateFlags | None = None
    on_restored: Callable[[dict], None] | None = None  # the copy runs (a pull returns to kubelet here)
    # The node agent (agent.py): hands this node's containers over to pulls; takes no pushed offers.
    pulls: Callable[[Channel, dict, dict], None] | None = None
    streams: int | None = None         # most data streams a stop-and-copy sender may use (migration/bulk.py)
    # A lazy copy's last step before `done` (every page in): one part of a pod-level pull waits there
    # for the pod's last part (podpull.py); raising removes the copy and fails the migration.
    before_done: Callable[[], None] | None = None
    # The offer, once every check passed (a pod-level pull's part: held at CRIU's pre-resume, or a GPU
    # part restored running and paused after, podpull.py TargetPart.unheld).
    on_offer: Callable[[dict], None] | None = None


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


class Receiver:
    def __init__(self, cfg: Config, opts: ReceiveOptions, report: Report) -> None:
        self.cfg = cfg
        self.opts = opts
        self.report = report
        self.key = load_key(cfg.migration_key_file)
        self.tls = TLSFiles(**cfg.migration_tls) if cfg.migration_tls else None
        self.store = Store(cfg.store)
        self.store.ensure()
        self.store.gc()
        self.runtime = cfg.runtime_path()
        self.root = opts.root or default_root(self.runtime)
        self.stall = cfg.migration_stall_timeout
        self.streams = opts.streams or cfg.migration_streams or bulk.auto_streams()
        self._deciding: dict[str, threading.Event] = {}  # checkpoint name -> set once its fate is known
        self._queries_only = False
        self._claimed = threading.Lock()  # --once: held by the one migration it receives
        self.admission = Admission(deadline=self.stall)  # before authentication: few, and not for long
        if opts.restore_bundle:
            Bundle.load(os.path.abspath(opts.restore_bundle))  # fail now, not at the first migration
            # Imports a restore needs (pycriu alone takes ~0.4 s here) are paid now, not in a downtime.
            with contextlib.suppress(ImportError):
                import pycriu  # noqa: F401

    # -- server loop ----------------------------------------------------------------------------
    def bind(self) -> socket.socket:
        host, port = parse_address(self.opts.listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            return socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise TransferError(f"cannot listen on {self.opts.listen}: {exc.strerror or exc}") from exc

    def serve(self, server: socket.socket) -> dict | None:
        """Accept forever, each connection in its own thread, those not yet authenticated held to
        self.admission's limits. With --once, return the result of the one authenticated migration
        (connections that do not authenticate, or only ask a question, do not count); if the sender's
        connection broke while we restored, first answer its queries (it asks on a new connection
        whether the container runs here) for a while."""
        ended: queue.SimpleQueue[dict] = queue.SimpleQueue()
        result: dict | None = None
        linger_until = 0.0
        if self.opts.once:
            server.settimeout(0.2)
        while True:
            while self.opts.once and not ended.empty():
                res = ended.get()
                if result is None and res.get("request") == "offer":
                    result = res
                    if not res.get("unsettled"):
                        return result
                    self._queries_only = True
                    linger_until = time.monotonic() + 3 * self.stall
                elif result is not None and res.get("answer"):
                    return result
            if linger_until and time.monotonic() > linger_until:
                return result
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                raise TransferError(f"accept on {self.opts.listen}: {exc.strerror or exc}") from exc
            conn.settimeout(None)

            def run(conn: socket.socket = conn) -> None:
                res = self.handle(conn)
                if res.get("authenticated"):
                    ended.put(res)

            threading.Thread(target=run, daemon=True, name="migrt-receive").start()

    # -- one migration ---------------------------------------------------------------------------
    def handle(self, conn: socket.socket) -> dict:
        try:
            peer = "{}:{}".format(*conn.getpeername()[:2])
        except OSError:
            peer = "?"
        ticket = self.admission.admit(conn)

        def authenticate() -> Channel:
            try:
                return accept(conn, self.key, tls=self.tls, stall=self.stall)
            finally:
                self.admission.done(ticket)

        return self._session(peer, authenticate, conn)

    def converse(self, ch: Channel) -> dict:
        """One migration on a channel this node opened itself (a pod's pull: pull.py), the source's
        offer coming next."""
        return self._session(ch.peer, lambda: ch, None)

    def _session(self, peer: str, channel: Callable[[], Channel], conn: socket.socket | None) -> dict:
        t0 = time.monotonic()
        out: dict = {"peer": peer, "name": None, "mode": None, "committed": False, "restored": False,
                     "bytes": 0, "timings": {}, "error": None}
        ch: Channel | None = None
        try:
            ch = channel()
            out["authenticated"] = True
            self._migration(ch, out)
        except AuthError as exc:
            out.update(error=str(exc), exit_code=exc.exit_code, refused=True)
        except MigrtError as exc:
            if ch:
                ch.error(str(exc), exc.exit_code)
            out.update(error=str(exc), exit_code=exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - a broken migration must not take the receiver down
            if ch:
                ch.error(f"internal error on the receiver: {exc!r}")
            out.update(error=f"internal error: {exc!r}", exit_code=1)
        finally:
            if ch:
                ch.close()
            elif conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
        out["timings"]["total_s"] = round(time.monotonic() - t0, 3)
        self.report(out)
        return out

    def _migration(self, ch: Channel, out: dict) -> None:
        offer = ch.recv("offer", "query", "pull")
        out["request"] = offer["type"]
        if offer["type"] == "query":
            self._answer(ch, offer, out)
            return
        if offer["type"] == "pull":
            if not self.opts.pulls:
                raise UsageError("this node does not hand containers over here: pulls go to its node agent "
                                 "('migrt serve', config 'agent_listen')")
            self.opts.pulls(ch, offer, out)
            return
        if self.opts.pulls:
            raise UsageError("this is a node agent ('migrt serve'): it hands containers over to pulls and takes "
                             "none pushed to it; push with 'migrt migrate' to a 'migrt receive'")
        if self._queries_only:
            raise Conflict("this receiver (--once) has handled its migration; it only answers queries now")
        if self.opts.once and not self._claimed.acquire(blocking=False):
            raise Conflict("this receiver (--once) is receiving another migration; it takes one")
        name = names.validate(offer.get("name"))
        mode = offer.get("mode")
        out.update(name=name, mode=mode)
        if mode not in MODES:
            raise UsageError(f"unknown migration mode {mode!r}")
        if not isinstance(offer.get("schema"), int) or offer["schema"] > mf.SCHEMA:
            raise UsageError(f"the sender writes manifest schema {offer.get('schema')}; this node understands "
                             f"{mf.SCHEMA}: upgrade migrt here")
        restore_id = self.opts.container_id or offer.get("container_id")
        if self.opts.restore_bundle:
            restore_id = _check_id(restore_id)
            if os.path.exists(os.path.join(self.root, restore_id)):
                raise Conflict(f"container {restore_id} already exists in {self.root} on the target")
        bundle = Bundle.load(os.path.abspath(self.opts.restore_bundle)) if self.opts.restore_bundle else None
        if bundle is not None and "cri" in offer:  # the rules of the restore, before the source freezes
            check_target({"source": {"cri": offer.get("cri") or {}}, "mounts": offer.get("mounts") or []}, bundle,
                         f"container {offer.get('container_id')}",
                         allow_cross_namespace=self.cfg.allow_cross_namespace_restore,
                         allow_unbound=self.cfg.allow_unbound_checkpoints)
        gpu = target_preflight(self.cfg, offer.get("gpu"), bundle.config if bundle else None,
                               f"migration of {offer.get('container_id')}")
        if gpu is not None:
            out["gpu"] = gpu
        if mode in PAGE_MODES:
            if not self.opts.restore_bundle:
                raise UsageError(f"{mode} migration needs a target that restores at once: start 'migrt receive' "
                                 "with --restore BUNDLE")
            lazy_mod.lazy_preflight("target")
        if name in self._deciding:
            raise Conflict(f"checkpoint {name} is being received from another sender")
        if self.opts.on_offer:
            self.opts.on_offer(offer)
        decided = self._deciding[name] = threading.Event()
        guard = Guard(f"target:{name}", self.cfg.log_file)
        try:
            self._receive(ch, offer, name, mode, restore_id, guard, decided, out)
        finally:
            decided.set()
            self._deciding.pop(name, None)
            guard.release(wait=self.stall * 3)

    def _receive(self, ch: Channel, offer: dict, name: str, mode: str, restore_id: str | None, guard: Guard,
                 decided: threading.Event, out: dict) -> None:
        t0 = time.monotonic()
        with importing(self.store, name) as imp:
            guard.arm({"do": "remove", "remove": [imp.path]})
            streams = bulk.Listener(ch, self.streams, tls=self.tls, stall=self.stall)  # lives as long as ch
            ch.send({"type": "ready", "restore": bool(self.opts.restore_bundle), "container_id": restore_id,
                     "pages": [PAGES_PROTOCOL], "bulk": streams.offer(),
                     **({"gpu": out["gpu"]} if out.get("gpu") is not None else {})})
            msg = self._take_files(ch, imp, streams, out)
            out["timings"]["receive_s"] = round(time.monotonic() - t0, 3)
            fill = self._commit(ch, imp, msg, offer, mode, restore_id, guard, out)
        out["committed"] = True
        if fill:
            assert restore_id is not None  # a filler runs in the page modes, which need --restore
            out["unsettled"] = True  # until the sender's bye: it may have to ask again
            guard.arm({"do": "remove", "pids": [fill.proc.pid], "store": self.store.root, "name": name})
            self._restore_lazy(ch, name, restore_id, fill, guard, decided, out, direct=mode == "direct")
            return
        guard.arm({"do": "nothing"})  # the committed checkpoint stays, whatever happens next
        # From here until the sender's bye, a sender that loses us may be about to ask again (it asks
        # whenever it may have sent `restore`, before knowing whether we got it).
        out["unsettled"] = bool(self.opts.restore_bundle)
        ch.send({"type": "committed", "name": name})
        try:
            nxt = ch.recv("restore", "bye")
        except TransferError:
            return  # the source went away after the commit: the checkpoint is safely here
        if nxt["type"] != "restore":
            out["unsettled"] = False
            return
        if not self.opts.restore_bundle or restore_id is None:  # (an id is checked with --restore)
            raise UsageError("this receiver was not started with --restore")
        self._restore_committed(ch, name, restore_id, guard, decided, out)

    def _take_files(self, ch: Channel, imp: Import, streams: bulk.Listener, out: dict) -> dict:
        """The files, one by one on the connection or all at once over the bulk streams, until the
        sender's commit (returned)."""
        while True:
            msg = ch.recv("file", "commit", "bulk")
            if msg["type"] == "commit":
                return msg
            if msg["type"] == "bulk":  # every file at once, over several streams (migration/bulk.py)
                out["bytes"] += bulk.receive_import(ch, msg, imp, streams)
                out["streams"] = msg.get("streams")
                continue
            rel, size = msg.get("path"), msg.get("size")
            if not isinstance(size, int) or size < 0:
                raise UsageError(f"file {rel!r} announced with an invalid size")
            rel = check_relpath(rel)
            with imp.open(rel) as fd:
                digest = ch.recv_file(fd, size)
            imp.record(rel, size, digest)
            out["bytes"] += size
            faults.point("receive:file")  # test seam: a receiver killed mid-transfer

    def _commit(self, ch: Channel, imp: Import, msg: dict, offer: dict, mode: str, restore_id: str | None,
                guard: Guard, out: dict) -> PageFill | None:
        """The sender's manifest with where the checkpoint came from, committed; in the page modes the
        images verified first and the page filler started (returned; None otherwise)."""
        manifest = msg.get("manifest") or {}
        fields = dict(manifest)
        fields["migration"] = {"from": ch.peer, "mode": mode, "received_at": _utc(time.time()),
                               "source_container": offer.get("container_id")}
        fill = None
        if mode in PAGE_MODES:
            assert restore_id is not None  # the page modes need --restore (checked at the offer)
            spec = self._page_source(msg, ch)
            fields["lazy"] = {"pages": "on the source's page server", "address": spec["address"],
                              "port": spec["port"]}
            imp.verify(manifest.get("files"))  # CRIU never reads an unverified image
            fill = self._start_filler(imp.images, spec, restore_id, first=mode == "direct")
            guard.arm({"do": "remove", "remove": [imp.path], "pids": [fill.proc.pid]})
        t1 = time.monotonic()
        try:
            with ch.busy("commit"):
                imp.commit(fields, manifest.get("files"), durable=mode not in PAGE_MODES)
        except BaseException:
            if fill:
                _stop_fill(fill)
            raise
        out["timings"]["commit_s"] = round(time.monotonic() - t1, 3)
        return fill

    def _restore_committed(self, ch: Channel, name: str, restore_id: str, guard: Guard, decided: threading.Event,
                           out: dict) -> None:
        """The sender's `restore` of the committed checkpoint; a failed restore of a GPU container removes
        it (the source resumes on its own GPU); once it runs, the sender told and its bye awaited."""
        with ch.busy("restore"):
            try:
                res = self._restore(name, restore_id, guard)
            except MigrtError as exc:
                if out.get("gpu") is not None:  # the source resumes on its own GPU: nothing of it stays here
                    with contextlib.suppress(MigrtError, OSError):
                        self.store.remove(name)
                        out["committed"] = False
                        exc.message += f"; the target removed checkpoint {name}"
                raise
        # The copy runs here and stays: from now on a broken connection changes nothing (the sender
        # asks again if it has to).
        guard.arm({"do": "nothing"})
        decided.set()
        out.update(restored=True, container_id=restore_id, pid=res["pid"])
        out["timings"]["restore_s"] = res["timings"].get("total_s")
        out["timings"]["restore"] = res["timings"]
        out["restore_pages"] = res.get("pages")  # the restore's page mode (the filler from this store, or eager)
        if self.opts.on_restored:
            self.opts.on_restored(res)
        try:
            ch.send({"type": "restored", "container_id": restore_id, "pid": res["pid"], "timings": res["timings"]})
            ch.recv("bye")
            out["unsettled"] = False
        except TransferError as exc:
            out["handover"] = f"connection lost after the restore ({exc}); the container runs here"

    def _answer(self, ch: Channel, msg: dict, out: dict) -> None:
        """A sender lost us while we restored: tell it, once that migration is decided, whether a
        container restored from the checkpoint runs here."""
        name = names.validate(msg.get("name"))
        cid = msg.get("container_id")
        out.update(name=name, mode="query")
        with ch.busy("deciding"):
            decided = self._deciding.get(name)
            if decided:
                decided.wait(DECIDE_TIMEOUT)
            wait_for_guards(f"target:{name}", DECIDE_TIMEOUT)  # a killed receiver's guard still cleaning
            state = handover.RUNNING if self._runs(cid, name) else handover.ABSENT
        out["answer"] = state
        ch.send({"type": "answer", "state": state})

    def _runs(self, cid: object, name: str) -> bool:
        """Whether container `cid`, restored from checkpoint `name`, runs here: in our runc root, or
        (a pod's pull restored it inside containerd's create) in another of this node's."""
        try:
            cid = _check_id(cid)
        except MigrtError:
            return False
        for root in dict.fromkeys([self.root, *candidate_roots(self.cfg.runtime_roots)]):
            try:
                with open(marker_path(root, cid), encoding="utf-8") as fh:
                    if jsonsafe.load(fh, max_bytes=1 << 20).get("checkpoint") != name:
                        continue
            except (OSError, ValueError, AttributeError):
                continue
            hold.wait_for_part(root, cid, DECIDE_TIMEOUT)  # a pod's part held here: once the pod is decided
            return self._alive(cid, root)
        return False

    def _alive(self, cid: str, root: str | None = None) -> bool:
        return LowerRuntime(self.runtime).status(root or self.root, cid) in ("running", "paused")

    def _page_source(self, msg: dict, ch: Channel) -> dict:
        """Where the filler fetches the pages: always the authenticated peer itself (never an address
        it names), with a key derived from this connection's session (pagefill/remote.py)."""
        ps = msg.get("pages") or {}
        if ps.get("protocol") != PAGES_PROTOCOL or not isinstance(ps.get("port"), int) or not 0 < ps["port"] < 65536:
            raise UsageError(f"lazy migration: the sender offers its pages as {ps!r}; this node takes "
                             f"{PAGES_PROTOCOL} only")
        return {"address": ch.peer_host, "port": ps["port"], "key": ch.pages_key.hex(),
                "tls": self.cfg.migration_tls or None, "timeout": self.stall}

    def _start_filler(self, images: str, spec: dict, restore_id: str, first: bool = False) -> PageFill:
        """The page filler for the images just verified, fetching from the source: started before the
        commit and the restore's preparations, so that its start-up overlaps them. It keeps the images
        directory open, so the commit's rename does not disturb it. first (a direct migration): it
        copies from CRIU's post-restore on, while the restore holds the tree there (ops/pages.py)."""
        from migrt.ops import pages

        try:
            return PageFill.start(images, threads=pages.streams(self.cfg), container_id=restore_id, root=self.root,
                                  log_file=self.cfg.log_file, remote=spec, post_restore=True if first else None)
        except MigrtError as exc:
            raise RuntimeFailed(f"lazy migration: {exc}") from exc

    def _restore(self, name: str, restore_id: str, guard: Guard, fill: PageFill | None = None,
                 **seams) -> dict:
        """restore_checkpoint under the progress deadline; a stuck or failed restore is killed and
        everything it left (mounts in its work directory, the container's state) removed."""
        where: dict = {}
        before = seams.pop("before_restore", None)
        extra_pids = [fill.proc.pid] if fill else []

        def prepare(view: str, work: str) -> None:
            where["work"] = work
            if before:
                before(view, work)

        def daemon_gone() -> str | None:
            st = fill.status() if fill else {}
            return f"the page filler failed: {st.get('error')}" if st.get("state") == "failed" else None

        def supervise(proc) -> int:
            guard.arm({**guard.current, "do": "kill-restore", "runtime": self.runtime, "root": self.root,
                       "cid": restore_id, "pids": [proc.pid, *extra_pids], "work": where.get("work")})
            try:
                return watchdog.supervise(proc, stall=self.stall, what=f"runc restore of {restore_id}",
                                          also=lambda: extra_pids, check=daemon_gone)
            except watchdog.Stuck:
                if fill:
                    _stop_fill(fill)
                if where.get("work"):
                    watchdog.kill_users(where["work"])
                    watchdog.unmount_under(where["work"])
                # before restore_checkpoint's `runc delete` (see watchdog.clear_container: it would
                # delete the bundle's rootfs through runc's criu-root bind mount)
                watchdog.unmount_under(os.path.join(self.root, restore_id))
                raise

        if not self.opts.restore_bundle:  # (the callers checked it)
            raise UsageError("this receiver was not started with --restore")
        bundle = Bundle.load(os.path.abspath(self.opts.restore_bundle))
        hooks = RestoreSeams(verified=True, before_restore=prepare, supervise=supervise, fill=fill, **seams)
        try:
            if self.opts.create is not None:  # inside containerd's create: its flags, its stdio
                return restore_checkpoint(self.cfg, name, RestoreTarget.for_create(self.opts.create, bundle, hooks))
            with open(os.devnull, "rb") as devnull, open(self.opts.output, "ab") as sink:
                return restore_checkpoint(self.cfg, name, RestoreTarget(
                    container_id=restore_id, bundle=bundle, root=self.root, stdio=(devnull, sink, sink), seams=hooks))
        except BaseException:
            watchdog.clear_container(self.runtime, self.root, restore_id)
            guard.arm({**guard.current, "do": "remove", "pids": [], "cid": None})  # cleaned up already
            raise

    def _restore_lazy(self, ch: Channel, name: str, restore_id: str, fill: PageFill, guard: Guard,
                      decided: threading.Event, out: dict, direct: bool = False) -> None:
        """Restore at once from a checkpoint without memory pages; the page filler fetches them from the
        source while the container already runs. The copy is kept only if every page arrives;
        otherwise it is killed (the filler's guard does it; we then remove what is left) before the
        sender hears about it. The pageless checkpoint is removed afterwards. direct: the restored tree
        is held at CRIU's post-restore until every page is in (RestoreSeams.fill_first): it runs with
        all of its memory, and a failure before that leaves nothing that ran."""
        def progress() -> dict:
            st = fill.status()
            return {"done_bytes": st.get("copied_bytes") or 0, "total_bytes": st.get("lazy_bytes") or 0}

        try:
            with ch.busy("restore", info=progress if direct else None, every=1.0 if direct else None):
                res = self._restore(name, restore_id, guard, fill, **({"fill_first": self.stall} if direct else {}))
            # A receiver killed from here on takes the copy with it (its pages would never all arrive).
            guard.arm({**guard.current, "do": "kill-restore", "runtime": self.runtime, "root": self.root,
                       "cid": restore_id, "pids": [fill.proc.pid], "work": None})
            out.update(restored=True, container_id=restore_id, pid=res["pid"])
            out["timings"]["restore_s"] = res["timings"].get("total_s")
            out["timings"]["restore"] = res["timings"]
            connected = True
            try:
                ch.send({"type": "restored", "container_id": restore_id, "pid": res["pid"], "timings": res["timings"]})
            except TransferError:
                connected = False  # the pages do not travel on this connection: carry on without it
            if self.opts.on_restored:
                self.opts.on_restored(res)
            t0 = time.monotonic()
            try:
                def progress() -> dict:
                    st = fill.status()
                    return {"done_bytes": st.get("copied_bytes") or 0, "total_bytes": st.get("lazy_bytes") or 0}

                with ch.busy("pages", info=progress, every=1.0) if connected else contextlib.nullcontext():
                    st = fill.wait(interval=0.02, stall=self.stall)
                    if self.opts.before_done:
                        self.opts.before_done()
                if not self._alive(restore_id):  # deleted meanwhile (by whoever owns it here): the source resumes
                    raise RuntimeFailed("it stopped running here before all its pages were in")
            except MigrtError as exc:
                _stop_fill(fill)
                watchdog.clear_container(self.runtime, self.root, restore_id)
                guard.arm({**guard.current, "do": "remove", "pids": [], "cid": None})
                out.update(restored=False)
                raise MigrtError(f"the restored copy {restore_id} did not get all its memory pages and was removed: "
                                 f"{exc}") from exc
            finally:
                decided.set()
            guard.arm({"do": "nothing"})
            out["timings"]["pages_s"] = round(time.monotonic() - t0, 3)
            out["pages"] = {k: st.get(k) for k in ("copied_bytes", "fill_s", "threads", "counts") if k in st}
            if connected:
                try:
                    ch.send({"type": "done", "pages_s": out["timings"]["pages_s"], "fill": out["pages"]})
                    ch.recv("bye")
                    out["unsettled"] = False
                except TransferError as exc:
                    out["handover"] = f"connection lost after the pages arrived ({exc}); the container runs here"
        finally:
            fill.detach()
            with contextlib.suppress(MigrtError, OSError):
                self.store.remove(name)
            out["committed"] = False  # a checkpoint without its pages is not kept


def _stop_fill(fill: PageFill) -> None:
    """The restore is abandoned: the filler stops (its guard kills a container it already serves)."""
    fill.abort()
    with contextlib.suppress(OSError):
        fill.proc.kill()
    fill.stop(10)


def _check_id(cid: object) -> str:
    return names.container_id(cid)  # the id to restore into, before it becomes a path


