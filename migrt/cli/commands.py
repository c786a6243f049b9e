"""The commands of `migrt` (each small; the work is in migrt.ops)."""

from __future__ import annotations

import os
import sys
import time

import click

from migrt import __version__, names
from migrt.cli.group import cli, handle_errors, load_config
from migrt.cli.render import ConsoleProgress, emit_json, human_size, table
from migrt.errors import UsageError

JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")


@cli.command()
@click.argument("container_id", required=False)
@click.option("--pod", "pod", metavar="NS/POD", help="Every container of this pod on this node, frozen together "
              "(one cut), as one checkpoint (instead of CONTAINER_ID).")
@click.option("--root", help="runc state root (default: searched in /run/containerd/runc/<ns>, /run/runc).")
@click.option("--name", help="Checkpoint name (default: <container>-<UTC timestamp>).")
@click.option("--leave-running", is_flag=True, help="Keep the container running after the dump.")
@click.option("--tcp-established", is_flag=True, help="Dump established TCP connections.")
@click.option("--ext-unix-sk", is_flag=True, help="Allow external unix sockets.")
@click.option("--file-locks", is_flag=True, help="Dump file locks.")
@JSON
@handle_errors
def checkpoint(container_id, pod, root, name, leave_running, tcp_established, ext_unix_sk, file_locks, as_json):
    """Checkpoint a running container (or with --pod a whole pod) into the store; prints the checkpoint name."""
    from migrt.ops.checkpoint import CheckpointRequest
    from migrt.ops.checkpoint import checkpoint as do_checkpoint

    if pod or not container_id:
        _checkpoint_pod(container_id, pod, root, name, leave_running, tcp_established, ext_unix_sk or file_locks,
                        as_json)
        return
    names.container_id(container_id)  # before anything builds a path from it
    cfg = load_config()
    progress = ConsoleProgress(enabled=None if not as_json else False)
    if progress.enabled:
        click.echo(f"checkpointing {container_id}", err=True)
    data = do_checkpoint(cfg, CheckpointRequest(
        container_id=container_id, root=root, name=name, leave_running=leave_running,
        tcp_established=tcp_established, ext_unix_sk=ext_unix_sk, file_locks=file_locks,
    ), progress=progress)
    if as_json:
        emit_json({k: data[k] for k in ("name", "created", "size_bytes", "timings", "source", "options")})
    else:
        if progress.enabled:
            total = data["timings"].get("total_s", 0)
            click.echo(f"  total: {total:.2f} s, {human_size(data['size_bytes'])}", err=True)
        click.echo(data["name"])


def _checkpoint_pod(container_id, pod, root, name, leave_running, tcp_established, other, as_json) -> None:
    from migrt.ops.pod_checkpoint import PodCheckpointRequest, checkpoint_pod, parse_pod

    if container_id or not pod:
        raise UsageError("give a CONTAINER_ID or --pod NS/POD (one of them)")
    if root or other:
        raise UsageError("--pod takes no --root, --ext-unix-sk or --file-locks (the pod's containers are found in "
                         "every runc root)")
    namespace, name_of_pod = parse_pod(pod)
    cfg = load_config()
    progress = ConsoleProgress(enabled=None if not as_json else False)
    if progress.enabled:
        click.echo(f"checkpointing pod {pod}", err=True)
    data = checkpoint_pod(cfg, PodCheckpointRequest(namespace, name_of_pod, name=name, leave_running=leave_running,
                                                    tcp_established=tcp_established), progress=progress)
    if as_json:
        emit_json({k: data[k] for k in ("name", "created", "size_bytes", "timings", "source", "options", "pod")})
        return
    if progress.enabled:
        click.echo(f"  {len(data['pod']['parts'])} containers, frozen together for "
                   f"{data['timings'].get('frozen_s', data['timings'].get('dump_s', 0)):.2f} s, "
                   f"{human_size(data['size_bytes'])}", err=True)
    click.echo(data["name"])


def _summary(ckpt) -> dict:
    from migrt.ops.pod_restore import is_pod, parts_of

    try:
        m = ckpt.manifest
    except Exception as exc:  # noqa: BLE001 - a broken checkpoint is still listed, with its problem
        return {"name": ckpt.name, "error": str(exc)}
    return {
        "name": ckpt.name, "created": m.created, "container_id": m.source.container_id,
        "cri": m.source.cri_fields, "size_bytes": m.size_bytes, "gpu": m.gpu is not None,
        **({"containers": [p["name"] for p in parts_of(m)]} if is_pod(m) else {}),
    }


