"""A GPU checkpoint restored lazily by reference (issue 30's GPU target), on the simulated GPU node
(migrt/gpu/fakenode.py) with the real runc, CRIU and the TLS+auth docker-registry behind the test
proxy (tests/helpers/registry_proxy.py): the workload (netns_workload.py) maps and fills its "host copy
of the GPU memory" at the checkpoint, as the driver does; the checkpoint goes to the registry and is
restored by `migrt-runc create` with MIGRT_RESTORE=oci:REF. The filler fetches the chunks holding the
host copy first (in ranges, verified), the GPU restore starts once they are in, the rest follows; every
byte of the data and of the host copy comes back. The registry gone before the host copy is in: the
create fails with the reason, no container is left, no GPU call was made on it, and a retry works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from migrt.gpu import fakenode
from tests.gpu import rig
from tests.helpers.twohosts import two_hosts
from tests.integration.conftest import SHIM, run_cli
from tests.integration.test_gpu_pause import driver
from tests.integration.test_migrate_gpu_netns import PYTHON, WORKLOAD, wait_for
from tests.integration.test_registry_lazy import CHUNK, Proxy, _events, _forget, _wait_event, reg  # noqa: F401
from tests.integration.test_runc import Piped

pytestmark = pytest.mark.integration
GIB = 1 << 30
U0 = "GPU-11111111-2222-3333-4444-555555555555"
# above fill_min_mib (auto: lazy); the data bigger than the copy (biggest first alone would take it first)
DATA_MIB, COPY_MIB = 200, 64
SOCKET = "migrt-reglazy-gpu"


@pytest.fixture(scope="module")
def node(stack, migrt_config, reg, tmp_path_factory):  # noqa: F811
    """The simulated GPU (its checkpoint asks the workload for its host copy), a network namespace
    for the containers, the workload's /data, the runc root."""
    base = tmp_path_factory.mktemp("reglazygpu")
    gpu = base / "gpu.json"
    marker = f"FAKE_CUDA={uuid.uuid4().hex}"
    gpu.write_text(json.dumps({"driver_version": "580.159", "marker": marker, "new_state": "running",
                               "process_bytes": 4 * GIB, "ns_init_only": True, "checkpoint_signal": 10,
                               "checkpoint_ack": "/tmp/gpu-copy",
                               "gpus": [{"uuid": U0, "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GIB,
                                         "minor": 0}]}))
    data = base / "data"
    data.mkdir()
    shutil.copy(WORKLOAD, data / "workload.py")
    root = base / "root"
    root.mkdir()
    old = os.environ.get(fakenode.ENV)
    os.environ[fakenode.ENV] = str(gpu)
    try:
        with two_hosts("grl") as hosts:
            yield {"base": base, "gpu": gpu, "marker": marker, "data": data, "root": str(root),
                   "netns": hosts["a"], "needed": rig.probe(PYTHON)["paths"]}
    finally:
        for cid in os.listdir(root):
            subprocess.run(["runc", "--root", str(root), "delete", "--force", cid], capture_output=True)
        if old is None:
            os.environ.pop(fakenode.ENV, None)
        else:
            os.environ[fakenode.ENV] = old


def _bundle(node, name: str, args: list[str], env: list[str]) -> str:
    return rig.make_bundle(str(node["base"] / name), args=args, data_dir=str(node["data"]), needed=node["needed"],
                           gpu_minors=None, netns=node["netns"],
                           env=["PATH=/usr/bin:/bin", node["marker"], f"NVIDIA_VISIBLE_DEVICES={U0}", *env])


