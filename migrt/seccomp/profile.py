"""linux.seccomp compiled into the BPF program runc would load for it, so that the profile's meaning
is libseccomp's own (its architecture checks, x32 and multiplexed calls, the order of overlapping
rules, 32-bit arguments) rather than a second reading of the JSON.

As runc 1.x does (libcontainer/specconv SetupSeccomp, seccomp.InitSeccomp, patchbpf): no
defaultAction and no syscalls means no filter; seccomp_init(defaultAction); every architecture
added; binary-tree optimisation above 32 syscall names; per name one rule (skipped when its action
is the default action or libseccomp does not know the name); conditions on distinct arguments form
one rule, several conditions on one argument one rule each; then, unless the default action lets
calls through, runc's stub that answers ENOSYS to numbers above the largest one the profile names,
per architecture. The stub here is built from the same facts; its instructions may differ from
runc's, not its answers. Needs libseccomp (ctypes); without it the caller refuses.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from migrt.kernel.libc import libc
from migrt.seccomp.bpf import Insn, decode

ACT_KILL_PROCESS, ACT_KILL_THREAD, ACT_TRAP, ACT_ERRNO = 0x80000000, 0, 0x00030000, 0x00050000
ACT_NOTIFY, ACT_TRACE, ACT_LOG, ACT_ALLOW = 0x7FC00000, 0x7FF00000, 0x7FFC0000, 0x7FFF0000
ENOSYS, EPERM = 38, 1
AUDIT_ARCH_X86_64, AUDIT_ARCH_I386 = 0xC000003E, 0x40000003
AUDIT_ARCH_AARCH64, AUDIT_ARCH_ARM = 0xC00000B7, 0x40000028
X32_BIT = 0x40000000
_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5,
        "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
_ALLOWING = ("SCMP_ACT_ALLOW", "SCMP_ACT_LOG", "SCMP_ACT_TRACE")
_FLTATR_CTL_OPTIMIZE = 8
_X32 = 0x4000003E  # SCMP_ARCH_X32
_LD_ABS, _JA, _JEQ, _JGT, _JSET, _RET = 0x20, 0x05, 0x15, 0x25, 0x45, 0x06


class ProfileError(Exception):
    """A profile runc would not load, or no libseccomp to compile it with."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


_lib: ctypes.CDLL | None = None


def libseccomp() -> ctypes.CDLL:
    """libseccomp.so.2, loaded once (ProfileError when it cannot be)."""
    global _lib
    if _lib is None:
        try:  # the soname of libseccomp 2.x everywhere (ctypes.util.find_library would run ldconfig)
            lib = ctypes.CDLL("libseccomp.so.2")
        except OSError as exc:
            raise ProfileError(f"cannot load libseccomp ({exc}); install libseccomp2") from exc
        u32, c_int, vp, cp = ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
        for fn, res, args in (("seccomp_init", vp, [u32]), ("seccomp_release", None, [vp]),
                              ("seccomp_arch_add", c_int, [vp, u32]), ("seccomp_arch_native", u32, []),
                              ("seccomp_arch_resolve_name", u32, [cp]),
                              ("seccomp_attr_set", c_int, [vp, c_int, u32]),
                              ("seccomp_rule_add_array", c_int,
                               [vp, u32, c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)]),
                              ("seccomp_export_bpf", c_int, [vp, c_int]),
                              ("seccomp_syscall_resolve_name", c_int, [cp]),
                              ("seccomp_syscall_resolve_name_arch", c_int, [u32, cp]),
                              ("seccomp_syscall_resolve_num_arch", vp, [u32, c_int])):
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
        _lib = lib
    return _lib


def action(name, errno_ret) -> int:
    """An OCI action name (and errnoRet) as the SECCOMP_RET_* value runc gives libseccomp."""
    data = errno_ret if isinstance(errno_ret, int) and not isinstance(errno_ret, bool) else None
    value = {"SCMP_ACT_KILL": ACT_KILL_THREAD, "SCMP_ACT_KILL_THREAD": ACT_KILL_THREAD,
             "SCMP_ACT_KILL_PROCESS": ACT_KILL_PROCESS, "SCMP_ACT_TRAP": ACT_TRAP, "SCMP_ACT_ALLOW": ACT_ALLOW,
             "SCMP_ACT_LOG": ACT_LOG, "SCMP_ACT_NOTIFY": ACT_NOTIFY,
             "SCMP_ACT_ERRNO": ACT_ERRNO | ((EPERM if data is None else data) & 0xFFFF),
             "SCMP_ACT_TRACE": ACT_TRACE | ((EPERM if data is None else data) & 0xFFFF)}.get(name)
    if value is None:
        raise ProfileError(f"unknown seccomp action {name!r}")
    return value