@cli.command("ls")
@JSON
@handle_errors
def ls_cmd(as_json):
    """List the checkpoints in the store."""
    from migrt.store import Store

    cfg = load_config()
    store = Store(cfg.store)
    items = [_summary(c) for c in store.list()]
    kept = store.incomplete()
    if kept:
        click.echo(f"migrt: {len(kept)} incomplete checkpoint(s) of interrupted operations are kept (not listed, not "
                   "restorable); see 'migrt recover --list'", err=True)
    if as_json:
        emit_json(items)
        return
    rows = []
    for it in items:
        if "error" in it:
            rows.append([it["name"], "-", "-", "-", f"BROKEN: {it['error']}"])
            continue
        cri = it["cri"]
        pod = f"{cri.get('pod_namespace', '')}/{cri.get('pod_name', '')}/{cri.get('container_name', '')}" \
            if cri else "-"
        if "containers" in it:  # a pod checkpoint: all its containers
            pod = f"{cri.get('pod_namespace', '')}/{cri.get('pod_name', '')} ({', '.join(it['containers'])})"
        rows.append([it["name"], it["created"] or "-", (it["container_id"] or "-")[:24], pod,
                     human_size(it["size_bytes"])])
    click.echo(table(["NAME", "CREATED", "CONTAINER", "POD", "SIZE"], rows))


@cli.command()
@click.argument("name")
@click.option("--verify", is_flag=True, help="Check every file against the manifest's sha256.")
@JSON
@handle_errors
def inspect(name, verify, as_json):
    """Show a checkpoint: manifest, process tree, memory, open files (read with pycriu)."""
    from migrt.criu.images import inspect_images
    from migrt.store import Store

    cfg = load_config()
    from migrt.ops.pod_restore import is_pod, part, parts_of

    with Store(cfg.store).reading(name) as ckpt:  # shared: restores and other readers go on
        m = ckpt.manifest
        pod = {p["name"]: inspect_images(part(ckpt, p["name"]).images) for p in parts_of(m)} if is_pod(m) else None
        img = inspect_images(ckpt.images) if pod is None else {}
        result: dict[str, object] = {"manifest": m.raw, "images": img, "verified": None}
        if pod is not None:  # a pod checkpoint: one set of images per container
            result["parts"] = pod
        if verify:
            ckpt.verify()
            result["verified"] = True
    if as_json:
        emit_json(result)
        return
    src = m.source
    click.echo(f"name:       {m.name}")
    click.echo(f"created:    {m.created}")
    root = f" (root {src.runtime_root})" if src.runtime_root else ""
    click.echo(f"container:  {src.container_id or '-'}{root}")
    if src.cri_fields:
        click.echo("pod:        " + ", ".join(f"{k}={v}" for k, v in sorted(src.cri_fields.items())))
    imported, pulled = m.imported or {}, m.pulled or {}
    if imported:  # an archive's or a registry's checkpoint: no migrt versions of its own
        click.echo(f"imported:   {imported.get('archive')} (written by {imported.get('producer') or 'unknown'})")
    if pulled:
        click.echo(f"pulled:     {pulled.get('reference') or ''}@{pulled.get('manifest_digest')}")
    versions = [f"{k} {v}" for k, v in sorted(m.versions.items()) if k != "runtime_path" and v]
    click.echo("versions:   " + (", ".join(versions) or "unknown"))
    click.echo("options:    " + (", ".join(k for k, v in sorted(m.options.items()) if v) or "none"))
    click.echo(f"size:       {human_size(m.size_bytes)} in {len(m.files)} files")
    click.echo("timings:    " + ", ".join(f"{k} {v}" for k, v in sorted(m.timings.items())))
    if pod is None:
        _processes(img, "")
    for p in parts_of(m):
        click.echo(f"container {p['name']} (image {p.get('image') or 'unknown'}, "
                   f"was {str(p.get('container_id'))[:12]}):")
        _processes(pod[p["name"]] if pod else {}, "  ")
    if m.gpu:
        from migrt.cli.gpu_render import render_gpu  # GPU issue

        render_gpu(m.gpu)
    if verify:
        click.echo("verify:     ok (every file matches its sha256)")