def _read(node, name: str) -> dict | None:
    try:
        return json.loads((node["data"] / name).read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def gpu_image(node, reg, migrt_config):  # noqa: F811
    """The workload checkpointed with its host copy (the fake driver's lock and checkpoint), pushed,
    its local checkpoint removed: the references, the first (host copy) and eager chunks' digests."""
    from migrt.pagefill import images as images_mod
    from migrt.pagefill import verify as verify_mod

    cid = f"grl-{uuid.uuid4().hex[:6]}"
    path = _bundle(node, f"src-{cid}", [PYTHON, "/data/workload.py", str(DATA_MIB), str(COPY_MIB), SOCKET], [])
    src = Piped(["runc", "--root", node["root"], "run", "-d", "--bundle", path, cid], path)  # pipes, as a shim's
    assert src.rc == 0
    wait_for(lambda: _read(node, "ready.json"), 60, "the workload's start")
    name = f"grl-ck-{uuid.uuid4().hex[:6]}"
    run_cli("checkpoint", cid, "--root", node["root"], "--name", name)
    src.close()
    images = os.path.join(migrt_config["store"], name, "images")
    plan = images_mod.plan(images)
    (proc,) = [p for p in plan.processes.values() if p.first]
    rel = "images/" + os.path.basename(proc.pages_file)
    size = os.path.getsize(proc.pages_file)
    first = {i for s in proc.segments if any(a < s.end and s.start < b for a, b in proc.first)
             for i in range(s.offset // CHUNK, (s.offset + s.length - 1) // CHUNK + 1)}
    eager = set(verify_mod.eager_chunks(size, [(s.offset, s.offset + s.length) for s in proc.segments]))
    pushed = json.loads(run_cli("push", name, reg.ref("team/gpu", "v1"), "--json").stdout)
    run_cli("rm", name)
    digest = pushed["digest"]
    layers = json.loads(subprocess.run(
        ["curl", "-sf", "--cacert", reg.ca_file, "-u", "migrt-test:s3cret-registry-pass", "-H",
         "Accept: application/vnd.oci.image.manifest.v1+json",
         f"https://{reg.host}/v2/team/gpu/manifests/{digest}"], capture_output=True, check=True).stdout)["layers"]
    chunks = {int(d["annotations"].get("io.migrt.checkpoint.offset", "0")) // CHUNK: d["digest"]
              for d in layers if d["annotations"]["io.migrt.checkpoint.path"] == rel}
    with fakenode.locked(str(node["gpu"])) as d:  # what is restored arrives checkpointed, as on a real node
        d["new_state"] = "checkpointed"
    return {"digest": digest, "proxied": f"{reg.proxy_host}/team/gpu@{digest}", "chunks": chunks,
            "first": {chunks[i] for i in first - eager}, "eager": {chunks[i] for i in eager},
            "name": "oci-gpu-" + digest.split(":", 1)[1][:16], "ready": _read(node, "ready.json"),
            "copy": _read(node, "copy.json")}


def _create(node, image: dict) -> tuple[Piped, str, str]:
    did = f"grl-r-{uuid.uuid4().hex[:6]}"
    bundle = _bundle(node, did, ["sh", "-c", "echo fresh; exit 3"], [f"MIGRT_RESTORE=oci:{image['proxied']}"])
    log = os.path.join(bundle, "log.json")
    p = Piped([SHIM, "--root", node["root"], "--log", log, "--log-format", "json", "create", "--bundle", bundle,
               "--pid-file", os.path.join(bundle, "init.pid"), did], bundle)
    return p, did, log


def _gets(log: str) -> list[dict]:
    """The proxy's blob GETs with a body, in the order they ended."""
    recs = [json.loads(ln) for ln in Path(log).read_text().splitlines()] if os.path.exists(log) else []
    return [dict(r, blob=r["path"].rsplit("/", 1)[1]) for r in recs
            if r["method"] == "GET" and "/blobs/" in r["path"] and r["status"] in (200, 206) and r["bytes"] > 1]


def _unasked(node) -> None:
    for f in ("verify-1", "result-1.json"):
        (node["data"] / f).unlink(missing_ok=True)


def _hashes(node) -> dict:
    (node["data"] / "verify-1").write_text("")
    return wait_for(lambda: _read(node, "result-1.json"), 60, "the copy's hashes")


def _gpu_states(node) -> dict:
    return {p: rec.get("state") for p, rec in (driver(node["gpu"]).get("processes") or {}).items()}


def test_a_gpu_checkpoint_restores_lazily_from_the_registry_host_copy_first(node, gpu_image, reg, migrt_config,  # noqa: F811
                                                                            tmp_path):
    image, store, node_log = gpu_image, migrt_config["store"], migrt_config["log"]
    assert image["first"], image  # the host copy lies in chunks the filler fetches (not CRIU)
    _forget(store, image)
    _unasked(node)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"), "--rate", str(96 << 20))
    p, did, log = _create(node, image)
    try:
        assert p.rc == 0, Path(log).read_text() if os.path.exists(log) else ""
        ev = _wait_event(node_log, "restored", did, 10)
        pages = ev["pages"]
        assert pages["mode"] == "lazy" and pages["source"] == "registry", pages
        (one,) = ev["timings"]["gpu_restores"]
        assert one["vpid"] == 1 and one["waited_for"] == "gpu_backing", one
        assert not _events(node_log, "registry_lazy_fallback", did)
        calls = [c[0] for c in driver(node["gpu"])["calls"] if c[1] == ev["pid"] and c[0] != "state"]
        assert calls == ["restore", "unlock"], calls
        done = _wait_event(node_log, "registry_fill_done", did, 120)
        assert done["fetched_chunks"] == pages["registry"]["chunks"] - pages["registry"]["present"]
        # the order: every host copy chunk in (whole, several at once, by the fill's fetching processes)
        # before the sweep took any other
        gets = _gets(proxy.log)
        first = [k for k, g in enumerate(gets) if g["blob"] in image["first"]]
        rest = set(image["chunks"].values()) - image["first"] - image["eager"]  # (the other files: the create's)
        others = [k for k, g in enumerate(gets) if g["blob"] in rest and g["range"] is None]
        assert first and others and max(first) < min(others), [(g["blob"][:19], g["range"]) for g in gets]
        assert not any(gets[k]["range"] for k in first)
        # every byte back: the data and the host copy
        result = _hashes(node)
        assert result == {"sha256": image["ready"]["sha256"], "copy": image["copy"]["sha256"], "socket": SOCKET}
        run_cli("inspect", image["name"], "--verify")
    finally:
        p.close()
        subprocess.run(["runc", "--root", node["root"], "delete", "--force", did], capture_output=True)
        proxy.stop()
        _forget(store, image)


def test_registry_gone_before_the_host_copy_is_in_stops_the_restore_and_a_retry_works(node, gpu_image, reg,  # noqa: F811
                                                                                      migrt_config, tmp_path):
    image, store, node_log = gpu_image, migrt_config["store"], migrt_config["log"]
    _forget(store, image)
    _unasked(node)
    proxy = Proxy(reg, str(tmp_path / "proxy.log"), "--exit-on", sorted(image["first"])[0])
    p, did, log = _create(node, image)
    try:
        assert p.rc != 0
        said = Path(log).read_text()
        assert f"registry {reg.proxy_host} went away while filling container {did}'s memory" in said, said
        failed = _wait_event(node_log, "page_fill_failed", did, 30)
        assert "the container was stopped; restore again" in failed["error"]
        assert subprocess.run(["runc", "--root", node["root"], "state", did], capture_output=True).returncode != 0
        assert "locked" not in _gpu_states(node).values()
        assert not os.path.exists(os.path.join(store, image["name"]))
        p.close()
        proxy.stop()
        proxy = Proxy(reg, str(tmp_path / "proxy2.log"))  # back: a retry restores, lazily again
        p, did, log = _create(node, image)
        assert p.rc == 0, Path(log).read_text() if os.path.exists(log) else ""
        ev = _wait_event(node_log, "restored", did, 10)
        assert ev["pages"]["source"] == "registry" and ev["timings"]["gpu_restores"][0]["waited_for"] == "gpu_backing"
        _wait_event(node_log, "registry_fill_done", did, 120)
        result = _hashes(node)
        assert result["sha256"] == image["ready"]["sha256"] and result["copy"] == image["copy"]["sha256"]
    finally:
        p.close()
        subprocess.run(["runc", "--root", node["root"], "delete", "--force", did], capture_output=True)
        proxy.stop()
        _forget(store, image)
