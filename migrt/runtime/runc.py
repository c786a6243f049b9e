"""The lower runtime run as a child (exec is the shim's job): state, checkpoint, restore, delete.
CalledProcessError/OSError become RuntimeFailed here, quoting CRIU's error lines."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from migrt import names
from migrt.criu.logs import error_lines
from migrt.criu.options import CriuOptions
from migrt.errors import Conflict, NotFound, RuntimeFailed

CONTAINERD_ROOTS = "/run/containerd/runc/*"
DEFAULT_ROOTS = ("/run/runc", "/run/crun")


def _last_runc_error(log_path: str | None) -> str | None:
    """The msg of the last error line runc wrote to its --log (JSON)."""
    if not log_path:
        return None
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") == "error":
            return str(rec.get("msg"))
    return None


_LOGFMT_MSG = re.compile(r'\blevel=\w+\s+msg="((?:[^"\\]|\\.)*)"')


def runc_message(line: str) -> str:
    """The message of one line runc wrote to stderr: `time="..." level=error msg="container does not
    exist"` (logfmt) gives `container does not exist`; any other line comes back as it is."""
    m = _LOGFMT_MSG.search(line)
    return re.sub(r'\\(.)', r"\1", m.group(1)) if m else line


_STAMP = re.compile(r'time="[^"]*"\s*|"time":"[^"]*",?|^\S+Z\s+')


def collapse_lines(text: str | None, *, limit: int = 4) -> str:
    """A lower runtime's stderr in one message: repeated lines (runc's "Failed to write to log ...
    no space left on device", once per log line it could not write) become one, with a count."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for line in (text or "").splitlines():
        line = line.strip()
        if not line:
            continue
        key = _STAMP.sub("", line)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, line)
    parts = [first[k] + (f" (x{n})" if n > 1 else "") for k, n in counts.items()]
    if len(parts) > limit:
        parts = parts[:limit] + [f"... {len(parts) - limit} more distinct line(s)"]
    return " | ".join(parts)


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

    def state(self, root: str | None, container_id: str) -> dict:
        try:
            out = subprocess.run(self._argv(root, ["state", container_id]), capture_output=True, text=True,
                                 timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeFailed(f"{self.path} state {container_id}: {exc}") from exc
        if out.returncode != 0:
            msg = runc_message(out.stderr.strip().splitlines()[-1]) if out.stderr.strip() else f"exit {out.returncode}"
            where = f" under {root}" if root else ""
            raise NotFound(f"container {container_id}{where}: {msg} (runc state)")
        try:
            return json.loads(out.stdout)
        except ValueError as exc:
            raise RuntimeFailed(f"{self.path} state {container_id}: unreadable output: {exc}") from exc

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
            msg = _last_runc_error(log) or collapse_lines(out.stderr) or f"exit status {out.returncode}"
            raise RuntimeFailed(
                f"checkpoint of container {container_id} failed: {msg}",
                details=error_lines(os.path.join(work_path, "dump.log")),
            )

    def restore(self, spec: RestoreSpec, *, global_tokens: list[str], stdio: tuple | None = None,
                log_path: str | None = None, env: dict[str, str] | None = None,
                supervise: Callable[[subprocess.Popen], int] | None = None) -> int:
        """Run `restore --detach`; return the restored init's pid (from the pid file when given).
        stdio: (stdin, stdout, stderr) for runc, which CRIU hands to the restored process;
        None inherits ours (the shim's pipes at create). env: runc's environment (None: ours).
        supervise: waits for runc (started in its own session) and returns its exit status; it may
        kill it (a migration's deadline) by raising a MigrtError."""
        argv = [self.path, *global_tokens, *spec.argv()]
        kw = {}
        if stdio is not None:
            kw = {"stdin": stdio[0], "stdout": stdio[1], "stderr": stdio[2]}
        try:
            if supervise:
                rc = supervise(subprocess.Popen(argv, env=env, start_new_session=True, **kw))
            else:
                rc = subprocess.run(argv, check=False, env=env, **kw).returncode
        except OSError as exc:
            raise RuntimeFailed(f"cannot run {self.path}: {exc}") from exc
        if rc != 0:
            msg = _last_runc_error(log_path) or f"{os.path.basename(self.path)} restore exited with status {rc}"
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
        from migrt.runtime import stop  # stop.py quotes errors with this module's helpers

        stop.stop(self.path, root, container_id)

    def delete_force(self, root: str | None, container_id: str) -> int:
        return subprocess.run(self._argv(root, ["delete", "--force", container_id]), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode

    def _simple(self, root: str | None, verb: str, container_id: str) -> None:
        try:
            out = subprocess.run(self._argv(root, [verb, container_id]), stdin=subprocess.DEVNULL, capture_output=True,
                                 text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeFailed(f"{self.path} {verb} {container_id}: {exc}") from exc
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