def _processes(img: dict, indent: str) -> None:
    if img.get("error") or "processes" not in img:
        click.echo(f"{indent}images:     unreadable: {img.get('error')}")
        return
    click.echo(f"{indent}processes:")
    for p in img["processes"]:
        click.echo(f"{indent}  pid {p['pid']:>6} ppid {p['ppid']:>6} threads {p['threads']:>3}  "
                   f"{p.get('comm', '?'):<16} mem {human_size(p.get('dumped_bytes'))} dumped / "
                   f"{human_size(p.get('vma_bytes'))} mapped")
        for f in p.get("files", [])[:20]:
            click.echo(f"{indent}      fd {f['fd']:>3} {f['type']:<8} {f.get('path', '')}")


@cli.command()
@click.argument("name")
@click.option("--wait", "wait_s", type=click.FloatRange(0, 3600), default=10.0, show_default=True,
              help="Seconds to wait for the processes reading the checkpoint (restores, inspects, transfers).")
@JSON
@handle_errors
def rm(name, wait_s, as_json):
    """Remove a checkpoint (never while it is being read: waits, then refuses naming the readers)."""
    from migrt.store import Store

    cfg = load_config()
    Store(cfg.store).remove(name, wait=wait_s)
    if as_json:
        emit_json({"removed": name})
    else:
        click.echo(f"removed {name}", err=True)


@cli.command()
@click.argument("name")
@click.argument("container_id")
@click.option("--bundle", required=True, type=click.Path(exists=True, file_okay=False),
              help="OCI bundle to restore into.")
@click.option("--root", help="runc state root (default /run/runc).")
@click.option("--output", type=click.Path(dir_okay=False), default=os.devnull, show_default=True,
              help="File receiving the restored container's stdout and stderr.")
@click.option("--pages", type=click.Choice(["auto", "lazy", "eager"]), default=None,
              help="How to fill the restored memory (default: the config's restore_pages).")
@click.option("--wait-pages", is_flag=True, help="Lazy restore: return only once all memory is in (by reference: "
              "once the fill has committed the image to the store, or failed to; its outcome reported).")
@click.option("--timeout", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="NAME oci:REF only: give up when the image's part (manifest, config, what CRIU reads, or the "
                   "full pull) takes longer; the fill's own deadline starts from it. Default: registry_timeout.")
@JSON
@handle_errors
def restore(name, container_id, bundle, root, output, pages, wait_pages, timeout, as_json):
    """Restore checkpoint NAME as container CONTAINER_ID from an OCI bundle (outside containerd). NAME is a
    store name, or oci:REF: the image restored from its registry as a create's migrt.io/restore=oci:REF is
    (lazily, or after a full pull; docs/registry.md)."""
    from migrt.cli import restore_ref
    from migrt.oci.bundle import Bundle
    from migrt.ops.restore import RestoreTarget, restore_checkpoint
    from migrt.registry.reference import is_reference
    from migrt.runtime.lower import default_root

    by_ref = is_reference(name)
    if by_ref:
        restore_ref.parse_reference(name)
    else:
        restore_ref.refuse_timeout(name, timeout)
    names.container_id(container_id)
    cfg = load_config()
    if pages:
        cfg.restore_pages = pages
        os.environ.pop("MIGRT_RESTORE_PAGES", None)  # the flag wins
    runtime = cfg.runtime_path()
    progress = ConsoleProgress(enabled=None if not as_json else False)
    try:
        out = open(output, "ab")  # noqa: SIM115 - opened before anything is restored (a bad path costs nothing)
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot open: {exc.strerror}") from exc
    with open(os.devnull, "rb") as devnull, out:
        target = RestoreTarget(container_id=container_id, bundle=Bundle.load(os.path.abspath(bundle)),
                               root=root or default_root(runtime), stdio=(devnull, out, out), wait_pages=wait_pages)
        if by_ref:
            result = restore_ref.restore_by_reference(cfg, name, target, timeout=timeout, progress=progress)
        else:
            result = restore_checkpoint(cfg, name, target, progress=progress)
    if as_json:
        emit_json(result)
    elif by_ref:
        restore_ref.render(result)
    else:
        click.echo(f"restored {name} as {container_id} (pid {result['pid']}) in {result['timings']['total_s']:.2f} s")


