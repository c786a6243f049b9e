"""Optional TLS for migrations: mutual authentication with a private CA, HMAC still inside."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from migrt.migration.wire import TransferError, accept, connect
from migrt.migration.tls import TLSFiles

KEY = b"k" * 32


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=d)


def _node(d, ca: str, name: str) -> TLSFiles:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.crt", cwd=d)
    return TLSFiles(cert=str(d / f"{name}.crt"), key=str(d / f"{name}.key"), ca=str(d / f"{ca}.crt"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if not shutil.which("openssl"):
        pytest.fail("openssl is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")
    return {"a": _node(d, "ca", "node-a"), "b": _node(d, "ca", "node-b"), "stranger": _node(d, "other-ca", "x")}


def _serve(tls, handler=None):
    server = socket.create_server(("127.0.0.1", 0))
    box: dict = {}

    def run():
        conn, _ = server.accept()
        try:
            ch = accept(conn, KEY, tls=tls)
            box["result"] = handler(ch) if handler else ch
        except BaseException as exc:
            box["error"] = exc
            conn.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return "127.0.0.1:%d" % server.getsockname()[1], t, box, server


def test_mutual_tls_carries_the_protocol(pki):
    address, t, box, server = _serve(pki["b"], lambda ch: (ch.recv("ping"), ch.send({"type": "pong"}),
                                                           isinstance(ch.sock, ssl.SSLSocket)))
    ch = connect(address, KEY, tls=pki["a"])
    assert isinstance(ch.sock, ssl.SSLSocket) and ch.sock.version() in ("TLSv1.2", "TLSv1.3")
    ch.send({"type": "ping"})
    assert ch.recv("pong")["type"] == "pong"
    ch.close()
    t.join(10)
    server.close()
    assert box["result"][2] is True


def test_certificate_from_another_ca_is_refused(pki):
    address, t, box, server = _serve(pki["b"])
    with pytest.raises(TransferError, match="TLS handshake"):
        connect(address, KEY, tls=pki["stranger"])
    t.join(10)
    server.close()
    assert isinstance(box.get("error"), TransferError)


def test_tls_client_against_a_plain_receiver(pki):
    address, t, box, server = _serve(None)
    with pytest.raises(TransferError, match="TLS handshake"):
        connect(address, KEY, tls=pki["a"])
    t.join(20)
    server.close()


def test_config_migration_tls(tmp_path, pki):
    from migrt import config
    from migrt.errors import ConfigError

    cfg = tmp_path / "c.yaml"
    a = pki["a"]
    cfg.write_text(f"migration_tls:\n  cert: {a.cert}\n  key: {a.key}\n  ca: {a.ca}\n")
    assert TLSFiles(**config.load(str(cfg)).migration_tls) == a
    for bad in ("migration_tls: yes\n", f"migration_tls:\n  cert: {a.cert}\n  key: {a.key}\n",
                "migration_tls:\n  cert: rel.crt\n  key: /k\n  ca: /c\n"):
        cfg.write_text(bad)
        with pytest.raises(ConfigError, match="migration_tls"):
            config.load(str(cfg))


def test_plain_client_against_a_tls_receiver_is_told_why(pki):
    address, t, box, server = _serve(pki["b"])
    with pytest.raises(TransferError, match="this receiver requires TLS"):
        connect(address, KEY)
    t.join(10)
    server.close()
    assert "without TLS" in str(box["error"])
