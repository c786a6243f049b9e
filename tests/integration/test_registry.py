"""Checkpoints through a real OCI registry (Debian's docker-registry, the CNCF distribution server) on
loopback with TLS (a CA made here) and basic auth (htpasswd, bcrypt); restore by image reference
through containerd; checkpointctl reading `migrt export`."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.registry import local_registry, missing, write_auth
from tests.integration.conftest import CLI, run_cli
from tests.integration.test_containerd import _checkpointed_counter, _ctr_run_fg, _id, _remove
from tests.integration.workloads import parse_ticks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registry(migrt_config, tmp_path_factory):
    miss = missing()
    if miss:
        msg = f"registry prerequisites missing: {', '.join(miss)} (run packaging/setup-host.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    base = tmp_path_factory.mktemp("registry")
    cfg = migrt_config["config"]
    with open(cfg) as fh:
        original = fh.read()
    with local_registry(str(base)) as reg:
        with open(cfg, "a") as fh:
            fh.write(f"registry_auth_file: {reg.auth_file}\nregistry_ca_file: {reg.ca_file}\n"
                     f"restore_registries: ['{reg.host}']\n")  # creates may restore `oci:` images from it
        try:
            yield reg
        finally:
            with open(cfg, "w") as fh:
                fh.write(original)


@pytest.fixture(scope="module")
def pushed(containerd, registry, tmp_path_factory):
    """A counter checkpointed through containerd and pushed once."""
    tmp = tmp_path_factory.mktemp("pushed")
    _src, name, before = _checkpointed_counter(containerd, tmp)
    ref = registry.ref("team/counter", "v1")
    out = json.loads(run_cli("push", name, ref, "--json").stdout)
    return {"name": name, "ref": ref, "push": out, "before": before}


def _manifest(store: str, name: str) -> dict:
    with open(os.path.join(store, name, "manifest.json")) as fh:
        return json.load(fh)


def test_push_pull_round_trip(pushed, registry, migrt_config):
    out = pushed["push"]
    src = _manifest(migrt_config["store"], pushed["name"])
    assert out["digest"].startswith("sha256:") and out["bytes_sent"] >= src["size_bytes"]
    pulled = json.loads(run_cli("pull", pushed["ref"], "--name", "pulled-copy", "--json").stdout)
    assert pulled["name"] == "pulled-copy" and pulled["digest"] == out["digest"]
    got = _manifest(migrt_config["store"], "pulled-copy")
    assert got["files"] == src["files"]                       # every file, size and digest
    assert got["options"] == src["options"] and got["source"] == src["source"]
    assert got["pulled"]["manifest_digest"] == out["digest"]
    for sub in ("", "images"):  # private like every checkpoint (README "Checkpoint store": 0700)
        assert stat.S_IMODE(os.stat(os.path.join(migrt_config["store"], "pulled-copy", sub)).st_mode) == 0o700
    run_cli("inspect", "pulled-copy", "--verify")
    # the same image again: already there, nothing received
    again = json.loads(run_cli("pull", pushed["ref"], "--name", "pulled-copy", "--json").stdout)
    assert again["already_present"] is True and again["bytes_received"] == 0
    run_cli("rm", "pulled-copy")


def test_second_push_sends_almost_nothing(pushed, registry, migrt_config):
    size = _manifest(migrt_config["store"], pushed["name"])["size_bytes"]
    out = json.loads(run_cli("push", pushed["name"], registry.ref("team/counter", "v1-again"), "--json").stdout)
    assert out["digest"] == pushed["push"]["digest"]          # same content, same image
    assert out["bytes_sent"] < 0.01 * size, out
    assert out["bytes_skipped"] > 0.99 * size            # identical blobs are sent once, so a little less


def test_tampered_blob_refused_nothing_committed(pushed, registry, migrt_config):
    # alter the largest blob in the registry's storage: the server hands the bytes out unchecked
    layers = _image_manifest(registry, pushed["push"]["digest"])["layers"]
    big = max(layers, key=lambda d: d["size"])
    path = registry.blob_path(big["digest"])
    with open(path, "rb") as fh:
        saved = fh.read()
    try:
        with open(path, "r+b") as fh:
            fh.seek(len(saved) // 2)
            fh.write(bytes([saved[len(saved) // 2] ^ 0xFF]))
        res = run_cli("pull", pushed["ref"], "--name", "tampered", check=False)
        assert res.returncode == 4, res.stderr
        assert "altered" in res.stderr and big["digest"] in res.stderr
        store = migrt_config["store"]
        assert not os.path.exists(os.path.join(store, "tampered"))
        assert os.listdir(os.path.join(store, ".pulls")) == []  # no partial left for a refused image
    finally:
        with open(path, "wb") as fh:
            fh.write(saved)


def test_tampered_manifest_digest_refused(pushed, registry, migrt_config, tmp_path):
    ref = pushed["ref"].rsplit(":", 1)[0] + "@sha256:" + "0" * 64
    res = run_cli("pull", ref, check=False)
    assert res.returncode in (3, 4), res.stderr  # unknown digest: the registry has no such manifest
    # a reference pinned to the right digest pulls; its bytes are checked against it
    good = pushed["ref"].rsplit(":", 1)[0] + "@" + pushed["push"]["digest"]
    out = json.loads(run_cli("pull", good, "--name", "pinned", "--json").stdout)
    assert out["digest"] == pushed["push"]["digest"] and not out["already_present"]
    # pulled from exactly that manifest: found again without the registry (here: an untrusted CA)
    cfg = tmp_path / "no-registry.yaml"
    system_ca = "/etc/ssl/certs/ca-certificates.crt"
    cfg.write_text(Path(migrt_config["config"]).read_text().replace(registry.ca_file, system_ca))
    again = json.loads(run_cli("--config", str(cfg), "pull", good, "--name", "pinned", "--json").stdout)
    assert again["already_present"] and again["bytes_received"] == 0
    res = run_cli("--config", str(cfg), "pull", pushed["ref"], "--name", "pinned", check=False)
    assert res.returncode == 9 and "not trusted" in res.stderr  # a tag must be resolved by the registry
    run_cli("rm", "pinned")


def test_wrong_password_and_open_auth_file(pushed, registry, migrt_config, tmp_path):
    bad = tmp_path / "bad-auth.json"
    write_auth(str(bad), registry.host, password="wrong")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(Path(migrt_config["config"]).read_text().replace(registry.auth_file, str(bad)))
    res = run_cli("--config", str(cfg), "pull", pushed["ref"], check=False)
    assert res.returncode == 9 and "registry_auth_file" in res.stderr, res.stderr
    os.chmod(bad, 0o644)
    res = run_cli("--config", str(cfg), "pull", pushed["ref"], check=False)
    assert res.returncode == 7 and "chmod 600" in res.stderr
    empty = cfg.with_name("none.yaml")
    empty.write_text("")  # every key at its default (a --config naming a missing file is refused, exit 2)
    res = run_cli("--config", str(empty), "pull", pushed["ref"], check=False)
    assert res.returncode == 9  # no config: no CA, no credentials -> TLS or auth refused


def test_pull_resumes_after_a_cut(pushed, registry, migrt_config, monkeypatch):
    """A pull cut off after some blobs (the connection to the registry fails) leaves its verified
    blobs; the next pull fetches only the rest."""
    from migrt import config as config_mod
    from migrt.errors import RegistryError
    from migrt.registry import client as client_mod
    from migrt.registry.pull import pull

    cfg = config_mod.load(migrt_config["config"])
    cfg.registry_parallel = 1
    real = client_mod.Client.fetch_blob
    first: list[str] = []

    def flaky(self, digest, size, sink):
        if len(first) == 3:
            raise RegistryError("connection cut (test)")
        first.append(digest)
        return real(self, digest, size, sink)

    monkeypatch.setattr(client_mod.Client, "fetch_blob", flaky)
    with pytest.raises(RegistryError):
        pull(cfg, pushed["ref"], name="resumed")
    assert os.listdir(os.path.join(migrt_config["store"], ".pulls"))  # the partial is kept
    second: list[str] = []

    def counting(self, digest, size, sink):
        second.append(digest)
        return real(self, digest, size, sink)

    monkeypatch.setattr(client_mod.Client, "fetch_blob", counting)
    pull(cfg, pushed["ref"], name="resumed")
    image = _image_manifest(registry, pushed["push"]["digest"])
    digests = [d["digest"] for d in image["layers"]]
    once = {d for d in digests if digests.count(d) == 1}
    # the first pull fetched the config and two blobs (journaled) before the cut: the second fetches
    # the config again and every other blob once (a digest at several places once), not those two
    # (unless one of them is also wanted at a place it was not copied to before the cut)
    assert first[0] == second[0] == image["config"]["digest"]
    assert sorted(second[1:]) == sorted(set(second[1:])) and set(first[1:] + second[1:]) == set(digests)
    assert set(first[1:]) & once and not set(first[1:]) & once & set(second[1:]), (first, second)
    run_cli("inspect", "resumed", "--verify")
    assert os.listdir(os.path.join(migrt_config["store"], ".pulls")) == []
    run_cli("rm", "resumed")


def test_restore_by_reference_through_containerd(pushed, registry, containerd, migrt_config):
    """Two containers restore `oci:REF` at once: one pull, two restored counters."""
    store = migrt_config["store"]
    last = pushed["before"][-1]
    ref = "oci:" + registry.ref("team/counter", "v1")
    procs = {}
    for _ in range(2):
        cid = _id("byref")
        procs[cid] = _ctr_run_fg(containerd, cid, "--env", f"MIGRT_RESTORE={ref}", cmd="echo started-fresh; exit 9")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ls = containerd.ctr("task", "ls").stdout
            if all(f"{cid} " in ls and "RUNNING" in ls.split(cid, 1)[1].splitlines()[0] for cid in procs):
                break
            if any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.2)
        time.sleep(1.0)
        for cid in procs:
            res = containerd.ctr("task", "exec", "--exec-id", "stop", cid, "sh", "-c", "touch /tmp/stop; echo ok",
                                 check=False)
            assert res.stdout.strip() == "ok", (res.stderr, procs[cid].poll())
        outs = {cid: p.communicate(timeout=30) for cid, p in procs.items()}
    finally:
        for cid, p in procs.items():
            if p.poll() is None:
                p.kill()
            _remove(containerd, cid)
    for cid, (out, err) in outs.items():
        assert procs[cid].returncode == 7, (out, err)
        after = parse_ticks(out)
        assert after and after[0][0] > last[0] and "started-fresh" not in out
    pulled = [n for n in os.listdir(store) if n.startswith("oci-counter-")]
    assert len(pulled) == 1, pulled                      # pulled once for both
    assert _manifest(store, pulled[0])["pulled"]["manifest_digest"] == pushed["push"]["digest"]
    assert os.listdir(os.path.join(store, ".pulls")) == []


def test_export_read_by_checkpointctl(pushed, migrt_config, tmp_path):
    if not shutil.which("checkpointctl"):
        if os.environ.get("CI") == "true":
            pytest.fail("checkpointctl missing (run packaging/setup-host.sh)")
        pytest.skip("checkpointctl missing")
    tar = tmp_path / "counter.tar"
    out = json.loads(run_cli("export", pushed["name"], "-o", str(tar), "--json").stdout)
    assert out["size"] == os.path.getsize(tar)
    show = subprocess.run(["checkpointctl", "show", str(tar)], capture_output=True, text=True, timeout=60)
    assert show.returncode == 0, show.stderr
    src = _manifest(migrt_config["store"], pushed["name"])
    assert src["source"]["container_id"][:12] in show.stdout, show.stdout
    assert "runc" in show.stdout or "migrt" in show.stdout
    insp = subprocess.run(["checkpointctl", "inspect", "--ps-tree", "--format", "json", str(tar)],
                          capture_output=True, text=True, timeout=60)
    assert insp.returncode == 0, insp.stderr
    tree = json.loads(insp.stdout)
    assert "sh" in json.dumps(tree)                       # the counter's shell, read from the CRIU images
    # and migrt reads its own export back (the Kubernetes archive importer)
    name = run_cli("import", str(tar), "--name", "exported-back").stdout.strip()
    assert name == "exported-back"
    back = _manifest(migrt_config["store"], name)
    imgs = {k: v for k, v in src["files"].items() if k.startswith("images/")}
    assert all(back["files"].get(k) == v for k, v in imgs.items() if k != "images/stats-dump")
    run_cli("rm", name)


def test_cri_format_push_and_pull(pushed, registry, migrt_config):
    ref = registry.ref("team/counter-cri", "v1")
    out = json.loads(run_cli("push", pushed["name"], ref, "--format", "cri", "--json").stdout)
    man = _image_manifest(registry, out["digest"], repo="team/counter-cri")
    assert man["annotations"]["io.kubernetes.cri-o.annotations.checkpoint.name"]
    assert len(man["layers"]) == 1 and man["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    pulled = json.loads(run_cli("pull", ref, "--name", "from-cri", "--json").stdout)
    assert pulled["name"] == "from-cri"
    got = _manifest(migrt_config["store"], "from-cri")
    assert got["imported"]["format"] == "kubernetes-checkpoint-archive"
    run_cli("inspect", "from-cri", "--verify")
    run_cli("rm", "from-cri")


def _image_manifest(registry, digest: str, repo: str = "team/counter") -> dict:
    """Read a manifest straight from the registry's storage (what it serves)."""
    from migrt.registry.auth import load
    from migrt.registry.client import Client
    from migrt.registry.reference import parse

    ref = parse(f"{registry.host}/{repo}@{digest}")
    client = Client(ref, credentials=load(registry.auth_file, registry.host), ca_file=registry.ca_file)
    try:
        return json.loads(client.get_manifest()[0])
    finally:
        client.close()


