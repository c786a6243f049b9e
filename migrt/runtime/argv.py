"""runc's command line as a value, and the one typed call that migrt's handlers take.

`RuncArgv`: (global flags, subcommand, rest), rendered back byte-identical. runc (urfave/cli)
accepts `-x`, `--x`, `--x=v` and `--x v`; containerd sends the single-dash `-no-subreaper` to
`restore`.

`Call`: what the shim hands a handler (ops/, migration/) once it decides to intercept: the parsed
command line and the lower runtime that serves it, with what every handler reads from them worked
out once (the runtime root, the global flags, the container, the images, the flags of a `create`
that becomes `runc restore`). Handlers take a Call and raise MigrtErrors; they never write runc's
log nor pick exit codes: the shim does both, from the error's class. That is runc's own line: its
command layer turns argv into CriuOpts, and libcontainer never sees argv.

Standard library only: the shim imports this module before it decides (the hot path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from migrt.errors import UsageError
from migrt.runtime.lower import default_root

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


# Flags of `create` that `restore` takes as they are (the rest are dropped when harmless, else refused).
CREATE_FLAGS_RESTORE_TAKES = frozenset({"bundle", "b", "pid-file", "console-socket", "no-pivot"})


def check_create_flags(cmd: CommandArgs) -> list[str]:
    """Flags of `create` that `restore` does not take: drop the harmless (returned, for the log),
    refuse the rest with a UsageError."""
    dropped = []
    for f in cmd.flags:
        if f.name in CREATE_FLAGS_RESTORE_TAKES:
            continue
        if f.name == "no-new-keyring":
            dropped.append("--no-new-keyring")  # restore keeps the checkpointed keyring
        elif f.name == "preserve-fds" and (f.value or "0") == "0":
            dropped.append("--preserve-fds=0")
        elif f.name in ("preserve-fds", "pidfd-socket"):
            raise UsageError(f"create flag --{f.name} is not supported when restoring a checkpoint")
        else:
            raise UsageError(f"create flag {' '.join(f.tokens)} is unknown to migrt; refusing to restore with it")
    return dropped


@dataclass(frozen=True)
class CreateFlags:
    """What a `create` that migrt turns into `runc restore` carries over from containerd's command
    line: the restore runs under the same global flags, pid file, console socket and log
    (ops/restore.py RestoreTarget.for_create). `dropped`: the create flags restore does not take."""

    container_id: str
    root: str
    global_tokens: tuple[str, ...]
    pid_file: str | None
    console_socket: str | None
    no_pivot: bool
    log_path: str | None
    log_format: str
    dropped: tuple[str, ...] = ()


@dataclass
class Call:
    """One runc call that migrt handles: its command line and the lower runtime that serves it."""

    argv: RuncArgv
    lower: str  # the lower runtime's executable
    lower_warning: str | None = None  # why the configured runtime was not used, for migrt's log
    root: str = field(init=False)  # the lower runtime's state root: --root, else its default
    cmd: CommandArgs = field(init=False)  # the subcommand's flags and positionals

    def __post_init__(self) -> None:
        self.root = self.argv.root or default_root(self.lower)
        self.cmd = self.argv.command_args()

    @property
    def command(self) -> str | None:
        return self.argv.command

    @property
    def container_id(self) -> str:
        """The first positional ("" when there is none: runc itself refuses such a call)."""
        return self.cmd.container_id or ""

    @property
    def log_path(self) -> str | None:
        return self.argv.log_path

    @property
    def log_format(self) -> str:
        return self.argv.log_format

    @property
    def global_tokens(self) -> list[str]:
        """The global flags as given (--root, --log, --systemd-cgroup ...), for the lower runtime's
        other calls on the same container."""
        return [t for f in self.argv.global_flags for t in f.tokens]

    @property
    def bundle_dir(self) -> str:
        """`--bundle`, else the working directory (runc's default)."""
        return self.cmd.value("bundle", "b") or os.getcwd()

    @property
    def image_path(self) -> str:
        """`--image-path` of checkpoint/restore, else ./checkpoint (runc's default)."""
        return self.cmd.value("image-path") or os.path.join(os.getcwd(), "checkpoint")

    def render(self) -> list[str]:
        """The command line for the lower runtime: byte-identical unless flags were added."""
        return self.argv.render()

    def add_flags(self, tokens: list[str]) -> None:
        """Flags put before the subcommand's own (restore: the bundle's --lsm-profile)."""
        self.argv.rest = [*tokens, *self.argv.rest]
        self.cmd = self.argv.command_args()

    def create_flags(self) -> CreateFlags:
        """A `create` that becomes `runc restore`: its container and the flags the restore keeps.
        UsageError without a container id or with a flag restore cannot honour."""
        if not self.container_id:
            raise UsageError("create without a container id")
        dropped = check_create_flags(self.cmd)
        return CreateFlags(
            container_id=self.container_id, root=self.root, global_tokens=tuple(self.global_tokens),
            pid_file=self.cmd.value("pid-file"), console_socket=self.cmd.value("console-socket"),
            no_pivot=self.cmd.has("no-pivot"), log_path=self.log_path, log_format=self.log_format,
            dropped=tuple(dropped))
