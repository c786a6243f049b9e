"""GPU machine fixtures (pytest -m gpu): the node, checked once; a missing prerequisite errors every
test (these tests never skip for want of a GPU: run them where there is one). Figures and logs go
to MIGRT_GPU_RESULTS (default: <test dir>/results); the test directory on /dev/shm is removed at
the end unless MIGRT_GPU_KEEP=1."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.gpu import harness


@pytest.fixture(scope="session")
def node():
    n = harness.make_node(harness.base_dir())
    try:
        yield n
    finally:
        for cid in n.containers:
            subprocess.run(["runc", "--root", str(n.runc_root), "delete", "--force", cid], capture_output=True)
        n.results.mkdir(parents=True, exist_ok=True)
        for name in ("migrt.log", "hook.log"):
            if (n.base / name).exists():
                shutil.copy(n.base / name, n.results / name)
        if os.environ.get("MIGRT_GPU_KEEP") != "1":
            shutil.rmtree(n.base, ignore_errors=True)