@cli.command()
@click.option("--wait", "wait_s", type=click.FloatRange(0, 3600), default=120.0, show_default=True,
              help="Seconds to wait for the helpers (runc, CRIU) of an interrupted operation to end.")
@click.option("--list", "list_only", is_flag=True, help="Only show the journal and the kept incomplete images.")
@JSON
@handle_errors
def recover(wait_s, list_only, as_json):
    """Bring back what an interrupted migrt left: thaw a frozen container, resume its GPU processes,
    finish a committed checkpoint, delete a half-restored container. Exit 6 if something is left."""
    from migrt.ops import recover as recover_mod

    cfg = load_config(auto_recover=False)
    outcomes = []
    if not list_only:
        stale = [e for e in recover_mod.describe(cfg)["journal"] if e.get("stale")]
        progress = ConsoleProgress(enabled=None if not as_json else False)
        if stale:  # helpers still at work can hold it for up to --wait seconds: say so before waiting
            progress("phase", name="recover", entries=len(stale), wait_s=wait_s)
            if progress.enabled and not progress.json:
                click.echo(f"  {len(stale)} interrupted operation(s); waiting up to {wait_s:g} s for their runc/CRIU "
                           "helpers to end", err=True)
        t0 = time.monotonic()
        outcomes = recover_mod.recover(cfg, wait_s=wait_s)
        if stale:
            progress("done", name="recover", seconds=round(time.monotonic() - t0, 3))
    left = recover_mod.describe(cfg)
    unfinished = [o for o in outcomes if o.status != "recovered"] + [e for e in left["journal"] if e.get("stale")]
    if as_json:
        emit_json({"recovered": [o.to_dict() for o in outcomes], **left})
    else:
        for o in outcomes:
            click.echo(o.line())
        for e in left["journal"]:
            state = "interrupted" if e.get("stale") else f"in progress (pid {e.get('pid')})"
            click.echo(f"journal: {e.get('op')} of {e.get('container') or e.get('name')} at phase {e.get('phase')}: "
                       f"{state}")
        for inc in left["incomplete"]:
            click.echo(f"incomplete: {inc['path']} ({human_size(inc['size_bytes'])}): {inc.get('reason', '?')}; "
                       "kept, never deleted by migrt: inspect it, then remove it by hand")
        if not outcomes and not left["journal"] and not left["incomplete"]:
            click.echo("nothing to recover", err=True)
    sys.exit(6 if unfinished else 0)


@cli.command()
@JSON
@handle_errors
def doctor(as_json):
    """Check this node: CRIU, runc, kernel features, containerd, store. Exit 1 if a check fails."""
    from migrt.node.doctor import run_checks

    checks = run_checks()
    failed = [c for c in checks if c["status"] == "fail"]
    if as_json:
        emit_json({"ok": not failed, "checks": checks})
    else:
        for c in checks:
            mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[c["status"]]
            click.echo(f"[{mark}] {c['name']}: {c['detail']}")
            if c["status"] != "ok" and c.get("fix"):
                click.echo(f"       fix: {c['fix']}")
    sys.exit(1 if failed else 0)


@cli.command()
@JSON
def version(as_json):
    """Print the versions of migrt, the lower runtime, CRIU and the kernel."""
    from migrt import config
    from migrt.criu.version import versions
    from migrt.errors import MigrtError

    problem = None
    try:
        runtime = config.load().runtime_path()
    except MigrtError as exc:  # still useful (e.g. in a bug report), but not silently about another runtime
        runtime, problem = "runc", str(exc)
        click.echo(f"migrt: warning: {exc}; showing 'runc' from PATH instead", err=True)
    v = versions(runtime)
    if problem:
        v["config_error"] = problem
    if as_json:
        emit_json(v)
    else:
        click.echo(f"migrt {__version__}")
        for k in ("runtime", "criu", "kernel"):
            click.echo(f"{k}: {v.get(k) or 'not found'}" + (f" ({v['runtime_path']})" if k == "runtime" else ""))
