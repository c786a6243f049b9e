"""LowerRuntime: the one way migrt runs the lower runtime (runc, crun, nvidia-container-runtime) as a
child: its verbs (state, checkpoint, restore, pause, resume, stop, delete), a captured call of any
other (run), a command line passed through whole (call), a child left running (spawn).
OSError and timeouts become RuntimeFailed here, quoting runc's last error and CRIU's error lines.
Handing the process over *as* the lower runtime (os.execv of an untouched argv) is the shim's job."""

from __future__ import annotations

import glob
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from migrt import names
from migrt.criu.logs import error_lines
from migrt.criu.options import CriuOptions
from migrt.errors import Conflict, NotFound, RuntimeFailed
from migrt.runtime import stop as stop_rule
from migrt.runtime.messages import ContainerState, collapse_lines, last_error, runc_message

TYPE_CHECKING = False  # typing stays off migrt-runc's restore path (tests/unit/test_restore_imports.py)
if TYPE_CHECKING:
    from typing import IO

    Stdio = int | IO[bytes] | IO[str] | None

__all__ = ["LowerRuntime", "ContainerState", "RestoreSpec", "collapse_lines", "runc_message", "candidate_roots",
           "find_root"]

CONTAINERD_ROOTS = "/run/containerd/runc/*"
DEFAULT_ROOTS = ("/run/runc", "/run/crun")


@dataclass
class RestoreSpec:
    container_id: str
    bundle: str
    image_path: str
    work_path: str
    pid_file: str | None = None
    console_socket: str | None = None
    no_pivot: bool = False
    options: CriuOptions = field(default_factory=CriuOptions)
    extra: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        out = ["restore", "--detach", "--bundle", self.bundle]
        if self.pid_file:
            out += ["--pid-file", self.pid_file]
        if self.console_socket:
            out += ["--console-socket", self.console_socket]
        if self.no_pivot:
            out.append("--no-pivot")
        out += ["--image-path", self.image_path, "--work-path", self.work_path]
        out += self.options.runc_flags() + self.extra
        out.append(self.container_id)
        return out


