"""Shared fixtures for the unit tests: a fake lower runtime that records its argv, a migrt config
pointing at it. Nothing here starts a container."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from tests.unit.support import FakeRuntime, MigrtEnv, make_fake_runtime


@pytest.fixture
def fake_runtime(tmp_path: Path) -> FakeRuntime:
    return make_fake_runtime(tmp_path / "fakebin")


@pytest.fixture
def migrt_env(tmp_path: Path, fake_runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> MigrtEnv:
    store = tmp_path / "store"
    log_file = tmp_path / "migrt.log"
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""\
        runtime: {fake_runtime.path}   # the fake lower runtime
        store: {store}
        log_file: {log_file}
        log_level: debug
        """))
    monkeypatch.setenv("MIGRT_CONFIG", str(config))
    env = dict(os.environ)
    env["MIGRT_CONFIG"] = str(config)
    env.pop("FAKE_RC", None)
    env.pop("MIGRT_RESTORE", None)
    return MigrtEnv(config=config, store=store, log_file=log_file, fake=fake_runtime, env=env)
