"""A real OCI registry for tests and benchmarks: Debian's `docker-registry` (the CNCF distribution
server) on loopback, with TLS from a CA made here (openssl CLI) and basic auth (htpasswd, bcrypt).

`local_registry(base)` yields a Registry whose `auth_file` (docker-style config.json) and `ca_file`
are what the migrt config's `registry_auth_file` / `registry_ca_file` take.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

USER = "migrt-test"
PASSWORD = "s3cret-registry-pass"


@dataclass
class Registry:
    host: str          # 127.0.0.1:PORT
    ca_file: str
    auth_file: str
    storage: str
    proc: subprocess.Popen
    log: str
    conf: str = ""

    def ref(self, repo: str, tag: str = "latest") -> str:
        return f"{self.host}/{repo}:{tag}"

    @contextlib.contextmanager
    def also_in_netns(self, netns_path: str) -> Iterator[None]:
        """The same registry (same storage, certificate, users, port) served inside a network
        namespace too, e.g. the one containerd's CRI pods and shims run in: the reference
        127.0.0.1:PORT/... then works from both sides."""
        log = self.log + ".netns"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["nsenter", f"--net={netns_path}", "--", "docker-registry", "serve", self.conf],
                                    stdout=out, stderr=subprocess.STDOUT)
        mirror = Registry(self.host, self.ca_file, self.auth_file, self.storage, proc, log, self.conf)
        try:
            _wait_ready(mirror, netns_path)
            yield
        finally:
            _stop(proc)

    def blob_path(self, digest: str) -> str:
        """Where the distribution server keeps a blob's bytes (for tampering tests)."""
        algo, hexd = digest.split(":", 1)
        return os.path.join(self.storage, "docker/registry/v2/blobs", algo, hexd[:2], hexd, "data")


def missing() -> list[str]:
    return [t for t in ("docker-registry", "openssl", "htpasswd") if not shutil.which(t)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def make_tls(base: str, ips: tuple[str, ...] = ("127.0.0.1",)) -> tuple[str, str, str]:
    """A throw-away CA and a server certificate for the addresses `ips` and localhost, signed by it."""
    ca_key, ca = os.path.join(base, "ca.key"), os.path.join(base, "ca.pem")
    key, csr, cert = (os.path.join(base, n) for n in ("server.key", "server.csr", "server.pem"))
    ext = os.path.join(base, "san.ext")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _run(["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca,
          "-days", "2", "-subj", "/CN=migrt test CA"])
    _run(["openssl", "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"])
    with open(ext, "w") as fh:
        fh.write(f"subjectAltName={','.join('IP:' + ip for ip in ips)},DNS:localhost\nbasicConstraints=CA:FALSE\n"
                 "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _run(["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
          "-days", "2", "-extfile", ext])
    return ca, cert, key


def write_auth(path: str, host: str, user: str = USER, password: str = PASSWORD) -> None:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    with open(path, "w") as fh:
        json.dump({"auths": {host: {"auth": token}}}, fh)
    os.chmod(path, 0o600)


@contextlib.contextmanager
def local_registry(base: str, *, basic_auth: bool = True) -> Iterator[Registry]:
    os.makedirs(base, exist_ok=True)
    ca, cert, key = make_tls(base)
    htpasswd = os.path.join(base, "htpasswd")
    _run(["htpasswd", "-Bbc", htpasswd, USER, PASSWORD])
    storage = os.path.join(base, "storage")
    os.makedirs(storage, exist_ok=True)
    port = _free_port()
    host = f"127.0.0.1:{port}"
    conf = os.path.join(base, "registry.yml")
    with open(conf, "w") as fh:
        fh.write(f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: {host}
  tls:
    certificate: {cert}
    key: {key}
""")
        if basic_auth:
            fh.write(f"auth:\n  htpasswd:\n    realm: migrt-test\n    path: {htpasswd}\n")
    log = os.path.join(base, "registry.log")
    auth_file = os.path.join(base, "config.json")
    write_auth(auth_file, host)
    with open(log, "wb") as out:
        proc = subprocess.Popen(["docker-registry", "serve", conf], stdout=out, stderr=subprocess.STDOUT)
    reg = Registry(host=host, ca_file=ca, auth_file=auth_file, storage=storage, proc=proc, log=log, conf=conf)
    try:
        _wait_ready(reg)
        yield reg
    finally:
        _stop(proc)


_PROBE = """
import ssl, sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[2], context=ssl.create_default_context(cafile=sys.argv[1]), timeout=2).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
except OSError:
    print(0)
"""


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_ready(reg: Registry, netns_path: str | None = None) -> None:
    deadline = time.monotonic() + 20
    while True:
        if reg.proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited ({reg.proc.returncode}): {open(reg.log).read()[-2000:]}")
        # a 401 means up and asking for credentials; in a namespace, the probe runs there (nsenter)
        argv = [sys.executable, "-c", _PROBE, reg.ca_file, f"https://{reg.host}/v2/"]
        if netns_path:
            argv = ["nsenter", f"--net={netns_path}", "--", *argv]
        code = subprocess.run(argv, capture_output=True, text=True).stdout.strip()
        if code in ("200", "401"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"docker-registry did not answer on {reg.host}: {open(reg.log).read()[-2000:]}")
        time.sleep(0.1)
