"""migrt.seccomp: the BPF reader, the profile compiled as runc compiles it, and the comparison a restore
makes between a checkpoint's filter stack and the new bundle's profile (issue 27 item 3)."""

from __future__ import annotations

import random
import time

import pytest

from migrt.criu.tasks import SECCOMP_DISABLED, SECCOMP_FILTER, SeccompFilter, Tasks, Thread
from migrt.seccomp import bpf, compare
from migrt.seccomp import profile as P
from migrt.seccomp.bpf import Dom, decode, encode, paths, run

X86_64, I386 = P.AUDIT_ARCH_X86_64, P.AUDIT_ARCH_I386
ARCHES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
MKDIR, MKDIRAT, READ, PERSONALITY, REBOOT = 83, 258, 0, 135, 169
LD_NR, LD_ARCH = (0x20, 0, 0, 0), (0x20, 0, 0, 4)
ALLOW, EPERM = (0x06, 0, 0, P.ACT_ALLOW), (0x06, 0, 0, P.ACT_ERRNO | 1)
ALLOW_ALL = [ALLOW]
NO_MKDIR = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ARCHES,
            "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO"}]}
# a default-deny profile in the shape of Docker's and containerd's: many names, argument rules
NAMES = ["read", "write", "open", "openat", "close", "stat", "fstat", "lstat", "poll", "lseek", "mmap", "mprotect",
         "munmap", "brk", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "ioctl", "pread64", "pwrite64", "readv",
         "writev", "access", "pipe", "select", "sched_yield", "mremap", "msync", "mincore", "madvise", "dup", "dup2",
         "nanosleep", "getpid", "sendfile", "exit", "exit_group", "wait4", "kill", "uname", "fcntl", "getcwd",
         "chdir", "rename", "mkdir", "rmdir", "unlink", "readlink", "chmod", "getuid", "getgid", "arch_prctl",
         "set_tid_address", "clock_gettime", "execve", "futex", "getdents64", "newfstatat", "prlimit64"]
DEFAULT_LIKE = {
    "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1, "architectures": ARCHES,
    "syscalls": [
        {"names": NAMES, "action": "SCMP_ACT_ALLOW"},
        *[{"names": ["personality"], "action": "SCMP_ACT_ALLOW",
           "args": [{"index": 0, "value": v, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]}
          for v in (0, 8, 0x20000, 0xFFFFFFFF)],
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 0x7E020000, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 40, "valueTwo": 0, "op": "SCMP_CMP_NE"}]},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
    ]}


def prog_of(profile: dict) -> list[bpf.Insn]:
    compiled = P.compile_profile(profile)
    assert compiled is not None
    return compiled.program


def weaker(stack: list[list[bpf.Insn]], profile: dict) -> compare.Weaker | None:
    return compare.Comparer(prog_of(profile), (X86_64, I386)).weaker([(encode(p), p) for p in stack])


def data(nr: int, arch: int = X86_64, args: tuple[int, ...] = ()) -> list[int]:
    words = [nr, arch, 0x401000, 0] + [0] * 12
    for i, a in enumerate(args):
        words[4 + 2 * i], words[5 + 2 * i] = a & 0xFFFFFFFF, a >> 32
    return words


# -- the interpreter and the symbolic reading ---------------------------------------------------------------
ARCH_CHECK = [LD_ARCH, (0x15, 1, 0, X86_64), (0x06, 0, 0, P.ACT_KILL_PROCESS), LD_NR, (0x15, 0, 1, MKDIR), EPERM,
              ALLOW]


def test_the_interpreter_runs_an_arch_check_and_a_number_test():
    assert run(ARCH_CHECK, data(MKDIR)) == P.ACT_ERRNO | 1
    assert run(ARCH_CHECK, data(READ)) == P.ACT_ALLOW
    assert run(ARCH_CHECK, data(MKDIR, I386)) == P.ACT_KILL_PROCESS
    assert decode(encode(ARCH_CHECK)) == ARCH_CHECK
    with pytest.raises(bpf.BpfError):
        decode(b"\x06\x00\x00")  # not whole instructions
    with pytest.raises(bpf.BpfError):
        run([(0x20, 0, 0, 2), ALLOW], data(0))  # an unaligned load the kernel would not accept


# masks, bit tests, ordering, scratch memory and X: every path kind the reading models
MIXED = [LD_NR, (0x35, 0, 9, 300), (0x20, 0, 0, 16), (0x54, 0, 0, 0xF0), (0x15, 0, 1, 0x30), EPERM,
         (0x02, 0, 0, 3), (0x61, 0, 0, 3), (0x45, 0, 1, 0x4), (0x06, 0, 0, P.ACT_TRAP), ALLOW,
         (0x01, 0, 0, 7), (0x25, 0, 2, 12), (0x20, 0, 0, 20), (0x1D, 1, 0, 0), ALLOW, (0x06, 0, 0, P.ACT_LOG)]


