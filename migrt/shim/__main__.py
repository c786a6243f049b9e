"""migrt-runc: runc-compatible entry point.

Everything not intercepted is handed to the lower runtime with os.execv, argv byte-identical
(`checkpoint` runs it as a child, argv byte-identical too: see _child).
Intercepted: `create` whose bundle asks for a restore (becomes `runc restore --detach`) or for a
live migration from another node (a pull: migration/pull.py), `create` of a pod container that was
migrated away from this node (refused: runtime/moved.py), `start`
of a container migrt restored (a no-op: it already runs), `checkpoint` of a container with CUDA
processes and `restore` of an image with GPU state (migrt drives the GPU around the lower runtime),
`create` of a bundle asking for GPU release on pause (marker for pause/resume), and `pause`/`resume`
of a container carrying that marker (GPU suspend before the freeze, GPU resume after the thaw).
A `restore` (the lower runtime's own checkpoints) is refused when its tasks hold more than the
bundle grants (ops/restore_privileges.py). Standard library only until that decision.
"""

from __future__ import annotations

import os
import sys

from migrt.criu.binary import use_migrt_criu
from migrt.names import is_container_id
from migrt.runtime import lower as _lower
from migrt.runtime import moved, runclog
from migrt.runtime.markers import GPU_RELEASE_MARKER as RELEASE_MARKER
from migrt.runtime.markers import gpu_suspended, gpu_suspended_message, is_restored
from migrt.shim.argv import RuncArgv
from migrt.trust import Untrusted


def _exec(path: str, args: list[str], parsed: RuncArgv) -> int:
    try:
        os.execv(path, [path, *args])
    except OSError as exc:
        runclog.append(parsed.log_path, "error", f"migrt: cannot execute lower runtime {path}: {exc}",
                       log_format=parsed.log_format)
        return 126
    return 126  # not reached


def _child(path: str, args: list[str], parsed: RuncArgv) -> int:
    """`checkpoint`: the lower runtime as a child instead of exec'd, argv untouched. containerd kills
    the runtime process (SIGKILL) when a CRI call's deadline passes (kubelet's checkpoint timeout); a
    runc killed mid-dump makes its CRIU fail at the next notification it sends runc, which leaves the
    container frozen for good (measured here: freezer FROZEN, tasks in D state, CRI still says
    running). Killed instead, migrt-runc leaves runc to finish: the dump completes or fails on its own
    and the container goes on (CRI checkpoints are --leave-running). Exit status is runc's."""
    import subprocess

    try:
        proc = subprocess.Popen([path, *args], close_fds=False)
    except OSError as exc:
        runclog.append(parsed.log_path, "error", f"migrt: cannot execute lower runtime {path}: {exc}",
                       log_format=parsed.log_format)
        return 126
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:  # the terminal's SIGINT reached runc too: wait for its answer
            continue
    return rc if rc >= 0 else 128 - rc


def _create(parsed: RuncArgv, lower: str, warning: str | None) -> int | None:
    """Returns an exit code when migrt handled the create, None to pass it through."""
    from migrt.oci.bundle import Bundle, BundleError

    cmd = parsed.command_args()
    bundle_dir = cmd.value("bundle", "b") or os.getcwd()
    try:
        bundle = Bundle.load(bundle_dir)
    except BundleError:
        return None  # runc reports its own error about the bundle
    refused = _moved_away(parsed, lower, bundle)
    if refused is not None:
        return refused
    pull = bundle.migrate_request()
    if pull is not None:
        from migrt.migration.pull import pull_on_create  # heavy imports only from here on

        return pull_on_create(parsed, cmd, bundle, pull, lower=lower, lower_warning=warning)
    request = bundle.restore_request()
    if request is None:
        if not bundle.gpu_release_on_pause:
            return None
        from migrt.ops import gpu_pause

        return gpu_pause.create(parsed, lower)
    from migrt.ops.restore import restore_on_create  # heavy imports only from here on

    rc = restore_on_create(parsed, cmd, bundle, request, lower=lower, lower_warning=warning)
    if rc == 0 and bundle.gpu_release_on_pause:
        from migrt.ops import gpu_pause

        gpu_pause.mark(parsed.root or _lower.default_root(lower), cmd.container_id or "")
    return rc


def _moved_away(parsed: RuncArgv, lower: str, bundle) -> int | None:
    """A container of a pod whose container was pulled to another node: its restart here is refused
    (runtime/moved.py); records of pods that are gone are removed on the way."""
    if not bundle.is_application_container:
        return None
    root = parsed.root or _lower.default_root(lower)
    rec = moved.find(root, bundle.annotations)
    if rec is None:
        moved.sweep(root)
        return None
    runclog.append(parsed.log_path, "error", f"migrt: {moved.refusal(rec)}", log_format=parsed.log_format)
    return 6  # errors.Conflict


def _pause(parsed: RuncArgv, lower: str) -> int | None:
    """pause/resume of a container created with GPU release on pause; None to pass through."""
    cid = parsed.command_args().container_id
    root = parsed.root or _lower.default_root(lower)
    if not is_container_id(cid) or not os.path.isfile(os.path.join(root, cid, RELEASE_MARKER)):
        return None
    from migrt.ops import gpu_pause

    return gpu_pause.pause(parsed, lower) if parsed.command == "pause" else gpu_pause.resume(parsed, lower)


