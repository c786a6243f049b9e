"""CRIU's lazy page server with the real runc and CRIU: it listens on the loopback address migrt gives
it (CRIU's RPC service drops a lazy dump's page-server address: it listened on every address of the
node), on the port migrt reserved for it, and migrt's own end of it (PS_IOV_CLOSE) still ends the dump."""

from __future__ import annotations

import os
import subprocess

import pytest

from migrt.criu.binary import choose as criu_choice
from migrt.criu.options import CriuOptions
from migrt.runtime import control
from tests.integration.test_pagefill import _bundle, _start, _uid, binaries, runc_root  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                addr, hexport = fields[1].split(":")
                if int(hexport, 16) == port and fields[3] == "0A":
                    out.append(addr)
    return out


def test_lazy_dump_page_server_listens_on_loopback_only(runc_root, binaries, tmp_path):
    cid = _uid("ps")
    _start(runc_root, cid, _bundle(str(tmp_path / "b"), ["/bin/memhog", "32"], binaries))
    subprocess.run(["runc", "--root", runc_root, "pause", cid], check=True, timeout=30)
    criu, _ = criu_choice()
    env = {**os.environ, "PATH": f"{os.path.dirname(criu)}:{os.environ['PATH']}"}  # runc runs `criu` from PATH
    work, images = tmp_path / "work", tmp_path / "images"
    work.mkdir()
    images.mkdir()
    port = control.loopback_page_server()
    lazy = control.LazyCheckpoint("runc", runc_root, cid, image_path=str(images), work_path=str(work),
                                  options=CriuOptions(), page_server=port, env=env)
    try:
        lazy.wait_ready(120)
        assert _listeners(port[1]) == ["0100007F"]  # 127.0.0.1 only (was 00000000: every address)
        lazy.finish(60)
    except BaseException:
        lazy.abort()
        raise
    assert os.path.exists(images / "inventory.img")
