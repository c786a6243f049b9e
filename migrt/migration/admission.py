"""What a listening node (`migrt receive`, `migrt serve`) grants a connection before it has proved it
holds the migration key: little, and not for long.

  - at most `slots` such connections at once; one more ends the oldest (an idle or trickling peer
    cannot keep a real sender out, and the receiver's threads and memory stay bounded: each costs a
    thread and a few KiB, frames before authentication being capped at protocol.MAX_HANDSHAKE);
  - each ends `deadline` seconds after it was accepted (the receiver's `migration_stall_timeout`: a
    whole handshake, TLS included, in the time a migration may go without progress), however slowly
    its bytes come: one reaper thread shuts the socket down, which ends whatever read or TLS
    handshake its thread is in.

Authenticated connections leave the gate (done()): they are migrations, bounded by their own
progress deadlines (Channel's stall, the watchdogs).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

SLOTS = 32
DEADLINE_S = 10.0


class Admission:
    def __init__(self, slots: int = SLOTS, deadline: float = DEADLINE_S) -> None:
        self.slots = slots
        self.deadline = deadline
        self._lock = threading.Lock()
        self._open: dict[int, tuple[float, socket.socket]] = {}  # id -> (deadline, a dup of the socket)
        self._next = 0
        self._reaper: threading.Thread | None = None
        self.ended = 0  # connections ended here (evicted or past their deadline), for reports and tests

    def admit(self, conn: socket.socket) -> int:
        """Start the clock for a freshly accepted connection; returns its ticket for done()."""
        try:
            dup = conn.dup()  # survives the TLS wrap (which detaches conn); shutdown acts on the connection
        except OSError:
            return -1
        with self._lock:
            ticket = self._next
            self._next += 1
            self._open[ticket] = (time.monotonic() + self.deadline, dup)
            while len(self._open) > self.slots:
                self._end(next(iter(self._open)))  # the oldest
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, daemon=True, name="migrt-admission")
                self._reaper.start()
        return ticket

    def done(self, ticket: int) -> None:
        """The connection authenticated (or ended by itself): no longer held to the gate."""
        with self._lock:
            entry = self._open.pop(ticket, None)
        if entry:
            entry[1].close()

    def waiting(self) -> int:
        with self._lock:
            return len(self._open)

    def _end(self, ticket: int) -> None:  # with the lock held
        _, dup = self._open.pop(ticket)
        with contextlib.suppress(OSError):
            dup.shutdown(socket.SHUT_RDWR)
        dup.close()
        self.ended += 1

    def _reap(self) -> None:
        while True:
            time.sleep(min(0.25, self.deadline / 4))
            now = time.monotonic()
            with self._lock:
                for ticket in [t for t, (due, _) in self._open.items() if due <= now]:
                    self._end(ticket)
