"""`migrt restore oci:REF`: the CLI's parsing and dispatch, and the create's image step as the operator's
CLI takes it (ops/restore.py image_for_restore with operator=True) against the fake TLS registry."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from migrt.cli.main import cli
from migrt.errors import MigrtError, PreconditionFailed, RegistryError
from migrt.oci.bundle import Bundle, RestoreRequest
from migrt.ops import pages
from migrt.ops import restore as restore_mod
from migrt.registry import pull
from migrt.registry.client import Deadline
from migrt.store import Store
from tests.helpers.fake_registry import migrt_image
from tests.unit.support import write_bundle
from tests.unit.test_registry_lazy import FILES, no_eager  # noqa: F401 - fixture
from tests.unit.test_registry_pull import Log, cfg, reg, tls  # noqa: F401 - fixtures


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_a_bad_reference_exits_2_naming_it_before_anything_runs(migrt_env, tmp_path):
    bundle = write_bundle(tmp_path / "bundle")
    res = invoke("restore", "oci:Team//ckpt", "c1", "--bundle", str(bundle), "--json")
    assert res.exit_code == 2, res.output
    data = json.loads(res.stdout)
    assert data["type"] == "UsageError" and "oci:Team//ckpt" in data["error"] and "store name" in data["error"]
    assert migrt_env.fake.calls() == []


def test_timeout_is_for_a_reference_only(migrt_env, tmp_path):
    bundle = write_bundle(tmp_path / "bundle")
    res = invoke("restore", "ckpt-1", "c1", "--bundle", str(bundle), "--timeout", "5")
    assert res.exit_code == 2 and "--timeout applies to a restore by reference" in res.stderr
    assert migrt_env.fake.calls() == []


def test_a_reference_goes_through_the_creates_image_step_as_the_operator(migrt_env, tmp_path, monkeypatch):
    bundle = write_bundle(tmp_path / "bundle")
    seen: dict = {}

    def image_for_restore(conf, request, bnd, log, cid, deadline, *, operator, progress):
        seen.update(ref=request.name, cid=cid, operator=operator, seconds=deadline.seconds,
                    fill_timeout=conf.registry_timeout)
        return restore_mod.ImageReady("oci-ckpt-0123456789abcdef", pulled=True, fallback="restore_pages is eager",
                                      seconds=0.5, bytes_received=4096)

    def restore_image(conf, image, target, progress):
        seen.update(name=image.name, verified=target.seams.verified, wait=target.wait_pages)
        return {"checkpoint": image.name, "container_id": target.container_id, "pid": 42,
                "timings": {"total_s": 0.2}, "pages": {"mode": "eager"}}

    monkeypatch.setattr(restore_mod, "image_for_restore", image_for_restore)
    monkeypatch.setattr(restore_mod, "restore_image", restore_image)
    res = invoke("restore", "oci:reg.example:5000/team/ckpt:v1", "c1", "--bundle", str(bundle), "--timeout", "7",
                 "--json")
    assert res.exit_code == 0, res.output
    assert seen == {"ref": "oci:reg.example:5000/team/ckpt:v1", "cid": "c1", "operator": True, "seconds": 7,
                    "fill_timeout": 7, "name": "oci-ckpt-0123456789abcdef", "verified": True, "wait": False}
    out = json.loads(res.stdout)
    assert (out["path"], out["fallback"], out["pid"]) == ("pull", "restore_pages is eager", 42)
    assert out["bytes_fetched"] == {"before_running": 4096, "fill": None} and out["running_after_s"] >= 0
    assert "fill_outcome" not in out                                  # not asked to wait


def _image(cfg, host: str, tmp_path, **kw):  # noqa: F811 - the fixture's value
    bundle = Bundle.load(str(write_bundle(tmp_path / "bundle")))
    request = RestoreRequest(name=f"oci:{host}/team/ckpt:v1", fallback="fail", source="cli")
    return restore_mod.image_for_restore(cfg, request, bundle, Log(), "c1", Deadline.after(30, "test"), **kw)


def test_the_operator_is_not_bound_by_restore_registries_the_create_is(cfg, reg, tmp_path):  # noqa: F811
    registry, host, _ca = reg
    migrt_image(registry, "v1", FILES)
    cfg.restore_registries = []
    cfg.restore_pages = "eager"                                       # the full pull (said as the fallback)
    with pytest.raises(PreconditionFailed, match="restore_registries"):
        _image(cfg, host, tmp_path)
    out = _image(cfg, host, tmp_path, operator=True)
    assert (out.path, out.fallback, out.lazy) == ("pull", "restore_pages is eager", None)
    assert out.bytes_received == sum(len(b) for b in FILES.values())
    assert Store(cfg.store).get(out.name).manifest.pulled
    again = _image(cfg, host, tmp_path, operator=True)               # in the store now: nothing fetched
    assert (again.path, again.name, again.bytes_received) == ("store", out.name, 0)


def test_a_lazy_image_says_so_with_the_bytes_the_create_part_fetched(cfg, reg, tmp_path, no_eager,  # noqa: F811
                                                                    monkeypatch):
    registry, host, _ca = reg
    registry.ranges = True
    migrt_image(registry, "v1", FILES)
    monkeypatch.setattr(restore_mod, "_lazy_refusal", lambda cfg: None)
    monkeypatch.setattr(restore_mod, "_lazy_ok", lambda cfg, name: lambda *a: None)
    out = _image(cfg, host, tmp_path, operator=True)
    try:
        assert out.path == "lazy" and out.fallback is None and out.seams().registry is out.lazy
        assert 0 < out.bytes_received < sum(len(b) for b in FILES.values())   # the pages left to the filler
    finally:
        out.lazy.release()


def test_the_operator_sees_the_registrys_own_error_the_create_one_line(cfg, reg, tmp_path):  # noqa: F811
    _registry, host, _ca = reg                                        # no image pushed: the tag is unknown
    with pytest.raises(MigrtError) as pulled:
        pull.pull(cfg, f"{host}/team/ckpt:v1", deadline=Deadline.after(30, "test"))
    with pytest.raises(MigrtError) as operator:
        _image(cfg, host, tmp_path, operator=True)
    assert (type(operator.value), operator.value.exit_code) == (type(pulled.value), pulled.value.exit_code)
    assert "see the node's migrt log" not in str(operator.value)
    with pytest.raises(RegistryError, match="see the node's migrt log"):
        _image(cfg, host, tmp_path)


class _Fill:
    """A filler whose status counts up and whose wait ends after `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.monotonic(), seconds
        self.over = threading.Event()

    def status(self) -> dict:
        return {"lazy_bytes": 1000, "copied_bytes": min(1000, int((time.monotonic() - self.t0) * 1000))}

    def wait(self) -> dict:
        time.sleep(self.seconds)
        return {"copied_bytes": 1000, "counts": {"registry_fetched_bytes": 900}}


def test_waiting_for_the_pages_tells_the_progress_of_the_bytes_copied():
    events: list = []
    decision: dict = {}
    pages.wait_all(_Fill(1.1), decision, {}, "ckpt", progress=lambda ev, **f: events.append((ev, f)))
    assert events[0] == ("phase", {"name": "pages", "total_bytes": 1000}) and events[-1][0] == "done"
    assert [e for e in events if e[0] == "bytes"]                    # at least one report in between
    assert decision["fill"]["counts"] == {"registry_fetched_bytes": 900}
