"""Is a stack of seccomp filters at least as strict as a profile's program, for every system call
this node's kernel can hand them?

The kernel runs every filter of a thread's stack and acts on the strictest answer (the lowest
SECCOMP_RET_* action as a signed number; an action it does not know kills the process). The
stack is "at least as strict" when, for every input, its action is at least as strict as the
profile's: KILL_PROCESS > KILL_THREAD > TRAP > ERRNO > USER_NOTIF > TRACE > LOG > ALLOW (the errno
or data an action carries is not compared). Inputs: every architecture the node's kernel runs
(x86_64 with x32 numbers, and i386; aarch64 and arm; the arch word free elsewhere), every syscall
number, every argument and instruction pointer (argument high words are 0 for 32-bit calls). Both
sides are read as regions (bpf.paths) and the regions of the stack are met with those of the
profile; a region where the stack is weaker and that holds an input is the finding.
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from migrt.seccomp import profile as P
from migrt.seccomp.bpf import ARCH, DEFER, FULL, NR, BpfError, Dom, Insn, Uncomparable, Words, decode, paths

LEVELS = {P.ACT_KILL_PROCESS: 0, P.ACT_KILL_THREAD: 1, P.ACT_TRAP: 2, P.ACT_ERRNO: 3, P.ACT_NOTIFY: 4,
          P.ACT_TRACE: 5, P.ACT_LOG: 6, P.ACT_ALLOW: 7}
NODE_ARCHES = {"x86_64": (P.AUDIT_ARCH_X86_64, P.AUDIT_ARCH_I386), "aarch64": (P.AUDIT_ARCH_AARCH64, P.AUDIT_ARCH_ARM)}
_COMPAT = (P.AUDIT_ARCH_I386, P.AUDIT_ARCH_ARM)
_ANY = Dom()
# SECCOMP_MODE_STRICT as a filter: read, write, exit and (rt_)sigreturn of each arch; any other call
# kills the thread (kernel/seccomp.c mode1_syscalls, and its compat list)
_STRICT_CALLS = {P.AUDIT_ARCH_X86_64: (0, 1, 60, 15), P.AUDIT_ARCH_I386: (3, 4, 1, 119),
                 P.AUDIT_ARCH_AARCH64: (63, 64, 93, 139), P.AUDIT_ARCH_ARM: (3, 4, 1, 119)}


def _strict_mode() -> list[Insn]:
    prog: list[Insn] = [(0x20, 0, 0, 4)]  # ld arch; per arch: jeq arch (else skip its 7), ld nr, 4 x jeq, kill, allow
    for arch, calls in _STRICT_CALLS.items():
        prog += [(0x15, 0, 7, arch), (0x20, 0, 0, 0), *[(0x15, 4 - i, 0, n) for i, n in enumerate(calls)],
                 (0x06, 0, 0, P.ACT_KILL_THREAD), (0x06, 0, 0, P.ACT_ALLOW)]
    return prog + [(0x06, 0, 0, P.ACT_KILL_THREAD)]


STRICT_MODE = _strict_mode()
Path = tuple[int, Words]


def level(ret: int) -> int:
    """How strict an action is (0 strictest); unknown actions kill the process."""
    return LEVELS.get(ret & 0xFFFF0000, 0)


def stacked(a: int, b: int) -> int:
    """The action the kernel takes when two filters answer a and b."""
    sa, sb = (x & 0xFFFF0000 for x in (a, b))
    return a if (sa - (1 << 32) if sa >> 31 else sa) <= (sb - (1 << 32) if sb >> 31 else sb) else b


def node_arches() -> tuple[int | None, ...]:
    """The audit arches a process here can call the kernel with (None: any arch word)."""
    return NODE_ARCHES.get(os.uname().machine, (None,))


def inputs(arch: int | None) -> Words:
    words: list = [_ANY] * 16
    if arch is not None:
        words[ARCH] = arch
    if arch in _COMPAT:
        for w in range(3, 16, 2):  # a 32-bit call's instruction pointer and arguments fit the low word
            words[w] = 0
    return tuple(words)


@dataclass(frozen=True)
class Weaker:
    """An input where the stack answers less strictly than the profile."""
    arch: int
    nr: int
    image: int        # the stack's action
    profile: int      # the profile's action
    some_args: bool   # only for some arguments or instruction pointers

    @property
    def call(self) -> str:
        name = P.syscall_name(self.arch, self.nr)
        if self.arch in _COMPAT:
            return f"{name} (as a 32-bit call)"
        return f"{name} (as an x32 call)" if self.arch == P.AUDIT_ARCH_X86_64 and self.nr & P.X32_BIT else name


class Comparer:
    """One profile against any number of filter stacks; regions cached by program.

    A filter that ends with the very bytes libseccomp makes of the profile, after a head (runc's
    -ENOSYS stub, whose instructions vary from run to run) that answers as the profile's own stub
    does, is the profile's program: then nothing else is read (the common restore, cheaply)."""

    def __init__(self, profile: P.Compiled | Sequence[Insn], arches: Sequence[int | None] | None = None) -> None:
        self.arches = tuple(node_arches() if arches is None else arches)
        self._compiled = profile if isinstance(profile, P.Compiled) else None
        self._prog = list(profile.program if isinstance(profile, P.Compiled) else profile)
        self._profile: dict[int | None, _Index] = {}
        self._cache: dict[tuple, Weaker | None] = {}
        self._regions: dict[tuple[bytes, int | None], list[Path]] = {}
        self._heads: dict[bytes, bool] = {}
        self._body_ok: bool | None = None

    def _profile_regions(self, arch: int | None) -> _Index:
        if arch not in self._profile:
            self._profile[arch] = _Index(paths(self._prog, inputs(arch)))
        return self._profile[arch]

    def runs_profile(self, raw: bytes) -> bool:
        """Is filter `raw` the profile's program: its libseccomp bytes after a head that answers
        as the profile's stub does (where one of them hands over to libseccomp's program the
        other must too, unless its own answer is the strictest or the other's is ALLOW)?"""
        c = self._compiled
        if c is None or not raw.endswith(c.body) or (len(raw) - len(c.body)) % 8:
            return False
        if self._body_ok is None:
            self._body_ok = _self_contained(c.body)
        if not self._body_ok:
            return False
        head = raw[:len(raw) - len(c.body)]
        if not head or not c.stub:
            return not head and not c.stub
        if head not in self._heads:
            try:
                mine = decode(head)
                self._heads[head] = all(_same_answers(paths(mine, inputs(a), defer_at=len(mine)),
                                                      paths(c.stub, inputs(a), defer_at=len(c.stub)))
                                        for a in self.arches)
            except (BpfError, Uncomparable):
                self._heads[head] = False
        return self._heads[head]

    def weaker(self, stack: Sequence[tuple[bytes, Sequence[Insn]]]) -> Weaker | None:
        """The first input where `stack` ((raw bytes, program) of each filter) is weaker; None
        when there is none. Uncomparable when a program is outside what can be decided."""
        key = tuple(raw for raw, _ in stack)
        if key not in self._cache and any(self.runs_profile(raw) for raw in key):
            self._cache[key] = None  # the stack holds the profile's own program: the kernel takes the strictest
        if key not in self._cache:
            found: list[Weaker] = []
            for w in (w for a in self.arches for w in self._weaker(stack, a)):
                found.append(w)
                if (w.arch == self.arches[0] and w.nr < P.X32_BIT) or len(found) > 64:
                    break  # a native call names the finding best; others only when there is none
            self._cache[key] = found[-1] if found and found[-1].nr < P.X32_BIT else (found[0] if found else None)
        return self._cache[key]

    def _weaker(self, stack, arch) -> Iterator[Weaker]:
        regions: list[Path] = [(P.ACT_ALLOW, inputs(arch))]
        budget = _Budget(MAX_MEETS)
        for raw, prog in stack:
            if (raw, arch) not in self._regions:
                self._regions[(raw, arch)] = paths(prog, inputs(arch))
            idx = _Index(self._regions[(raw, arch)])
            regions = [(stacked(a, b), m) for a, d in regions for b, e in budget.spend(idx.over(d))
                       if (m := _meet(d, e))]
        prof = self._profile_regions(arch)
        for a, d in sorted(regions, key=lambda r: _span(r[1])):
            for b, e in budget.spend(prof.over(d)):
                if level(a) > level(b) and (m := _meet(d, e)) is not None and (nr := _inhabited(m)) is not None:
                    yield Weaker(arch=m[ARCH] if isinstance(m[ARCH], int) else -1, nr=nr, image=a, profile=b,
                                 some_args=any(m[w] is not _ANY for w in range(2, 16) if not isinstance(m[w], int)))