def test_push_resumes_after_a_cut(pushed, registry, migrt_config, monkeypatch):
    """A push cut off after some blobs: the next push sends only the blobs the registry lacks."""
    from migrt import config as config_mod
    from migrt.errors import RegistryError
    from migrt.registry import client as client_mod
    from migrt.registry.push import push

    cfg = config_mod.load(migrt_config["config"])
    cfg.registry_parallel = 1
    real = client_mod.Client.upload_blob
    calls = {"n": 0}

    def flaky(self, digest, fd, offset, length):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RegistryError("connection cut (test)")
        return real(self, digest, fd, offset, length)

    ref = registry.ref("team/cut-push", "v1")  # a repository the registry has no blob of yet
    monkeypatch.setattr(client_mod.Client, "upload_blob", flaky)
    with pytest.raises(RegistryError):
        push(cfg, pushed["name"], ref)
    monkeypatch.setattr(client_mod.Client, "upload_blob", real)
    out = push(cfg, pushed["name"], ref)
    total = _manifest(migrt_config["store"], pushed["name"])["size_bytes"]
    assert 0 < out["bytes_sent"] < total and out["bytes_skipped"] > 0, out  # the 3 blobs sent before the cut
    got = json.loads(run_cli("pull", ref, "--name", "after-cut-push", "--json").stdout)
    assert got["digest"] == out["digest"]
    run_cli("inspect", "after-cut-push", "--verify")
    run_cli("rm", "after-cut-push")


