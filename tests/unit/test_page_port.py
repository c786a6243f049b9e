"""CRIU's lazy page server (the lazy dump of lazy migration and of the parallel dump): a loopback port
reserved for it until it listens, and loopback only.

Seen: "Can't bind page server: Address already in use" in 1 lazy migration of 6 (migrt picked a free
port, let it go, and CRIU bound it after the whole dump), and CRIU listening on every address of the
node (its RPC service drops a lazy dump's page-server address). A fake runc here does what CRIU does
with them: reads CRIU_CONFIG_FILE, binds SO_REUSEADDR to `address` (all addresses without one) and the
--page-server port, listens, says ready on --status-fd, answers one close request."""

from __future__ import annotations

import errno
import json
import socket
import sys
from pathlib import Path

import pytest

from migrt.criu.options import CriuOptions
from migrt.runtime import control
from tests.unit.support import make_executable

FAKE_CRIU_RUNC = """\
#!{python}
import json, os, socket, struct, sys
argv = sys.argv[1:]
port = int(argv[argv.index("--page-server") + 1].rsplit(":", 1)[1])
status = int(argv[argv.index("--status-fd") + 1])
address = "0.0.0.0"
conf = os.environ.get("CRIU_CONFIG_FILE")
lines = open(conf).read().splitlines() if conf else []
for line in lines:
    if line.startswith("address "):
        address = line.split()[1]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((address, port))
except OSError as exc:
    print("Error (criu/util.c:1239): Can't bind page server:", exc.strerror, file=sys.stderr)
    sys.exit(1)
s.listen(1)
with open({record!r}, "w") as fh:
    json.dump({{"bound": s.getsockname()[:2], "config": lines}}, fh)
os.write(status, b"\\0")
conn, _ = s.accept()
conn.recv(32)
conn.sendall(struct.pack("<i", 0))
"""


@pytest.fixture
def fake_runc(tmp_path: Path):
    record = tmp_path / "criu.json"
    path = make_executable(tmp_path / "bin" / "runc", FAKE_CRIU_RUNC.format(python=sys.executable, record=str(record)))
    return path, record


def _lazy(runc: Path, tmp_path: Path, page_server, env=None) -> control.LazyCheckpoint:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return control.LazyCheckpoint(str(runc), str(tmp_path / "root"), "c1", image_path=str(tmp_path / "images"),
                                  work_path=str(work), options=CriuOptions(), page_server=page_server, env=env)


def test_the_port_is_kept_from_every_other_socket_until_criu_listens():
    reserved = control.loopback_page_server()
    host, port = reserved
    assert host == "127.0.0.1"
    other = socket.socket()
    try:
        with pytest.raises(OSError) as info:  # what took the port from CRIU before
            other.bind(("127.0.0.1", port))
        assert info.value.errno == errno.EADDRINUSE
    finally:
        other.close()
    criu = socket.socket()  # CRIU's way: SO_REUSEADDR, bind, listen
    criu.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    criu.bind(("127.0.0.1", port))
    criu.listen(1)
    criu.close()
    reserved.release()
    free = socket.socket()
    free.bind(("127.0.0.1", port))  # released: an ordinary port again
    free.close()


def test_lazy_dump_page_server_listens_on_loopback_only_and_the_port_is_released(fake_runc, tmp_path):
    runc, record = fake_runc
    port = control.loopback_page_server()
    lazy = _lazy(runc, tmp_path, port)
    lazy.wait_ready(30)
    seen = json.loads(record.read_text())
    assert seen["bound"] == ["127.0.0.1", port[1]], seen  # was 0.0.0.0: every address of the node
    assert port._sock is None  # CRIU listens: the reservation is given back
    lazy.finish(30)
    assert lazy.proc.returncode == 0


def test_a_criu_config_from_the_environment_is_carried_over(fake_runc, tmp_path):
    runc, record = fake_runc
    mine = tmp_path / "admin.conf"
    mine.write_text("log-file=admin.log")
    lazy = _lazy(runc, tmp_path, control.loopback_page_server(), env={"CRIU_CONFIG_FILE": str(mine), "PATH": "/bin"})
    lazy.wait_ready(30)
    lazy.finish(30)
    assert json.loads(record.read_text())["config"] == ["log-file=admin.log", "address 127.0.0.1"]


def test_a_failed_start_gives_the_port_back(tmp_path):
    port = control.loopback_page_server()
    with pytest.raises(Exception, match="cannot run"):
        _lazy(tmp_path / "no-such-runc", tmp_path, port)
    assert port._sock is None