# regions met with regions per architecture: stacked filters multiply their regions (six filters of six
# argument tests each: 0.7 s, each more one 7 times that); runc's program and an application's own filter on
# it stay far below
MAX_MEETS = 400_000


class _Budget:
    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self, items: Iterator[Path]) -> Iterator[Path]:
        for item in items:
            self.left -= 1
            if self.left < 0:
                raise Uncomparable(f"its filters split the system calls into more than {MAX_MEETS} cases to compare")
            yield item


def _self_contained(body: bytes) -> bool:
    """A program whose answers do not depend on A, X or scratch words left by a program before it:
    it loads A first and never reads X or scratch memory (libseccomp's programs are such)."""
    prog = decode(body)
    return prog[0][0] == 0x20 and all(code & 7 not in (1, 2, 3, 7) and not (code & 7 in (4, 5) and code & 0x08)
                                      and not (code & 7 == 6 and code & 0x18) for code, *_ in prog)


def _same_answers(mine: list[Path], theirs: list[Path]) -> bool:
    """Two heads (DEFER: hands over to the same program) that answer alike wherever they meet."""
    idx = _Index(theirs)
    for a, d in mine:
        for b, e in idx.over(d):
            if (a == DEFER) == (b == DEFER) and (a == DEFER or level(a) <= level(b)):
                continue
            if (a != DEFER and level(a) == 0) or (b != DEFER and level(b) == level(P.ACT_ALLOW)):
                continue
            if (m := _meet(d, e)) is not None and _inhabited(m) is not None:
                return False
    return True