def test_the_symbolic_regions_agree_with_the_interpreter_on_random_inputs():
    rng = random.Random(27)
    regions = paths(MIXED, tuple([Dom()] * 16))
    seen = set()
    for _ in range(3000):
        nr = rng.choice([0, 7, 12, 13, 299, 300, 301, rng.getrandbits(32)])
        a0 = rng.choice([0, 0x30, 0x34, 0x3F, 0x7, 4, rng.getrandbits(32)])
        a0 |= rng.choice([0, 7 << 32, rng.getrandbits(32) << 32])
        a1 = rng.choice([0, 7, rng.getrandbits(32)])
        words = data(nr, args=(a0, a1))
        inside = [act for act, ws in regions if all(w == v if isinstance(w, int) else w.has(v)
                                                    for w, v in zip(ws, words, strict=True))]
        assert inside == [run(MIXED, words)], (nr, a0, a1)
        seen.add(inside[0])
    assert seen == {P.ACT_ERRNO | 1, P.ACT_ALLOW, P.ACT_LOG}  # TRAP: a bit the mask clears, never reached
    assert P.ACT_TRAP not in {act for act, _ in regions}


def test_a_region_is_empty_when_its_exclusions_cover_it():
    assert Dom(care=1, val=0, negs=((2, 0), (2, 2))).witness() is None  # bit 1 can be neither
    assert Dom(lo=5, hi=7, excl=frozenset({5, 6, 7})).witness() is None
    d = Dom(lo=4, hi=20, negs=((0xC, 0x4),), excl=frozenset({8}))
    assert d.witness() == 9 and all(d.has(v) == (4 <= v <= 20 and v & 0xC != 4 and v != 8) for v in range(40))


def test_arithmetic_on_an_input_word_is_not_guessed():
    sneaky = [LD_NR, (0x04, 0, 0, 1), (0x15, 0, 1, MKDIR + 1), ALLOW, EPERM]  # nr + 1 == 84: mkdir
    with pytest.raises(bpf.Uncomparable):
        paths(sneaky, tuple([Dom()] * 16))


# -- the profile as runc compiles it -------------------------------------------------------------------------
def test_the_profile_program_answers_as_the_profile_says():
    prog = prog_of(NO_MKDIR)
    assert run(prog, data(MKDIR)) == P.ACT_ERRNO | 1 and run(prog, data(MKDIRAT)) == P.ACT_ERRNO | 1
    assert run(prog, data(READ)) == P.ACT_ALLOW and run(prog, data(39, I386)) == P.ACT_ERRNO | 1  # i386 mkdir
    only64 = prog_of({**NO_MKDIR, "architectures": ["SCMP_ARCH_X86_64"]})
    assert run(only64, data(READ, I386)) == P.ACT_KILL_THREAD  # libseccomp's bad-arch action
    assert P.compile_profile({}) is None  # no defaultAction, no syscalls: runc loads no filter


def test_the_enosys_stub_answers_numbers_above_the_profiles_largest():
    prog = prog_of(DEFAULT_LIKE)
    largest = max(P.libseccomp().seccomp_syscall_resolve_name_arch(X86_64, n.encode()) for n in NAMES + ["clone3"])
    assert run(prog, data(largest + 1)) == P.ACT_ERRNO | P.ENOSYS  # a call newer than the profile
    assert run(prog, data(REBOOT)) == P.ACT_ERRNO | 1  # an older one the profile leaves out: its default
    assert run(prog, data(PERSONALITY, args=(8,))) == P.ACT_ALLOW
    assert run(prog, data(PERSONALITY, args=(9,))) == P.ACT_ERRNO | 1
    assert run(prog_of(NO_MKDIR), data(500)) == P.ACT_ALLOW  # an allowing default: no stub


def test_an_unknown_action_and_a_missing_libseccomp_are_errors(monkeypatch):
    with pytest.raises(P.ProfileError, match="unknown seccomp action"):
        P.compile_profile({"defaultAction": "SCMP_ACT_MAYBE"})
    monkeypatch.setattr(P, "_lib", None)
    monkeypatch.setattr(P.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError("no such file")))
    with pytest.raises(P.ProfileError, match="cannot load libseccomp"):
        P.compile_profile(NO_MKDIR)