def _memory_arriving(parsed: RuncArgv, lower: str) -> int | None:
    """checkpoint of a container whose memory a lazy restore is still filling: wait until it is all in
    (CRIU would skip the pages not yet there: runtime/lazy_memory.py); an exit code if it never is."""
    from migrt.errors import MigrtError
    from migrt.gpu import procs
    from migrt.runtime import lazy_memory

    cid = parsed.command_args().container_id or ""
    root = parsed.root or _lower.default_root(lower)
    try:
        lazy_memory.wait_filled(lambda: procs.runc_container_pids(root, cid), f"container {cid}")
    except MigrtError as exc:
        runclog.append(parsed.log_path, "error", f"migrt: {exc}", log_format=parsed.log_format)
        return exc.exit_code
    return None


def _restore_privileges(parsed: RuncArgv) -> int | None:
    """`restore` of the lower runtime's own checkpoint (containerd's task restore, its CRI restore of a
    checkpoint image): its tasks may hold no more than the bundle grants, as in migrt's own restores
    (ops/restore_privileges.py). An exit code when refused; None to go on, with the bundle's LSM
    label added as --lsm-profile where the tasks recorded another."""
    from migrt.errors import MigrtError
    from migrt.oci.bundle import Bundle, BundleError
    from migrt.ops import restore_privileges

    cmd = parsed.command_args()
    try:
        bundle = Bundle.load(cmd.value("bundle", "b") or os.getcwd())
    except BundleError:
        return None  # runc reports its own error about the bundle
    images = cmd.value("image-path") or os.path.join(os.getcwd(), "checkpoint")
    try:
        verdict = restore_privileges.check(images, bundle, images)
    except MigrtError as exc:
        runclog.append(parsed.log_path, "error", f"migrt: {exc}", log_format=parsed.log_format)
        return exc.exit_code
    if verdict.runc_args and cmd.value("lsm-profile") is None:
        parsed.rest = [*verdict.runc_args, *parsed.rest]
    return None


def _gpu(parsed: RuncArgv, lower: str) -> int | None:
    """checkpoint/restore with GPU state: migrt drives the GPU; None to pass the call through."""
    from migrt.gpu import procs, records

    if os.environ.get(records.HANDLED_ENV):
        return None  # whoever called us drives the GPU
    cmd = parsed.command_args()
    if parsed.command == "checkpoint":
        root = parsed.root or _lower.default_root(lower)
        if gpu_suspended(root, cmd.container_id or ""):  # its GPU state sits in host memory: refuse
            runclog.append(parsed.log_path, "error", f"migrt: {gpu_suspended_message(cmd.container_id or '')}",
                           log_format=parsed.log_format)
            return 6
        pids = procs.container_cuda_pids(parsed.root or _lower.default_root(lower), cmd.container_id or "")
        if not pids:
            return None
        from migrt.ops import gpu_runc

        return gpu_runc.checkpoint(parsed, lower, pids)
    image_dir = cmd.value("image-path") or os.path.join(os.getcwd(), "checkpoint")
    if not os.path.isfile(os.path.join(image_dir, records.IMAGE_FILE)):
        return None
    from migrt.ops import gpu_runc

    return gpu_runc.restore(parsed, lower, image_dir)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = RuncArgv.parse(args)
    try:
        lower, warning = _lower.lower_runtime()
    except Untrusted as exc:  # its `runtime:` would run as root: refused, never replaced by a default
        runclog.append(parsed.log_path, "error", f"migrt: {exc}", log_format=parsed.log_format)
        return exc.exit_code
    if lower is None:
        runclog.append(parsed.log_path, "error",
                       "migrt: no lower runtime found: set 'runtime:' in the migrt config or put runc on PATH",
                       log_format=parsed.log_format)
        return 127
    # runc runs `criu` from PATH: migrt's own CRIU first (migrt.criu.binary)
    use_migrt_criu(_lower.configured_value("criu"))
    if parsed.command == "create":
        rc = _create(parsed, lower, warning)
        if rc is not None:
            return rc
    elif parsed.command in ("checkpoint", "restore"):
        rc = _memory_arriving(parsed, lower) if parsed.command == "checkpoint" else _restore_privileges(parsed)
        if rc is not None:
            return rc
        if parsed.command == "restore":
            args = parsed.render()  # byte-identical, or with the bundle's --lsm-profile added
        rc = _gpu(parsed, lower)
        if rc is not None:
            return rc
        if parsed.command == "checkpoint":
            from migrt.ops import runc_checkpoint

            return runc_checkpoint.checkpoint(parsed, lower, lambda: _child(lower, args, parsed))
    elif parsed.command in ("pause", "resume"):
        rc = _pause(parsed, lower)
        if rc is not None:
            return rc
    elif parsed.command == "start":
        cid = parsed.command_args().container_id
        root = parsed.root or _lower.default_root(lower)
        if cid and is_restored(root, cid):
            return 0  # restored at create: already running
    return _exec(lower, args, parsed)


if __name__ == "__main__":
    sys.exit(main())
