"""A private containerd (own root, state dir and socket) for the demo, tests and benchmarks.
Started here, stopped by pid. CRI is disabled unless asked for.

Containerd versions: "2" is the one on PATH (scripts/test.sh puts packaging/setup-test.sh's containerd
2.1 first; on a node set up by setup-host.sh alone, the node's own, whatever its version); "1.7" is
Debian trixie's 1.7 that setup-test.sh unpacks into $MIGRT_DEPS/containerd-1.7; "1.6" is the node
release's own (/usr/bin: Debian 12's 1.6.20 with its runc 1.1.5, the oldest migrt supports). A
versioned one gets its own directory first on the daemon's PATH (its ctr, shims and, for 1.6, runc).
The config version (2 or 3) follows the binary's own `containerd --version`. Which versions the tests
run is tests/helpers/containerd.py's (MIGRT_TEST_CONTAINERD).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import time

SYSTEM = "2"
VERSIONS = (SYSTEM, "1.7", "1.6")
DEPS = os.environ.get("MIGRT_DEPS", "/opt/migrt-deps")
RELEASE_BIN = "/usr/bin"  # the node release's containerd 1.6 (Debian 12)
RELEASE_PATH = "/usr/sbin:/usr/bin"  # ... and its runc (/usr/sbin/runc, 1.1.5) first for its shims


def bin_dir(version: str) -> str | None:
    """Where that containerd's binaries are; None: the one on PATH."""
    if version == SYSTEM:
        return None
    return RELEASE_BIN if version == "1.6" else os.path.join(DEPS, f"containerd-{version}", "usr", "bin")


@functools.cache
def config_version(binary: str) -> int:
    """2 for containerd 1.x, 3 for 2.x (from `containerd --version`; 3 when it cannot tell)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 3
    m = re.search(r"\sv?(\d+)\.\d+", out)
    return 2 if m and m.group(1) == "1" else 3


def missing(version: str) -> str | None:
    """Why that containerd cannot run here, or None."""
    d = bin_dir(version)
    if d is None:
        return None
    need = [os.path.join(d, b) for b in ("containerd", "ctr", "containerd-shim-runc-v2")]
    absent = [p for p in need if not os.access(p, os.X_OK)]
    if not absent:
        return None
    return (f"containerd {version}: {', '.join(absent)} missing (packaging/setup-test.sh unpacks 1.7; 1.6 is the "
            "node release's own package)")


CONFIG_V2 = """version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  level = "warn"
"""
DISABLED_V2 = 'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
CONFIG = """version = 3
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  level = "warn"
[plugins]
  [plugins.'io.containerd.grpc.v1.cri']
"""
DISABLED = ('disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", '
            '"io.containerd.cri.v1.runtime", "io.containerd.podsandbox.controller.v1.podsandbox", '
            '"io.containerd.sandbox.controller.v1.shim"]\n')


class Containerd:
    def __init__(self, base: str, namespace: str = "migrt-test", extra_config: str = "", cri: bool = False,
                 version: str | None = None) -> None:
        self.version = version or SYSTEM
        self.bin_dir = bin_dir(self.version)
        self.config_version = config_version(self.binary("containerd"))
        self.base = base
        self.root = os.path.join(base, "root")
        self.state = os.path.join(base, "state")
        self.sock = os.path.join(base, "containerd.sock")
        self.namespace = namespace
        self.extra_config = extra_config
        self.cri = cri
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(base, "containerd.log")

    def start(self, timeout: float = 30.0) -> Containerd:
        os.makedirs(self.base, exist_ok=True)
        cfg = os.path.join(self.base, "config.toml")
        with open(cfg, "w") as fh:
            fh.write(self.config_text())
        self.prepare(cfg)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (the daemon's log, open until stop())
        self.proc = subprocess.Popen(self.command(cfg), stdout=self._log, stderr=self._log,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited early; see {self.log_path}")
            if os.path.exists(self.sock) and self.ctr("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not come up in {timeout}s; see {self.log_path}")

    def config_text(self) -> str:
        template, disabled = (CONFIG, DISABLED) if self.config_version == 3 else (CONFIG_V2, DISABLED_V2)
        text = template.format(root=self.root, state=self.state, sock=self.sock)
        return (text if self.cri else disabled + text) + self.extra_config

    def prepare(self, config_path: str) -> None:
        """Runs once the config is written, before containerd starts (e.g. `migrt install containerd`)."""

    def binary(self, name: str) -> str:
        return os.path.join(self.bin_dir, name) if self.bin_dir else name

    def env(self) -> dict:
        """The daemon's environment: its own shims first on PATH."""
        env = dict(os.environ)
        if self.bin_dir:
            first = RELEASE_PATH if self.version == "1.6" else self.bin_dir
            env["PATH"] = first + os.pathsep + env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        return env

    def command(self, config_path: str) -> list[str]:
        """argv that starts containerd (subclasses may wrap it, e.g. in nsenter; the pid stays containerd's)."""
        return [self.binary("containerd"), "--config", config_path]

    def ctr(self, *args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        argv = [self.binary("ctr"), "--address", self.sock, "--namespace", self.namespace, *args]
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        res = subprocess.run(argv, timeout=timeout, check=False, **kw)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr}")
        return res

    def import_image(self, tar: str, ref: str) -> str:
        """An OCI layout tar (oci_image.py) into this containerd; returns ref."""
        self.ctr("images", "import", tar)
        return ref

    def containers(self) -> list[str]:
        out = self.ctr("containers", "list", "-q", check=False).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def cleanup_containers(self) -> None:
        for cid in self.containers():
            self.ctr("task", "kill", "-s", "KILL", cid, check=False)
            for _ in range(50):
                if self.ctr("task", "delete", cid, check=False).returncode == 0 or "not found" in \
                        self.ctr("task", "ls", check=False).stdout + "not found":
                    break
                time.sleep(0.1)
            self.ctr("task", "delete", "--force", cid, check=False)
            self.ctr("containers", "delete", cid, check=False)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.cleanup_containers()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        try:  # the shim's per-namespace runc root, empty once every container is gone
            os.rmdir(f"/run/containerd/runc/{self.namespace}")
        except OSError:
            pass
