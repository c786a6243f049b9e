"""`migrt restore oci:REF CONTAINER_ID --bundle DIR`: a restore by image reference from the node's CLI,
through the create's own steps (ops/restore.py image_for_restore, restore_image): lazily from the
registry, every chunk verified before a page of it goes in, under the image's lock, or after a full
pull in the cases registry/lazy.py names (said once in the node's log, and here). The whole image
step runs within `--timeout` (default: registry_timeout), which the fill's own deadline starts from
too. As `migrt pull`, the operator may name any registry (restore_registries binds pods only), and a
failed pull exits with the registry's own error and code (docs/registry.md).

What it reports: the path taken (`lazy`, `pull` with the fallback's reason, or `store`: the image
was in the store already), the seconds until the container ran, the bytes fetched before it ran,
and with `--wait-pages` the fill's outcome (the rest of the bytes, whether it committed the image).
"""

from __future__ import annotations

import time

import click

from migrt.cli.render import human_size
from migrt.config import Config
from migrt.errors import UsageError
from migrt.ops.restore import RestoreTarget
from migrt.progress import Progress
from migrt.store import Store


def restore_by_reference(cfg: Config, reference: str, target: RestoreTarget, *, timeout: float | None,
                         progress: Progress) -> dict:
    """The image made ready, then restored as `target`; the report (module docstring)."""
    from migrt import log as log_mod
    from migrt.oci.bundle import RestoreRequest
    from migrt.ops.restore import image_for_restore, restore_image
    from migrt.registry.client import Deadline

    t0 = time.monotonic()
    if timeout:
        cfg.registry_timeout = timeout  # (the fill's deadline: this, plus the pages at 8 MiB/s)
    deadline = Deadline.after(cfg.registry_timeout, "migrt restore --timeout; by default registry_timeout in the "
                              "migrt config", then="what arrived is kept and the next restore of the image resumes it")
    request = RestoreRequest(name=reference, fallback="fail", source="cli")
    image = image_for_restore(cfg, request, target.bundle, log_mod.get(), target.container_id, deadline,
                              operator=True, progress=progress)
    target.seams = image.seams()
    result = restore_image(cfg, image, target, progress)
    return _report(cfg, reference, image, result, time.monotonic() - t0, target.wait_pages)


def _report(cfg: Config, reference: str, image, result: dict, total_s: float, waited: bool) -> dict:
    waited_s = float(result["timings"].get("pages_wait_s") or 0)
    fill = (result.get("pages") or {}).get("fill") if waited and image.lazy is not None else None
    counts = (fill or {}).get("counts") or {}
    out = {**result, "reference": reference, "path": image.path, "fallback": image.fallback,
           "joined": bool((image.lazy.summary if image.lazy is not None else {}).get("joined")),
           "image_s": image.seconds, "running_after_s": round(total_s - waited_s, 3),
           "bytes_fetched": {"before_running": image.bytes_received,
                             "fill": counts.get("registry_fetched_bytes") if fill is not None else None}}
    if fill is not None:
        committed = Store(cfg.store).exists(image.name)
        out["fill_outcome"] = {"committed": committed, "checkpoint": image.name if committed else None,
                               "seconds": waited_s, "copied_bytes": fill.get("copied_bytes"),
                               "fetched_chunks": counts.get("registry_fetched_chunks"),
                               "taken_chunks": counts.get("registry_taken_chunks")}
    return out


def parse_reference(text: str) -> str:
    """`oci:REF` checked before anything runs (UsageError, exit 2, naming what is wrong)."""
    from migrt.registry.reference import parse

    try:
        parse(text)
    except UsageError as exc:
        raise UsageError(f"migrt restore: {exc.message}; NAME is oci:<image reference> or a checkpoint's store "
                         "name ('migrt ls')") from exc
    return text


def render(out: dict) -> None:
    """The human lines: the path and the figures on stderr, the restored container on stdout."""
    why = f" ({out['fallback']})" if out["fallback"] else ""
    how = {"lazy": "lazily from the registry", "pull": f"after a full pull{why}",
           "store": "from the store (pulled before)"}[out["path"]]
    fetched = out["bytes_fetched"]
    click.echo(f"  {how}: running after {out['running_after_s']:.2f} s, "
               f"{human_size(fetched['before_running'])} fetched before it ran", err=True)
    outcome = out.get("fill_outcome")
    if outcome is not None:
        state = f"committed as {outcome['checkpoint']}" if outcome["committed"] else \
            "not committed (see the node's migrt log: registry_fill_incomplete)"
        click.echo(f"  fill: {human_size(fetched['fill'] or 0)} fetched in {outcome['seconds']:.2f} s, {state}",
                   err=True)
    click.echo(f"restored {out['reference']} as {out['container_id']} (pid {out['pid']}) "
               f"in {out['timings']['total_s']:.2f} s")


def refuse_timeout(name: str, timeout: float | None) -> None:
    if timeout is not None:
        raise UsageError(f"--timeout applies to a restore by reference (oci:REF), not to checkpoint {name} of the "
                         "store")

