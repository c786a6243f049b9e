"""A small OCI distribution client on the standard library (http.client + ssl).

Why not oras-py (docs/registry.md has the measurements): its monolithic push reads a whole blob into
memory (1 GiB blob: 1.06 GiB RSS), its PUT carries no credentials with basic auth (the upload to a
basic-auth registry fails after sending the data), and its pull neither checks digests nor resumes.
What migrt needs is a handful of requests done well: streaming from and to file ranges, one
connection per worker thread, a digest check on every byte received, and redirects.

The API spoken (OCI distribution spec v1.1):
  GET  /v2/                                   auth challenge (Basic, or Bearer with a token realm)
  HEAD /v2/<repo>/blobs/<digest>              present? (push skips what the registry has)
  POST /v2/<repo>/blobs/uploads/ + PUT <location>?digest=   one blob
  GET  /v2/<repo>/blobs/<digest>              a blob (redirects followed, without credentials to another host)
  GET|HEAD|PUT /v2/<repo>/manifests/<tag|digest>
Every error becomes a RegistryError (or NotFound, CheckpointInvalid) here, at one boundary.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from migrt.errors import CheckpointInvalid, NotFound, RegistryError
from migrt.registry.auth import Credentials
from migrt.registry.reference import Reference

BUF = 4 << 20
MAX_MANIFEST = 4 << 20
RETRIES = 3
# Connecting (TCP and TLS handshake) gets less time than a request: a registry behind a firewall that
# drops packets, or one that accepts and never answers, must not hold a pull (inside kubelet's 2-minute
# StartContainer) for RETRIES+1 times the request timeout.
CONNECT_TIMEOUT_S = 10.0
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_TRANSIENT = (OSError, http.client.HTTPException, ssl.SSLError)


class _Connection(http.client.HTTPSConnection):
    """HTTPSConnection whose connect and TLS handshake are bounded by CONNECT_TIMEOUT_S; requests on it
    then by the client's timeout."""

    def connect(self) -> None:
        request_timeout, self.timeout = self.timeout, min(self.timeout, CONNECT_TIMEOUT_S)
        try:
            super().connect()
        finally:
            self.timeout = request_timeout
        self.sock.settimeout(request_timeout)


@dataclass
class Stats:
    """Bytes moved and requests made (push reports what it sent; the benchmark reads it)."""
    sent: int = 0
    received: int = 0
    skipped: int = 0
    requests: int = 0
    retries: int = 0
    lock: threading.Lock = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _RangeReader:
    """A file range as a request body (http.client calls read(blocksize)); counts what it sent."""

    def __init__(self, fd: int, offset: int, length: int, on_bytes: Callable[[int], None]) -> None:
        self.fd, self.pos, self.left, self.on_bytes = fd, offset, length, on_bytes

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        n = self.left if n is None or n < 0 else min(n, self.left)
        buf = os.pread(self.fd, n, self.pos)
        if not buf:
            raise OSError("file shrank while being uploaded")
        self.pos += len(buf)
        self.left -= len(buf)
        self.on_bytes(len(buf))
        return buf


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


