"""scripts/demo.py (the README's demo) runs to its RESULT line with each containerd version the tests
cover: the system's 2.x and 1.7 beside it (tests/helpers/containerd.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import containerd as ctd_versions

pytestmark = pytest.mark.integration
DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "demo.py")


@pytest.mark.parametrize("version", ctd_versions.test_versions(), ids=lambda v: f"containerd-{v}")
def test_demo(stack, version):
    why = ctd_versions.missing(version)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "MIGRT_CONFIG"}  # the demo makes its own
    res = subprocess.run([sys.executable, DEMO, "--containerd", version], capture_output=True, text=True,
                         timeout=180, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"containerd {version}" in res.stdout  # the version the demo reports is the one it was asked for
    assert "RESULT: the counter resumed where it stopped, memory intact" in res.stdout, res.stdout[-3000:]
