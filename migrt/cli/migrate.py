"""`migrt migrate` (source node), `migrt receive` (target node) and `migrt serve` (the node agent that
hands containers over to pods pulling them). The work is in migrt.migration.migrate
and migrt.migration.receive; this file parses options and renders progress and results."""

from __future__ import annotations

import json
import os
import signal
import sys

import click

from migrt.cli.group import cli, handle_errors, load_config
from migrt.cli.render import ConsoleProgress, emit_json, human_size

JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")


def _rate(nbytes: int, seconds: float | None) -> str:
    return f"{human_size(nbytes / seconds)}/s" if seconds else "-"


@cli.command()
@click.argument("container_id")
@click.option("--to", "to", required=True, metavar="HOST:PORT", help="Address of the target's 'migrt receive'.")
@click.option("--root", help="runc state root (default: searched in /run/containerd/runc/<ns>, /run/runc).")
@click.option("--pre-dump", "pre_dump", default="auto", show_default=True, metavar="auto|N",
              help="Pre-dump rounds while the container runs (needs soft-dirty tracking; skipped, and said so, "
                   "where the kernel lacks it). 0 turns them off.")
@click.option("--lazy", is_flag=True, help="Post-copy: the target runs before the memory has arrived; pages "
                                           "follow on demand from a CRIU page server here.")
@click.option("--direct", is_flag=True,
              help="Stop-and-copy without images: the memory goes from the frozen container straight into the "
                   "target's restored processes over several streams, which run once all of it is in.")
@click.option("--name", help="Checkpoint name on the target (default: <container>-<UTC timestamp>).")
@click.option("--free-source-early", is_flag=True,
              help="Destroy the frozen source as soon as the target has committed the checkpoint, before it "
                   "restores (halves peak memory when both ends share one machine; a failed restore on the "
                   "target can then no longer fall back to the source).")
@click.option("--streams", type=click.IntRange(1, 64), metavar="N",
              help="Stop-and-copy: connections the checkpoint travels over at once (default: the config's "
                   "migration_streams; 0 there: half the CPUs, 1 to 8). The receiver may take fewer.")
@JSON
@handle_errors
def migrate(container_id, to, root, pre_dump, lazy, direct, name, free_source_early, streams, as_json):
    """Move a running container to another node's 'migrt receive'.

    Until the target holds the container's state, any failure resumes the container here.
    """
    from migrt.migration.migrate import MigrateRequest
    from migrt.migration.migrate import migrate as do_migrate

    if lazy and direct:
        raise click.UsageError("--lazy and --direct are two modes: choose one")
    cfg = load_config()
    progress = ConsoleProgress(enabled=None if not as_json else False)
    if progress.enabled:
        click.echo(f"migrating {container_id} to {to}", err=True)
    res = do_migrate(cfg, MigrateRequest(container_id=container_id, to=to, root=root, name=name, pre_dump=pre_dump,
                                         lazy=lazy, direct=direct, free_source_early=free_source_early,
                                         streams=streams),
                     progress=progress)
    if as_json:
        emit_json(res)
        return
    pd = res["pre_dump"]
    if pd["requested"] not in (0, "0") and not pd["available"]:
        click.echo(f"pre-dump: {pd['note']}", err=True)
    where = (f"running there as {res['target']['container_id']} (pid {res['target']['pid']})" if res["restored"]
             else f"stored there as checkpoint {res['name']}")
    transfer = res["phases"].get("transfer_s")
    down = f"downtime {res['downtime_s']:.3f} s" if res["downtime_s"] is not None else \
        f"frozen {res['frozen_s']:.3f} s until committed"
    click.echo(f"migrated {container_id} to {to} ({res['mode']}): {where}; {down}; "
               f"{human_size(res['bytes'])} sent at {_rate(res['bytes'], transfer)}; total {res['total_s']:.3f} s",
               err=True)
    if res.get("gpu"):
        gpu_s = res["phases"].get("gpu_checkpoint_s", 0)
        click.echo(f"  GPU: checkpoint {gpu_s:.3f} s; " + _gpu_line(res["gpu"]), err=True)
    click.echo(res["name"])


def _gpu_line(gpu: dict) -> str:
    """The receiver's GPU preflight answer, for people."""
    pairs = ", ".join(f"{p['old']} -> {p['new']}" for p in gpu.get("pairs") or [])
    gpus = ", ".join(f"{g.get('name')} ({human_size(g.get('memory_free'))} free)" for g in gpu.get("gpus") or [])
    if not gpu.get("restore_here"):
        return f"stored on the target (driver {gpu.get('driver') or 'none'}), not restored there"
    return f"target GPU(s) {gpus}, driver {gpu.get('driver')}; {pairs}"


