"""Pulls against fake registries on loopback (tests/helpers/fake_registry.py), the hostile registry
of issue 22: which registries a container's create may name (restore_registries), what the runc log
tells the pod's author when a pull fails, the create's whole-pull deadline (registry_timeout), the
namespace an image says it belongs to (checked before any layer), what a refused or failed pull
leaves behind, a deeply nested config blob, and the writable layer of a pulled image (no devices, no
setuid)."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from migrt import config as config_mod
from migrt.errors import CheckpointInvalid, PreconditionFailed, RegistryError
from migrt.oci.bundle import Bundle, RestoreRequest
from migrt.registry import pull
from migrt.registry.reference import parse
from migrt.store import Store
from tests.helpers.fake_registry import Registry, archive_image, migrt_image, send, serve, tls_files
from tests.unit.support import PY_SHIM, write_bundle

pytestmark = pytest.mark.skipif(not shutil.which("openssl"), reason="openssl CLI missing")

FILES = {"images/inventory.img": b"inventory", "images/core-1.img": b"core" * 100}


def _within(seconds: float, fn):
    """fn() in a thread: {"value"} or {"error"}; the test fails if it still runs after `seconds`."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    return out


@pytest.fixture()
def tls(tmp_path):
    return tls_files(str(tmp_path / "tls"))


@pytest.fixture()
def reg(tls):
    """A fake registry serving over TLS; yields (Registry, 'host:port', ca file)."""
    ca, cert, key = tls
    registry = Registry()
    with serve(registry, cert, key) as host:
        yield registry, host, ca


@pytest.fixture()
def cfg(migrt_env, reg):
    _r, host, ca = reg
    c = config_mod.load(str(migrt_env.config))
    c.registry_ca_file = ca
    c.restore_registries = [host]
    return c


def pod_bundle(tmp_path: Path, namespace: str = "team-b") -> Bundle:
    path = write_bundle(tmp_path / "bundle", annotations={"io.kubernetes.cri.container-type": "container",
                                                          "io.kubernetes.cri.sandbox-namespace": namespace})
    return Bundle.load(str(path))


