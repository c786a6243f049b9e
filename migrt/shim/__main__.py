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

The handlers take the typed call (runtime/argv.py Call) and raise MigrtErrors; this module alone
writes runc's log line (runtime/runclog.py) and picks the exit code, from the error's class.
"""

from __future__ import annotations

import os
import sys

from migrt.criu.binary import use_migrt_criu
from migrt.errors import Conflict, LowerRuntimeFailed, MigrtError, NoLowerRuntime
from migrt.names import is_container_id
from migrt.runtime import lower as _lower
from migrt.runtime import moved, runclog
from migrt.runtime.argv import Call, RuncArgv
from migrt.runtime.markers import GPU_RELEASE_MARKER as RELEASE_MARKER
from migrt.runtime.markers import gpu_suspended, gpu_suspended_message, is_restored

TYPE_CHECKING = False  # the standard library only, and not even typing, before the decision
if TYPE_CHECKING:
    from typing import NoReturn


def _exec(path: str, args: list[str]) -> NoReturn:
    try:
        os.execv(path, [path, *args])
    except OSError as exc:
        raise LowerRuntimeFailed(f"cannot execute lower runtime {path}: {exc}") from exc


def _child(path: str, args: list[str]) -> int:
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
        raise LowerRuntimeFailed(f"cannot execute lower runtime {path}: {exc}") from exc
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:  # the terminal's SIGINT reached runc too: wait for its answer
            continue
    return rc if rc >= 0 else 128 - rc


def _create(call: Call) -> int | None:
    """Returns an exit code when migrt handled the create, None to pass it through."""
    from migrt.oci.bundle import Bundle, BundleError

    try:
        bundle = Bundle.load(call.bundle_dir)
    except BundleError:
        return None  # runc reports its own error about the bundle
    _moved_away(call, bundle)
    pull = bundle.migrate_request()
    if pull is not None:
        from migrt.migration.pull import pull_on_create  # heavy imports only from here on

        return pull_on_create(call, bundle, pull)
    unlisted = bundle.unlisted_pod_part()
    if unlisted is not None and unlisted.pod is not None:  # an init container: did it run on the source?
        from migrt.migration import initran

        args = initran.on_create(call, bundle, unlisted.value, unlisted.pod)
        if args is not None:
            _exec(call.lower, args)
    request = bundle.restore_request()
    if request is None:
        if not bundle.gpu_release_on_pause:
            return None
        from migrt.ops import gpu_pause

        return gpu_pause.create(call)
    from migrt.ops.restore import restore_on_create  # heavy imports only from here on

    fresh = restore_on_create(call, bundle, request)
    if fresh is not None:  # the restore failed; the policy says: the original create
        runclog.append(call.log_path, "warning", f"migrt: {fresh.warning}", log_format=call.log_format)
        return None
    if bundle.gpu_release_on_pause:
        from migrt.ops import gpu_pause

        gpu_pause.mark(call.root, call.container_id)
    return 0


def _moved_away(call: Call, bundle) -> None:
    """A container of a pod whose container was pulled to another node: its restart here is refused
    (runtime/moved.py); records of pods that are gone are removed on the way."""
    if not bundle.is_application_container:
        return
    rec = moved.find(call.root, bundle.annotations)
    if rec is None:
        moved.sweep(call.root)
        return
    raise Conflict(moved.refusal(rec))


def _pause(call: Call) -> int | None:
    """pause/resume of a container created with GPU release on pause; None to pass through."""
    cid = call.container_id
    if not is_container_id(cid) or not os.path.isfile(os.path.join(call.root, cid, RELEASE_MARKER)):
        return None
    from migrt.ops import gpu_pause

    return gpu_pause.pause(call) if call.command == "pause" else gpu_pause.resume(call)


def _memory_arriving(call: Call) -> None:
    """checkpoint of a container whose memory a lazy restore is still filling: wait until it is all in
    (CRIU would skip the pages not yet there: runtime/lazy_memory.py); a MigrtError if it never is."""
    from migrt.gpu import procs
    from migrt.runtime import lazy_memory

    cid = call.container_id
    lazy_memory.wait_filled(lambda: procs.runc_container_pids(call.root, cid), f"container {cid}")


def _restore_privileges(call: Call) -> None:
    """`restore` of the lower runtime's own checkpoint (containerd's task restore, its CRI restore of a
    checkpoint image): its tasks may hold no more than the bundle grants, as in migrt's own restores
    (ops/restore_privileges.py). A MigrtError when refused; else the bundle's LSM label is added as
    --lsm-profile where the tasks recorded another."""
    from migrt.oci.bundle import Bundle, BundleError
    from migrt.ops import restore_privileges

    try:
        bundle = Bundle.load(call.bundle_dir)
    except BundleError:
        return  # runc reports its own error about the bundle
    images = call.image_path
    verdict = restore_privileges.check(images, bundle, images)
    if verdict.runc_args and call.cmd.value("lsm-profile") is None:
        call.add_flags(verdict.runc_args)


def _gpu(call: Call) -> int | None:
    """checkpoint/restore with GPU state: migrt drives the GPU; None to pass the call through."""
    from migrt.gpu import procs, records

    if os.environ.get(records.HANDLED_ENV):
        return None  # whoever called us drives the GPU
    if call.command == "checkpoint":
        if gpu_suspended(call.root, call.container_id):  # its GPU state sits in host memory: refuse
            raise Conflict(gpu_suspended_message(call.container_id))
        pids = procs.container_cuda_pids(call.root, call.container_id)
        if not pids:
            return None
        from migrt.ops import gpu_runc

        return gpu_runc.checkpoint(call, pids)
    image_dir = call.image_path
    if not os.path.isfile(os.path.join(image_dir, records.IMAGE_FILE)):
        return None
    from migrt.ops import gpu_runc

    return gpu_runc.restore(call, image_dir)


def _call(parsed: RuncArgv) -> Call:
    """The typed call, once the lower runtime is known; migrt's CRIU first on runc's PATH."""
    lower, warning = _lower.lower_runtime()  # trust.Untrusted: its `runtime:` would run as root
    if lower is None:
        raise NoLowerRuntime("no lower runtime found: set 'runtime:' in the migrt config or put runc on PATH")
    use_migrt_criu(_lower.configured_value("criu"))  # runc runs `criu` from PATH (migrt.criu.binary)
    return Call(parsed, lower, warning)


def _handle(call: Call, args: list[str]) -> int:
    """The call's exit code: migrt's handling of it, else the lower runtime exec'd with `args`."""
    rc: int | None = None
    if call.command == "create":
        rc = _create(call)
    elif call.command == "checkpoint":
        _memory_arriving(call)
        rc = _gpu(call)
        if rc is None:
            from migrt.ops import runc_checkpoint

            return runc_checkpoint.checkpoint(call, lambda: _child(call.lower, args))
    elif call.command == "restore":
        _restore_privileges(call)
        args = call.render()  # byte-identical, or with the bundle's --lsm-profile added
        rc = _gpu(call)
    elif call.command in ("pause", "resume"):
        rc = _pause(call)
    elif call.command == "start" and call.container_id and is_restored(call.root, call.container_id):
        return 0  # restored at create: already running
    if rc is not None:
        return rc
    _exec(call.lower, args)


def report(parsed: RuncArgv, exc: MigrtError) -> int:
    """A failed call: its one line in runc's log (containerd shows the last error line as the reason
    for the failure), and its exit code, which the error's class says."""
    runclog.append(parsed.log_path, "error", f"migrt: {exc}", log_format=parsed.log_format)
    return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = RuncArgv.parse(args)
    try:
        return _handle(_call(parsed), args)
    except MigrtError as exc:
        return report(parsed, exc)


if __name__ == "__main__":
    sys.exit(main())
