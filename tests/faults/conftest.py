"""Fault-injection suite: real runc, CRIU and containerd, as root (like tests/integration; with CI=true
a missing prerequisite fails). The integration fixtures are shared from there.

Fixtures of the local (store, checkpoint, restore) faults: the real runc, CRIU (and containerd for the CRI case), a private store
and runc root per test, busybox containers whose output (a tick counter) goes to a file on the host.

`Node.migrt(..., fault="checkpoint:dumping:kill")` sets MIGRT_FAULT (migrt/faults.py, a documented
test seam); `Node.wait_phase` follows an operation through the store's journal, so that a test can
kill migrt from outside at the moment a phase begins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from tests.helpers.bundles import make_bundle
from tests.integration.conftest import CLI, containerd, migrt_config, run_cli, stack  # noqa: F401 - fixtures
from tests.integration.conftest import pytest_collection_modifyitems  # noqa: F401 - CRI-checkpoint tests: 2.x only
from tests.integration.conftest_cri import cri, cri_containerd, cri_stack, cri_stubs  # noqa: F401
from tests.integration.workloads import parse_ticks

pytestmark = pytest.mark.integration


def counter(mb: int = 0) -> str:
    """A tick every 0.1 s, holding `mb` MB of memory in a shell variable (what CRIU has to dump)."""
    fill = f"m=$(head -c {mb}000000 /dev/zero | tr '\\0' a); " if mb else ""
    return fill + 'i=0; while true; do i=$((i+1)); echo "tick $i x x"; sleep 0.1; done'


class Node:
    def __init__(self, base: str) -> None:
        self.base = base
        self.root = os.path.join(base, "runc-root")
        self.store = os.path.join(base, "store")
        self.config = os.path.join(base, "config.yaml")
        os.makedirs(self.root, exist_ok=True)
        self.write_config()
        self.outputs: dict[str, str] = {}
        self._cats: list[subprocess.Popen] = []
        self.extra_env: dict[str, str] = {}
        self.tag = uuid.uuid4().hex[:6]
        self.container_env: list[str] = []

    def write_config(self, **extra) -> None:
        lines = ["runtime: runc", f"store: {self.store}", "restore_failure_policy: fail",
                 f"log_file: {os.path.join(self.base, 'migrt.log')}", "log_level: debug"]
        lines += [f"{k}: {json.dumps(v)}" for k, v in extra.items()]
        with open(self.config, "w") as fh:
            fh.write("\n".join(lines) + "\n")

    def env(self, fault: str | None = None) -> dict:
        env = {**os.environ, "MIGRT_CONFIG": self.config, **self.extra_env}
        env.pop("MIGRT_FAULT", None)
        if fault:
            env["MIGRT_FAULT"] = fault
        return env

    # -- migrt -----------------------------------------------------------------------------------
    def migrt(self, *args: str, fault: str | None = None, check: bool = True, timeout: float = 120):
        res = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, env=self.env(fault))
        if check and res.returncode != 0:
            raise AssertionError(f"migrt {' '.join(args)} failed ({res.returncode}): {res.stderr}")
        return res

    def spawn(self, *args: str, fault: str | None = None) -> subprocess.Popen:
        return subprocess.Popen([CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env(fault))

    def journal(self) -> list[dict]:
        d = os.path.join(self.store, ".journal")
        out = []
        for n in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if n.endswith(".json"):
                try:
                    with open(os.path.join(d, n)) as fh:
                        out.append(json.load(fh))
                except (OSError, ValueError):
                    continue  # being replaced right now
        return out

    def wait_phase(self, op: str, phase: str, pid: int | None = None, timeout: float = 60) -> dict:
        """Poll the journal (every 5 ms) until an operation `op` of process `pid` records `phase`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.journal():
                if e.get("op") == op and phase in (e.get("phases") or []) and (pid is None or e.get("pid") == pid):
                    return e
            time.sleep(0.005)
        raise AssertionError(f"no {op} reached phase {phase} within {timeout}s; journal: {self.journal()}")

    def listed(self) -> list[str]:
        return [c["name"] for c in json.loads(self.migrt("ls", "--json").stdout)]

    def assert_clean_store(self) -> None:
        """Nothing partial anywhere: no journal entry, no staging directory, no restore view."""
        assert self.journal() == [], self.journal()
        for d in (".staging", ".tmp"):
            path = os.path.join(self.store, d)
            assert not os.path.isdir(path) or os.listdir(path) == [], (d, os.listdir(path))

    # -- containers ------------------------------------------------------------------------------
    def bundle(self, name: str, mb: int = 0) -> str:
        return make_bundle(os.path.join(self.base, f"bundle-{name}"), ["sh", "-c", counter(mb)],
                           env=self.container_env)

    def run(self, mb: int = 0, cid: str | None = None) -> str:
        cid = cid or f"c-{uuid.uuid4().hex[:6]}"
        bundle = self.bundle(cid, mb)
        out = os.path.join(self.base, f"{cid}.out")
        # stdout through a pipe (CRIU dumps a pipe as external; a host file it cannot look up), which
        # `cat` copies into a file the test reads
        with open(out, "ab") as fh:
            cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=fh)
        self._cats.append(cat)
        subprocess.run(["runc", "--root", self.root, "run", "-d", cid], cwd=bundle, stdin=subprocess.DEVNULL,
                       stdout=cat.stdin, stderr=cat.stdin, check=True, timeout=60)
        self.outputs[cid] = out
        self.wait_ticks(cid, 2, timeout=30)
        return cid

    def id(self, name: str) -> str:
        """A container id unique to this test: runc derives the cgroup path from the id when the bundle
        names none, and cgroups are machine-wide (other tests, other people's runs)."""
        return f"{name}-{self.tag}"

    def restore(self, name: str, cid: str, *, bundle_of: str, check: bool = True, fault: str | None = None):
        out = os.path.join(self.base, f"{cid}.out")
        self.outputs[cid] = out
        return self.migrt("restore", name, cid, "--bundle", os.path.join(self.base, f"bundle-{bundle_of}"),
                          "--root", self.root, "--output", out, check=check, fault=fault)

    def state(self, cid: str) -> str | None:
        res = subprocess.run(["runc", "--root", self.root, "state", cid], capture_output=True, text=True)
        return json.loads(res.stdout)["status"] if res.returncode == 0 else None

    def ticks(self, cid: str) -> list[int]:
        try:
            with open(self.outputs[cid], errors="replace") as fh:
                return [t[0] for t in parse_ticks(fh.read())]
        except FileNotFoundError:
            return []

    def wait_ticks(self, cid: str, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ticks(cid)) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"container {cid}: {len(self.ticks(cid))} ticks after {timeout}s, wanted {n}")
            time.sleep(0.05)

    def assert_running(self, cid: str) -> None:
        """runc says running AND the process makes progress (a frozen one would not tick)."""
        assert self.state(cid) == "running", (cid, self.state(cid))
        before = len(self.ticks(cid))
        self.wait_ticks(cid, before + 3, timeout=10)

    def delete_all(self) -> None:
        for cid in os.listdir(self.root):
            subprocess.run(["runc", "--root", self.root, "delete", "--force", cid], capture_output=True)
        for cat in self._cats:
            cat.stdin.close()
            cat.kill()
            cat.wait(10)


@pytest.fixture
def node(stack, tmp_path):  # noqa: F811
    n = Node(str(tmp_path))
    yield n
    n.delete_all()


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
