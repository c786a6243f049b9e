"""`migrt restore oci:REF` with the real docker-registry (TLS, basic auth), runc and CRIU, no containerd:
memhog (320 MiB it hashes on SIGUSR1) run by runc, checkpointed, pushed, its local checkpoint removed;
then restored by reference from the node's CLI into a new runc container, lazily (the fill waited for,
its outcome reported and the image committed to the store) or after a full pull (the fallback said);
the memory checked each time. A registry error exits as `migrt pull` does."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from migrt.store import manifest as mf
from tests.integration.conftest import run_cli
from tests.integration.test_pagefill import _bundle, binaries, runc_root  # noqa: F401 (fixtures)
from tests.integration.test_pagefill_record import MIB, _checkpoint, _env
from tests.integration.test_registry import registry  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture()
def pushed(runc_root, binaries, registry, tmp_path):  # noqa: F811 - the fixtures' values
    """memhog checkpointed from runc and pushed (its checksum, reference, digest); no copy in the store."""
    name = _uid("rr")
    want = _checkpoint(runc_root, binaries, tmp_path, name)
    ref = registry.ref("team/memhog-cli", name)
    digest = json.loads(run_cli("push", name, ref, "--json").stdout)["digest"]
    run_cli("rm", name)
    return {"sum": want, "ref": ref, "digest": digest}


def _restore(ref: str, did: str, runc_root: str, binaries: dict, tmp_path, *extra: str):  # noqa: F811
    dst = _bundle(str(tmp_path / did), ["true"], binaries)
    out = tmp_path / f"{did}.out"
    res = run_cli("restore", f"oci:{ref}", did, "--bundle", dst, "--root", runc_root, "--output", str(out),
                  "--timeout", "120", "--json", *extra, check=False, env=_env())
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), out


def _sum(runc_root: str, did: str, out) -> str:  # noqa: F811
    st = json.loads(subprocess.run(["runc", "--root", runc_root, "state", did], capture_output=True, text=True,
                                   check=True).stdout)
    os.kill(st["pid"], 10)  # SIGUSR1: memhog hashes its memory again
    end = time.monotonic() + 60
    while time.monotonic() < end and "sum " not in out.read_text():
        time.sleep(0.1)
    subprocess.run(["runc", "--root", runc_root, "delete", "--force", did], check=True, timeout=60)
    return next(ln.split()[1] for ln in out.read_text().splitlines() if ln.startswith("sum "))


def test_a_lazy_restore_by_reference_from_the_cli_fills_verified_and_commits(pushed, runc_root, binaries,  # noqa: F811
                                                                            migrt_config, tmp_path):
    r, out = _restore(pushed["ref"], _uid("rr-d"), runc_root, binaries, tmp_path, "--pages", "lazy", "--wait-pages")
    assert (r["path"], r["fallback"], r["pages"]["source"]) == ("lazy", None, "registry"), r
    outcome, fetched = r["fill_outcome"], r["bytes_fetched"]
    assert outcome["committed"] and outcome["checkpoint"] == r["checkpoint"]
    assert fetched["before_running"] > 0 and fetched["fill"] > 0
    assert fetched["before_running"] + fetched["fill"] >= MIB << 20     # every chunk came from the registry once
    assert r["running_after_s"] < r["timings"]["total_s"]            # it ran before the fill ended
    verify = r["pages"]["fill"]["verify"]
    assert verify["verified"] == verify["chunks"] and "error" not in verify
    assert _sum(runc_root, r["container_id"], out) == pushed["sum"]
    data = mf.load(os.path.join(migrt_config["store"], r["checkpoint"]), r["checkpoint"])
    assert data["pulled"]["manifest_digest"] == pushed["digest"] and data["pulled"]["lazy"]

    # the image is in the store now: the next restore by reference fetches nothing
    again, out2 = _restore(pushed["ref"] + "@" + pushed["digest"], _uid("rr-e"), runc_root, binaries, tmp_path)
    assert (again["path"], again["checkpoint"], again["bytes_fetched"]["before_running"]) == \
        ("store", r["checkpoint"], 0)
    assert _sum(runc_root, again["container_id"], out2) == pushed["sum"]
    run_cli("rm", r["checkpoint"])


def test_a_restore_by_reference_that_cannot_be_lazy_says_why_and_pulls_first(pushed, runc_root, binaries,  # noqa: F811
                                                                            tmp_path):
    r, out = _restore(pushed["ref"], _uid("rr-p"), runc_root, binaries, tmp_path, "--pages", "eager")
    assert (r["path"], r["fallback"], r["pages"]["mode"]) == ("pull", "restore_pages is eager", "eager"), r
    assert r["bytes_fetched"]["before_running"] >= MIB << 20 and "fill_outcome" not in r
    assert _sum(runc_root, r["container_id"], out) == pushed["sum"]
    run_cli("rm", r["checkpoint"])


def test_a_registry_error_exits_as_migrt_pull_does(runc_root, binaries, registry, tmp_path):  # noqa: F811
    ref = "127.0.0.1:9/team/none:v1"  # not in restore_registries either: the operator's CLI is not bound by it
    pulled = run_cli("pull", ref, "--timeout", "5", check=False)
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries)
    res = run_cli("restore", f"oci:{ref}", _uid("rr-x"), "--bundle", dst, "--root", runc_root, "--timeout", "5",
                  check=False, env=_env())
    assert pulled.returncode == res.returncode == 9, (pulled.stderr, res.stderr)
    assert "127.0.0.1:9" in res.stderr and "restore_registries" not in res.stderr
    assert os.listdir(runc_root) == []
