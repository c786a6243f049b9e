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
Any failure before the commit discards the staging directory: nothing becomes visible.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from migrt import names
from migrt.config import Config
from migrt.criu import lazy as lazy_mod
from migrt.errors import Conflict, MigrtError, UsageError
from migrt.oci.bundle import Bundle
from migrt.ops.restore import RestoreTarget, restore_checkpoint
from migrt.runtime.lower import default_root
from migrt.store import Store
from migrt.store import manifest as mf
from migrt.store.importer import importing
from migrt.migration.wire import Channel, TransferError, accept, load_key, parse_address
from migrt.migration.protocol import AuthError
from migrt.migration.tls import TLSFiles

MODES = ("stop-and-copy", "lazy")
LAZY_PAGES_TIMEOUT = 3600.0

Report = Callable[[dict], None]


@dataclass
class ReceiveOptions:
    listen: str
    once: bool = False
    restore_bundle: str | None = None  # restore each migration into this OCI bundle
    root: str | None = None            # runc root for those restores (default: the runtime's)
    container_id: str | None = None    # id of the restored container (default: the source's id)
    output: str = os.devnull           # restored container's stdout and stderr


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
            return socket.create_server((host, port), family=family, backlog=16)
        except OSError as exc:
            raise TransferError(f"cannot listen on {self.opts.listen}: {exc.strerror or exc}") from exc

    def serve(self, server: socket.socket) -> dict | None:
        """Accept forever (or one connection with --once; then return its result)."""
        while True:
            try:
                conn, _ = server.accept()
            except OSError as exc:
                raise TransferError(f"accept on {self.opts.listen}: {exc.strerror or exc}") from exc
            if self.opts.once:
                return self.handle(conn)
            threading.Thread(target=self.handle, args=(conn,), daemon=True, name="migrt-receive").start()

    # -- one migration ---------------------------------------------------------------------------
    def handle(self, conn: socket.socket) -> dict:
        t0 = time.monotonic()
        try:
            peer = "%s:%s" % conn.getpeername()[:2]
        except OSError:
            peer = "?"
        out: dict = {"peer": peer, "name": None, "mode": None, "committed": False, "restored": False,
                     "bytes": 0, "timings": {}, "error": None}
        ch: Channel | None = None
        try:
            ch = accept(conn, self.key, tls=self.tls)
            self._migration(ch, out)
        except AuthError as exc:
            out.update(error=str(exc), exit_code=exc.exit_code, refused=True)
        except MigrtError as exc:
            if ch:
                ch.error(str(exc), exc.exit_code)
            out.update(error=str(exc), exit_code=exc.exit_code)
        except Exception as exc:  # a broken migration must not take the receiver down
            if ch:
                ch.error(f"internal error on the receiver: {exc!r}")
            out.update(error=f"internal error: {exc!r}", exit_code=1)
        finally:
            if ch:
                ch.close()
            else:
                with contextlib.suppress(OSError):
                    conn.close()
        out["timings"]["total_s"] = round(time.monotonic() - t0, 3)
        self.report(out)
        return out

    def _migration(self, ch: Channel, out: dict) -> None:
        offer = ch.recv("offer")
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
            if not restore_id or "/" in restore_id or restore_id in (".", ".."):
                raise UsageError(f"invalid container id {restore_id!r} to restore into")
            if os.path.exists(os.path.join(self.root, restore_id)):
                raise Conflict(f"container {restore_id} already exists in {self.root} on the target")
        if mode == "lazy":
            if not self.opts.restore_bundle:
                raise UsageError("lazy migration needs a target that restores at once: start 'migrt receive' "
                                 "with --restore BUNDLE")
            lazy_mod.lazy_preflight("target")
        t0 = time.monotonic()
        with importing(self.store, name) as imp:
            ch.send({"type": "ready", "restore": bool(self.opts.restore_bundle), "container_id": restore_id})
            while True:
                msg = ch.recv("file", "commit")
                if msg["type"] == "commit":
                    break
                rel, size = msg.get("path"), msg.get("size")
                if not isinstance(size, int) or size < 0:
                    raise UsageError(f"file {rel!r} announced with an invalid size")
                with imp.open(rel) as fd:
                    digest = ch.recv_file(fd, size)
                imp.record(rel, size, digest)
                out["bytes"] += size
            out["timings"]["receive_s"] = round(time.monotonic() - t0, 3)
            manifest = msg.get("manifest") or {}
            fields = dict(manifest)
            fields["migration"] = {"from": ch.peer, "mode": mode, "received_at": _utc(time.time()),
                                   "source_container": offer.get("container_id")}
            lazy = None
            if mode == "lazy":
                page_server = self._page_server(msg, ch)
                fields["lazy"] = {"pages": "on the source's page server", **page_server}
                imp.verify(manifest.get("files"))  # CRIU never reads an unverified image
                lazy = self._start_lazy_daemon(name, imp.images, page_server)
            t1 = time.monotonic()
            try:
                imp.commit(fields, manifest.get("files"), durable=mode != "lazy")
            except BaseException:
                if lazy:
                    lazy.close()
                raise
            out["timings"]["commit_s"] = round(time.monotonic() - t1, 3)
        out["committed"] = True
        if lazy:
            self._restore_lazy(ch, name, restore_id, lazy, out)
            return
        ch.send({"type": "committed", "name": name})
        try:
            nxt = ch.recv("restore", "bye")
        except TransferError:
            return  # the source went away after the commit: the checkpoint is safely here
        if nxt["type"] == "restore":
            if not self.opts.restore_bundle:
                raise UsageError("this receiver was not started with --restore")
            res = self._restore(name, restore_id)
            out.update(restored=True, container_id=restore_id, pid=res["pid"])
            out["timings"]["restore_s"] = res["timings"].get("total_s")
            ch.send({"type": "restored", "container_id": restore_id, "pid": res["pid"], "timings": res["timings"]})
            with contextlib.suppress(TransferError):
                ch.recv("bye")

    @staticmethod
    def _page_server(msg: dict, ch: Channel) -> dict:
        ps = msg.get("page_server") or {}
        peer_host = ch.sock.getpeername()[0]
        # The daemon connects only to the authenticated peer itself, never to an address it names.
        if ps.get("address") != peer_host or not isinstance(ps.get("port"), int) or not 0 < ps["port"] < 65536:
            raise UsageError(f"lazy migration: page server {ps!r} is not on the sending node {peer_host}")
        return {"address": peer_host, "port": ps["port"]}

    def _restore(self, name: str, restore_id: str, **seams) -> dict:
        with open(os.devnull, "rb") as devnull, open(self.opts.output, "ab") as sink:
            return restore_checkpoint(self.cfg, name, RestoreTarget(
                container_id=restore_id, bundle=Bundle.load(os.path.abspath(self.opts.restore_bundle)),
                root=self.root, stdio=(devnull, sink, sink), verified=True, **seams))

    def _start_lazy_daemon(self, name: str, images: str, page_server: dict) -> "_LazyDaemon":
        """`criu lazy-pages` for the images just verified: started before the commit and the restore's
        preparations, so that its start-up (~50 ms here) overlaps them. It keeps the images directory
        open, so the commit's rename does not disturb it; its socket lives in a directory of ours (short:
        a unix socket path has at most 107 bytes) and is linked into runc's work directory right before
        the restore."""
        workdir = tempfile.mkdtemp(prefix="migrt-lazy-")
        try:
            daemon = lazy_mod.LazyPagesDaemon(images, workdir, page_server["address"], page_server["port"],
                                              os.path.join(workdir, "lazy-pages.log"))
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return _LazyDaemon(daemon, workdir)

    def _restore_lazy(self, ch: Channel, name: str, restore_id: str, lazy: "_LazyDaemon", out: dict) -> None:
        """Restore at once from a checkpoint without memory pages; `criu lazy-pages` fetches them from
        the source while the container already runs. The pageless checkpoint is removed afterwards."""
        daemon = lazy.daemon

        def link_daemon(view: str, work: str) -> None:
            daemon.wait_listening()
            os.symlink(daemon.socket, os.path.join(work, "lazy-pages.socket"))

        try:
            res = self._restore(name, restore_id, extra=["--lazy-pages"], before_restore=link_daemon)
            out.update(restored=True, container_id=restore_id, pid=res["pid"])
            out["timings"]["restore_s"] = res["timings"].get("total_s")
            out["timings"]["restore"] = res["timings"]
            ch.send({"type": "restored", "container_id": restore_id, "pid": res["pid"], "timings": res["timings"]})
            t0 = time.monotonic()
            daemon.wait(LAZY_PAGES_TIMEOUT)
            out["timings"]["pages_s"] = round(time.monotonic() - t0, 3)
            ch.send({"type": "done", "pages_s": out["timings"]["pages_s"]})
            with contextlib.suppress(TransferError):
                ch.recv("bye")
        finally:
            lazy.close()
            with contextlib.suppress(MigrtError, OSError):
                self.store.remove(name)
            out["committed"] = False  # a checkpoint without its pages is not kept


class _LazyDaemon:
    def __init__(self, daemon: lazy_mod.LazyPagesDaemon, workdir: str) -> None:
        self.daemon, self.workdir = daemon, workdir

    def close(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
