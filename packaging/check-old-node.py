"""Run by packaging/check-old-node.sh with the payload's python, inside an old distribution's root.

  check-old-node.py DOCTOR_JSON     what the payload's python must do on any node (an AssertionError
                                    names what failed): its libraries, a node library through ctypes,
                                    name lookups, locale, CA certificates, children without LD_*
  check-old-node.py --bundle CONFIG make runc's default config.json (runc spec) a busybox counter
"""

from __future__ import annotations

import ctypes
import http.server
import json
import locale
import os
import pwd
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

PREFIX = "/opt/migrt/"
# Keeps 400 KB of random data in a shell variable and prints "tick N HASH-AT-START HASH-NOW" every 0.2 s.
COUNTER = ('exec </dev/null >/tmp/ticks 2>&1; d=$(head -c 200000 /dev/urandom | od -An -tx1 | tr -d " \\n"); '
           'h=$(echo "$d" | sha256sum | cut -c1-16); i=0; '
           'while :; do i=$((i+1)); echo "tick $i $h $(echo "$d" | sha256sum | cut -c1-16)"; sleep 0.2; done')


def mapped() -> set[str]:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {f.split()[-1] for f in lines if len(f.split()) > 5 and ".so" in f}


def check_libraries() -> None:
    outside = sorted(p for p in mapped() if not p.startswith(PREFIX))
    assert not outside, f"mapped from outside the payload: {outside}"
    assert any(p.startswith(PREFIX + "libc/libc.so") for p in mapped()), sorted(mapped())
    seccomp = ctypes.CDLL("libseccomp.so.2")  # migrt/seccomp's: the payload's own
    assert seccomp.seccomp_api_get() >= 0
    assert [p for p in mapped() if "libseccomp" in p] == [PREFIX + "python/lib/libseccomp.so.2"], sorted(mapped())
    acl = ctypes.CDLL("libacl.so.1")  # the node's, found through its /etc/ld.so.cache (as the driver's libcuda)
    acl.acl_init.restype = ctypes.c_void_p
    assert acl.acl_init(1)
    node = [p for p in mapped() if "libacl" in p]
    assert node and not node[0].startswith(PREFIX), node
    print(f"  libraries: the payload's C library and libseccomp; the node's {node[0]} loads through ctypes")


def check_names() -> None:
    local = {a[4][0] for a in socket.getaddrinfo("localhost", 80, proto=socket.IPPROTO_TCP)}
    assert local & {"127.0.0.1", "::1"}, local
    hosts = {a[4][0] for a in socket.getaddrinfo("migrt-check-host", 80, proto=socket.IPPROTO_TCP)}
    assert hosts == {"10.254.254.7"}, hosts
    assert pwd.getpwuid(0).pw_name == "root"
    nss = Path("/etc/nsswitch.conf").read_text().split("hosts:")[1].splitlines()[0].strip()
    print(f"  names: localhost {sorted(local)}, migrt-check-host {sorted(hosts)}, uid 0 root (hosts: {nss})")


def check_locale() -> None:
    assert locale.setlocale(locale.LC_ALL, "") == "C.UTF-8" and sys.getfilesystemencoding() == "utf-8"
    for lang in ("en_US.UTF-8", "de_DE.ISO-8859-1"):  # not in the root: the interpreter still starts
        r = subprocess.run([sys.executable, "-P", "-c", "import sys; print(sys.getfilesystemencoding())"],
                           env={"LANG": lang, "PATH": os.environ["PATH"]}, capture_output=True, text=True)
        assert r.returncode == 0, (lang, r.stderr)
    print("  locale: C.UTF-8 set; absent locales start with a fallback")


def _https_server() -> tuple[http.server.HTTPServer, int]:
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hello)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain("/tmp/server.pem", "/tmp/server.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _fetch(port: int) -> subprocess.CompletedProcess:
    """urlopen in a fresh interpreter (its sitecustomize chooses the node's CA bundle at start)."""
    code = f"import urllib.request; print(urllib.request.urlopen('https://localhost:{port}/', timeout=10).read())"
    return subprocess.run([sys.executable, "-P", "-c", code], env={"PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=60)


def check_tls() -> None:
    assert not os.path.exists("/usr/lib/ssl/cert.pem"), "the root has Debian's OpenSSL store: no test of the fallback"
    server, port = _https_server()
    ca = Path("/tmp/ca.pem").read_text()
    try:
        r = _fetch(port)
        assert r.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in r.stderr, r  # no store: refused
        for store in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"):
            os.makedirs(os.path.dirname(store), exist_ok=True)
            with open(store, "w") as fh:
                fh.write(ca)
            r = _fetch(port)
            os.unlink(store)
            assert r.returncode == 0 and "hello" in r.stdout, (store, r.stderr[-2000:])
        print("  tls: https://localhost verified with the CA in Debian's store, then in RHEL's; refused with none")
    finally:
        server.shutdown()


def check_children() -> None:
    assert not [k for k in os.environ if k.startswith("LD_")], os.environ
    r = subprocess.run(["sh", "-c", "env; cat /proc/self/maps"], capture_output=True, text=True, check=True)
    assert not [v for v in r.stdout.splitlines() if v.startswith("LD_")], r.stdout
    libc = [line.split()[-1] for line in r.stdout.splitlines() if "libc" in line and ".so" in line]
    assert libc and not any(p.startswith(PREFIX) for p in libc), libc
    print(f"  children: the node's sh on the node's C library ({libc[0]}), no LD_* variable")


def check_doctor(path: str) -> None:
    checks = {c["name"]: c for c in json.loads(Path(path).read_text())["checks"]}
    for c in checks.values():
        print(f"  doctor: {c['name']:<28} {c['status']:<5} {c['detail'][:100]}")
    for name in ("criu", "lower runtime"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["criu"]["detail"].startswith("/opt/migrt/criu/sbin/criu"), checks["criu"]


def make_bundle(config: str) -> None:
    with open(config) as fh:
        spec = json.load(fh)
    spec["process"]["args"] = ["sh", "-c", COUNTER]
    spec["process"]["terminal"] = False
    spec["root"]["readonly"] = False
    # Not the cgroup tree: on a cgroup v1 host runc's read-only tmpfs there is found read-write in the
    # images, and migrt's restore refuses the difference (migrt/ops/restore_privileges.py); this check is
    # about the payload on an old C library, not about that rule.
    spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/sys/fs/cgroup"]
    with open(config, "w") as fh:
        json.dump(spec, fh, indent=1)


def main() -> None:
    if sys.argv[1] == "--bundle":
        make_bundle(sys.argv[2])
        return
    check_doctor(sys.argv[1])
    check_libraries()
    check_names()
    check_locale()
    check_tls()
    check_children()


if __name__ == "__main__":
    main()
