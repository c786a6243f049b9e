"""Classic BPF as the kernel runs it for seccomp, read two ways.

A seccomp filter is a classic BPF program over struct seccomp_data: 16 little-endian 32-bit words
(0 nr, 1 arch, 2-3 instruction_pointer, 4-15 args[0..5] as low, high word). The kernel accepts only
word loads at aligned offsets below 64, immediates, the 16 scratch words, ALU and jumps, and returns
a 32-bit action (SECCOMP_RET_*: the top 16 bits choose what happens, the low 16 carry data).

`run` executes a program on one input. `paths` reads it symbolically: every input word the program
tests is a Dom (the values still possible on this path: an interval, bits forced to a pattern,
patterns excluded and single values excluded) and every test splits the path in two, so the program
becomes a list of (action, words) regions that together cover each possible input exactly once. A
test the reading cannot model (arithmetic on an input word other than AND with a constant, a
comparison of input words with each other, a masked ordering test) raises Uncomparable: the caller
refuses rather than guesses. Stdlib only.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

FULL = 0xFFFFFFFF
WORDS = 16                     # struct seccomp_data in 32-bit words
NR, ARCH = 0, 1
MAX_INSNS = 4096               # BPF_MAXINSNS
_LD, _LDX, _ST, _STX, _ALU, _JMP, _RET, _MISC = range(8)
_JA, _JEQ, _JGT, _JGE, _JSET = 0x00, 0x10, 0x20, 0x30, 0x40
_IMM, _ABS, _MEM, _LEN = 0x00, 0x20, 0x60, 0x80
_ADD, _SUB, _MUL, _DIV, _OR, _AND, _LSH, _RSH, _NEG, _MOD, _XOR = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0)
_SRC_X = 0x08
_STEPS = 200_000               # instructions walked over all paths before giving up (runc's programs: < 5000)
DEFER = -1                     # paths(defer_at=): the path goes on into what follows the program

Insn = tuple[int, int, int, int]          # code, jt, jf, k
Value = int | tuple[int, int]             # a constant, or (input word, mask): that word ANDed with mask


class BpfError(ValueError):
    """Bytes that are not a program the kernel would have loaded."""


class Uncomparable(Exception):
    """A program (or a question about it) outside what the symbolic reading models."""


def decode(raw: bytes) -> list[Insn]:
    """struct sock_filter[] as CRIU stores it (native byte order, 8 bytes an instruction)."""
    if not raw or len(raw) % 8 or len(raw) // 8 > MAX_INSNS:
        raise BpfError(f"a seccomp filter of {len(raw)} bytes (want 8 to {8 * MAX_INSNS}, a multiple of 8)")
    return [(c, jt, jf, k) for c, jt, jf, k in struct.iter_unpack("<HBBI", raw)]


def encode(prog: Sequence[Insn]) -> bytes:
    return b"".join(struct.pack("<HBBI", *i) for i in prog)


def _test(op: int, a: int, k: int) -> bool:
    if op == _JEQ:
        return a == k
    if op == _JGT:
        return a > k
    if op == _JGE:
        return a >= k
    if op == _JSET:
        return bool(a & k)
    raise BpfError(f"jump opcode {op:#x}")


def _alu(op: int, a: int, v: int) -> int | None:
    """A op v in 32 bits; None for a division by zero (the kernel's program then returns 0)."""
    if op in (_DIV, _MOD) and v == 0:
        return None
    fn = {_ADD: lambda: a + v, _SUB: lambda: a - v, _MUL: lambda: a * v, _DIV: lambda: a // v,
          _OR: lambda: a | v, _AND: lambda: a & v, _LSH: lambda: a << (v & 31) if v < 32 else 0,
          _RSH: lambda: a >> v if v < 32 else 0, _NEG: lambda: -a, _MOD: lambda: a % v,
          _XOR: lambda: a ^ v}.get(op)
    if fn is None:
        raise BpfError(f"ALU opcode {op:#x}")
    return fn() & FULL


def run(prog: Sequence[Insn], data: Sequence[int]) -> int:
    """The action `prog` returns for one input (16 words)."""
    a = x = pc = 0
    mem = [0] * 16
    while True:
        if pc >= len(prog):
            raise BpfError(f"the program runs past its end at instruction {pc}")
        code, jt, jf, k = prog[pc]
        cls = code & 7
        pc += 1
        if cls == _JMP:
            op = code & 0xF0
            pc += k if op == _JA else (jt if _test(op, a, x if code & _SRC_X else k) else jf)
        elif cls == _RET:
            return (k if code & 0x18 == 0 else a) & FULL
        elif cls in (_LD, _LDX):
            v = _load(code, k, lambda w: data[w], mem)
            if not isinstance(v, int):  # (a concrete input gives a concrete word)
                raise BpfError(f"instruction {pc - 1} loads no value")
            a, x = (v, x) if cls == _LD else (a, v)
        elif cls in (_ST, _STX):
            mem[_slot(k)] = a if cls == _ST else x
        elif cls == _ALU:
            r = _alu(code & 0xF0, a, x if code & _SRC_X else k)
            if r is None:
                return 0
            a = r
        else:  # MISC: TAX / TXA
            a, x = (a, a) if code & 0xF8 == 0 else (x, x)


def _slot(k: int) -> int:
    if k >= 16:
        raise BpfError(f"scratch word {k}")
    return k


def _load(code: int, k: int, word, mem) -> Value:
    mode = code & 0xE0
    if mode == _IMM:
        return k
    if mode == _MEM:
        return mem[_slot(k)]
    if mode == _LEN:
        return WORDS * 4
    if mode == _ABS and code & 0x18 == 0 and k % 4 == 0 and k < WORDS * 4:
        return word(k // 4)
    raise BpfError(f"load opcode {code:#x} offset {k} (seccomp loads aligned words of seccomp_data)")


class Dom:
    """The values one input word may still take: lo <= w <= hi, w & care == val, w & c != v for each
    (c, v) in negs, w not in excl."""
    __slots__ = ("lo", "hi", "care", "val", "negs", "excl")

    def __init__(self, lo: int = 0, hi: int = FULL, care: int = 0, val: int = 0,
                 negs: tuple[tuple[int, int], ...] = (), excl: frozenset[int] = frozenset()) -> None:
        self.lo, self.hi, self.care, self.val, self.negs, self.excl = lo, hi, care, val, negs, excl

    def __repr__(self) -> str:
        return f"Dom({self.lo:#x}..{self.hi:#x}, care={self.care:#x}, val={self.val:#x}, negs={self.negs}, " \
               f"excl={sorted(self.excl)[:8]})"

    def has(self, w: int) -> bool:
        return (self.lo <= w <= self.hi and w & self.care == self.val and w not in self.excl
                and all(w & c != v for c, v in self.negs))

    def _with(self, lo=None, hi=None, care=None, val=None, negs=None, excl=None) -> Dom | None:
        d = Dom(self.lo if lo is None else lo, self.hi if hi is None else hi, self.care if care is None else care,
                self.val if val is None else val, self.negs if negs is None else negs,
                self.excl if excl is None else excl)
        if d.lo > d.hi:
            return None
        if d.lo == d.hi:
            return Dom(d.lo, d.lo) if d.has(d.lo) else None
        return d

    def cut(self, mask: int, op: int, k: int, truth: bool) -> Dom | None:
        """This domain where ((w & mask) op k) == truth; None when no value is left (as far as a
        cheap test shows: `witness` decides)."""
        if self.lo == self.hi:
            return self if _test(op, self.lo & mask, k) == truth else None
        if op == _JSET:
            m = mask & k
            if truth:
                return None if m == 0 else self._with(negs=self.negs + ((m, 0),))
            return self._pattern(m, 0)
        if op == _JEQ:
            if k & ~mask:  # never equal
                return None if truth else self
            if mask == FULL:
                if truth:
                    return Dom(k, k) if self.has(k) else None
                return self._with(excl=self.excl | {k}) if self.has(k) else self
            return self._pattern(mask, k) if truth else self._with(negs=self.negs + ((mask, k),))
        if mask != FULL:
            raise Uncomparable(f"an ordering test on a masked input word ({mask:#x})")
        if op == _JGT:
            k += 1
        elif op != _JGE:
            raise BpfError(f"jump opcode {op:#x}")
        if truth:  # w >= k
            return None if k > FULL else self._with(lo=max(self.lo, k))
        return None if k == 0 else self._with(hi=min(self.hi, k - 1))

    def _pattern(self, mask: int, v: int) -> Dom | None:
        if self.care & mask & (self.val ^ v):
            return None
        return self._with(care=self.care | mask, val=self.val | v)

    def meet(self, other: Dom) -> Dom | None:
        if other.lo == other.hi:
            return other if self.has(other.lo) else None
        if self.lo == self.hi:
            return self if other.has(self.lo) else None
        d = self._pattern(other.care, other.val)
        return None if d is None else d._with(lo=max(d.lo, other.lo), hi=min(d.hi, other.hi),
                                               negs=d.negs + other.negs, excl=d.excl | other.excl)

    def witness(self, budget: int = 20_000) -> int | None:
        """A value of this domain, or None when it is empty. Uncomparable when the search runs out
        of `budget` steps (a caller treats that as "may be non-empty")."""
        steps = [budget]
        w = self._least(self.lo, steps)
        while w is not None and w in self.excl:
            w = self._least(w + 1, steps) if w < self.hi else None
        return w

    def _least(self, start: int, steps: list[int]) -> int | None:
        """The least w >= start, <= hi, with the pattern and none of negs (excl not looked at)."""
        care, val, hi, negs = self.care, self.val, self.hi, self.negs
        low_bit = [(c & -c).bit_length() - 1 for c, _ in negs]
        failed: set = set()

        def go(bit: int, prefix: int, tlo: bool, thi: bool) -> int | None:
            if bit < 0:
                return prefix
            pending = 0
            for (c, _), lb in zip(negs, low_bit, strict=True):
                if lb <= bit:
                    pending |= c
            key = (bit, tlo, thi, prefix & pending)
            if key in failed:
                return None
            steps[0] -= 1
            if steps[0] < 0:
                raise Uncomparable("a region too intricate to decide")
            b = 1 << bit
            for choice in (0, b):
                if (tlo and choice < start & b) or (thi and choice > hi & b) or (care & b and val & b != choice):
                    continue
                p = prefix | choice
                if any(lb == bit and p & c == v for (c, v), lb in zip(negs, low_bit, strict=True)):
                    continue
                r = go(bit - 1, p, tlo and choice == start & b, thi and choice == hi & b)
                if r is not None:
                    return r
            failed.add(key)
            return None

        return go(31, 0, True, True) if start <= hi else None


Words = tuple  # 16 entries: an int (a known word) or a Dom


def _word(doms: Words, w: int) -> Value:
    d = doms[w]
    if isinstance(d, int):
        return d
    return d.lo if d.lo == d.hi else (w, FULL)


def paths(prog: Sequence[Insn], inputs: Words, budget: int = _STEPS,
          defer_at: int | None = None) -> list[tuple[int, Words]]:
    """Every (action, words) region of `inputs` (16 entries: a known int or a Dom) on which `prog`
    returns `action`. Regions found empty by cheap tests are left out. `defer_at`: reaching that
    instruction ends a path with DEFER (a program's head, read apart from what follows it)."""
    out: list[tuple[int, Words]] = []
    stack: list[tuple[int, Value, Value, tuple, Words]] = [(0, 0, 0, (0,) * 16, inputs)]
    steps = 0
    while stack:
        pc, a, x, mem, doms = stack.pop()
        while True:
            steps += 1
            if steps > budget:
                raise Uncomparable(f"more than {budget} steps over its paths")
            if pc == defer_at:
                out.append((DEFER, doms))
                break
            if pc >= len(prog):
                raise BpfError(f"the program runs past its end at instruction {pc}")
            code, jt, jf, k = prog[pc]
            cls = code & 7
            pc += 1
            if cls == _JMP:
                op = code & 0xF0
                if op == _JA:
                    pc += k
                    continue
                rhs = x if code & _SRC_X else k
                if not isinstance(rhs, int):
                    raise Uncomparable("a jump that compares with an input word in X")
                if isinstance(a, int):
                    pc += jt if _test(op, a, rhs) else jf
                    continue
                w, mask = a
                d = doms[w]
                t, f = d.cut(mask, op, rhs, True), d.cut(mask, op, rhs, False)
                if t is None and f is None:
                    break
                if t is not None and f is not None:
                    stack.append((pc + jf, a, x, mem, doms[:w] + (f,) + doms[w + 1:]))
                pc += jt if t is not None else jf
                doms = doms[:w] + (t if t is not None else f,) + doms[w + 1:]
            elif cls == _RET:
                v = k if code & 0x18 == 0 else a
                if not isinstance(v, int):
                    raise Uncomparable("a program that returns an input word")
                out.append((v & FULL, doms))
                break
            elif cls in (_LD, _LDX):
                v = _load(code, k, lambda i, doms=doms: _word(doms, i), mem)
                a, x = (v, x) if cls == _LD else (a, v)
            elif cls in (_ST, _STX):
                i = _slot(k)
                mem = mem[:i] + (a if cls == _ST else x,) + mem[i + 1:]
            elif cls == _ALU:
                op, rhs = code & 0xF0, x if code & _SRC_X else k
                if isinstance(a, int) and isinstance(rhs, int):
                    r = _alu(op, a, rhs)
                    if r is None:
                        out.append((0, doms))
                        break
                    a = r
                elif op == _AND and isinstance(rhs, int) and not isinstance(a, int):
                    a = (a[0], a[1] & rhs) if a[1] & rhs else 0
                else:
                    raise Uncomparable(f"arithmetic (ALU {op:#x}) on an input word")
            else:
                a, x = (a, a) if code & 0xF8 == 0 else (x, x)
    return out
