"""The oldest runc and containerd migrt supports, as the node's release ships them (Debian 12: runc
1.1.5 in /usr/sbin, containerd 1.6.20 in /usr/bin; packaging/setup-test.sh installs them from the
release): the README's demo (a counter checkpointed through containerd with `migrt checkpoint`,
removed, and restored by a new container's create with MIGRT_RESTORE) runs on them with migrt's own
CRIU, and the checkpoint's manifest says that runc made it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from migrt.criu.version import MIN_CONTAINERD, MIN_RUNC, parse_version
from tests.helpers import containerd as ctd_versions

pytestmark = pytest.mark.integration
DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "demo.py")


def test_demo_on_the_release_runc_and_containerd(stack):
    why = ctd_versions.missing("1.6")
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "MIGRT_CONFIG"}
    res = subprocess.run([sys.executable, DEMO, "--containerd", "1.6"], capture_output=True, text=True,
                         timeout=180, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "RESULT: the counter resumed where it stopped, memory intact" in res.stdout, out[-3000:]
    ctd = re.search(r"^containerd (\S+)", res.stdout, re.M)
    runc = re.search(r"^made with runc (\S+) \((\S+)\), CRIU (\S+)", res.stdout, re.M)
    assert ctd and runc, res.stdout[-3000:]
    # Exactly the oldest supported: the release's 1.6 and 1.1, not the newer test builds on PATH.
    assert parse_version(ctd.group(1))[:2] == MIN_CONTAINERD, ctd.group(1)
    assert parse_version(runc.group(1))[:2] == MIN_RUNC and runc.group(2) == "/usr/sbin/runc", runc.groups()
    assert parse_version(runc.group(3)) >= (4, 2)


def test_doctor_refuses_a_runc_older_than_supported(tmp_path):
    """A lower runtime that says it is runc 1.0 fails `migrt doctor` with what to do."""
    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\necho 'runc version 1.0.2'\n")
    fake.chmod(0o755)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"runtime: {fake}\nstore: {tmp_path / 'store'}\nlog_file: {tmp_path / 'log'}\n")
    cfg.chmod(0o644)
    env = dict(os.environ, MIGRT_CONFIG=str(cfg))
    res = subprocess.run([os.path.join(os.environ.get("MIGRT_BINDIR", "/usr/local/bin"), "migrt"), "doctor", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    import json

    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["lower runtime"]["status"] == "fail", checks["lower runtime"]
    assert "runc >= 1.1" in checks["lower runtime"]["fix"]
