"""scripts/demo.py (the README's demo) runs to its RESULT line with each containerd version the tests
cover: the system's 2.x and 1.7 beside it (tests/helpers/containerd.py), without importing anything of
the tests (their helpers need the test set-up, e.g. busybox-static: the demo's image is the host's own
sh and coreutils, scripts/lab/host_rootfs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import containerd as ctd_versions

pytestmark = pytest.mark.integration
DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "demo.py")
# Runs the demo (argv[1]) with every import of the tests package refused.
NO_TESTS = """import runpy, sys
class NoTests:
    def find_spec(self, name, path=None, target=None):
        if name == "tests" or name.startswith("tests."):
            raise ImportError("the demo imported " + name + ", which belongs to the tests")
sys.meta_path.insert(0, NoTests())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("version", ctd_versions.test_versions(), ids=lambda v: f"containerd-{v}")
def test_demo(stack, version):
    why = ctd_versions.missing(version)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "MIGRT_CONFIG"}  # the demo makes its own
    res = subprocess.run([sys.executable, "-c", NO_TESTS, DEMO, "--containerd", version], capture_output=True,
                         text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"containerd {version}" in res.stdout  # the version the demo reports is the one it was asked for
    assert "RESULT: the counter resumed where it stopped, memory intact" in res.stdout, res.stdout[-3000:]
