"""A private containerd (own root, state dir and socket) for tests, demo and benchmarks.
Started here, stopped by pid. CRI is disabled unless asked for."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.helpers.oci_image import IMAGE_REF, build_image_tar

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
DISABLED = 'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime", "io.containerd.podsandbox.controller.v1.podsandbox", "io.containerd.sandbox.controller.v1.shim"]\n'


class Containerd:
    def __init__(self, base: str, namespace: str = "migrt-test", extra_config: str = "", cri: bool = False) -> None:
        self.base = base
        self.root = os.path.join(base, "root")
        self.state = os.path.join(base, "state")
        self.sock = os.path.join(base, "containerd.sock")
        self.namespace = namespace
        self.extra_config = extra_config
        self.cri = cri
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(base, "containerd.log")

    def start(self, timeout: float = 30.0) -> "Containerd":
        os.makedirs(self.base, exist_ok=True)
        cfg = os.path.join(self.base, "config.toml")
        with open(cfg, "w") as fh:
            fh.write(self.config_text())
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(cfg), stdout=self._log, stderr=self._log,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited early; see {self.log_path}")
            if os.path.exists(self.sock) and self.ctr("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not come up in {timeout}s; see {self.log_path}")

    def config_text(self) -> str:
        text = CONFIG.format(root=self.root, state=self.state, sock=self.sock)
        return (text if self.cri else DISABLED + text) + self.extra_config

    def command(self, config_path: str) -> list[str]:
        """argv that starts containerd (subclasses may wrap it, e.g. in nsenter; the pid stays containerd's)."""
        return ["containerd", "--config", config_path]

    def ctr(self, *args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        argv = ["ctr", "--address", self.sock, "--namespace", self.namespace, *args]
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        res = subprocess.run(argv, timeout=timeout, check=False, **kw)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr}")
        return res

    def import_busybox(self) -> str:
        tar = build_image_tar(os.path.join(self.base, "busybox-oci.tar"))
        self.ctr("images", "import", tar)
        return IMAGE_REF

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