class LowerRuntime:
    def __init__(self, path: str, global_args: list[str] | None = None) -> None:
        self.path = path
        self.global_args = list(global_args or [])

    def _argv(self, root: str | None, args: list[str]) -> list[str]:
        g = list(self.global_args)
        if root and "--root" not in g:
            g = ["--root", root, *g]
        return [self.path, *g, *args]

    def run(self, root: str | None, args: list[str], *, timeout: float | None = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`<runtime> [--root root] <globals> args`, stdin from /dev/null, its output captured as text.
        RuntimeFailed when it cannot be run or outlives `timeout`; its exit status is the caller's."""
        try:
            return subprocess.run(self._argv(root, args), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, check=False, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeFailed(f"{self.path} {args[0]} {args[-1]}: {exc}") from exc

    def call(self, args: list[str], *, env: dict[str, str] | None = None) -> int:
        """`<runtime> args`: a whole command line as given (a rendered runc argv, its global flags in it),
        our stdio inherited; its exit status. RuntimeFailed when it cannot be executed."""
        try:
            return subprocess.run([self.path, *args], env=env, check=False).returncode
        except OSError as exc:
            raise RuntimeFailed(f"cannot execute lower runtime {self.path}: {exc}") from exc

    def spawn(self, root: str | None, args: list[str], *, stdout: int | IO[bytes] | None = None,
              stderr: int | IO[bytes] | None = None, pass_fds: tuple[int, ...] = (),
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`<runtime> [--root root] <globals> args` left running (stdin /dev/null); OSError as Popen
        raises it (the caller undoes what it set up for the child)."""
        return subprocess.Popen(self._argv(root, args), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                pass_fds=pass_fds, env=env)

    def state(self, root: str | None, container_id: str) -> ContainerState:
        """NotFound when the runtime does not know the container, RuntimeFailed when it cannot answer."""
        out = self.run(root, ["state", container_id], timeout=30)
        if out.returncode != 0:
            msg = runc_message(out.stderr.strip().splitlines()[-1]) if out.stderr.strip() else f"exit {out.returncode}"
            where = f" under {root}" if root else ""
            raise NotFound(f"container {container_id}{where}: {msg} (runc state)")
        try:
            return ContainerState.parse(out.stdout)
        except ValueError as exc:
            raise RuntimeFailed(f"{self.path} state {container_id}: unreadable output: {exc}") from exc

    def status(self, root: str | None, container_id: str) -> str | None:
        """The container's status; None when the runtime does not know it (gone) or says nothing readable.
        RuntimeFailed when the runtime cannot be run."""
        out = self.run(root, ["state", container_id], timeout=30)
        if out.returncode != 0:
            return None
        try:
            return ContainerState.parse(out.stdout).status
        except ValueError:
            return None

    def checkpoint(self, root: str, container_id: str, *, image_path: str, work_path: str,
                   options: CriuOptions, leave_running: bool, extra: list[str] | None = None,
                   env: dict[str, str] | None = None) -> None:
        """env: runc's environment (None: ours); CRIU passes it on to its action scripts."""
        log = os.path.join(work_path, "runc.log")
        args = ["--log", log, "--log-format", "json"] if "--log" not in self.global_args else []
        argv = [self.path, "--root", root, *args, *self.global_args, "checkpoint",
                "--image-path", image_path, "--work-path", work_path, *options.runc_flags(),
                *(["--leave-running"] if leave_running else []), *(extra or []), container_id]
        try:
            out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False, env=env)
        except OSError as exc:
            raise RuntimeFailed(f"cannot run {self.path}: {exc}") from exc
        if out.returncode != 0:
            msg = last_error(log) or collapse_lines(out.stderr) or f"exit status {out.returncode}"
            raise RuntimeFailed(
                f"checkpoint of container {container_id} failed: {msg}",
                details=error_lines(os.path.join(work_path, "dump.log")),
            )

    def restore(self, spec: RestoreSpec, *, global_tokens: list[str], stdio: tuple[Stdio, Stdio, Stdio] | None = None,
                log_path: str | None = None, env: dict[str, str] | None = None,
                supervise: Callable[[subprocess.Popen[bytes]], int] | None = None) -> int:
        """Run `restore --detach`; return the restored init's pid (from the pid file when given).
        stdio: (stdin, stdout, stderr) for runc, which CRIU hands to the restored process;
        None inherits ours (the shim's pipes at create). env: runc's environment (None: ours).
        supervise: waits for runc (started in its own session) and returns its exit status; it may
        kill it (a migration's deadline) by raising a MigrtError."""
        argv = [self.path, *global_tokens, *spec.argv()]
        stdin, stdout, stderr = stdio if stdio is not None else (None, None, None)
        try:
            if supervise:
                rc = supervise(subprocess.Popen(argv, env=env, start_new_session=True, stdin=stdin, stdout=stdout,
                                                stderr=stderr))
            else:
                rc = subprocess.run(argv, check=False, env=env, stdin=stdin, stdout=stdout, stderr=stderr).returncode
        except OSError as exc:
            raise RuntimeFailed(f"cannot run {self.path}: {exc}") from exc
        if rc != 0:
            msg = last_error(log_path) or f"{os.path.basename(self.path)} restore exited with status {rc}"
            raise RuntimeFailed(f"restore failed: {msg}",
                                details=error_lines(os.path.join(spec.work_path, "restore.log")))
        if spec.pid_file:
            try:
                with open(spec.pid_file) as fh:
                    return int(fh.read().strip())
            except (OSError, ValueError) as exc:
                raise RuntimeFailed(f"restore succeeded but pid file {spec.pid_file} is unreadable: {exc}") from exc
        return 0

    def stop(self, root: str, container_id: str) -> None:
        """Kill and delete the container; a frozen one is killed before it is thawed (runtime/stop.py)."""
        stop_rule.stop(self, root, container_id)

    def delete_force(self, root: str | None, container_id: str, *, timeout: float | None = None) -> int:
        """`delete --force`, for cleaning up: its exit status, -1 when it could not run or outlived timeout."""
        try:
            return self.run(root, ["delete", "--force", container_id], timeout=timeout).returncode
        except RuntimeFailed:
            return -1

    def _simple(self, root: str | None, verb: str, container_id: str) -> None:
        out = self.run(root, [verb, container_id], timeout=60)
        if out.returncode != 0:
            raise RuntimeFailed(f"{os.path.basename(self.path)} {verb} {container_id} failed: "
                                f"{collapse_lines(out.stderr) or f'exit status {out.returncode}'}")

    def pause(self, root: str | None, container_id: str) -> None:
        """Freeze every process of the container (cgroup freezer)."""
        self._simple(root, "pause", container_id)

    def resume(self, root: str | None, container_id: str) -> None:
        self._simple(root, "resume", container_id)


def candidate_roots(extra: list[str] | None = None) -> list[str]:
    roots = sorted(glob.glob(CONTAINERD_ROOTS)) + list(DEFAULT_ROOTS) + list(extra or [])
    seen, out = set(), []
    for r in roots:
        if r not in seen and os.path.isdir(r):
            seen.add(r)
            out.append(r)
    return out


def find_root(container_id: str, extra: list[str] | None = None) -> str:
    """The runc root holding container_id: containerd's per-namespace roots, /run/runc, /run/crun."""
    names.container_id(container_id)  # before it becomes a path
    hits = [r for r in candidate_roots(extra) if os.path.isfile(os.path.join(r, container_id, "state.json"))]
    if not hits:
        where = ", ".join(candidate_roots(extra)) or "any runc root"
        raise NotFound(f"container {container_id}: not found under {where}; pass --root")
    if len(hits) > 1:
        raise Conflict(f"container {container_id}: found in several roots ({', '.join(hits)}); pass --root")
    return hits[0]