class Log:
    """Stands in for migrt's structlog logger: records (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **kw: self.events.append((level, event, kw))


def _pulls_left(store_root: str) -> list[str]:
    top = os.path.join(store_root, pull.PULLS)
    return os.listdir(top) if os.path.isdir(top) else []


# -- restore_registries -----------------------------------------------------------------------------

@pytest.mark.parametrize("ref,patterns,allowed", [
    ("registry.example/a/b", ["registry.example"], True),
    ("registry.example:443/a/b", ["registry.example"], True),
    ("registry.example:5000/a/b", ["registry.example"], False),
    ("registry.example:5000/a/b", ["registry.example:5000"], True),
    ("registry.example:5000/a/b", ["registry.example:*"], True),
    ("eu.corp.example/a/b", ["*.corp.example"], True),
    ("evilcorp.example/a/b", ["*.corp.example"], False),
    ("Registry.Example/a/b", ["registry.example"], True),
    ("busybox", ["docker.io"], True),
    ("busybox", ["registry.example"], False),
    ("[::1]:5000/a/b", ["[::1]:5000"], True),
    ("127.0.0.1:5000/a/b", [], False),
])
def test_restore_registries_patterns(ref, patterns, allowed):
    from migrt.registry.reference import registry_allowed

    assert registry_allowed(parse(ref), patterns) is allowed


@pytest.mark.parametrize("text", ["restore_registries: registry.example\n", "restore_registries: ['a b']\n",
                                  "restore_registries: ['https://registry.example']\n",
                                  "restore_registries: ['registry.example/team']\n", "restore_registries: [5]\n",
                                  "registry_timeout: 0\n", "registry_timeout: true\n"])
def test_restore_registries_and_timeout_are_validated(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(config_mod.ConfigError, match="'(restore_registries|registry_timeout)' must be"):
        config_mod.load(str(path))


def test_defaults_allow_no_registry_and_bound_the_pull():
    cfg = config_mod.Config(path="x")
    assert cfg.restore_registries == [] and cfg.registry_timeout == 60


def test_create_refuses_a_registry_not_allowed_before_any_connection(migrt_env):
    cfg = config_mod.load(str(migrt_env.config))
    cfg.restore_registries = ["registry.example"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        out = _within(10, lambda: pull.ensure_local(cfg, f"oci:127.0.0.1:{port}/team/ckpt:v1"))
        assert isinstance(out.get("error"), PreconditionFailed), out
        assert "restore_registries" in str(out["error"]) and "127.0.0.1" in str(out["error"])
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()                                          # nobody connected
    finally:
        listener.close()


def test_migrt_pull_is_not_limited_by_restore_registries(cfg, reg):
    registry, host, _ca = reg
    digest = migrt_image(registry, "v1", FILES)
    cfg.restore_registries = []
    out = pull.pull(cfg, f"{host}/team/ckpt:v1")
    assert out["digest"] == digest and Store(cfg.store).exists(out["name"])


# -- what the runc log tells the pod's author --------------------------------------------------------

def test_the_runc_log_hides_what_the_network_answered(migrt_env, tls, tmp_path):
    """A closed port, a plain-HTTP server, a TLS server the node does not trust and a registry that
    answers 404 all read the same in the runc log (containerd shows it to the pod's author); migrt's
    own log has the detail. A registry the config does not allow is said as it is."""
    ca, cert, key = tls
    _other_ca, other_cert, other_key = tls_files(str(tmp_path / "other-tls"))  # a CA the node does not know
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    with open(migrt_env.config, "a") as fh:
        fh.write(f"restore_registries: ['127.0.0.1:*']\nregistry_timeout: 3\nregistry_ca_file: {ca}\n")

    def create(ref: str, name: str) -> dict:
        bundle = write_bundle(tmp_path / name, env=[f"MIGRT_RESTORE={ref}"])
        argv = ["--root", str(tmp_path / "root"), "--log", str(bundle / "log.json"), "--log-format", "json",
                "create", "--bundle", str(bundle), f"c-{name}"]
        r = subprocess.run([str(PY_SHIM), *argv], env=migrt_env.env, capture_output=True, timeout=60)
        assert (r.stdout, r.stderr) == (b"", b"")
        rec = json.loads((bundle / "log.json").read_text().splitlines()[-1])
        return {"rc": r.returncode, "msg": rec["msg"]}

    got = {}
    with serve(lambda h: send(h, 200, b"{}"), None, None) as plain, \
            serve(lambda h: send(h, 200, b"{}"), other_cert, other_key) as untrusted, \
            serve(lambda h: send(h, 404, b'{"errors":[{"code":"NAME_UNKNOWN"}]}')
                  if h.path != "/v2/" else send(h, 200, b"{}"), cert, key) as missing:
        for what, host in (("closed", f"127.0.0.1:{closed_port}"), ("plain", plain), ("untrusted", untrusted),
                           ("missing", missing)):
            ref = f"oci:{host}/team/ckpt:v1"
            got[what] = create(ref, what)
            assert got[what] == {"rc": 9, "msg": f"migrt: cannot pull {ref} (see the node's migrt log)"}, what
    events = [json.loads(line) for line in migrt_env.log_file.read_text().splitlines()]
    details = [e["error"] for e in events if e.get("event") == "restore_pull_failed"]
    assert len(details) == 4 and len(set(details)) == 4          # the detail is in migrt's log, each its own
    assert any("not trusted" in d for d in details) and any("404" in d for d in details)
    refused = create("oci:registry.example/team/ckpt:v1", "refused")
    assert refused["rc"] == 8 and "restore_registries" in refused["msg"]


# -- the create's whole-pull deadline ----------------------------------------------------------------

def test_a_create_pull_ends_within_registry_timeout(cfg, reg):
    """A manifest trickled a byte every 0.2 s (never a pause a per-recv timeout would notice): the
    create's pull gives up at registry_timeout, well inside kubelet's 2 minutes."""
    registry, host, _ca = reg
    stop = threading.Event()

    def trickle(h):
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        while not stop.is_set():
            try:
                h.wfile.write(b" ")
            except OSError:
                return
            stop.wait(0.2)
    registry.hooks["/v2/team/ckpt/manifests/v1"] = trickle
    cfg.registry_timeout = 2
    t0 = time.monotonic()
    try:
        out = _within(20, lambda: pull.ensure_local(cfg, f"oci:{host}/team/ckpt:v1"))
    finally:
        stop.set()
    assert isinstance(out.get("error"), RegistryError), out
    assert "not finished within 2 s (registry_timeout in the migrt config)" in str(out["error"])
    assert time.monotonic() - t0 < 5


# -- namespaces ------------------------------------------------------------------------------------

def test_an_image_of_another_namespace_is_refused_before_any_layer(cfg, reg, tmp_path):
    from migrt.ops.restore import pull_for_create

    registry, host, _ca = reg
    migrt_image(registry, "v1", FILES, namespace="team-a")
    request = RestoreRequest(name=f"oci:{host}/team/ckpt:v1", fallback=None, source="env")
    with pytest.raises(PreconditionFailed, match="taken in Kubernetes namespace 'team-a'"):
        pull_for_create(cfg, request, pod_bundle(tmp_path, "team-b"), Log(), "c1")
    layer_digests = {registry.add_blob(data) for data in FILES.values()}
    assert not [p for p in registry.blob_paths() if p.rsplit("/", 1)[1] in layer_digests]   # no layer asked for
    assert Store(cfg.store).list() == [] and _pulls_left(cfg.store) == []
    # the same image for its own namespace is pulled
    name, pulled = pull_for_create(cfg, request, pod_bundle(tmp_path / "a", "team-a"), Log(), "c2")
    assert pulled and Store(cfg.store).exists(name)


def test_an_image_bound_to_no_namespace_is_refused_for_a_pod_before_any_layer(cfg, reg, tmp_path):
    from migrt.ops.restore import pull_for_create

    registry, host, _ca = reg
    migrt_image(registry, "v1", FILES, namespace=None)
    request = RestoreRequest(name=f"oci:{host}/team/ckpt:v1", fallback=None, source="env")
    with pytest.raises(PreconditionFailed, match="records no Kubernetes namespace"):
        pull_for_create(cfg, request, pod_bundle(tmp_path, "team-b"), Log(), "c1")
    assert len(registry.blob_paths()) == 1                              # the config blob only
    assert Store(cfg.store).list() == [] and _pulls_left(cfg.store) == []


def test_an_image_whose_namespace_shows_only_once_pulled_is_removed_again(cfg, reg, tmp_path):
    """A checkpoint image without the namespace annotation whose archive records namespace team-a:
    refused for a pod of team-b once pulled, and the pulled checkpoint removed."""
    from migrt.ops.restore import pull_for_create
    from tests.unit.test_import_cri import base_entries, diff_tar

    registry, host, _ca = reg
    archive_image(registry, "v1", diff_tar(base_entries()))
    request = RestoreRequest(name=f"oci:{host}/team/ckpt:v1", fallback=None, source="env")
    log = Log()
    with pytest.raises(PreconditionFailed, match="taken in Kubernetes namespace 'team-a'"):
        pull_for_create(cfg, request, pod_bundle(tmp_path, "team-b"), log, "c1")
    assert Store(cfg.store).list() == []


# -- what a failed or refused pull leaves ------------------------------------------------------------

def test_a_pull_that_verified_nothing_leaves_no_partial_directory(cfg, reg):
    registry, host, _ca = reg
    digest = migrt_image(registry, "v1", FILES)
    for data in FILES.values():
        registry.hooks[f"/v2/team/ckpt/blobs/{registry.add_blob(data)}"] = \
            lambda h: send(h, 403, b'{"errors":[{"code":"DENIED","message":"no"}]}')
    with pytest.raises(RegistryError, match="403"):
        pull.pull(cfg, f"{host}/team/ckpt:v1")
    assert digest.split(":")[1] not in " ".join(_pulls_left(cfg.store))
    assert Store(cfg.store).list() == []


def test_a_deeply_nested_config_blob_is_a_clear_error(cfg, reg):
    from migrt.registry import image

    registry, host, _ca = reg
    deep = b'{"files": {}, "schema": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    config = image.descriptor(image.CONFIG_TYPE, registry.add_blob(deep), len(deep))
    registry.add_manifest("v1", image.migrt_manifest(config, [], "x", "2026-01-01T00:00:00Z"))
    with pytest.raises(CheckpointInvalid, match="nested deeper than 64 levels"):
        pull.pull(cfg, f"{host}/team/ckpt:v1")
    with pytest.raises(CheckpointInvalid, match="nested deeper"):
        image.parse(b"[" * 100_000 + b"]" * 100_000, "x")
    assert _pulls_left(cfg.store) == []


# -- the writable layer of a pulled image -------------------------------------------------------------

def _layer(entries: list[tuple[str, bytes, int, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, mode, data in entries:
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, mode
            if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
                info.devmajor, info.devminor = 1, 3
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


LAYER = _layer([
    ("bin", tarfile.DIRTYPE, 0o755, None),
    ("bin/su", tarfile.REGTYPE, 0o4755, b"#!/bin/sh\n"),
    ("bin/wall", tarfile.REGTYPE, 0o2755, b"#!/bin/sh\n"),
    ("bin/plain", tarfile.REGTYPE, 0o755, b"#!/bin/sh\n"),
    ("mem", tarfile.CHRTYPE, 0o666, None),
    ("disk", tarfile.BLKTYPE, 0o666, None),
    ("pipe", tarfile.FIFOTYPE, 0o644, None),
])


@pytest.mark.skipif(os.geteuid() != 0, reason="rootfs.apply chroots (root only)")
def test_an_applied_layer_never_creates_devices_or_fifos(tmp_path):
    from migrt.pods import rootfs

    diff = tmp_path / "diff"
    diff.mkdir()
    (diff / rootfs.DIFF_TAR).write_bytes(LAYER)
    (diff / rootfs.DIFF_META).write_text('{"deleted": [], "opaque": []}')
    new = tmp_path / "rootfs"
    new.mkdir()
    rootfs.apply(str(diff), str(new))
    assert sorted(os.listdir(new)) == ["bin"]                          # no mem, disk, pipe
    assert stat.S_IMODE(os.stat(new / "bin" / "su").st_mode) == 0o4755  # a local checkpoint keeps its modes


@pytest.mark.skipif(os.geteuid() != 0, reason="rootfs.apply chroots (root only)")
def test_a_pulled_layer_brings_no_devices_and_no_setuid(cfg, reg, tmp_path):
    from migrt.pods import rootfs

    registry, host, _ca = reg
    migrt_image(registry, "v1", {**FILES, rootfs.DIFF_TAR: LAYER,
                                 rootfs.DIFF_META: b'{"deleted": [], "opaque": []}'})
    name = pull.pull(cfg, f"{host}/team/ckpt:v1")["name"]
    ckpt = Store(cfg.store).get(name)
    new = tmp_path / "rootfs"
    new.mkdir()
    rootfs.apply_checkpoint(ckpt.path, ckpt.manifest, str(new))        # what a restore applies
    assert sorted(os.listdir(new)) == ["bin"]
    modes = {f: stat.S_IMODE(os.stat(new / "bin" / f).st_mode) for f in ("su", "wall", "plain")}
    assert modes == {"su": 0o755, "wall": 0o755, "plain": 0o755}


def test_migrt_pull_timeout_bounds_the_whole_pull(migrt_env, reg):
    from click.testing import CliRunner

    import migrt.cli.registry_cmd  # noqa: F401 - registers `migrt pull`
    from migrt.cli.main import cli

    registry, host, ca = reg
    stop = threading.Event()

    def trickle(h):
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        while not stop.is_set():
            try:
                h.wfile.write(b" ")
            except OSError:
                return
            stop.wait(0.2)
    registry.hooks["/v2/team/ckpt/manifests/v1"] = trickle
    with open(migrt_env.config, "a") as fh:
        fh.write(f"registry_ca_file: {ca}\n")
    t0 = time.monotonic()
    try:
        out = _within(20, lambda: CliRunner().invoke(cli, ["pull", f"{host}/team/ckpt:v1", "--timeout", "1.5"]))
    finally:
        stop.set()
    res = out["value"]
    assert res.exit_code == 9, res.output
    assert "not finished within 1.5 s (migrt pull --timeout)" in res.output
    assert time.monotonic() - t0 < 5


def _trickler(stop: threading.Event, length: int = 100_000):
    """Headers at once, then one byte every 0.2 s (never a pause a per-recv timeout would see)."""
    def answer(h):
        h.send_response(200)
        h.send_header("Content-Length", str(length))
        h.end_headers()
        while not stop.is_set():
            try:
                h.wfile.write(b" ")
            except OSError:
                return
            stop.wait(0.2)
    return answer


def _cli(args: list[str], seconds: float = 30):
    from click.testing import CliRunner

    import migrt.cli.registry_cmd  # noqa: F401 - registers `migrt push|pull`
    from migrt.cli.main import cli

    return _within(seconds, lambda: CliRunner().invoke(cli, args))["value"]


def _store_is_clean(root: str) -> None:
    assert Store(root).list() == [] and _pulls_left(root) == []
    assert [e for e in os.listdir(os.path.join(root, ".tmp")) if not e.startswith(".")] == []


@pytest.mark.parametrize("where", ["manifest", "blob"])
def test_migrt_pull_has_a_whole_deadline_by_default(migrt_env, reg, where):
    """`migrt pull` of a trickled manifest once ran 487 s (4 tries of 120 s); without --timeout it now
    ends at registry_timeout (plus the image's size at 8 MiB/s: nothing here), naming the registry and
    the deadline, and leaves no checkpoint and nothing unverified behind (a blob that arrived whole is
    kept for the next pull, which resumes)."""
    registry, host, ca = reg
    digest = migrt_image(registry, "v1", FILES)
    stop = threading.Event()
    layer = json.loads(registry.manifests[digest])["layers"][0]
    path = "/v2/team/ckpt/manifests/v1" if where == "manifest" else f"/v2/team/ckpt/blobs/{layer['digest']}"
    registry.hooks[path] = _trickler(stop, 100_000 if where == "manifest" else layer["size"])
    with open(migrt_env.config, "a") as fh:
        fh.write(f"registry_ca_file: {ca}\nregistry_timeout: 2\n")
    t0 = time.monotonic()
    try:
        res = _cli(["pull", f"{host}/team/ckpt:v1"])
    finally:
        stop.set()
    took = time.monotonic() - t0
    assert res.exit_code == 9, res.output
    assert f"registry {host}: " in res.output and "not finished within 2 s (migrt pull --timeout; by default " \
        "registry_timeout in the migrt config, plus the image's size at 8 MiB/s)" in res.output, res.output
    assert took < 8, took
    root = str(migrt_env.store)
    if where == "blob":  # the blob that arrived whole (and verified) is kept for the next pull to resume
        assert Store(root).list() == [] and len(_pulls_left(root)) == 2
        del registry.hooks[path]
        res = _cli(["pull", f"{host}/team/ckpt:v1", "--name", "again"])
        assert res.exit_code == 0, res.output
        assert [c.name for c in Store(root).list()] == ["again"]
        other = f"/v2/team/ckpt/blobs/{json.loads(registry.manifests[digest])['layers'][1]['digest']}"
        assert registry.blob_paths().count(other) == 1  # resumed: not fetched again
        assert _pulls_left(root) == []
        return
    _store_is_clean(root)


def test_migrt_push_has_a_whole_deadline_by_default(migrt_env, cfg, reg):
    registry, host, ca = reg
    migrt_image(registry, "v1", FILES)
    name = pull.pull(cfg, f"{host}/team/ckpt:v1")["name"]  # a checkpoint in the store to push
    stop = threading.Event()
    registry.hooks["/v2/"] = _trickler(stop)
    with open(migrt_env.config, "a") as fh:
        fh.write(f"registry_ca_file: {ca}\nregistry_timeout: 2\n")
    t0 = time.monotonic()
    try:
        res = _cli(["push", name, f"{host}/team/other:v2"])
    finally:
        stop.set()
    assert res.exit_code == 9, res.output
    assert f"registry {host}: connecting: not finished within 2 s (migrt push --timeout" in res.output, res.output
    assert "the next push skips them" in res.output
    assert time.monotonic() - t0 < 8
    res = _cli(["push", name, f"{host}/team/other:v2", "--timeout", "1.5"])
    assert res.exit_code == 9 and "not finished within 1.5 s (migrt push --timeout)" in res.output, res.output


def test_the_default_deadline_carries_a_large_image():
    from migrt.registry.connect import WHOLE_RATE, deadline_for

    d = deadline_for(config_mod.Config("x"), "migrt pull")
    left = d.left()
    d.allow(16 << 30)
    assert d.seconds == 60 + (16 << 30) / WHOLE_RATE and d.left() - left == pytest.approx((16 << 30) / WHOLE_RATE, abs=1)
    fixed = deadline_for(config_mod.Config("x"), "migrt pull", 30)
    fixed.allow(16 << 30)
    assert fixed.seconds == 30  # --timeout is a plain wall-clock budget
