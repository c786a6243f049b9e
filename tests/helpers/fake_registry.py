"""Fake OCI registries for unit tests: TLS servers on loopback addresses (127.0.0.x), started and
stopped by the test, whose answers the test chooses (hostile ones included: trickling bodies, odd
redirects, escape sequences, short blobs). `Registry` serves images built here (`migrt_image`,
`archive_image`) from memory and records every request; with `ranges` set, byte ranges of blobs too.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import ssl
import threading
from collections.abc import Callable, Iterator

from migrt.registry import image
from migrt.store import manifest as mf

REPO = "team/ckpt"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):  # noqa: N802
        self.server.app(self)

    do_HEAD = do_GET


def send(h: http.server.BaseHTTPRequestHandler, code: int, body: bytes = b"", headers: dict | None = None) -> None:
    h.send_response(code)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    if "Content-Length" not in (headers or {}):
        h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


def send_range(h: http.server.BaseHTTPRequestHandler, data: bytes) -> None:
    """A 206 answer to `Range: bytes=a-b` (one range, as a registry serves a blob's)."""
    first, _, last = h.headers["Range"].removeprefix("bytes=").partition("-")
    a, b = int(first), min(int(last), len(data) - 1)
    send(h, 206, data[a:b + 1], {"Content-Type": "application/octet-stream",
                                 "Content-Range": f"bytes {a}-{b}/{len(data)}"})


@contextlib.contextmanager
def serve(app: Callable, cert: str | None, key: str | None, host: str = "127.0.0.1") -> Iterator[str]:
    """A server on host:<free port> calling app(handler) for each request (TLS unless cert is None);
    yields 'host:port'. Stopped (and its connections left to die with their daemon threads) on exit."""
    srv = http.server.ThreadingHTTPServer((host, 0), _Handler)
    srv.daemon_threads = True
    srv.app = app
    if cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"{host}:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


class Registry:
    """An in-memory registry of one repository: `manifests` by tag and digest, `blobs` by digest.
    `hooks[path]`, if set, answers that path instead (a function of the handler). Every request is
    recorded in `requests` as (method, path)."""

    def __init__(self, repo: str = REPO) -> None:
        self.repo = repo
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}
        self.hooks: dict[str, Callable] = {}
        self.requests: list[tuple[str, str]] = []
        self.ranges = False  # serve `Range: bytes=a-b` of blobs (206), as the distribution server does
        self.lock = threading.Lock()

    def add_blob(self, data: bytes) -> str:
        digest = sha(data)
        self.blobs[digest] = data
        return digest

    def add_manifest(self, tag: str, manifest: dict) -> str:
        raw = image.dumps(manifest)
        digest = sha(raw)
        self.manifests[tag] = self.manifests[digest] = raw
        return digest

    def blob_paths(self) -> list[str]:
        return [p for _m, p in self.requests if "/blobs/" in p]

    def __call__(self, h) -> None:
        with self.lock:
            self.requests.append((h.command, h.path))
        hook = self.hooks.get(h.path)
        if hook:
            return hook(h)
        if h.path == "/v2/":
            return send(h, 200, b"{}")
        prefix = f"/v2/{self.repo}/"
        if h.path.startswith(prefix + "manifests/"):
            raw = self.manifests.get(h.path[len(prefix + "manifests/"):])
            if raw is not None:
                return send(h, 200, raw, {"Content-Type": image.MANIFEST_TYPE, "Docker-Content-Digest": sha(raw)})
        if h.path.startswith(prefix + "blobs/"):
            data = self.blobs.get(h.path[len(prefix + "blobs/"):])
            if data is not None and self.ranges and h.headers.get("Range"):
                return send_range(h, data)
            if data is not None:
                return send(h, 200, data, {"Content-Type": "application/octet-stream"})
        return send(h, 404, b'{"errors":[{"code":"NOT_FOUND","message":"unknown"}]}')


def migrt_image(reg: Registry, tag: str, files: dict[str, bytes], *, namespace: str | None = None,
                name: str = "src", extra: dict | None = None) -> str:
    """A migrt-format checkpoint image of `files` (each below 64 MiB: one blob each) in reg under tag;
    returns the manifest digest. namespace: the pod namespace its checkpoint manifest records; extra:
    more sections of that manifest (e.g. "gpu")."""
    ckpt = {**(extra or {}), "schema": mf.SCHEMA, "name": name, "created": "2026-01-02T03:04:05Z",
            "files": {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                      for rel, data in sorted(files.items())},
            "source": {"container_id": "c0ffee", **({"cri": {"pod_namespace": namespace}} if namespace else {})}}
    if "rootfs-diff.tar" in files:
        ckpt["rootfs"] = {"captured": True}
    layers = [image.descriptor(image.FILE_TYPE, reg.add_blob(data), len(data), {image.A_PATH: rel, image.A_OFFSET: "0"})
              for rel, data in sorted(files.items())]
    raw = image.dumps(ckpt)
    config = image.descriptor(image.CONFIG_TYPE, reg.add_blob(raw), len(raw))
    return reg.add_manifest(tag, image.migrt_manifest(config, layers, name, ckpt["created"]))


def archive_image(reg: Registry, tag: str, archive: bytes, annotations: dict | None = None) -> str:
    """A CRI-O-style checkpoint image: one tar layer holding a checkpoint archive."""
    layer = image.descriptor(image.TAR_TYPES[0], reg.add_blob(archive), len(archive))
    cfg = image.dumps(image.cri_config(layer["digest"], "2026-01-02T03:04:05Z"))
    config = image.descriptor(image.OCI_CONFIG_TYPE, reg.add_blob(cfg), len(cfg))
    manifest = {"schemaVersion": 2, "mediaType": image.MANIFEST_TYPE, "config": config, "layers": [layer],
                "annotations": {image.CRIO_NAME: "app", **(annotations or {})}}
    return reg.add_manifest(tag, manifest)


def tls_files(base: str, ips: tuple[str, ...] = ("127.0.0.1",)) -> tuple[str, str, str]:
    """(ca, cert, key) for a server on those loopback addresses (tests/helpers/registry.make_tls)."""
    from tests.helpers.registry import make_tls

    os.makedirs(base, exist_ok=True)
    return make_tls(base, ips=ips)


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()
