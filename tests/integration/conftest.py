"""Integration fixtures: real runc, CRIU and containerd, as root.

Outside CI a missing prerequisite skips these tests; with CI=true it fails them loudly (they must run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from migrt.criu.binary import choose as criu_choice
from tests.helpers.containerd import Containerd

BINDIR = os.environ.get("MIGRT_BINDIR", "/usr/local/bin")  # setup-host.sh MIGRT_BINDIR: a private install
SHIM = f"{BINDIR}/migrt-runc"
CLI = f"{BINDIR}/migrt"


def _missing() -> list[str]:
    miss = []
    if os.geteuid() != 0:
        miss.append("root")
    for tool in ("runc", "containerd", "ctr", "iptables"):
        if not shutil.which(tool):
            miss.append(tool)
    for path in (SHIM, CLI):
        if not os.access(path, os.X_OK):
            miss.append(path)
    criu, why = criu_choice()  # migrt's own build (packaging/build-criu.sh), as migrt itself picks it
    if not criu:
        miss.append(f"criu ({why})")
    else:
        out = subprocess.run([criu, "--version"], capture_output=True, text=True).stdout
        if "Version: 4.2" not in out and "Version: 4.3" not in out:
            miss.append(f"criu >= 4.2 (found {out.strip().splitlines()[0] if out.strip() else '?'})")
    return miss


@pytest.fixture(scope="session")
def stack() -> None:
    miss = _missing()
    if miss:
        msg = "integration prerequisites missing: " + ", ".join(miss) + " (run packaging/setup-host.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def migrt_config(stack, tmp_path_factory) -> dict:
    """A private store, log and config for the whole session; MIGRT_CONFIG is inherited by containerd,
    its shims and thus migrt-runc."""
    base = tmp_path_factory.mktemp("migrt")
    store = base / "store"
    cfg = base / "config.yaml"
    cfg.write_text(f"runtime: runc\nstore: {store}\nrestore_failure_policy: fail\n"
                   f"log_file: {base / 'migrt.log'}\nlog_level: debug\n")
    old = os.environ.get("MIGRT_CONFIG")
    os.environ["MIGRT_CONFIG"] = str(cfg)
    yield {"config": str(cfg), "store": str(store), "log": str(base / "migrt.log"), "base": str(base)}
    if old is None:
        os.environ.pop("MIGRT_CONFIG", None)
    else:
        os.environ["MIGRT_CONFIG"] = old


@pytest.fixture(scope="session")
def containerd(migrt_config, tmp_path_factory):
    base = tmp_path_factory.mktemp("containerd")
    ns = f"migrt-it-{uuid.uuid4().hex[:8]}"
    ctd = Containerd(str(base), namespace=ns).start()
    try:
        ctd.image = ctd.import_busybox()
        yield ctd
    finally:
        ctd.stop()


def pytest_collection_modifyitems(config, items):
    """Tests marked cri_checkpoint_api are not collected for containerd 1.7 (no CRI CheckpointContainer
    there): a capability the version lacks is not a missing prerequisite, so no skip is reported."""
    drop = [it for it in items if it.get_closest_marker("cri_checkpoint_api")
            and getattr(it, "callspec", None) is not None
            and it.callspec.params.get("cri_containerd", "").startswith("1.")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if it not in drop]


def run_cli(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"migrt {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res


# CRI fixtures (containerd's CRI plugin, pods, a generated CRI client): cri_stack, cri_containerd, cri.
from tests.integration.conftest_cri import cri, cri_containerd, cri_stack, cri_stubs  # noqa: E402,F401