@pytest.fixture(scope="module")
def big(registry, migrt_config):
    """A 212 MiB checkpoint (random pages: three 64 MiB blobs and one of 20 MiB) pushed to a
    repository of its own."""
    from migrt.store import Store

    name = "big-random"
    with Store(migrt_config["store"]).writer(name) as w:
        with open(os.path.join(w.images, "inventory.img"), "wb") as fh:
            fh.write(b"inventory")
        with open(os.path.join(w.images, "pages-1.img"), "wb") as fh:
            for _ in range(212):
                fh.write(os.urandom(1 << 20))
        w.commit({"created": "2026-11-27T00:00:00Z"})
    ref = registry.ref("team/big", "v1")
    out = json.loads(run_cli("push", name, ref, "--json").stdout)
    yield {"name": name, "ref": ref, "digest": out["digest"],
           "layers": _image_manifest(registry, out["digest"], repo="team/big")["layers"]}
    run_cli("rm", name, check=False)


def _served(log: str, repo: str) -> dict[str, int]:
    """Bytes of each blob the registry served (GET answered 200 or 206), from its access log, and
    the number of 206 answers (ranges), probes of one byte (`Range: bytes=0-0`) apart."""
    pattern = re.compile(rf'"GET /v2/{re.escape(repo)}/blobs/(sha256:[0-9a-f]{{64}}) HTTP/1\.1" (200|206) (\d+)')
    served: dict[str, int] = {"ranges": 0, "probes": 0}
    with open(log, errors="replace") as fh:
        for m in pattern.finditer(fh.read()):
            if m[2] == "206" and m[3] == "1":
                served["probes"] += 1
                continue
            served["ranges"] += m[2] == "206"
            served[m[1]] = served.get(m[1], 0) + int(m[3])
    return served