class Client:
    """One repository of one registry. Thread-safe: each thread keeps its own connection."""

    def __init__(self, ref: Reference, *, credentials: Credentials | None = None, ca_file: str | None = None,
                 timeout: float = 120.0, push: bool = False) -> None:
        self.ref = ref
        self.host = ref.api_host
        self.repo = ref.repository
        self.credentials = credentials
        self.timeout = timeout
        self.push = push
        try:
            self.ctx = ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise RegistryError(f"CA bundle {ca_file} (registry_ca_file) cannot be loaded: {exc}") from exc
        self.stats = Stats()
        self._auth: str | None = None
        self._auth_lock = threading.Lock()
        self._local = threading.local()
        self._all: list[http.client.HTTPSConnection] = []

    # -- connections and requests ----------------------------------------------------------------
    def _conn(self, host: str | None = None) -> http.client.HTTPSConnection:
        host = host or self.host
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(host)
        if conn is None:
            conn = _Connection(host, timeout=self.timeout, context=self.ctx, blocksize=1 << 20)
            conns[host] = conn
            with self._auth_lock:
                self._all.append(conn)
        return conn

    def _drop(self, host: str | None = None) -> None:
        conns = getattr(self._local, "conns", {}) or {}
        conn = conns.pop(host or self.host, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close every connection, those of the worker threads too."""
        with self._auth_lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local.conns = {}

    def _send(self, method: str, url: str, headers: dict, body=None, host: str | None = None
              ) -> http.client.HTTPResponse:
        conn = self._conn(host)
        self.stats.add(requests=1)
        try:
            conn.request(method, url, body=body, headers=headers)
            return conn.getresponse()
        except BaseException:
            self._drop(host)
            raise

    def request(self, method: str, path: str, *, headers: dict | None = None, body_factory=None,
                ok: tuple[int, ...] = (200,), what: str = "") -> http.client.HTTPResponse:
        """One request with credentials; on 401 the challenge is answered once and the request
        repeated (body_factory makes a fresh body for that). The caller reads the response."""
        for attempt in range(2):
            hdrs = {"User-Agent": "migrt", **(headers or {})}
            if self._auth:
                hdrs["Authorization"] = self._auth
            body = body_factory() if body_factory else None
            resp = self._send(method, path, hdrs, body)
            if resp.status == 401 and attempt == 0:
                challenge = resp.getheader("WWW-Authenticate") or ""
                _drain(resp)
                self._authenticate(challenge)
                continue
            if resp.status in ok or (300 <= resp.status < 400 and method == "GET"):
                return resp
            self._fail(resp, method, what or path)
        raise AssertionError("unreachable")

    def _fail(self, resp: http.client.HTTPResponse, method: str, what: str):
        text = _drain(resp, limit=64 << 10)
        detail = text.decode(errors="replace").strip()
        try:
            errs = json.loads(text).get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errs) or detail
        except (ValueError, AttributeError):
            pass
        msg = f"registry {self.host}: {method} {what} answered {resp.status} {resp.reason}" + (f" ({detail[:300]})" if detail else "")
        if resp.status == 401:
            raise RegistryError(msg + "; check the credentials for this registry in registry_auth_file")
        if resp.status == 403:
            raise RegistryError(msg + f"; the credentials may not {'push to' if self.push else 'pull from'} {self.repo}")
        if resp.status == 404:
            raise NotFound(msg)
        raise RegistryError(msg)

    def _authenticate(self, challenge: str) -> None:
        scheme, params = _challenge(challenge)
        with self._auth_lock:
            if scheme == "basic":
                if not self.credentials:
                    raise RegistryError(f"registry {self.host} asks for credentials (Basic) and registry_auth_file "
                                        "has none for it")
                self._auth = self.credentials.basic_header()
            elif scheme == "bearer" and params.get("realm"):
                self._auth = "Bearer " + self._token(params)
            else:
                raise RegistryError(f"registry {self.host} answered 401 with an unsupported challenge {challenge!r}")

    def _token(self, params: dict[str, str]) -> str:
        """Docker token auth: GET realm?service=&scope= with Basic credentials (if any)."""
        realm = urllib.parse.urlsplit(params["realm"])
        if realm.scheme != "https":
            raise RegistryError(f"registry {self.host}: token realm {params['realm']} is not https; refusing to send "
                                "credentials there")
        actions = "pull,push" if self.push else "pull"
        query = {"service": params.get("service", ""), "scope": f"repository:{self.repo}:{actions}"}
        path = (realm.path or "/") + "?" + urllib.parse.urlencode(query) + (("&" + realm.query) if realm.query else "")
        hdrs = {"User-Agent": "migrt"}
        if self.credentials:
            hdrs["Authorization"] = self.credentials.basic_header()
        resp = self._send("GET", path, hdrs, host=realm.netloc)
        body = _drain(resp, limit=1 << 20)
        if resp.status != 200:
            raise RegistryError(f"registry {self.host}: token service {realm.netloc} answered {resp.status} "
                                f"{resp.reason}; check registry_auth_file")
        try:
            data = json.loads(body)
            return data.get("token") or data["access_token"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RegistryError(f"registry {self.host}: token service {realm.netloc} sent no token") from exc

    def _retry(self, fn: Callable, what: str):
        """Run fn, repeating it after a cut connection (fresh connection, 1 s, 2 s back-off)."""
        for attempt in range(RETRIES + 1):
            try:
                return fn()
            except ssl.SSLCertVerificationError as exc:  # permanent: not worth a retry
                self._drop()
                raise RegistryError(f"registry {self.host}: TLS certificate not trusted ({exc.verify_message}); "
                                    "give the CA bundle that signed it as registry_ca_file in the migrt config") from exc
            except _TRANSIENT as exc:
                self._drop()
                if attempt == RETRIES:
                    raise RegistryError(f"registry {self.host}: {what} failed after {RETRIES + 1} tries: {exc}") from exc
                self.stats.add(retries=1)
                if attempt or not isinstance(exc, http.client.RemoteDisconnected):
                    time.sleep(min(4, 2 ** attempt))  # an idle keep-alive connection the server closed: at once

    # -- API ---------------------------------------------------------------------------------
    def ping(self) -> None:
        def go():
            resp = self.request("GET", "/v2/", ok=(200,), what="/v2/ (API check)")
            _drain(resp)
        self._retry(go, "connecting")

    def blob_exists(self, digest: str, size: int) -> bool:
        def go():
            resp = self.request("HEAD", f"/v2/{self.repo}/blobs/{digest}", ok=(200, 404), what=f"blob {digest}")
            _drain(resp)
            if resp.status == 404:
                return False
            length = resp.getheader("Content-Length")
            return length is None or int(length) == size
        return self._retry(go, f"checking blob {digest}")

    def upload_blob(self, digest: str, fd: int, offset: int, length: int) -> None:
        """Upload one blob from a file range: POST (session), PUT ?digest= (the registry checks it)."""
        def go():
            resp = self.request("POST", f"/v2/{self.repo}/blobs/uploads/", headers={"Content-Length": "0"},
                                ok=(202,), what="starting a blob upload")
            location = resp.getheader("Location")
            _drain(resp)
            if not location:
                raise RegistryError(f"registry {self.host}: no Location for the blob upload")
            url = urllib.parse.urlsplit(location)
            if url.netloc and url.netloc != self.host:
                raise RegistryError(f"registry {self.host}: upload location on another host ({url.netloc}) is not "
                                    "supported")
            path = url.path + "?" + ((url.query + "&") if url.query else "") + urllib.parse.urlencode({"digest": digest})
            sent = [0]

            def body():
                if sent[0]:
                    self.stats.add(sent=-sent[0])
                sent[0] = 0

                def count(n: int) -> None:
                    sent[0] += n
                    self.stats.add(sent=n)
                return _RangeReader(fd, offset, length, count)
            resp = self.request("PUT", path, headers={"Content-Type": "application/octet-stream",
                                                      "Content-Length": str(length)},
                                body_factory=body, ok=(201,), what=f"blob {digest}")
            _drain(resp)
        self._retry(go, f"uploading blob {digest}")

    def put_blob_bytes(self, data: bytes, digest: str | None = None) -> str:
        """A small blob (the image config) from memory."""
        import tempfile

        digest = digest or sha256_bytes(data)
        with tempfile.TemporaryFile() as tmp:
            tmp.write(data)
            tmp.flush()
            if not self.blob_exists(digest, len(data)):
                self.upload_blob(digest, tmp.fileno(), 0, len(data))
        return digest

    def fetch_blob(self, digest: str, size: int, sink: Callable[[memoryview], None]) -> None:
        """Stream a blob to sink(chunk); the sha256 and size of what arrived must match the digest
        (CheckpointInvalid otherwise). A cut connection restarts the blob (sink must accept a rewind:
        it is called with an empty view first on each try)."""
        if not digest.startswith("sha256:"):
            raise CheckpointInvalid(f"blob digest {digest!r}: only sha256 is supported")

        def go():
            sink(memoryview(b""))
            resp = self.request("GET", f"/v2/{self.repo}/blobs/{digest}", ok=(200,), what=f"blob {digest}")
            host = None
            for _ in range(5):  # redirects (object storage behind the registry)
                if resp.status not in (301, 302, 303, 307, 308):
                    break
                loc = urllib.parse.urlsplit(resp.getheader("Location") or "")
                _drain(resp)
                if loc.scheme != "https":
                    raise RegistryError(f"registry {self.host}: blob {digest} redirects to a non-https location")
                host = loc.netloc
                hdrs = {"User-Agent": "migrt"}
                if host == self.host and self._auth:
                    hdrs["Authorization"] = self._auth
                resp = self._send("GET", loc.path + (f"?{loc.query}" if loc.query else ""), hdrs, host=host)
            if resp.status != 200:
                self._fail(resp, "GET", f"blob {digest}")
            h = hashlib.sha256()
            got = 0
            buf = bytearray(BUF)
            view = memoryview(buf)
            while True:
                n = resp.readinto(view)
                if not n:
                    break
                got += n
                if got > size:
                    raise CheckpointInvalid(f"blob {digest} from {self.host} is larger than the {size} bytes the "
                                            "image manifest says")
                h.update(view[:n])
                sink(view[:n])
            self.stats.add(received=got)
            if got < size:  # a cut connection: tried again
                raise http.client.IncompleteRead(b"", size - got)
            if "sha256:" + h.hexdigest() != digest:
                raise CheckpointInvalid(f"blob {digest} from {self.host}/{self.repo}: the data received has sha256 "
                                        f"{h.hexdigest()[:16]}...; it was altered in the registry or in transit "
                                        "(nothing was committed)")
        self._retry(go, f"downloading blob {digest}")

    def get_manifest(self, target: str | None = None) -> tuple[bytes, str, str]:
        """(raw bytes, media type, digest) of a manifest; the bytes are checked against the digest
        asked for (or the one the registry states)."""
        target = target or self.ref.target

        def go():
            resp = self.request("GET", f"/v2/{self.repo}/manifests/{target}",
                                headers={"Accept": ", ".join(MANIFEST_TYPES)}, what=f"manifest {target}")
            if resp.length is not None and resp.length > MAX_MANIFEST:
                raise CheckpointInvalid(f"manifest {target} is larger than {MAX_MANIFEST} bytes")
            data = resp.read(MAX_MANIFEST + 1)
            if len(data) > MAX_MANIFEST:
                raise CheckpointInvalid(f"manifest {target} is larger than {MAX_MANIFEST} bytes")
            return data, (resp.getheader("Content-Type") or "").split(";")[0].strip(), resp.getheader("Docker-Content-Digest")
        data, ctype, stated = self._retry(go, f"reading manifest {target}")
        digest = sha256_bytes(data)
        if target.startswith("sha256:") and digest != target:
            raise CheckpointInvalid(f"manifest {target} from {self.host}: its bytes have digest {digest}; altered "
                                    "(nothing was committed)")
        if stated and stated != digest:
            raise CheckpointInvalid(f"manifest {target} from {self.host}: the registry states digest {stated} but the "
                                    f"bytes have {digest}; altered in transit (nothing was committed)")
        return data, ctype, digest

    def resolve(self) -> str:
        """The manifest digest a reference names now (a tag can move)."""
        if self.ref.digest:
            return self.ref.digest
        return self.get_manifest()[2]

    def put_manifest(self, data: bytes, media_type: str, tag: str) -> str:
        def go():
            resp = self.request("PUT", f"/v2/{self.repo}/manifests/{tag}",
                                headers={"Content-Type": media_type, "Content-Length": str(len(data))},
                                body_factory=lambda: data, ok=(201, 200), what=f"manifest {tag}")
            _drain(resp)
            return resp.getheader("Docker-Content-Digest")
        stated = self._retry(go, f"writing manifest {tag}")
        digest = sha256_bytes(data)
        if stated and stated != digest:
            raise RegistryError(f"registry {self.host} stored manifest {tag} under digest {stated}, expected {digest}")
        return digest


def _drain(resp: http.client.HTTPResponse, limit: int = 1 << 20) -> bytes:
    """Read what is left of a response (so the connection can carry the next request)."""
    data = resp.read(limit) if limit else b""
    if not resp.isclosed():
        resp.close()
    return data
