"""A small HTTPS proxy in front of a test registry, run as its own process (tests start it and stop it
by pid): it passes every request on (credentials included) and can misbehave the ways a registry or
the network between may:

  --rate BYTES/S      throttle every response body (a slow registry: a lazy fill takes seconds)
  --flip DIGEST       flip one byte in the middle of every body served for that blob (200 or 206)
  --no-ranges         drop the Range header: the registry answers 200 with the whole blob
  --exit-on DIGEST    exit at the first request for that blob's bytes (the one-byte range probe
                      aside): the registry goes away right then

Every request is logged as a JSON line to --log: method, path, range asked, status, bytes sent,
time, so a test sees what the client fetched and when.

  python -m tests.helpers.registry_proxy --port P --upstream 127.0.0.1:Q --cert C --key K --ca CA --log L
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import ssl
import threading
import time

HOP = {"connection", "keep-alive", "transfer-encoding", "host", "proxy-connection"}


class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    opts: argparse.Namespace
    ctx: ssl.SSLContext
    log_lock = threading.Lock()

    def log_message(self, format, *args) -> None:
        pass

    def _upstream(self) -> http.client.HTTPSConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = self._conn = http.client.HTTPSConnection(self.opts.upstream, context=self.ctx, timeout=60)
        return conn

    def do_GET(self) -> None:
        self._forward()

    def do_HEAD(self) -> None:
        self._forward()

    def _forward(self) -> None:
        if self.opts.exit_on and self.opts.exit_on in self.path and self.headers.get("Range") != "bytes=0-0":
            self._log(0, 0)
            os._exit(0)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        if self.opts.no_ranges:
            headers.pop("Range", None)
        conn = self._upstream()
        try:
            conn.request(self.command, self.path, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            self._conn = None
            self.send_error(502)
            return
        body_len = int(resp.getheader("Content-Length") or 0)
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP:
                self.send_header(k, v)
        self.end_headers()
        sent = 0
        if self.command != "HEAD":
            flip = body_len // 2 if (self.opts.flip and self.opts.flip in self.path
                                     and resp.status in (200, 206)) else -1
            sent = self._pump(resp, flip)
        else:
            resp.read()
        self._log(resp.status, sent)

    def _pump(self, resp: http.client.HTTPResponse, flip: int) -> int:
        sent, t0 = 0, time.monotonic()
        while True:
            buf = resp.read(256 << 10)
            if not buf:
                return sent
            if sent <= flip < sent + len(buf):
                b = bytearray(buf)
                b[flip - sent] ^= 0xFF
                buf = bytes(b)
            self.wfile.write(buf)
            sent += len(buf)
            if self.opts.rate:
                ahead = sent / self.opts.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)

    def _log(self, status: int, sent: int) -> None:
        rec = {"method": self.command, "path": self.path, "range": self.headers.get("Range"), "status": status,
               "bytes": sent, "t": time.time()}
        with self.log_lock, open(self.opts.log, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--rate", type=float, default=0)
    p.add_argument("--flip", default="")
    p.add_argument("--no-ranges", action="store_true")
    p.add_argument("--exit-on", default="")
    opts = p.parse_args()
    Proxy.opts = opts
    Proxy.ctx = ssl.create_default_context(cafile=opts.ca)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", opts.port), Proxy)
    server.daemon_threads = True
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(opts.cert, opts.key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
