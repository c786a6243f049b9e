"""A process holding a deleted file open (NCCL's and PyTorch's /dev/shm segments: 34 MB each under
NCCL's socket transport, seen on the H200 pair) checkpoints and restores: CRIU dumps such "ghost"
files whole only up to its ghost limit (1 MiB by default), and migrt raises it to
`criu_ghost_limit_mib` (256 by default) through the CRIU config file it names for the dump."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

from tests.helpers.bundles import make_bundle
from tests.integration.conftest import SHIM, run_cli

pytestmark = pytest.mark.integration

# a 4 MiB segment in /dev/shm, opened on fd 3 and unlinked; then the process sleeps holding it
HOLDER = ("dd if=/dev/urandom of=/dev/shm/seg bs=1M count=4 2>/dev/null; exec 3</dev/shm/seg; rm /dev/shm/seg; "
          "echo held; while :; do sleep 0.1; done")


def _run(runc_root: str, bundle: str, cid: str) -> int:
    # stdio /dev/null: a detached container keeps pipes open, and the caller would wait on them
    assert subprocess.run(["runc", "--root", runc_root, "run", "-d", "--bundle", bundle, cid], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode == 0
    state = subprocess.run(["runc", "--root", runc_root, "state", cid], capture_output=True, text=True).stdout
    pid = int(state.split('"pid":')[1].split(",")[0])
    for _ in range(100):
        if os.path.exists(f"/proc/{pid}/fd/3") or any(
                os.path.exists(f"/proc/{c}/fd/3") for c in _children(pid)):
            return pid
        time.sleep(0.1)
    raise AssertionError("the holder never opened its segment")


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def _held_size(pid: int) -> int:
    for p in [pid, *_children(pid)]:
        try:
            if "(deleted)" in os.readlink(f"/proc/{p}/fd/3"):
                return os.stat(f"/proc/{p}/fd/3").st_size
        except OSError:
            continue
    return -1


@pytest.fixture
def runc_root(stack, migrt_config, tmp_path):
    root = tmp_path / "runc-root"
    root.mkdir()
    yield str(root)
    for cid in os.listdir(root):
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid], capture_output=True)


def test_a_deleted_shm_segment_held_open_checkpoints_and_restores(runc_root, migrt_config, tmp_path):
    sid, did = f"ghost-{uuid.uuid4().hex[:6]}", f"ghost-{uuid.uuid4().hex[:6]}-b"
    src = make_bundle(str(tmp_path / "src"), ["sh", "-c", HOLDER])
    pid = _run(runc_root, src, sid)
    assert _held_size(pid) == 4 << 20
    name = f"ck-{sid}"
    run_cli("checkpoint", sid, "--root", runc_root, "--name", name)  # CRIU's 1 MiB default refused this
    dst = make_bundle(str(tmp_path / "dst"), ["sh", "-c", "echo fresh"], env=[f"MIGRT_RESTORE={name}"])
    log = str(tmp_path / "log.json")
    res = subprocess.run([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle", dst,
                          "--pid-file", os.path.join(dst, "init.pid"), did], cwd=dst, timeout=120,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert res.returncode == 0, open(log).read() if os.path.exists(log) else res
    restored = int(open(os.path.join(dst, "init.pid")).read())
    assert _held_size(restored) == 4 << 20  # the deleted segment came back whole, still deleted


def test_the_ghost_limit_is_what_lets_it_through(runc_root, migrt_config, tmp_path):
    """With the limit set to CRIU's own default the same checkpoint fails, naming the ghost file."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(open(migrt_config["config"]).read() + "criu_ghost_limit_mib: 1\n")
    cfg.chmod(0o644)
    sid = f"ghost-{uuid.uuid4().hex[:6]}"
    src = make_bundle(str(tmp_path / "src"), ["sh", "-c", HOLDER])
    _run(runc_root, src, sid)
    res = run_cli("checkpoint", sid, "--root", runc_root, "--name", f"ck-{sid}", check=False,
                  env={**os.environ, "MIGRT_CONFIG": str(cfg)})
    assert res.returncode != 0 and "ghost file" in res.stderr, res.stderr
    state = subprocess.run(["runc", "--root", runc_root, "state", sid], capture_output=True, text=True).stdout
    assert '"running"' in state  # a failed checkpoint leaves the container running