def arch_token(oci: str) -> int:
    """SCMP_ARCH_X86_64 -> libseccomp's token for x86_64 (ProfileError for a name it does not know)."""
    if not isinstance(oci, str) or not oci.startswith("SCMP_ARCH_"):
        raise ProfileError(f"unknown seccomp architecture {oci!r}")
    token = libseccomp().seccomp_arch_resolve_name(oci.removeprefix("SCMP_ARCH_").lower().encode())
    if not token:
        raise ProfileError(f"unknown seccomp architecture {oci!r}")
    return token


def syscall_name(arch: int, nr: int) -> str:
    """The name libseccomp gives number `nr` on audit arch `arch` (x32 numbers carry X32_BIT)."""
    lib = libseccomp()
    token = _X32 if arch == AUDIT_ARCH_X86_64 and nr & X32_BIT else arch  # SCMP_ARCH_X32
    ptr = lib.seccomp_syscall_resolve_num_arch(token, ctypes.c_int(nr & 0xFFFFFFFF).value)
    if not ptr:
        return f"system call {nr}"
    name = ctypes.string_at(ptr).decode(errors="replace")
    libc.free(ptr)
    return name


@dataclass(frozen=True)
class _Rule:
    name: str
    action: int
    args: tuple[tuple[int, int, int, int], ...]   # (index, op, value, valueTwo)


def _rules(profile: dict) -> list[_Rule]:
    out = []
    for call in profile.get("syscalls") or []:
        if not isinstance(call, dict):
            raise ProfileError("a syscalls entry that is not an object")
        act = action(call.get("action"), call.get("errnoRet"))
        args = []
        for a in call.get("args") or []:
            if not isinstance(a, dict) or a.get("op") not in _OPS or not isinstance(a.get("index"), int) \
                    or not 0 <= a["index"] < 6:
                raise ProfileError(f"a syscall argument condition runc would not load: {a!r}")
            args.append((a["index"], _OPS[a["op"]], int(a.get("value") or 0) & (2**64 - 1),
                         int(a.get("valueTwo") or 0) & (2**64 - 1)))
        for name in call.get("names") or []:
            if isinstance(name, str) and name:
                out.append(_Rule(name, act, tuple(args)))
    return out


@dataclass(frozen=True)
class Compiled:
    """What runc loads for a profile: runc's -ENOSYS stub (here: one with the same answers), then
    libseccomp's program (the same bytes runc loads, with the same libseccomp)."""
    stub: list[Insn]
    body: bytes

    @property
    def program(self) -> list[Insn]:
        return self.stub + decode(self.body)


def compile_profile(profile: dict) -> Compiled | None:
    """The program runc would load for `profile` (linux.seccomp); None when it loads none."""
    if not isinstance(profile, dict):
        raise ProfileError("linux.seccomp is not an object")
    if not profile.get("defaultAction") and not profile.get("syscalls"):
        return None
    default = action(profile.get("defaultAction"), profile.get("defaultErrnoRet"))
    rules = _rules(profile)
    tokens = [arch_token(a) for a in profile.get("architectures") or []]
    lib = libseccomp()
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise ProfileError("libseccomp could not start a filter")
    try:
        for t in tokens:
            rc = lib.seccomp_arch_add(ctx, t)
            if rc < 0 and rc != -17:  # -EEXIST: the native architecture
                raise ProfileError(f"libseccomp refused architecture {t:#x} ({os.strerror(-rc)})")
        if len(rules) > 32:
            lib.seccomp_attr_set(ctx, _FLTATR_CTL_OPTIMIZE, 2)
        for r in rules:
            _add(lib, ctx, r, default)
        body = _export(lib, ctx)
    finally:
        lib.seccomp_release(ctx)
    decode(body)  # a program at all
    if profile.get("defaultAction") in _ALLOWING:
        return Compiled([], body)
    return Compiled(_enosys_stub(rules, tokens, lib.seccomp_arch_native()), body)


