"""podman with private storage for tests: its own --root, --runroot and --tmpdir under a temp dir,
no events journal, cgroupfs, containers without a network (`--network none`: no bridge, no firewall
rules on the host). Nothing outside `base` is written; stop() removes every container and unmounts
the storage (`podman system reset`), so the temp dir can be deleted.

The busybox test image is built here (tests/helpers/oci_image.py) and loaded as an OCI archive.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess

from tests.helpers.oci_image import IMAGE_REF, build_image_tar


PODMAN_NPROC = 32768  # podman 4.3's --ulimit default, which it also sets on itself (conmon, runc inherit it)


def _ulimits() -> list[str]:
    """Open-file and process limits the container can be given here. podman 4.3 (Debian 12's) asks for
    1048576 of each for a root container once any --ulimit is given (and for open files always); runc
    sets them in the container, which needs CAP_SYS_RESOURCE above the hard limits runc runs with:
    where that capability is not ours (a sandboxed CI runner), every create fails with "error setting
    rlimit type 7 (or 6): operation not permitted"."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], PODMAN_NPROC)
    return ["--ulimit", f"nofile={soft}:{hard}", "--ulimit", f"nproc={nproc}:{nproc}"]


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

    def _conf(self) -> str:
        """A containers.conf (CONTAINERS_CONF) that hands PATH and MIGRT_CONFIG to conmon, and so to the
        runtime's create: podman 4.3 gives conmon only `conmon_env_vars` (default: a fixed PATH)."""
        keep = [f"{k}={os.environ[k]}" for k in ("PATH", "MIGRT_CONFIG") if k in os.environ]
        path = os.path.join(self.base, "containers.conf")
        os.makedirs(self.base, exist_ok=True)
        with open(path, "w") as fh:
            fh.write("[engine]\nconmon_env_vars = [" + ", ".join(json.dumps(v) for v in keep) + "]\n")
        return path

    def __call__(self, *args: str, check: bool = True, timeout: float = 120,
                 runtime: str | None = None) -> subprocess.CompletedProcess:
        argv = self.argv(*args, runtime=runtime)
        # MIGRT_CONFIG reaches migrt-runc: directly where podman runs it, through conmon (the create) by _conf
        env = {**os.environ, "PODMAN_IGNORE_CGROUPSV1_WARNING": "1", "CONTAINERS_CONF": self._conf()}
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
        return self("run", "-d", "--name", name, "--network", "none", *_ulimits(), *extra, image, "sh", "-c", command,
                    runtime=runtime).stdout.strip()

    def logs(self, name: str) -> str:
        return self("logs", name, check=False).stdout

    def state(self, name: str) -> str:
        return self("inspect", "--format", "{{.State.Status}}", name).stdout.strip()

    def stop(self) -> None:
        self("rm", "--all", "--force", "--time", "0", check=False)
        self("system", "reset", "--force", check=False)
