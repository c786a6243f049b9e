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
  GET  /v2/<repo>/blobs/<digest>              a blob (redirects followed, without credentials to another host),
                                              or a byte range of it (Range: bytes=a-b, answered 206)
  GET|HEAD|PUT /v2/<repo>/manifests/<tag|digest>
Every error becomes a RegistryError (or NotFound, CheckpointInvalid) here, at one boundary; text the
registry controls (error bodies, reason phrases, headers) is printed through text.printable.

Time: a connection and its TLS handshake get CONNECT_TIMEOUT_S; every request has a total budget
(the client's timeout, plus size / MIN_BLOB_RATE for a blob) that covers its headers and its body,
enforced on each socket operation (not per recv: a server trickling a byte now and then is cut at the
budget's end); and a whole operation (a pull) may carry a Deadline that bounds every request, retry
and back-off in it.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from migrt import jsonsafe, trust
from migrt import log as log_mod
from migrt.errors import CheckpointInvalid, NotFound, RegistryError
from migrt.registry.auth import Credentials
from migrt.registry.reference import Reference
from migrt.text import printable

BUF = 4 << 20
MAX_MANIFEST = 4 << 20
RETRIES = 3
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
# Connecting (TCP and TLS handshake) gets less time than a request: a registry behind a firewall that
# drops packets, or one that accepts and never answers, must not hold a pull (inside kubelet's 2-minute
# StartContainer) for RETRIES+1 times the request timeout.
CONNECT_TIMEOUT_S = 10.0
# A blob's request may take the client's timeout plus its size at this rate (64 MiB: 256 s more): slow
# links pass, a server that trickles a byte now and then does not hold a connection for ever.
MIN_BLOB_RATE = 256 << 10
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_TRANSIENT = (OSError, http.client.HTTPException, ssl.SSLError)


@dataclass
class Deadline:
    """The end of a whole operation (a push or a pull), on time.monotonic(), and the setting that chose
    it (named in the error). With a `rate` (bytes/s), allow(n) extends it by n / rate once the size of
    the data is known (before any of it moves, or before waiting for another pull of the same image
    to move it), so that a budget sized for the exchange of manifests also carries a large image;
    without one it is a plain wall-clock budget. The allowance covers the most bytes ever allowed, not
    their sum: the wait for another pull and a pull of the same image after it are allowed once.
    `then`: what the error says happens to what moved."""
    at: float
    seconds: float
    setting: str
    rate: float | None = None
    then: str = "what arrived is kept and the next pull of the same image resumes it"
    allowed: int = 0

    @classmethod
    def after(cls, seconds: float, setting: str, *, rate: float | None = None, then: str | None = None) -> Deadline:
        return cls(time.monotonic() + seconds, seconds, setting, rate, then or cls.then)

    def allow(self, nbytes: int) -> None:
        """nbytes of data are about to move: with a rate, the budget covers their time at that rate (grown
        by what nbytes exceed the bytes allowed so far)."""
        if self.rate and nbytes > self.allowed:
            extra = (nbytes - self.allowed) / self.rate
            self.allowed = nbytes
            self.at += extra
            self.seconds += extra

    def left(self) -> float:
        return self.at - time.monotonic()

    def error(self, what: str) -> RegistryError:
        return RegistryError(f"{what}: not finished within {round(self.seconds, 1):g} s ({self.setting}); {self.then}")

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise self.error(what)


class _Expired(TimeoutError):
    """A request's budget (or the whole operation's deadline) ran out during a socket operation."""


class _Clock:
    """When the request in progress on one connection must end; each socket operation gets the time
    left (at most the client's per-operation timeout)."""

    def __init__(self, per_op: float) -> None:
        self.per_op = per_op
        self.until: float | None = None

    def timeout(self) -> float:
        if self.until is None:
            return self.per_op
        left = self.until - time.monotonic()
        if left <= 0:
            raise _Expired("the request's time is up (the registry answers too slowly)")
        return min(self.per_op, left)


class _DeadlineSocket(ssl.SSLSocket):
    """An SSLSocket whose every read and write is bounded by its connection's clock. A timeout on an
    SSL socket bounds one whole call (all the recvs of one record), so the sum of the calls of a request
    cannot pass its end however slowly the server sends. (The context's documented sslsocket_class.)"""

    clock: _Clock | None = None

    def _arm(self) -> None:
        if self.clock is not None:
            self.settimeout(self.clock.timeout())

    def read(self, len=1024, buffer=None):
        self._arm()
        return super().read(len, buffer)

    def send(self, data, flags=0):
        self._arm()
        return super().send(data, flags)


class _Connection(http.client.HTTPSConnection):
    """HTTPSConnection whose connect and TLS handshake are bounded by CONNECT_TIMEOUT_S (and by the
    time the request has left); requests on it then by its clock."""

    def __init__(self, host: str, *, clock: _Clock, **kw) -> None:
        super().__init__(host, timeout=clock.per_op, **kw)
        self.clock = clock

    def connect(self) -> None:
        request_timeout = self.clock.per_op
        self.timeout = min(request_timeout, CONNECT_TIMEOUT_S, self.clock.timeout())
        try:
            super().connect()
        finally:
            self.timeout = request_timeout
        self.sock.settimeout(request_timeout)
        if isinstance(self.sock, _DeadlineSocket):
            self.sock.clock = self.clock


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


def _content_range(resp: http.client.HTTPResponse) -> tuple[int, int, int] | None:
    """(first, last, total) of a 206 answer's `Content-Range: bytes first-last/total` (None: another form)."""
    m = re.fullmatch(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})", (resp.getheader("Content-Range") or "").strip())
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


class Client:
    """One repository of one registry. Thread-safe: each thread keeps its own connection.
    deadline: the end of the whole operation this client serves (None: each request's budget only)."""

    def __init__(self, ref: Reference, *, credentials: Credentials | None = None, ca_file: str | None = None,
                 timeout: float = 120.0, push: bool = False, deadline: Deadline | None = None) -> None:
        self.ref = ref
        self.host = ref.api_host
        self.repo = ref.repository
        self.credentials = credentials
        self.timeout = timeout
        self.push = push
        # no deadline given (tests; every migrt caller passes one, connect.client_for): what the retries
        # of requests of the client's own budget could take anyway
        self.deadline = deadline or Deadline.after((timeout + CONNECT_TIMEOUT_S) * (RETRIES + 1) + 7,
                                                   "the registry client's own limit")
        if ca_file:
            trust.check(ca_file, "registry CA bundle (registry_ca_file)")  # it decides which servers are believed
        try:
            self.ctx = ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise RegistryError(f"CA bundle {ca_file} (registry_ca_file) cannot be loaded: {exc}") from exc
        self.ctx.sslsocket_class = _DeadlineSocket
        self.stats = Stats()
        self._auth: str | None = None
        self._conns_lock = threading.Lock()  # guards _all only; never held across network I/O
        self._local = threading.local()
        self._all: list[http.client.HTTPSConnection] = []
        self.ranges: bool | None = None  # serves byte ranges of blobs (serves_ranges; None: not asked yet)

    # -- connections and requests ----------------------------------------------------------------
    def _conn(self, host: str | None = None) -> _Connection:
        host = host or self.host
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(host)
        if conn is None:
            conn = _Connection(host, clock=_Clock(self.timeout), context=self.ctx, blocksize=1 << 20)
            conns[host] = conn
            with self._conns_lock:
                self._all.append(conn)
        return conn

    def _drop(self, host: str | None = None) -> None:
        conns = getattr(self._local, "conns", {}) or {}
        conn = conns.pop(host or self.host, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close every connection, those of the worker threads too."""
        with self._conns_lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local.conns = {}

    def until(self, budget: float | None = None) -> float:
        """When a request started now must end: its budget (default: the client's timeout), and never
        after the whole operation's deadline."""
        end = time.monotonic() + (self.timeout if budget is None else budget)
        return min(end, self.deadline.at)

    def _send(self, method: str, url: str, headers: dict, body=None, host: str | None = None,
              until: float | None = None) -> http.client.HTTPResponse:
        conn = self._conn(host)
        conn.clock.until = self.until() if until is None else until  # the response's body too
        self.stats.add(requests=1)
        try:
            conn.request(method, url, body=body, headers=headers)
            resp = conn.getresponse()
        except BaseException:
            self._drop(host)
            raise
        resp.migrt_host = host or self.host  # type: ignore[attr-defined]  # (_drain drops its connection)
        return resp

    def request(self, method: str, path: str, *, headers: dict | None = None, body_factory=None,
                ok: tuple[int, ...] = (200,), what: str = "", until: float | None = None,
                redirects: bool = False) -> http.client.HTTPResponse:
        """One request with credentials; on 401 the challenge is answered once and the request
        repeated (body_factory makes a fresh body for that). With redirects=True (get()), a redirect
        is returned too. The caller reads the response."""
        until = self.until() if until is None else until
        for attempt in range(2):
            hdrs = {"User-Agent": "migrt", **(headers or {})}
            if self._auth:
                hdrs["Authorization"] = self._auth
            body = body_factory() if body_factory else None
            resp = self._send(method, path, hdrs, body, until=until)
            if resp.status == 401 and attempt == 0:
                challenge = resp.getheader("WWW-Authenticate") or ""
                self._drain(resp)
                self._authenticate(challenge)
                continue
            if resp.status in ok or (redirects and resp.status in REDIRECTS):
                return resp
            self._fail(resp, method, what or path)
        raise AssertionError("unreachable")

    def get(self, path: str, *, headers: dict | None = None, what: str, until: float | None = None,
            ok: tuple[int, ...] = (200,)) -> http.client.HTTPResponse:
        """GET with redirects followed (at most MAX_REDIRECTS, https only, credentials only to the
        registry's own host); returns a response of a status in `ok`, anything else is an error."""
        until = self.until() if until is None else until
        resp = self.request("GET", path, headers=headers, what=what, until=until, redirects=True, ok=ok)
        host = self.host
        for hop in range(MAX_REDIRECTS + 1):
            if resp.status not in REDIRECTS:
                break
            location = resp.getheader("Location") or ""
            self._drain(resp)
            if hop == MAX_REDIRECTS:
                raise RegistryError(f"registry {self.host}: {what} was redirected more than {MAX_REDIRECTS} times")
            loc = urllib.parse.urlsplit(urllib.parse.urljoin(f"https://{host}{path}", location))
            if loc.scheme != "https" or not loc.netloc or loc.username is not None:
                raise RegistryError(f"registry {self.host}: {what} redirects to {printable(location, 200)!r}, not "
                                    "an https location; refusing to follow")
            host, path = loc.netloc, (loc.path or "/") + (f"?{loc.query}" if loc.query else "")
            hdrs = {"User-Agent": "migrt", **(headers or {})}
            if host == self.host and self._auth:
                hdrs["Authorization"] = self._auth
            resp = self._send("GET", path, hdrs, host=host, until=until)
        if resp.status not in ok:
            self._fail(resp, "GET", what)
        return resp

    def _drain(self, resp: http.client.HTTPResponse, limit: int = 1 << 20) -> bytes:
        """Read what is left of a response, at most `limit` bytes, so that its connection can carry the
        next request; a connection with more unread (a large or endless body) is dropped instead."""
        data = resp.read(limit) if limit else b""
        if not resp.isclosed():
            resp.close()
            self._drop(getattr(resp, "migrt_host", None))
        return data

    def _fail(self, resp: http.client.HTTPResponse, method: str, what: str):
        text = self._drain(resp, limit=64 << 10)
        detail = text.decode(errors="replace").strip()
        try:
            errs = jsonsafe.loads(text).get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errs) or detail
        except (ValueError, AttributeError):
            pass
        msg = (f"registry {self.host}: {method} {what} answered {resp.status} {printable(resp.reason, 80)}"
               + (f" ({printable(detail)})" if detail else ""))
        if resp.status == 401:
            raise RegistryError(msg + "; check the credentials for this registry in registry_auth_file")
        if resp.status == 403:
            verb = "push to" if self.push else "pull from"
            raise RegistryError(msg + f"; the credentials may not {verb} {self.repo}")
        if resp.status == 404:
            raise NotFound(msg)
        raise RegistryError(msg)

    def _authenticate(self, challenge: str) -> None:
        """Answer a 401's challenge. No lock is held here: a token service on another host opens a
        connection of its own (two threads answering at once each fetch a token; either will do)."""
        scheme, params = _challenge(challenge)
        if scheme == "basic":
            if not self.credentials:
                raise RegistryError(f"registry {self.host} asks for credentials (Basic) and registry_auth_file "
                                    "has none for it")
            self._auth = self.credentials.basic_header()
        elif scheme == "bearer" and params.get("realm"):
            self._auth = "Bearer " + self._token(params)
        else:
            raise RegistryError(f"registry {self.host} answered 401 with an unsupported challenge "
                                f"{printable(challenge, 200)!r}")

    def _token(self, params: dict[str, str]) -> str:
        """Docker token auth: GET realm?service=&scope= with Basic credentials (if any)."""
        realm = urllib.parse.urlsplit(params["realm"])
        if realm.scheme != "https" or not realm.netloc or realm.username is not None:
            raise RegistryError(f"registry {self.host}: token realm {printable(params['realm'], 200)!r} is not an "
                                "https URL; refusing to send credentials there")
        actions = "pull,push" if self.push else "pull"
        query = {"service": params.get("service", ""), "scope": f"repository:{self.repo}:{actions}"}
        path = (realm.path or "/") + "?" + urllib.parse.urlencode(query) + (("&" + realm.query) if realm.query else "")
        hdrs = {"User-Agent": "migrt"}
        if self.credentials:
            hdrs["Authorization"] = self.credentials.basic_header()
        service = printable(realm.netloc, 100)
        resp = self._send("GET", path, hdrs, host=realm.netloc)
        body = self._drain(resp, limit=1 << 20)
        if resp.status != 200:
            raise RegistryError(f"registry {self.host}: token service {service} answered {resp.status} "
                                f"{printable(resp.reason, 80)}; check registry_auth_file")
        try:
            data = jsonsafe.loads(body)
            token = data.get("token") or data["access_token"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RegistryError(f"registry {self.host}: token service {service} sent no token") from exc
        if not isinstance(token, str) or not token.isprintable() or not token.isascii():
            raise RegistryError(f"registry {self.host}: token service {service} sent no usable token")
        return token

    def _retry(self, fn: Callable, what: str):
        """Run fn, repeating it after a cut connection (fresh connection, 1 s, 2 s back-off), never
        past the whole operation's deadline."""
        for attempt in range(RETRIES + 1):
            self.deadline.check(f"registry {self.host}: {what}")
            try:
                return fn()
            except ssl.SSLCertVerificationError as exc:  # permanent: not worth a retry
                self._drop()
                raise RegistryError(f"registry {self.host}: TLS certificate not trusted ({exc.verify_message}); "
                                    "give the CA bundle that signed it as registry_ca_file in the migrt "
                                    "config") from exc
            except _TRANSIENT as exc:
                self._drop()
                if self.deadline.left() <= 0:
                    raise self.deadline.error(f"registry {self.host}: {what}") from exc
                if attempt == RETRIES:
                    raise RegistryError(f"registry {self.host}: {what} failed after {RETRIES + 1} tries: "
                                        f"{printable(exc, 200)}") from exc
                self.stats.add(retries=1)
                if attempt or not isinstance(exc, http.client.RemoteDisconnected):
                    pause = min(4, 2 ** attempt)  # an idle keep-alive connection the server closed: at once
                    time.sleep(max(0.0, min(pause, self.deadline.left())))

    # -- API ---------------------------------------------------------------------------------
    def ping(self) -> None:
        def go():
            resp = self.request("GET", "/v2/", ok=(200,), what="/v2/ (API check)")
            self._drain(resp)
        self._retry(go, "connecting")

    def blob_exists(self, digest: str, size: int) -> bool:
        def go():
            resp = self.request("HEAD", f"/v2/{self.repo}/blobs/{digest}", ok=(200, 404), what=f"blob {digest}")
            self._drain(resp)
            if resp.status == 404:
                return False
            length = resp.getheader("Content-Length")
            return length is None or length.strip() == str(size)
        return self._retry(go, f"checking blob {digest}")

    def upload_blob(self, digest: str, fd: int, offset: int, length: int) -> None:
        """Upload one blob from a file range: POST (session), PUT ?digest= (the registry checks it)."""
        def go():
            resp = self.request("POST", f"/v2/{self.repo}/blobs/uploads/", headers={"Content-Length": "0"},
                                ok=(202,), what="starting a blob upload")
            location = resp.getheader("Location")
            self._drain(resp)
            if not location:
                raise RegistryError(f"registry {self.host}: no Location for the blob upload")
            url = urllib.parse.urlsplit(location)
            if url.netloc and url.netloc != self.host:
                raise RegistryError(f"registry {self.host}: upload location on another host "
                                    f"({printable(url.netloc, 100)}) is not supported")
            query = ((url.query + "&") if url.query else "") + urllib.parse.urlencode({"digest": digest})
            path = url.path + "?" + query
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
                                body_factory=body, ok=(201,), what=f"blob {digest}",
                                until=self.until(self.timeout + length / MIN_BLOB_RATE))
            self._drain(resp)
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
        (CheckpointInvalid otherwise, at once: a registry that sends other content, or less of it than
        the descriptor says, is not asked again). A cut connection restarts the blob (sink must accept
        a rewind: it is called with an empty view first on each try)."""
        if not digest.startswith("sha256:"):
            raise CheckpointInvalid(f"blob digest {printable(digest, 80)!r}: only sha256 is supported")
        what = f"blob {digest}"

        def go():
            sink(memoryview(b""))
            resp = self.get(f"/v2/{self.repo}/blobs/{digest}", what=what,
                            until=self.until(self.timeout + size / MIN_BLOB_RATE))
            if resp.length is not None and resp.length != size:
                self._drain(resp, limit=0)
                raise CheckpointInvalid(f"{what} from {self.host}/{self.repo}: the registry sends {resp.length} "
                                        f"bytes, the image manifest says {size} (nothing was committed)")
            h = hashlib.sha256()
            got = self._stream(resp, size, sink, what, h)
            if got < size:  # the body ended where the server said it ends: other content, not a cut
                raise CheckpointInvalid(f"{what} from {self.host}/{self.repo}: the registry sent {got} bytes, the "
                                        f"image manifest says {size}; the registry holds other content under this "
                                        "digest (nothing was committed)")
            if "sha256:" + h.hexdigest() != digest:
                raise CheckpointInvalid(f"{what} from {self.host}/{self.repo}: the data received has sha256 "
                                        f"{h.hexdigest()[:16]}...; it was altered in the registry or in transit "
                                        "(nothing was committed)")
        self._retry(go, f"downloading {what}")

    def serves_ranges(self, digest: str, size: int) -> bool:
        """Whether the registry (or the storage it redirects to) serves byte ranges of blobs: one
        `Range: bytes=0-0` request, once per client. A whole 200 answer (its body not read: the
        connection is dropped) means no; said once in the node's log."""
        if self.ranges is None:
            def go() -> bool:
                resp = self.get(f"/v2/{self.repo}/blobs/{digest}", headers={"Range": "bytes=0-0"},
                                what=f"blob {digest} (range probe)", ok=(200, 206))
                yes = resp.status == 206 and _content_range(resp) == (0, 0, size)
                self._drain(resp, limit=1 if yes else 0)
                return yes
            self.ranges = self._retry(go, f"probing byte ranges of blob {digest}")
            if not self.ranges:
                log_mod.get().info("registry_no_ranges", registry=self.host, repository=self.repo,
                                   detail="the registry does not serve byte ranges: one stream per blob")
        return bool(self.ranges)

    def fetch_range(self, digest: str, size: int, start: int, length: int, sink: Callable[[memoryview], None]
                    ) -> bool:
        """Stream bytes [start, start+length) of a blob to sink (rewound with an empty view on each
        try, as fetch_blob). False, with nothing given to sink, when the registry answers with the
        whole blob instead (no ranges after all). The caller verifies the blob's digest once all its
        ranges are in; here only the range's place and length are checked."""
        what = f"blob {digest} bytes {start}-{start + length - 1}"

        def go() -> bool:
            sink(memoryview(b""))
            resp = self.get(f"/v2/{self.repo}/blobs/{digest}", headers={"Range": f"bytes={start}-{start + length - 1}"},
                            what=what, until=self.until(self.timeout + length / MIN_BLOB_RATE), ok=(200, 206))
            if resp.status == 200:
                self._drain(resp, limit=0)
                return False
            if _content_range(resp) != (start, start + length - 1, size) or \
                    (resp.length is not None and resp.length != length):
                self._drain(resp, limit=0)
                raise CheckpointInvalid(f"{what} from {self.host}/{self.repo}: the registry answered range "
                                        f"{printable(resp.getheader('Content-Range') or '', 80)!r} of "
                                        f"{resp.length} bytes (nothing was committed)")
            got = self._stream(resp, length, sink, what)
            if got < length:
                raise CheckpointInvalid(f"{what} from {self.host}/{self.repo}: the registry sent {got} bytes of "
                                        f"{length} (nothing was committed)")
            return True
        return self._retry(go, f"downloading {what}")

    def _stream(self, resp: http.client.HTTPResponse, limit: int, sink: Callable[[memoryview], None],
                what: str, h=None) -> int:
        """Read a body to sink (and hasher h), at most `limit` bytes; returns the bytes read."""
        got = 0
        view = memoryview(bytearray(min(BUF, max(limit, 1))))
        while True:
            n = resp.readinto(view)  # 0 at the end, or where a cut connection ended it (below)
            if not n:
                break
            got += n
            if got > limit:
                raise CheckpointInvalid(f"{what} from {self.host} is larger than the {limit} bytes the "
                                        "image manifest says")
            if h is not None:
                h.update(view[:n])
            sink(view[:n])
        if resp.length:  # (readinto gives 0 at a cut; what the server announced is still to come)
            raise http.client.IncompleteRead(b"", resp.length)  # a cut connection: tried again
        self.stats.add(received=got)
        return got

    def get_manifest(self, target: str | None = None) -> tuple[bytes, str, str]:
        """(raw bytes, media type, digest) of a manifest; the bytes are checked against the digest
        asked for (or the one the registry states)."""
        target = target or self.ref.target

        def go():
            resp = self.get(f"/v2/{self.repo}/manifests/{target}", headers={"Accept": ", ".join(MANIFEST_TYPES)},
                            what=f"manifest {target}")
            if resp.length is not None and resp.length > MAX_MANIFEST:
                self._drain(resp, limit=0)
                raise CheckpointInvalid(f"manifest {target} is larger than {MAX_MANIFEST} bytes")
            data = resp.read(MAX_MANIFEST + 1)
            if len(data) > MAX_MANIFEST:
                self._drain(resp, limit=0)
                raise CheckpointInvalid(f"manifest {target} is larger than {MAX_MANIFEST} bytes")
            ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip()
            return data, ctype, resp.getheader("Docker-Content-Digest")
        data, ctype, stated = self._retry(go, f"reading manifest {target}")
        digest = sha256_bytes(data)
        if target.startswith("sha256:") and digest != target:
            raise CheckpointInvalid(f"manifest {target} from {self.host}: its bytes have digest {digest}; altered "
                                    "(nothing was committed)")
        if stated and stated.strip() != digest:
            raise CheckpointInvalid(f"manifest {target} from {self.host}: the registry states digest "
                                    f"{printable(stated, 80)} but the bytes have {digest}; altered in transit "
                                    "(nothing was committed)")
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
            self._drain(resp)
            return resp.getheader("Docker-Content-Digest")
        stated = self._retry(go, f"writing manifest {tag}")
        digest = sha256_bytes(data)
        if stated and stated.strip() != digest:
            raise RegistryError(f"registry {self.host} stored manifest {tag} under digest {printable(stated, 80)}, "
                                f"expected {digest}")
        return digest
