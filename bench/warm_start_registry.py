"""The registry leg of bench/warm_start.py (`--from-registry`, issue 30): the checkpointed server
pushed with `migrt push` to a docker-registry on loopback, then restored by reference
(`MIGRT_RESTORE=oci:REF`) into a node store that is empty before every run.

The registry is tests/helpers/registry.py's: Debian's docker-registry on 127.0.0.1 with TLS (a CA and
certificate made in the run with the openssl CLI) and basic auth (an htpasswd file made in the run,
bcrypt). On the GPU machine docker-registry and htpasswd come from the kit (tests/gpu/prepare_kit.sh
puts Debian 12's .debs into .device/debs; bench/run_warm_start_on_device.sh unpacks them); where no
htpasswd runs, a stand-in made here writes the same bcrypt line with Python's crypt module.

The node's config gains registry_auth_file, registry_ca_file, restore_registries and registry_timeout
(the push reads the first two); the restores by reference get a copy of it whose store is a
directory of their own, emptied before each run, so that each one fetches the image from the
registry. How a restore got its pages (a full pull then a restore from the store, or a lazy restore
from the registry, or a fallback and why) is read from its records in migrt's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.registry import alive, container_events, guard_of, restore_path
from tests.helpers import registry as reg_helpers

REPO = "warm/server"
TAG = "v1"
GUARD_WAIT_S = 60.0  # a removed container's page filler aborts and exits; its store goes after it

# `htpasswd -Bbc FILE USER PASSWORD` (all tests/helpers/registry.py asks) without apache2-utils; bcrypt
# cost 5 as htpasswd -B (the registry checks the password on every request)
HTPASSWD_STANDIN = """#!{python}
import crypt, sys, warnings
warnings.simplefilter("ignore")
if len(sys.argv) != 5 or sys.argv[1] != "-Bbc":
    sys.exit("htpasswd stand-in (bench/warm_start_registry.py): only -Bbc FILE USER PASSWORD")
line = sys.argv[3] + ":" + crypt.crypt(sys.argv[4], crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=32)) + "\\n"
if not line.split(":", 1)[1].startswith("$2"):
    sys.exit("htpasswd stand-in: this libcrypt makes no bcrypt hashes")
open(sys.argv[2], "w").write(line)
"""


def htpasswd_works() -> bool:
    try:
        return subprocess.run(["htpasswd", "-nbB", "u", "p"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_htpasswd(bindir: Path) -> str | None:
    """A working `htpasswd` on PATH: the system's, else the stand-in in bindir (put first on PATH);
    what was done, for the notes, or None."""
    if htpasswd_works():
        return None
    bindir.mkdir(parents=True, exist_ok=True)
    path = bindir / "htpasswd"
    path.write_text(HTPASSWD_STANDIN.format(python=sys.executable))
    path.chmod(0o755)
    os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    return f"htpasswd: no working apache2-utils binary, the Python stand-in in {bindir} made the bcrypt line"


def missing_tools() -> list[str]:
    """What the leg lacks (the stand-in counts for htpasswd when Python's crypt makes bcrypt)."""
    out = [t for t in reg_helpers.missing() if t != "htpasswd"]
    if not shutil.which("htpasswd") and not _crypt_bcrypt():
        out.append("htpasswd (apache2-utils; or Python's crypt with bcrypt)")
    return out


def _crypt_bcrypt() -> bool:
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import crypt
        return crypt.crypt("x", crypt.mksalt(crypt.METHOD_BLOWFISH)).startswith("$2")
    except (ImportError, AttributeError, OSError, ValueError):
        return False


class RegistryLeg:
    """The running registry, the pushed image and the empty store of the restores by reference."""

    def __init__(self, node, base: Path) -> None:
        self.node, self.base = node, base
        self.stack = contextlib.ExitStack()
        self.notes: list[str] = []
        note = ensure_htpasswd(base / "registry-bin")
        if note:
            self.notes.append(note)
        self.reg = self.stack.enter_context(reg_helpers.local_registry(str(base / "registry")))
        self.ref = self.reg.ref(REPO, TAG)
        self.store = base / "store-registry"
        config = Path(node.env["MIGRT_CONFIG"])
        lines = (f"registry_auth_file: {self.reg.auth_file}\nregistry_ca_file: {self.reg.ca_file}\n"
                 f"restore_registries: ['{self.reg.host}']\nregistry_timeout: 600\n")
        if os.environ.get("WARM_START_REGISTRY_PARALLEL"):  # connections per transfer (default the config's)
            lines += f"registry_parallel: {int(os.environ['WARM_START_REGISTRY_PARALLEL'])}\n"
        text = config.read_text()
        config.write_text(text + ("" if text.endswith("\n") else "\n") + lines)
        self.config = base / "config-registry.yaml"
        self.config.write_text(re.sub(r"(?m)^store: .*$", f"store: {self.store}", config.read_text()))
        self.env = {**node.env, "MIGRT_CONFIG": str(self.config)}
        self.push_result: dict = {}

    def version(self) -> str:
        return subprocess.run(["docker-registry", "--version"], capture_output=True, text=True,
                              timeout=30).stdout.strip()

    def push(self, name: str, timeout: float) -> dict:
        """`migrt push NAME REF` from the node's store: seconds, bytes sent, MB/s."""
        t0 = time.monotonic()
        r = subprocess.run([self.node.migrt, "push", name, self.ref, "--json"], capture_output=True, text=True,
                           env=self.node.env, timeout=timeout)
        wall = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"migrt push {name} {self.ref} -> {r.returncode}: {r.stderr.strip()[-2000:]}")
        out = json.loads(r.stdout)
        sent = out.get("bytes_sent") or 0
        self.push_result = {"ref": self.ref, "wall_s": round(wall, 3), "seconds": out.get("seconds"),
                            "bytes_sent": sent, "layers": out.get("layers"),
                            "mbps": round(sent / 1e6 / out["seconds"], 1) if out.get("seconds") else None,
                            "registry": self.version()}
        return self.push_result

    def empty_store(self) -> dict:
        """The restores' store, emptied (each restore fetches the image again); their environment."""
        shutil.rmtree(self.store, ignore_errors=True)
        self.store.mkdir(mode=0o700, parents=True)
        return self.env

    def after(self, cid: str) -> None:
        """Once its container is gone: until its page filler (if any) has exited."""
        found = guard_of(cid)
        deadline = time.monotonic() + GUARD_WAIT_S
        while found and alive(found[0]) and time.monotonic() < deadline:
            time.sleep(0.05)

    def describe(self, cid: str) -> dict:
        """How the restore of `cid` got its image: restore_path's words, the pull's seconds in the
        create, a fallback's reason."""
        log_file = self.node.base / "migrt.log"
        events = container_events(str(log_file), cid) if log_file.exists() else []
        ready = next((e for e in events if e.get("event") == "restore_image_ready"), {})
        fallback = next((e for e in events if e.get("event") == "registry_lazy_fallback"), {})
        return {"path": restore_path(events), "image_ready_s": ready.get("seconds"),
                "pulled": ready.get("pulled"), "lazy_fallback": fallback.get("reason")}

    def close(self) -> None:
        self.stack.close()
        shutil.rmtree(self.store, ignore_errors=True)
