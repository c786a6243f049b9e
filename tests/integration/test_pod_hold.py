"""migrt/pods/hold.py with the real runc and CRIU: a part restored under the hold's CRIU action comes
back frozen (runc state "paused", its counter still), the restore returning at once; it runs on
only when the pod's last part arrives and releases the hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from migrt.pods import hold
from tests.helpers.bundles import make_bundle

pytestmark = pytest.mark.integration

COUNT = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done"


def _runc(root: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["runc", "--root", root, *args], capture_output=True, text=True, timeout=60, check=check,
                          stdin=subprocess.DEVNULL)


def _count(bundle: str) -> int:
    return int(open(os.path.join(bundle, "rootfs", "tmp", "count")).read() or 0)


def _status(root: str, cid: str) -> str:
    return json.loads(_runc(root, "state", cid).stdout)["status"]


def _restore_held(tmp_path, root: str, name: str) -> tuple[str, str]:
    """A counting container, checkpointed and restored under the hold: (container id, bundle)."""
    bundle = make_bundle(str(tmp_path / name), ["sh", "-c", COUNT])
    cid = f"hold-{name}-{uuid.uuid4().hex[:6]}"
    subprocess.run(["runc", "--root", root, "run", "-d", "--bundle", bundle, cid], check=True, timeout=60,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    images, work = tmp_path / f"{name}-img", tmp_path / f"{name}-work"
    images.mkdir()
    work.mkdir()
    _runc(root, "checkpoint", "--image-path", str(images), "--work-path", str(work), cid)
    with open(tmp_path / f"{name}.err", "w") as err:  # never a pipe: the restored tree would keep it open
        t0 = time.monotonic()
        res = subprocess.run(["runc", "--root", root, "restore", "-d", "--image-path", str(images), "--work-path",
                              str(work), "--bundle", bundle, cid], env=hold.criu_env(None, str(work)),
                             stdin=subprocess.DEVNULL, stdout=err, stderr=err, timeout=60)
    assert res.returncode == 0, (tmp_path / f"{name}.err").read_text()
    assert time.monotonic() - t0 < 10  # the create returns with the part held, it does not wait for its peers
    assert (work / "pod-hold.frozen").read_text().split()[0] in ("v1", "v2")
    return cid, bundle


def test_restored_parts_stay_frozen_until_the_last_is_in(tmp_path):
    root = str(tmp_path / "runc")
    cids = []
    try:
        h = hold.Hold(root, f"sb{uuid.uuid4().hex[:8]}")
        os.makedirs(root, exist_ok=True)
        h.join(["one", "two"], 60)
        one, one_bundle = _restore_held(tmp_path, root, "one")
        cids.append(one)
        assert h.arrived("one", one) is False
        assert _status(root, one) == "paused"
        two, two_bundle = _restore_held(tmp_path, root, "two")
        cids.append(two)
        held = (_count(one_bundle), _count(two_bundle))
        time.sleep(0.5)
        assert (_count(one_bundle), _count(two_bundle)) == held  # neither ran ahead
        assert _status(root, one) == _status(root, two) == "paused"
        assert h.arrived("two", two) is True
        h.release()
        assert _status(root, one) == _status(root, two) == "running"
        time.sleep(0.5)
        assert _count(one_bundle) > held[0] + 2 and _count(two_bundle) > held[1] + 2  # both go on
        assert h.state() == hold.RELEASED
    finally:
        for cid in cids:
            _runc(root, "delete", "--force", cid, check=False)
        shutil.rmtree(root, ignore_errors=True)
