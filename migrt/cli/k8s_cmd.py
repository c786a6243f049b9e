"""`migrt k8s move-manifest`: the target pod of a live move, written from the source pod's manifest
(the work is in migrt.pods.move_manifest; nothing here talks to an API server)."""

from __future__ import annotations

import sys

import click

from migrt.cli.group import cli, handle_errors
from migrt.cli.render import emit_json


@cli.group()
def k8s() -> None:
    """Kubernetes objects for moving pods (written for kubectl; no API server is contacted)."""


@k8s.command("move-manifest")
@click.argument("manifest", type=click.File("r"), default="-")
@click.option("--to-node", required=True, metavar="NODE", help="The target node's name (spec.nodeName of the copy).")
@click.option("--from-node", metavar="ADDRESS[:PORT]",
              help="The source node's agent, as migrate-from names it (default: the pod's status.hostIP, else its "
                   "spec.nodeName); the target node's migrate_peers must list it.")
@click.option("--name", help="The copy's name (default: <name>-moved; a StatefulSet's pod: <name>-moving, then "
                             "its own name in the second pull).")
@click.option("--container", metavar="NAME", help="Move only this container of a pod of several (the others start "
                                                  "fresh on the target). Default for a pod of several: the "
                                                  "pod-level pull (migrt.io/migrate-pod, one cut of the pod).")
@click.option("--separate-cuts", is_flag=True,
              help="Pull every container of a pod of several, each frozen and dumped on its own (no common cut; "
                   "no migrt.io/migrate-pod).")
@click.option("--runtime-class", metavar="NAME", default=None,
              help="runtimeClassName of the copy (default: the source's; '' for none, where migrt-runc is the "
                   "nodes' default runtime).")
@click.option("--drop-label", "drop_labels", multiple=True, metavar="KEY",
              help="A label the copy does not keep (a key of the owner's selector, so that it does not adopt the "
                   "copy); repeatable.")
@click.option("--any-owner", is_flag=True, help="Write the copy of a pod whose controller migrt does not know.")
@click.option("-o", "--output", "fmt", type=click.Choice(["yaml", "json"]), default=None,
              help="Format of the copy (default: the input's).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object on stdout: the copy (pod), owner, migrate_from, steps, warnings.")
@handle_errors
def move_manifest(manifest, to_node, from_node, name, container, separate_cuts, runtime_class, drop_labels,
                  any_owner, fmt, as_json):
    """Write the pod that pulls MANIFEST's pod (a file, or - for stdin: `kubectl get pod X -o yaml |
    migrt k8s move-manifest --to-node N`) onto node N: pinned there, migrt.io/migrate-from set (and for a pod
    of several containers migrt.io/migrate-pod: the pod-level pull), what the API
    server and the controllers own stripped, the owner's selector labels dropped. The copy goes to stdout;
    what to do next, step by step (docs/kubernetes.md), to stderr."""
    from migrt.pods import move_manifest as mm

    obj, in_fmt = mm.read(manifest.read(mm.MAX_BYTES + 1))
    opts = mm.MoveOptions(to_node=to_node, from_node=from_node, name=name, container=container,
                          separate_cuts=separate_cuts,
                          runtime_class=mm.KEEP if runtime_class is None else runtime_class,
                          drop_labels=tuple(drop_labels), any_owner=any_owner)
    out_fmt = fmt or in_fmt
    moved = mm.move(obj, opts, out_fmt)
    if as_json:
        emit_json(moved.report())
    else:
        sys.stdout.write(mm.render(moved.pod, out_fmt))
        sys.stdout.flush()
    _explain(moved)


def _explain(moved) -> None:
    report = moved.report()
    click.echo(f"{report['source']} -> {report['target']} on node {report['node']} (owner: {report['owner']['kind']}"
               f"{' ' + report['owner']['name'] if report['owner']['name'] else ''}; migrate-from "
               f"{report['migrate_from']})", err=True)
    for w in report["warnings"]:
        click.echo(f"warning: {w}", err=True)
    click.echo("next:", err=True)
    for i, step in enumerate(report["steps"], 1):
        click.echo(f"  {i}. {step}", err=True)
