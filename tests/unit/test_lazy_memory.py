"""A checkpoint waits for memory still arriving (migrt/runtime/lazy_memory.py): the kernel's `um`
flag read on this very process (a range registered with a userfaultfd of our own), and the wait's
progress and stall rules with a fake clock."""

from __future__ import annotations

import ctypes
import os

import pytest

from migrt.errors import Conflict
from migrt.pagefill import uffd
from migrt.runtime import lazy_memory

PAGE = 4096
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def test_registered_follows_a_userfaultfd_range_of_this_process():
    if uffd.usable():
        pytest.fail(f"userfaultfd is needed here: {uffd.usable()}")
    me = os.getpid()
    assert lazy_memory.registered(me) is None
    size = 1 << 20
    addr = _libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    fd, _ = uffd.open_uffd()  # no fork event: a fork of ours would not wait for us
    try:
        uffd.register(fd, addr, size)
        assert lazy_memory.registered(me) == 0  # registered, nothing in yet
        assert lazy_memory.pending([me, 999_999_999]) == {me: 0}
        src = ctypes.create_string_buffer(os.urandom(16 * PAGE), 16 * PAGE)
        uffd.copy(fd, addr, ctypes.addressof(src), 16 * PAGE)  # what the filler does: pages arrive
        assert lazy_memory.registered(me) == 16 * PAGE
    finally:
        os.close(fd)  # the last holder: the kernel unregisters the range
    try:
        assert lazy_memory.registered(me) is None
        assert lazy_memory.wait_filled(lambda: [me], "test") == 0.0
    finally:
        _libc.munmap(addr, size)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _scripted(monkeypatch, values: list):
    """registered() answers from values, one per call (None: nothing registered any more)."""
    it = iter(values)
    monkeypatch.setattr(lazy_memory, "registered", lambda pid: next(it))


def test_wait_returns_once_the_memory_is_in(monkeypatch):
    clock = Clock()
    _scripted(monkeypatch, [0, 4096, 8192, None])
    waited = lazy_memory.wait_filled(lambda: [7], "container c", clock=clock, sleep=clock.sleep, interval=0.5)
    assert waited == 1.5


def test_wait_gives_up_only_without_progress(monkeypatch):
    clock = Clock()
    # grows for 40 s (longer than the stall limit), then stays at 80 KiB
    _scripted(monkeypatch, [i * 4096 for i in range(21)] + [20 * 4096] * 100)
    with pytest.raises(Conflict) as err:
        lazy_memory.wait_filled(lambda: [7], "container c", stall_s=30, clock=clock, sleep=clock.sleep, interval=2)
    assert clock.now - 100.0 == 40 + 30
    msg = str(err.value)
    assert msg.startswith("container c: the memory of process(es) 7 is still being restored"), msg
    assert "no progress for 30 s" in msg and "page filler" in msg
    assert err.value.exit_code == Conflict.exit_code
