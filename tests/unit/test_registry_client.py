"""migrt.registry.client against a small fake registry on loopback (TLS from a CA made with the
openssl CLI): Docker token auth (Bearer), redirects for blobs, digest checks of what arrives."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import shutil
import ssl
import threading

import pytest

from migrt.errors import CheckpointInvalid, RegistryError
from migrt.registry.auth import Credentials
from migrt.registry.client import Client
from migrt.registry.reference import parse

pytestmark = pytest.mark.skipif(not shutil.which("openssl"), reason="openssl CLI missing")

BLOB = b"checkpoint bytes " * 1000
BLOB_D = "sha256:" + hashlib.sha256(BLOB).hexdigest()
MANIFEST = json.dumps({"schemaVersion": 2, "layers": []}).encode()
MANIFEST_D = "sha256:" + hashlib.sha256(MANIFEST).hexdigest()


class Fake(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: dict = {}

    def log_message(self, *a):  # quiet
        pass

    def _send(self, code, body=b"", headers=None):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        st = self.state
        if self.path.startswith("/token"):
            st["token_query"] = self.path
            ok = self.headers.get("Authorization") == "Basic " + base64.b64encode(b"u:p").decode()
            return self._send(200 if ok else 401, json.dumps({"token": "T1"}).encode())
        if self.headers.get("Authorization") != "Bearer T1":
            realm = f"https://127.0.0.1:{self.server.server_address[1]}/token"
            return self._send(401, b"{}", {"WWW-Authenticate": f'Bearer realm="{realm}",service="fake"'})
        if self.path == "/v2/":
            return self._send(200, b"{}")
        if self.path.startswith("/v2/team/ckpt/manifests/"):
            return self._send(200, MANIFEST, {"Content-Type": "application/vnd.oci.image.manifest.v1+json",
                                              "Docker-Content-Digest": st.get("stated", MANIFEST_D)})
        if self.path == f"/v2/team/ckpt/blobs/{BLOB_D}":
            return self._send(307, b"", {"Location": f"https://127.0.0.1:{self.server.server_address[1]}/storage/x"})
        if self.path == "/storage/x":
            return self._send(200, st.get("blob", BLOB))
        return self._send(404, b'{"errors":[{"code":"NOT_FOUND","message":"nope"}]}')


@pytest.fixture()
def fake(tmp_path):
    from tests.helpers.registry import make_tls

    ca, cert, key = make_tls(str(tmp_path))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    Fake.state = {}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.server_address[1]}", ca
    srv.shutdown()
    srv.server_close()


def _client(fake, creds=Credentials("u", "p")):
    host, ca = fake
    return Client(parse(f"{host}/team/ckpt:v1"), credentials=creds, ca_file=ca)


def test_bearer_token_redirect_and_digests(fake):
    c = _client(fake)
    c.ping()
    assert "scope=repository%3Ateam%2Fckpt%3Apull" in Fake.state["token_query"]
    raw, ctype, digest = c.get_manifest()
    assert raw == MANIFEST and digest == MANIFEST_D and ctype.endswith("manifest.v1+json")
    got = bytearray()
    c.fetch_blob(BLOB_D, len(BLOB), lambda v: got.extend(v) if len(v) else got.clear())
    assert bytes(got) == BLOB
    c.close()


def test_altered_blob_and_manifest_refused(fake):
    c = _client(fake)
    Fake.state["blob"] = BLOB[:-1] + b"X"
    with pytest.raises(CheckpointInvalid, match="altered"):
        c.fetch_blob(BLOB_D, len(BLOB), lambda v: None)
    Fake.state["stated"] = "sha256:" + "0" * 64
    with pytest.raises(CheckpointInvalid, match="states digest"):
        c.get_manifest()


def test_wrong_credentials_and_untrusted_ca(fake):
    with pytest.raises(RegistryError, match="token service"):
        _client(fake, Credentials("u", "wrong")).ping()
    host, _ca = fake
    c = Client(parse(f"{host}/team/ckpt:v1"), credentials=None, ca_file=None)
    with pytest.raises(RegistryError, match="not trusted.*registry_ca_file"):
        c.ping()  # the system CAs do not know this certificate: said at once, not retried


def test_a_registry_that_never_answers_the_handshake_is_given_up_on_quickly(monkeypatch):
    import socket
    import time

    from migrt.registry import client as client_mod

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts connections; nobody ever speaks TLS on them
    monkeypatch.setattr(client_mod, "CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(client_mod, "RETRIES", 1)
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)
    c = Client(parse(f"127.0.0.1:{silent.getsockname()[1]}/team/ckpt:v1"), timeout=120)
    t0 = time.monotonic()
    try:
        with pytest.raises(RegistryError, match="connecting failed after 2 tries:.*timed out"):
            c.ping()
    finally:
        silent.close()
    assert time.monotonic() - t0 < 5          # 2 x the connect timeout, not 2 x the 120 s request timeout