def _span(d: Words) -> tuple[int, int]:
    nr = d[NR]
    return (nr, nr) if isinstance(nr, int) else (nr.lo, nr.hi)


def _meet(d1: Words, d2: Words) -> Words | None:
    out = []
    for x, y in zip(d1, d2, strict=True):
        if x is y or y is _ANY:
            out.append(x)
        elif x is _ANY:
            out.append(y)
        elif isinstance(x, int) or isinstance(y, int):
            v, dom = (x, y) if isinstance(x, int) else (y, x)
            if (v != dom) if isinstance(dom, int) else not dom.has(v):
                return None
            out.append(v)
        else:
            m = x.meet(y)
            if m is None:
                return None
            out.append(m)
    return tuple(out)


def _inhabited(d: Words) -> int | None:
    """The syscall number of an input in region `d`, or None when it holds none. A word whose
    search runs out counts as inhabited (the caller then refuses: safe)."""
    nr = None
    for i, w in enumerate(d):
        if isinstance(w, int) or w is _ANY:
            v = w if isinstance(w, int) else 0
        else:
            try:
                v = w.witness()
            except Uncomparable:
                v = w.lo
            if v is None:
                return None
        if i == NR:
            nr = v
    return nr


class _Index:
    """Regions looked up by the syscall numbers they may hold."""

    def __init__(self, regions: list[Path]) -> None:
        self.keyed: dict[int, list[Path]] = {}
        wide: list[Path] = []
        for r in regions:
            lo, hi = _span(r[1])
            (self.keyed.setdefault(lo, []).append(r) if lo == hi else wide.append(r))
        self.keys = sorted(self.keyed)
        self.starts = sorted({0, *(_span(r[1])[0] for r in wide), *(_span(r[1])[1] + 1 for r in wide)} - {FULL + 1})
        self.cover: list[list[Path]] = [[] for _ in self.starts]
        for r in wide:
            lo, hi = _span(r[1])
            for i in range(bisect_right(self.starts, lo) - 1, bisect_right(self.starts, hi)):
                self.cover[i].append(r)

    def over(self, d: Words) -> Iterator[Path]:
        lo, hi = _span(d)
        for k in self.keys[bisect_left(self.keys, lo):bisect_right(self.keys, hi)]:
            yield from self.keyed[k]
        seen: set[int] = set()
        for i in range(bisect_right(self.starts, lo) - 1, bisect_right(self.starts, hi)):
            for r in self.cover[i]:
                if id(r) not in seen:
                    seen.add(id(r))
                    yield r