# -- the comparison --------------------------------------------------------------------------------------------
def test_an_allow_all_filter_is_weaker_than_a_profile_that_denies_mkdir():
    w = weaker([ALLOW_ALL], NO_MKDIR)
    assert w is not None and w.call == "mkdir" and compare.level(w.image) > compare.level(w.profile)
    assert weaker([prog_of(NO_MKDIR)], NO_MKDIR) is None  # the profile's own program
    assert weaker([ALLOW_ALL, prog_of(NO_MKDIR)], NO_MKDIR) is None  # stacked: the strictest answer counts
    assert weaker([prog_of(NO_MKDIR)], {**NO_MKDIR, "syscalls": []}) is None  # a laxer profile


def test_a_default_like_profile_with_argument_rules_and_its_stub():
    prog = prog_of(DEFAULT_LIKE)
    assert weaker([prog], DEFAULT_LIKE) is None
    assert weaker([prog], NO_MKDIR) is not None  # it allows mkdir
    laxer = {**DEFAULT_LIKE, "syscalls": DEFAULT_LIKE["syscalls"] + [{"names": ["personality"],
                                                                      "action": "SCMP_ACT_ALLOW"}]}
    w = weaker([prog_of(laxer)], DEFAULT_LIKE)  # personality with any argument where only four are allowed
    assert w is not None and w.call == "personality" and w.some_args
    assert weaker([prog], laxer) is None
    no_stub = prog[next(i for i, ins in enumerate(prog) if ins == (0x06, 0, 0, P.ACT_ERRNO | P.ENOSYS)) + 1:]
    assert weaker([no_stub], DEFAULT_LIKE) is None  # ERRNO(EPERM) where the stub says ENOSYS: as strict


def test_a_stub_in_front_of_an_allow_all_filter_is_still_weaker():
    stub = prog_of(DEFAULT_LIKE)
    stub = stub[:stub.index((0x06, 0, 0, P.ACT_ERRNO | P.ENOSYS)) + 1]
    w = weaker([stub + ALLOW_ALL], DEFAULT_LIKE)
    assert w is not None and w.image == P.ACT_ALLOW


def test_errors_are_ordered_below_kills():
    killing = {"defaultAction": "SCMP_ACT_KILL_PROCESS", "architectures": ARCHES,
               "syscalls": [{"names": NAMES, "action": "SCMP_ACT_ALLOW"}]}
    eperm = {**killing, "defaultAction": "SCMP_ACT_ERRNO"}
    w = weaker([prog_of(eperm)], killing)  # a call the profile kills for gets an error instead
    assert w is not None and compare.level(w.profile) == 0 and compare.level(w.image) == 3
    assert weaker([prog_of(killing)], eperm) is None


# -- the thread's chain in the images ------------------------------------------------------------------------------
def test_a_threads_chain_follows_prev_and_tsync_covers_unrecorded_threads():
    f = [SeccompFilter(b"a", None, 1), SeccompFilter(b"b", 0, 1), SeccompFilter(b"c", 2, 0)]
    leader = Thread(pid=7, tid=7, comm="app", seccomp_mode=SECCOMP_FILTER, seccomp_filter=1)
    other = Thread(pid=7, tid=8, comm="app", seccomp_mode=SECCOMP_DISABLED)
    t = Tasks(threads=[leader, other], files=[], mounts=[], seccomp_filters=3, filters=f)
    assert [x.program for x in t.seccomp_chain(leader)] == [b"b", b"a"]
    assert t.seccomp_chain(other) == t.seccomp_chain(leader)  # CRIU's TSYNC: the leader's chain on every thread
    f[0] = SeccompFilter(b"a", None, 0)
    t.filters = f
    assert t.seccomp_chain(other) is None
    loop = Thread(pid=9, tid=9, comm="x", seccomp_mode=SECCOMP_FILTER, seccomp_filter=2)
    assert t.seccomp_chain(loop) is None  # prev points at itself


# -- the profile's own program, recognised without reading it region by region ----------------------------------
def test_runcs_program_is_recognised_by_its_libseccomp_bytes_after_an_equivalent_stub():
    c = P.compile_profile(DEFAULT_LIKE)
    comparer = compare.Comparer(c, (X86_64, I386))
    assert comparer.runs_profile(encode(c.stub) + c.body)
    assert comparer.runs_profile(encode([(0x05, 0, 0, 0)] + c.stub) + c.body)  # assembled otherwise, same answers
    assert comparer.runs_profile(encode([LD_NR, (0x15, 0, 1, MKDIR), (0x06, 0, 0, P.ACT_KILL_PROCESS)] + c.stub)
                                 + c.body)  # a head that kills for mkdir: stricter, so still as strict
    allows_reboot = [LD_NR, (0x15, 0, 1, REBOOT), ALLOW] + c.stub  # the profile leaves reboot to its default
    assert not comparer.runs_profile(encode(allows_reboot) + c.body)
    w = comparer.weaker([(encode(allows_reboot) + c.body, allows_reboot + decode(c.body))])
    assert w is not None and w.call == "reboot"  # then read region by region, and found
    into_body = [(0x05, 0, 0, 3)]  # jumps past its own end, into the middle of libseccomp's program
    assert not comparer.runs_profile(encode(into_body) + c.body)
    assert not comparer.runs_profile(c.body)  # the stub left out: numbers above the largest get the default
    assert compare.Comparer(P.compile_profile(NO_MKDIR), (X86_64, I386)).runs_profile(P.compile_profile(NO_MKDIR).body)