def _add(lib, ctx, r: _Rule, default: int) -> None:
    if r.action == default:
        return  # runc skips a rule that repeats the default action
    nr = lib.seccomp_syscall_resolve_name(r.name.encode())
    if nr == -1:
        return  # a name libseccomp does not know: runc ignores the rule
    counts = [i for i, *_ in r.args]
    groups = [[a] for a in r.args] if len(set(counts)) < len(counts) else [list(r.args)]
    for group in groups:
        arr = (_ArgCmp * max(1, len(group)))(*[_ArgCmp(i, op, va, vb) for i, op, va, vb in group])
        rc = lib.seccomp_rule_add_array(ctx, r.action, nr, len(group), arr)
        if rc < 0:
            raise ProfileError(f"libseccomp refused the rule for {r.name} ({os.strerror(-rc)})")


def _export(lib, ctx) -> bytes:
    fd = os.memfd_create("migrt-seccomp")
    try:
        rc = lib.seccomp_export_bpf(ctx, fd)
        if rc < 0:
            raise ProfileError(f"libseccomp could not export the filter ({os.strerror(-rc)})")
        return os.pread(fd, 8 * 70000, 0)
    finally:
        os.close(fd)


def _audit_arch(token: int) -> int:
    return AUDIT_ARCH_X86_64 if token == _X32 else token  # x32 runs under the x86_64 audit arch


def _enosys_stub(rules: list[_Rule], tokens: list[int], native: int) -> list[Insn]:
    """runc's patchbpf stub: per audit arch, numbers above the largest the profile names (x86_64
    and x32 apart, by the x32 bit) return ERRNO(ENOSYS); everything else falls through to the
    filter that follows."""
    lib = libseccomp()
    largest: dict[int, dict[int, int]] = {}
    for t in dict.fromkeys([*tokens, native]):
        top = max([0, *(lib.seccomp_syscall_resolve_name_arch(t, r.name.encode()) for r in rules)])
        if top:
            largest.setdefault(_audit_arch(t), {})[t] = top
    src: list = [(_LD_ABS, 0, 0, 4), *[(_JEQ, f"a{a}", 0, a) for a in largest], (_JA, 0, 0, "filter")]
    for audit, per in largest.items():
        src += [("label", f"a{audit}"), (_LD_ABS, 0, 0, 0)]
        if audit == AUDIT_ARCH_X86_64:
            amd64, x32 = per.get(AUDIT_ARCH_X86_64), per.get(_X32)
            src += [(_JSET, "x32", 0, X32_BIT),
                    (_JGT, "enosys", "filter", amd64) if amd64 else (_JA, 0, 0, "filter"), ("label", "x32"),
                    (_JGT, "enosys", "filter", x32) if x32 else (_JA, 0, 0, "filter")]
        else:
            src.append((_JGT, "enosys", "filter", next(iter(per.values()))))
    src += [("label", "enosys"), (_RET, 0, 0, ACT_ERRNO | ENOSYS), ("label", "filter")]
    return _assemble(src)


def _assemble(src: list) -> list[Insn]:
    """Instructions whose jump targets may be labels (("label", name) entries mark them)."""
    at: dict[str, int] = {}
    for item in src:
        if item[0] == "label":
            at[item[1]] = sum(1 for i in src[:src.index(item)] if i[0] != "label")
    out: list[Insn] = []
    for code, jt, jf, k in (i for i in src if i[0] != "label"):
        pc = len(out)
        rel = {n: (at[v] - pc - 1 if isinstance(v, str) else v) for n, v in (("jt", jt), ("jf", jf))}
        if code == _JA:
            out.append((code, 0, 0, at[k] - pc - 1 if isinstance(k, str) else k))
        else:
            out.append((code, rel["jt"], rel["jf"], k))
    if any(not 0 <= jt <= 255 or not 0 <= jf <= 255 for _, jt, jf, _ in out):
        raise ProfileError("the -ENOSYS stub does not fit classic BPF jumps")
    return out