def test_four_pulls_of_one_image_share_one_download(big, registry, migrt_config):
    """Four `migrt pull` processes of one image on one store at once: one downloads it (each blob's
    bytes served once, per the registry's own access log), the other three wait and use it."""
    store = migrt_config["store"]
    before = _served(registry.log, "team/big")
    procs = []
    for _ in range(4):
        procs.append((time.monotonic(), subprocess.Popen([CLI, "pull", big["ref"], "--json"], text=True,
                                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    outs = []
    for start, p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append((start, time.monotonic(), json.loads(out)))
    try:
        assert sorted(o[2]["already_present"] for o in outs) == [False, True, True, True], outs
        puller = next(o for o in outs if not o[2]["already_present"])
        assert all(o[0] < puller[1] for o in outs)        # all four ran at once (else the test proves nothing)
        assert {o[2]["name"] for o in outs} == {puller[2]["name"]}
        after = _served(registry.log, "team/big")
        sizes = {d["digest"]: d["size"] for d in big["layers"]}
        assert {d: after.get(d, 0) - before.get(d, 0) for d in sizes} == sizes   # each blob once, whole
        assert after["probes"] - before["probes"] <= 4                           # (one per pull at most)
        run_cli("inspect", puller[2]["name"], "--verify")
        assert os.listdir(os.path.join(store, ".pulls")) == []
    finally:
        run_cli("rm", outs[0][2]["name"], check=False)


def test_a_small_image_is_pulled_in_parallel_ranges(big, registry, migrt_config):
    """Three 64 MiB blobs for four connections: cut into 16 MiB ranges (the distribution server serves
    them), every range verified as part of its blob's digest; each blob's bytes served once."""
    before = _served(registry.log, "team/big")
    out = json.loads(run_cli("pull", big["ref"], "--name", "big-ranges", "--json").stdout)
    try:
        after = _served(registry.log, "team/big")
        sizes = {d["digest"]: d["size"] for d in big["layers"]}
        assert {d: after.get(d, 0) - before.get(d, 0) for d in sizes} == sizes
        big_blobs = sum(-(-s // (16 << 20)) for s in sizes.values() if s > 32 << 20)
        assert after["ranges"] - before["ranges"] == big_blobs and after["probes"] - before["probes"] == 1
        assert out["name"] == "big-ranges" and not out["already_present"]
        run_cli("inspect", "big-ranges", "--verify")
    finally:
        run_cli("rm", "big-ranges", check=False)
