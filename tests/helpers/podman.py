"""podman with private storage for tests: its own --root, --runroot and --tmpdir under a temp dir,
no events journal, cgroupfs, containers without a network (`--network none`: no bridge, no firewall
rules on the host). Nothing outside `base` is written; stop() removes every container and unmounts
the storage (`podman system reset`), so the temp dir can be deleted.

The busybox test image is built here (tests/helpers/oci_image.py) and loaded as an OCI archive.
"""

from __future__ import annotations

import os
import subprocess

from tests.helpers.oci_image import IMAGE_REF, build_image_tar


class Podman:
    def __init__(self, base: str, runtime: str | None = None) -> None:
        self.base = base
        self.runtime = runtime

    def argv(self, *args: str, runtime: str | None = None) -> list[str]:
        rt = runtime or self.runtime
        return ["podman", "--root", os.path.join(self.base, "root"), "--runroot", os.path.join(self.base, "run"),
                "--tmpdir", os.path.join(self.base, "tmp"), "--network-config-dir", os.path.join(self.base, "networks"),
                "--events-backend", "none",
                "--cgroup-manager", "cgroupfs", *(["--runtime", rt] if rt else []), *args]

    def __call__(self, *args: str, check: bool = True, timeout: float = 120,
                 runtime: str | None = None) -> subprocess.CompletedProcess:
        argv = self.argv(*args, runtime=runtime)
        env = {**os.environ, "PODMAN_IGNORE_CGROUPSV1_WARNING": "1"}  # MIGRT_CONFIG reaches migrt-runc
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                             stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def load_busybox(self) -> str:
        os.makedirs(self.base, exist_ok=True)
        tar = build_image_tar(os.path.join(self.base, "busybox-oci.tar"))
        self("load", "-i", tar)
        return IMAGE_REF

    def run_detached(self, name: str, image: str, command: str, *extra: str, runtime: str | None = None) -> str:
        return self("run", "-d", "--name", name, "--network", "none", *extra, image, "sh", "-c", command,
                    runtime=runtime).stdout.strip()

    def logs(self, name: str) -> str:
        return self("logs", name, check=False).stdout

    def state(self, name: str) -> str:
        return self("inspect", "--format", "{{.State.Status}}", name).stdout.strip()

    def stop(self) -> None:
        self("rm", "--all", "--force", "--time", "0", check=False)
        self("system", "reset", "--force", check=False)
