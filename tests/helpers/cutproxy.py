"""A TCP proxy that cuts one migration connection at a chosen point (a fault-injection helper).

    python cutproxy.py LISTEN_HOST:PORT TARGET_HOST:PORT SPEC

It forwards every connection to TARGET, parsing migrt's frames on the way (type u8 | length u32 |
payload; a sealed payload is a 32-byte MAC then JSON, readable; a `file` or `chunk` message is
followed by that many raw bytes). The FIRST connection is cut (both sockets closed at once) at the point SPEC names;
later connections (a sender asking again with `query`) pass untouched. SPEC:

    bytes:N                 after N bytes from the sender (e.g. inside the handshake)
    up:TYPE:before|after    around the sender's message of that type (offer, commit, restore, bye ...)
    down:TYPE:before|after  around the receiver's message of that type (ready, committed, restored, done)
    file:FRACTION           inside the first file (or a stop-and-copy's chunk, migration/bulk.py) of
                            64 KiB or more on this connection, after FRACTION of its bytes (e.g. 0.5)

Prints "listening" once ready, then one JSON line per connection when it ends ({"conn", "cut", "up",
"down", "where"}).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading

HEADER = struct.Struct("!BI")
SEALED = 2
BIG_FILE = 64 << 10


class Cut(Exception):
    pass


class Stream:
    """One direction's parser; `feed` raises Cut (carrying what may still be forwarded) at the cut point."""

    def __init__(self, direction: str, spec: str, armed: bool) -> None:
        self.direction, self.spec, self.armed = direction, spec, armed
        self.buf = b""
        self.file_left = 0
        self.file_size = 0
        self.total = 0
        self.where = None

    def _check(self, point: str) -> bool:
        return self.armed and self.spec == point

    def feed(self, data: bytes) -> bytes:
        """Returns the bytes that may be forwarded; raises Cut (with what may still go) when cut."""
        out = bytearray()
        pos = 0
        while pos < len(data):
            if self.armed and self.spec.startswith("bytes:") and self.direction == "up":
                limit = int(self.spec.split(":")[1])
                room = limit - self.total
                if room <= 0:
                    self.where = f"after {self.total} bytes"
                    raise Cut(bytes(out))
                take = min(room, len(data) - pos)
                out += data[pos:pos + take]
                self.total += take
                pos += take
                continue
            if self.file_left:
                take = min(self.file_left, len(data) - pos)
                if self.armed and self.spec.startswith("file:") and self.file_size >= BIG_FILE:
                    frac = float(self.spec.split(":")[1])
                    cut_at = int(self.file_size * frac)
                    done = self.file_size - self.file_left
                    if done + take >= cut_at:
                        out += data[pos:pos + (cut_at - done)]
                        self.where = f"{cut_at} of {self.file_size} bytes into a file"
                        raise Cut(bytes(out))
                out += data[pos:pos + take]
                self.file_left -= take
                pos += take
                self.total += take
                continue
            # frame parsing: accumulate until a whole frame is known
            self.buf += data[pos:pos + 1]
            pos += 1
            self.total += 1
            if len(self.buf) < HEADER.size:
                continue
            kind, length = HEADER.unpack(self.buf[:HEADER.size])
            if len(self.buf) < HEADER.size + length:
                continue
            frame, self.buf = self.buf, b""
            msg = {}
            try:
                body = frame[HEADER.size:]
                msg = json.loads(body[32:] if kind == SEALED else body)
            except ValueError:
                pass
            mtype = msg.get("type", "?")
            if self._check(f"{self.direction}:{mtype}:before"):
                self.where = f"before {self.direction} {mtype}"
                raise Cut(bytes(out))
            out += frame
            if mtype in ("file", "chunk") and isinstance(msg.get("size"), int):  # chunk: migration/bulk.py
                self.file_left = self.file_size = msg["size"]
            if self._check(f"{self.direction}:{mtype}:after"):
                self.where = f"after {self.direction} {mtype}"
                raise Cut(bytes(out))
        return bytes(out)


def pump(src: socket.socket, dst: socket.socket, stream: Stream, state: dict, done: threading.Event) -> None:
    try:
        while not done.is_set():
            data = src.recv(65536)
            if not data:
                break
            try:
                fwd = stream.feed(data)
            except Cut as cut:
                if cut.args[0]:
                    dst.sendall(cut.args[0])
                state["cut"] = stream.where
                break
            dst.sendall(fwd)
    except OSError:
        pass
    finally:
        if state.get("cut") or not done.is_set():
            done.set()
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        state[stream.direction] = stream.total


def serve(listen: str, target: str, spec: str) -> None:
    lh, lp = listen.rsplit(":", 1)
    th, tp = target.rsplit(":", 1)
    server = socket.create_server((lh, int(lp)), reuse_port=False)
    print("listening", flush=True)
    n = 0
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection((th, int(tp)))
        armed = n == 0
        state: dict = {"conn": n}
        done = threading.Event()
        threads = [threading.Thread(target=pump, args=(client, upstream, Stream("up", spec, armed), state, done)),
                   threading.Thread(target=pump, args=(upstream, client, Stream("down", spec, armed), state,
                                                       done))]
        for t in threads:
            t.daemon = True
            t.start()

        def report(threads=threads, state=state) -> None:
            for t in threads:
                t.join()
            print(json.dumps(state), flush=True)

        threading.Thread(target=report, daemon=True).start()
        n += 1


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3])
