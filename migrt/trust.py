"""Files the node trusts (standard library only: the migrt-runc shim uses it before its decision).

migrt runs as root and takes orders from files: the config (which names the lower runtime migrt
execs), the runtime and CRIU binaries, the CRIU hook, the migration key, TLS key and CAs, the registry
credentials and CA. The rule, one for all of them (and for the store, store/store.py):

  a file is trusted when nobody but root (or the user migrt runs as) could have written it: the file
  itself and every directory above it, on the path as given and once links are resolved, are owned
  by root or by us and not writable by group or others. A directory writable by others is accepted
  with the sticky bit (/tmp): others can neither rename nor remove our entries in it. A symbolic link
  on the way is followed when it is ours too (its target is then checked the same way).
  Secrets (keys, credentials) must in addition be readable by nobody else.

An untrusted file is refused, never skipped for a default: the message names the file, the component
that breaks the rule and the command that fixes it. migrt-runc.sh applies the same rule with sh
builtins and one `stat`, and hands every doubtful case to the Python shim, which decides with this.
"""

from __future__ import annotations

import os
import stat

from migrt.errors import ConfigError


class Untrusted(ConfigError):
    """A file migrt would act on that another user could have written (or read, for a secret)."""


def owners() -> tuple[int, ...]:
    """Who may own a trusted file: root, and the user migrt runs as."""
    me = os.geteuid()
    return (0,) if me == 0 else (0, me)


def _owner_name() -> str:
    me = os.geteuid()
    return "root" if me == 0 else f"root or uid {me}"


def _components(path: str) -> list[str]:
    """'/a/b/c' -> ['/', '/a', '/a/b', '/a/b/c']."""
    out = ["/"]
    for part in path.strip("/").split("/"):
        if part:
            out.append(os.path.join(out[-1], part))
    return out


def _judge(comp: str, st: os.stat_result, *, final: bool, secret: bool) -> tuple[str, str, bool] | None:
    """(what is wrong with this component, the command that fixes it, whether others could read rather
    than write it) or None."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in owners():
        return f"{comp} is owned by uid {st.st_uid}, not {_owner_name()}", f"chown root {comp}", False
    if stat.S_ISLNK(st.st_mode):
        return None  # a link's own mode means nothing; its owner is what counts
    if stat.S_ISDIR(st.st_mode) and not final:
        if mode & 0o022 and not mode & stat.S_ISVTX:
            return f"{comp} is writable by group or others (mode {mode:o})", f"chmod go-w {comp}", False
        return None
    if mode & 0o022:
        return f"{comp} is writable by group or others (mode {mode:o})", f"chmod go-w {comp}", False
    if secret and mode & 0o077:
        return f"{comp} is readable by group or others (mode {mode:o})", f"chmod 600 {comp}", True
    return None


def problem(path: str, *, secret: bool = False, st: os.stat_result | None = None) -> str | None:
    """Why `path` is not trusted (module docstring), as the tail of a message, or None. `st`: the
    fstat of the file as it was opened (checked instead of a fresh stat of the path). A path that does
    not exist is not judged here (None): whoever opens it says so."""
    lexical = os.path.abspath(path)
    try:
        real = os.path.realpath(path, strict=True)
    except OSError:
        return None
    seen: set[str] = set()
    for chain in (real, lexical):  # the resolved one first: its last component is the file opened
        comps = _components(chain)
        for i, comp in enumerate(comps):
            if comp in seen:
                continue
            seen.add(comp)
            final = i == len(comps) - 1
            try:
                cst = os.lstat(comp)
            except OSError:
                continue  # a component a link's target replaces; the resolved chain is checked too
            if final and comp == real and st is not None:
                cst = st
            bad = _judge(comp, cst, final=final, secret=secret)
            if bad:
                why, fix, readable = bad
                if readable:
                    return f"{why}: another user could read the secret; run '{fix}' (and replace the secret)"
                return (f"{why}: another user could change it, so migrt refuses to use it; run '{fix}' if you "
                        "trust its content")
    return None


def check(path: str, what: str, *, secret: bool = False, st: os.stat_result | None = None) -> None:
    """Raise Untrusted naming `what` and `path` when `path` is not trusted."""
    why = problem(path, secret=secret, st=st)
    if why:
        raise Untrusted(f"{what} {path}: {why}")


def read(path: str, what: str, *, secret: bool = False, limit: int = 1 << 20) -> bytes:
    """The content of a trusted regular file (at most `limit` bytes), checked as it was opened.
    OSError (FileNotFoundError...) for the caller to word; Untrusted; ConfigError when it is not a
    regular file or too large."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path}: cannot read: not a regular file")
        check(path, what, secret=secret, st=st)
        if st.st_size > limit:
            raise ConfigError(f"{what} {path} is larger than {limit} bytes")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise ConfigError(f"{what} {path} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)