@cli.command()
@click.option("--listen", required=True, metavar="ADDR:PORT", help="Address to accept migrations on.")
@click.option("--once", is_flag=True, help="Handle one connection, then exit with its status.")
@click.option("--restore", "restore_bundle", type=click.Path(exists=True, file_okay=False), metavar="BUNDLE",
              help="Restore each received container at once from this OCI bundle (needed for --lazy senders).")
@click.option("--root", help="runc state root for restored containers (default /run/runc).")
@click.option("--container-id", help="Id of the restored container (default: the source container's id).")
@click.option("--output", type=click.Path(dir_okay=False), default=os.devnull, show_default=True,
              help="File receiving restored containers' stdout and stderr.")
@click.option("--streams", type=click.IntRange(1, 64), metavar="N",
              help="The most connections a stop-and-copy sender may use at once (default: the config's "
                   "migration_streams; 0 there: half the CPUs, 1 to 8).")
@JSON
@handle_errors
def receive(listen, once, restore_bundle, root, container_id, output, streams, as_json):
    """Receive migrations from other nodes into this node's store (a long-running server).

    Peers must hold the same migration key (config 'migration_key_file'). Each verified checkpoint is
    committed atomically (ready for MIGRT_RESTORE), and restored at once with --restore.
    """
    from migrt.migration.receive import ReceiveOptions, Receiver

    cfg = load_config()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    receiver = Receiver(cfg, ReceiveOptions(listen=listen, once=once, restore_bundle=restore_bundle, root=root,
                                            container_id=container_id, output=output, streams=streams),
                        _reporter("receive", as_json))
    server = receiver.bind()
    click.echo(f"migrt receive: listening on {listen} (store {cfg.store})", err=True)
    try:
        res = receiver.serve(server)
    finally:
        server.close()
    if res and res.get("error"):
        sys.exit(res.get("exit_code") or 1)


@cli.command()
@click.option("--listen", metavar="ADDR:PORT", help="Address to serve on (default: the config's agent_listen, "
                                                    "0.0.0.0:7070).")
@JSON
@handle_errors
def serve(listen, as_json):
    """The node agent: hands this node's containers over to pods on other nodes that pull them.

    A pod created elsewhere with the annotation migrt.io/migrate-from=<this node>/<namespace>/<pod>/<container>
    pulls that container live (docs/migration.md); the source pod must opt in (migrt.io/migratable=true)
    unless the config says 'migrate_any_container: true'; the pulling node lists this one in its
    'migrate_peers'. A refused pull is told the same whatever the reason; the reason is in this
    command's report and the migrt log. Also answers other nodes' questions about migrations that
    ended here. Peers need the same migration key (and TLS, when configured).
    """
    from migrt.migration.agent import Agent

    cfg = load_config()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    agent = Agent(cfg, _reporter("serve", as_json), listen)
    server = agent.bind()
    click.echo(f"migrt serve: listening on {agent.listen} (store {cfg.store})", err=True)
    try:
        agent.serve(server)
    finally:
        server.close()


def _reporter(command: str, as_json: bool):
    """One line per connection on stderr (and its JSON on stdout with --json)."""
    def report(r: dict) -> None:
        if as_json:
            click.echo(json.dumps(r, sort_keys=True, default=str))
            sys.stdout.flush()
        if r.get("error"):
            why = f" (why: {r['reason']})" if r.get("reason") else ""  # a pull's refusal: what the puller is not told
            click.echo(f"migrt {command}: from {r['peer']}: {'refused' if r.get('refused') else 'failed'}: "
                       f"{r['error']}{why}", err=True)
            return
        t = r["timings"]
        if r.get("mode") == "query":
            click.echo(f"migrt {command}: {r['peer']} asked about {r['name']}: a container restored from it is "
                       f"{'running' if r.get('answer') == 'running' else 'not running'} here", err=True)
            return
        if r.get("mode") == "pull":
            down = f"downtime {r['downtime_s']:.3f} s" if r.get("downtime_s") is not None else "downtime unknown"
            click.echo(f"migrt {command}: handed container {r.get('container_id')} over to {r['peer']} (pulled into "
                       f"{(r.get('target') or {}).get('container_id')}); {down}; total {t.get('total_s', 0):.3f} s",
                       err=True)
            return
        what = (f"restored as {r['container_id']} (pid {r['pid']})" if r.get("restored")
                else f"committed as checkpoint {r['name']}")
        click.echo(f"migrt {command}: {r['name']} from {r['peer']} ({r['mode']}): {human_size(r['bytes'])} "
                   f"received in {t.get('receive_s', 0):.3f} s; {what}; total {t.get('total_s', 0):.3f} s", err=True)
        if r.get("gpu"):
            restored = (t.get("restore") or {}).get("gpu_restore_s")
            click.echo(f"  GPU: {_gpu_line(r['gpu'])}" + (f"; GPU restore {restored:.3f} s" if restored else ""),
                       err=True)
    return report