# -- through the restore's check, on images pycriu writes -----------------------------------------------------------
def test_strict_mode_is_compared_as_the_kernel_applies_it(tmp_path):
    from tests.unit.test_restore_privileges import ALL, Images, bundle, passes, refused

    im = Images(tmp_path / "strict").proc(seccomp="strict").write()  # read, write, exit, sigreturn; else killed
    assert passes(im, bundle(tmp_path, caps=ALL, linux={"seccomp": NO_MKDIR}))
    no_write = {**NO_MKDIR, "syscalls": [{"names": ["write"], "action": "SCMP_ACT_ERRNO"}]}
    err = str(refused(im, bundle(tmp_path, caps=ALL, linux={"seccomp": no_write}, name="nowrite")))
    assert "process 1 (app) may call write, which the container's seccomp profile denies (linux.seccomp)" in err


def test_a_filter_outside_the_symbolic_reading_is_refused_not_guessed(tmp_path):
    from tests.unit.test_restore_privileges import ALL, Images, bundle, refused

    im = Images(tmp_path / "sneaky").proc(seccomp="filter")
    im.seccomp, im.seccomp_program = 1, encode([LD_NR, (0x04, 0, 0, 1), (0x15, 0, 1, MKDIR + 1), ALLOW, EPERM])
    err = str(refused(im.write(), bundle(tmp_path, caps=ALL, linux={"seccomp": NO_MKDIR})))
    assert "process 1 (app) runs a seccomp filter that cannot be compared with the container's profile " \
           "(arithmetic (ALU 0x0) on an input word) (linux.seccomp)" in err


def test_stacked_filters_that_multiply_their_cases_end_within_a_budget():
    """Stacked filters multiply their regions: nine filters of six argument tests each (7**9 cases) ran for
    hours; the comparison stops at compare.MAX_MEETS and the restore is refused as not comparable."""
    def six_tests(word: int) -> list[bpf.Insn]:
        prog = [(0x20, 0, 0, word)]
        for c in range(1, 7):
            prog += [(0x15, 0, 1, c), (0x06, 0, 0, P.ACT_ERRNO | c)]
        return [*prog, ALLOW]

    t0 = time.monotonic()
    with pytest.raises(bpf.Uncomparable, match="more than 400000 cases"):
        weaker([six_tests(16 + 8 * (i % 6)) for i in range(9)], NO_MKDIR)
    assert time.monotonic() - t0 < 5
    assert weaker([six_tests(16), six_tests(24)], NO_MKDIR) is not None  # a few: compared as before


def test_more_different_filters_than_a_restore_compares_are_refused(tmp_path):
    """Each different program costs up to its step budget (~0.4 s an architecture): 1000 threads with a
    filter each kept a restore busy for many minutes. At most rp.MAX_FILTERS different programs."""
    import base64
    import os

    import pycriu

    from migrt.ops import restore_privileges as rp
    from tests.unit.test_restore_privileges import ALL, Images, bundle, passes, refused

    def images(name: str, n: int) -> str:
        im = Images(tmp_path / name).proc(seccomp="filter")
        im.seccomp = n
        d = im.write()
        progs = [encode([LD_NR, (0x15, 0, 1, 1000 + i), EPERM, ALLOW]) for i in range(n)]  # each denies one more
        with open(os.path.join(d, "seccomp.img"), "wb") as fh:
            pycriu.images.dump({"magic": "SECCOMP", "entries": [{"seccomp_filters": [
                {"filter": base64.b64encode(p).decode(), **({"prev": i - 1} if i else {})}
                for i, p in enumerate(progs)]}]}, fh)
        return d

    b = bundle(tmp_path, caps=ALL, linux={"seccomp": {**NO_MKDIR, "syscalls": []}})
    passes(images("few", rp.MAX_FILTERS), b)
    assert "its threads run 17 different seccomp filters, more than the 16 a restore compares" in \
        str(refused(images("many", rp.MAX_FILTERS + 1), b))
