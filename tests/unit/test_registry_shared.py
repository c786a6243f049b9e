"""Many pulls of one image on one store (issue 30, "many nodes, one image"): one pull per manifest
digest at a time (a lock in the store), the others wait under their own whole deadline, then use
what the first committed; a failed first pull lets the next one try; nothing partial is visible.
Against the fake registry of tests/helpers/fake_registry.py, which records every request."""

from __future__ import annotations

import os
import threading
import time

import pytest

from migrt.errors import RegistryError
from migrt.registry import pull
from migrt.registry.client import Deadline
from migrt.store import Store
from tests.helpers.fake_registry import migrt_image, send
from tests.unit.test_registry_pull import FILES, cfg, reg, tls  # noqa: F401 - fixtures

REF = "{host}/team/ckpt:v1"


def _pull_in_threads(cfg, host: str, n: int) -> list[dict]:  # noqa: F811 - the fixture's value
    """n pulls of one reference at once, each in its own thread (its own lock descriptor and
    connections, as separate processes have): [{"value" | "error", "start", "end"}]."""
    gate = threading.Barrier(n)
    outs: list[dict] = [{} for _ in range(n)]

    def one(i: int) -> None:
        gate.wait()
        outs[i]["start"] = time.monotonic()
        try:
            outs[i]["value"] = pull.pull(cfg, REF.format(host=host))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outs[i]["error"] = exc
        outs[i]["end"] = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a pull still runs after 60 s"
    return outs


def _slow_first(registry, path: str, seconds: float, store: str, then=None) -> dict:
    """The first request for the blob at path waits `seconds` (the other pulls reach the lock
    meanwhile), notes which checkpoints the store lists then, and is answered by `then` (default: the
    blob); later requests get the blob."""
    calls: dict = {"n": 0, "listed": None}
    data = registry.blobs[path.rsplit("/", 1)[1]]

    def hook(h):
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(seconds)
            calls["listed"] = [c.name for c in Store(store).list()]  # nothing partial visible
            if then:
                return then(h)
        return send(h, 200, data, {"Content-Type": "application/octet-stream"})
    registry.hooks[path] = hook
    return calls


def test_four_pulls_of_one_image_fetch_each_blob_once(cfg, reg):  # noqa: F811
    registry, host, _ca = reg
    digest = migrt_image(registry, "v1", FILES)
    blobs = [f"/v2/team/ckpt/blobs/{registry.add_blob(d)}" for d in FILES.values()]
    calls = _slow_first(registry, blobs[0], 1.0, cfg.store)
    outs = _pull_in_threads(cfg, host, 4)
    assert all("value" in o for o in outs), [o.get("error") for o in outs]
    first_end = min(o["end"] for o in outs)
    assert all(o["start"] < first_end for o in outs), "the pulls did not overlap: the test proves nothing"
    assert {o["value"]["name"] for o in outs} == {pull.default_name(pull.parse(REF.format(host=host)), digest)}
    assert sorted(o["value"]["already_present"] for o in outs) == [False, True, True, True]
    assert [registry.blob_paths().count(p) for p in blobs] == [1, 1]     # each layer once, for all four
    assert calls["listed"] == []                                         # mid-pull: no checkpoint shown
    assert len(Store(cfg.store).list()) == 1 and os.listdir(os.path.join(cfg.store, pull.PULLS)) == []


def test_a_failed_first_pull_lets_the_next_one_try(cfg, reg):  # noqa: F811
    registry, host, _ca = reg
    migrt_image(registry, "v1", FILES)
    blob = f"/v2/team/ckpt/blobs/{registry.add_blob(FILES['images/core-1.img'])}"
    calls = _slow_first(registry, blob, 0.5, cfg.store, then=lambda h: send(h, 403, b'{"errors":[{"code":"DENIED"}]}'))
    outs = _pull_in_threads(cfg, host, 2)
    failed = [o["error"] for o in outs if "error" in o]
    done = [o["value"] for o in outs if "value" in o]
    assert len(failed) == 1 and isinstance(failed[0], RegistryError) and "403" in str(failed[0])
    assert len(done) == 1 and done[0]["already_present"] is False         # the waiter pulled it itself
    assert [c.name for c in Store(cfg.store).list()] == [done[0]["name"]]
    assert registry.blob_paths().count(blob) == 2 and calls["listed"] == []
    assert os.listdir(os.path.join(cfg.store, pull.PULLS)) == []


def _held(cfg, digest: str, seconds: float) -> threading.Thread:  # noqa: F811
    """Another pull of the image (its lock) held for `seconds`, then given up without a checkpoint."""
    store = Store(cfg.store)
    held = threading.Event()

    def hold() -> None:
        with pull.image_lock(store, digest, Deadline.after(30, "test")):
            held.set()
            time.sleep(seconds)
    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert held.wait(10)
    return t


def test_a_waiter_has_the_images_size_in_its_deadline(cfg, reg):  # noqa: F811
    """A `migrt pull` deadline is registry_timeout plus the image's size at a rate; waiting for another
    pull of the image moves as much data, so the wait gets that allowance too (it once timed out at
    registry_timeout while the other pull of a large image was still well within its own)."""
    registry, host, _ca = reg
    digest = migrt_image(registry, "v1", FILES)
    size = sum(len(d) for d in FILES.values())
    holder = _held(cfg, digest, 1.5)
    t0 = time.monotonic()
    out = pull.pull(cfg, REF.format(host=host), deadline=Deadline.after(0.5, "test", rate=size / 4))
    holder.join()
    assert out["already_present"] is False and time.monotonic() - t0 >= 1.0  # waited, then pulled itself


def test_a_waiter_without_a_rate_ends_at_its_deadline(cfg, reg):  # noqa: F811
    registry, host, _ca = reg
    digest = migrt_image(registry, "v1", FILES)
    holder = _held(cfg, digest, 3)
    t0 = time.monotonic()
    with pytest.raises(RegistryError, match=f"waiting for another pull of {digest} on this node: not finished "
                                            "within 0.8 s"):
        pull.pull(cfg, REF.format(host=host), deadline=Deadline.after(0.8, "test"))
    assert time.monotonic() - t0 < 2.5
    holder.join()
    assert registry.blob_paths() == []                                   # it never pulled a layer
