"""runc's command line as a value: (global flags, subcommand, rest), rendered back byte-identical.

runc (urfave/cli) accepts `-x`, `--x`, `--x=v` and `--x v`; containerd sends the single-dash
`-no-subreaper` to `restore`. Standard library only: this module is on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# runc's global flags. Value flags take the next token unless written `--x=v`.
GLOBAL_VALUE_FLAGS = frozenset({"root", "log", "log-format", "criu", "rootless"})
GLOBAL_BOOL_FLAGS = frozenset({"debug", "systemd-cgroup", "help", "h", "version", "v"})

# Value flags of the subcommands migrt reads or rewrites (runc 1.1-1.3).
COMMAND_VALUE_FLAGS: dict[str, frozenset[str]] = {
    "create": frozenset({"bundle", "b", "console-socket", "pidfd-socket", "pid-file", "preserve-fds"}),
    "run": frozenset({"bundle", "b", "console-socket", "pidfd-socket", "pid-file", "preserve-fds"}),
    "restore": frozenset({
        "console-socket", "pidfd-socket", "image-path", "work-path", "manage-cgroups-mode",
        "pid-file", "bundle", "b", "empty-ns", "lsm-profile", "lsm-mount-context", "parent-path",
    }),
    "checkpoint": frozenset({
        "image-path", "work-path", "parent-path", "page-server", "manage-cgroups-mode",
        "empty-ns", "status-fd", "lsm-profile", "lsm-mount-context",
    }),
    "exec": frozenset({
        "console-socket", "pidfd-socket", "cwd", "env", "e", "user", "u", "additional-gids", "g",
        "process", "p", "pid-file", "process-label", "apparmor", "cap", "c", "preserve-fds", "cgroup",
    }),
    "ps": frozenset({"format", "f"}),
    "update": frozenset({
        "resources", "r", "blkio-weight", "cpu-period", "cpu-quota", "cpu-burst", "cpu-share",
        "cpu-rt-period", "cpu-rt-runtime", "cpuset-cpus", "cpuset-mems", "memory", "cpu-idle",
        "memory-reservation", "memory-swap", "pids-limit", "l3-cache-schema", "mem-bw-schema",
    }),
    "start": frozenset(),
    "delete": frozenset(),
    "kill": frozenset(),
    "state": frozenset(),
}
# Commands whose flags end at the first positional (runc sets SkipArgReorder: `exec ID sh -c ...`).
NO_REORDER = frozenset({"exec"})
COMMAND_BOOL_FLAGS: dict[str, frozenset[str]] = {
    "create": frozenset({"no-pivot", "no-new-keyring"}),
    "run": frozenset({"no-pivot", "no-new-keyring", "detach", "d", "no-subreaper", "keep"}),
    "restore": frozenset({
        "tcp-established", "ext-unix-sk", "shell-job", "file-locks", "detach", "d", "no-subreaper",
        "no-pivot", "auto-dedup", "lazy-pages",
    }),
    "checkpoint": frozenset({
        "leave-running", "tcp-established", "ext-unix-sk", "shell-job", "lazy-pages", "file-locks",
        "pre-dump", "auto-dedup", "tcp-skip-in-flight", "link-remap",
    }),
    "exec": frozenset({"tty", "t", "detach", "d", "no-new-privs", "ignore-paused"}),
    "ps": frozenset(),
    "update": frozenset(),
    "start": frozenset(),
    "delete": frozenset({"force", "f"}),
    "kill": frozenset({"all", "a"}),
    "state": frozenset(),
}


@dataclass(frozen=True)
class Flag:
    """One flag as given: canonical name, value (None for a bare boolean) and its raw tokens."""

    name: str
    value: str | None
    tokens: tuple[str, ...]

    @classmethod
    def make(cls, name: str, value: str | None = None) -> Flag:
        tokens = (f"--{name}",) if value is None else (f"--{name}", value)
        return cls(name, value, tokens)


def _split_flag(token: str) -> tuple[str, str | None] | None:
    """'--x=v' -> ('x', 'v'); '-x' -> ('x', None); a non-flag (or '-', '--') -> None."""
    if not token.startswith("-") or token in ("-", "--"):
        return None
    body = token[2:] if token.startswith("--") else token[1:]
    name, eq, value = body.partition("=")
    return name, (value if eq else None)


def parse_flags(
    tokens: list[str], value_flags: frozenset[str], *, stop_at_positional: bool
) -> tuple[list[Flag], list[str], list[str]]:
    """Parse flags from tokens. Returns (flags, positionals, unparsed tail).

    With stop_at_positional the first positional ends parsing (global flags, `exec`); otherwise flags
    and positionals may interleave, as urfave/cli v1 reorders them for runc's subcommands (`delete
    ID --force` works); `--` ends flags.
    """
    flags: list[Flag] = []
    positionals: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            return flags, positionals, tokens[i:]
        split = _split_flag(tok)
        if split is None:
            if stop_at_positional:
                return flags, positionals, tokens[i:]
            positionals.append(tok)
            i += 1
            continue
        name, value = split
        if value is None and name in value_flags and i + 1 < len(tokens):
            flags.append(Flag(name, tokens[i + 1], (tok, tokens[i + 1])))
            i += 2
            continue
        flags.append(Flag(name, value, (tok,)))
        i += 1
    return flags, positionals, []


@dataclass
class RuncArgv:
    """argv[1:] of a runc call as (global flags, subcommand, rest)."""

    global_flags: list[Flag]
    command: str | None
    rest: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, argv: list[str]) -> RuncArgv:
        flags, _, tail = parse_flags(list(argv), GLOBAL_VALUE_FLAGS, stop_at_positional=True)
        if not tail:
            return cls(flags, None, [])
        return cls(flags, tail[0], list(tail[1:]))

    def render(self) -> list[str]:
        out: list[str] = []
        for f in self.global_flags:
            out.extend(f.tokens)
        if self.command is not None:
            out.append(self.command)
        out.extend(self.rest)
        return out

    def global_value(self, *names: str) -> str | None:
        value = None
        for f in self.global_flags:
            if f.name in names:
                value = f.value
        return value

    @property
    def root(self) -> str | None:
        return self.global_value("root")

    @property
    def log_path(self) -> str | None:
        return self.global_value("log")

    @property
    def log_format(self) -> str:
        return self.global_value("log-format") or "text"

    def command_args(self) -> CommandArgs:
        values = COMMAND_VALUE_FLAGS.get(self.command or "", frozenset())
        flags, positionals, tail = parse_flags(self.rest, values,
                                               stop_at_positional=self.command in NO_REORDER)
        positionals = positionals + [t for t in tail if t != "--"]
        return CommandArgs(self.command or "", flags, positionals)


@dataclass
class CommandArgs:
    """Flags and positionals of one subcommand."""

    command: str
    flags: list[Flag]
    positionals: list[str]

    def value(self, *names: str) -> str | None:
        value = None
        for f in self.flags:
            if f.name in names:
                value = f.value
        return value

    def has(self, *names: str) -> bool:
        return any(f.name in names and f.value not in ("false", "0") for f in self.flags)

    @property
    def container_id(self) -> str | None:
        """The first positional, as runc reads it (`kill ID SIGNAL`, `exec ID CMD...`)."""
        return self.positionals[0] if self.positionals else None

    def unknown_flags(self) -> list[Flag]:
        known = COMMAND_VALUE_FLAGS.get(self.command, frozenset()) | COMMAND_BOOL_FLAGS.get(
            self.command, frozenset()
        )
        return [f for f in self.flags if f.name not in known]
