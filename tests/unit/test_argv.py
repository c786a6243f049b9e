"""RuncArgv: runc's argv as (global flags, subcommand, rest), rendered back byte-identical; the typed Call
the shim builds from it for its handlers."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from migrt.errors import UsageError
from migrt.runtime.argv import (
    COMMAND_BOOL_FLAGS,
    COMMAND_VALUE_FLAGS,
    GLOBAL_BOOL_FLAGS,
    GLOBAL_VALUE_FLAGS,
    Call,
    CreateFlags,
    Flag,
    RuncArgv,
    check_create_flags,
)

ROOT = "/run/containerd/runc/k8s.io"
B = "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc123"
CID = "abc123"
# containerd's global flags, always in this order (FIELD.md).
G = ["--root", ROOT, "--log", f"{B}/log.json", "--log-format", "json"]

# (argv, command, root, log path, container id)
CASES = [
    pytest.param([*G, "create", "--bundle", B, "--pid-file", f"{B}/init.pid", CID], "create", ROOT, f"{B}/log.json",
                 CID, id="create"),
    pytest.param([*G, "--systemd-cgroup", "create", "--bundle", B, "--pid-file", f"{B}/init.pid",
                  "--console-socket", "/tmp/pty123/pty.sock", "--no-pivot", "--no-new-keyring", CID],
                 "create", ROOT, f"{B}/log.json", CID, id="create-all-flags"),
    pytest.param([*G, "start", CID], "start", ROOT, f"{B}/log.json", CID, id="start"),
    pytest.param([*G, "exec", "--process", "/tmp/runc-process123", "--detach", "--pid-file", f"{B}/x.pid", CID],
                 "exec", ROOT, f"{B}/log.json", CID, id="exec"),
    pytest.param([*G, "exec", "--process", "/tmp/runc-process9", "--console-socket", "/tmp/s.sock", "--detach",
                  "--pid-file", f"{B}/e1.pid", CID], "exec", ROOT, f"{B}/log.json", CID, id="exec-tty"),
    pytest.param([*G, "kill", "--all", CID, "9"], "kill", ROOT, f"{B}/log.json", CID, id="kill-all"),
    pytest.param([*G, "kill", CID, "15"], "kill", ROOT, f"{B}/log.json", CID, id="kill"),
    pytest.param([*G, "delete", CID], "delete", ROOT, f"{B}/log.json", CID, id="delete"),
    pytest.param([*G, "delete", "--force", CID], "delete", ROOT, f"{B}/log.json", CID, id="delete-force"),
    pytest.param([*G, "pause", CID], "pause", ROOT, f"{B}/log.json", CID, id="pause"),
    pytest.param([*G, "resume", CID], "resume", ROOT, f"{B}/log.json", CID, id="resume"),
    pytest.param([*G, "ps", "--format", "json", CID], "ps", ROOT, f"{B}/log.json", CID, id="ps"),
    pytest.param([*G, "update", "--resources=-", CID], "update", ROOT, f"{B}/log.json", CID, id="update"),
    pytest.param([*G, "checkpoint", "--image-path", "/ck/img", "--work-path", "/ck/work", "--parent-path", "../prev",
                  "--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks", "--empty-ns", "network",
                  "--leave-running", CID], "checkpoint", ROOT, f"{B}/log.json", CID, id="checkpoint-all"),
    pytest.param([*G, "restore", "--image-path", "/ck/img", "--work-path", "/ck/work", "--detach",
                  "--pid-file", f"{B}/init.pid", "--console-socket", "/tmp/s.sock", "--no-pivot", "-no-subreaper",
                  "--bundle", B, CID], "restore", ROOT, f"{B}/log.json", CID, id="restore-containerd"),
    pytest.param(["features"], "features", None, None, None, id="features"),
    pytest.param(["--version"], None, None, None, None, id="version"),
    pytest.param(["-v"], None, None, None, None, id="v"),
    pytest.param(["--root=/r", "state", CID], "state", "/r", None, CID, id="root-equals"),
    pytest.param(["-root", "/r", "state", CID], "state", "/r", None, CID, id="root-single-dash"),
    pytest.param(["-root=/r", "--log=/l.json", "list"], "list", "/r", "/l.json", None, id="single-dash-equals"),
    pytest.param(["--debug", "--root", "/r", "--systemd-cgroup", "start", CID], "start", "/r", None, CID, id="bools"),
    pytest.param(["--criu", "/usr/sbin/criu", *G, "checkpoint", "--image-path", "/i", CID], "checkpoint", ROOT,
                 f"{B}/log.json", CID, id="criu-global"),
    pytest.param(["--rootless", "false", "--root", "/r", "run", "-d", "--bundle", B, CID], "run", "/r", None, CID,
                 id="rootless-value"),
    pytest.param(["--root", "/a", "--root", "/b", "start", CID], "start", "/b", None, CID, id="last-root-wins"),
    pytest.param(["--unknown-global", "--root", "/r", "start", CID], "start", "/r", None, CID, id="unknown-global"),
    pytest.param(["--root", "/with space", "start", "id with space"], "start", "/with space", None, "id with space",
                 id="spaces"),
    pytest.param([], None, None, None, None, id="empty"),
]


@pytest.mark.parametrize(("argv", "command", "root", "log", "cid"), CASES)
def test_round_trip_and_fields(argv, command, root, log, cid):
    parsed = RuncArgv.parse(list(argv))
    assert parsed.render() == argv
    assert parsed.command == command
    assert parsed.root == root
    assert parsed.log_path == log
    assert parsed.command_args().container_id == cid


def test_parse_does_not_mutate_its_input():
    argv = [*G, "create", "--bundle", B, CID]
    copy = list(argv)
    RuncArgv.parse(argv).render()
    assert argv == copy


def test_render_keeps_the_original_spelling_of_every_token():
    argv = ["-root", "/r", "--log=/l", "-log-format=json", "-debug", "restore", "-no-subreaper", "-b", "/b",
            "--image-path=/i", "-d", CID]
    parsed = RuncArgv.parse(argv)
    assert parsed.render() == argv
    assert [f.tokens for f in parsed.global_flags] == [("-root", "/r"), ("--log=/l",), ("-log-format=json",),
                                                        ("-debug",)]
    assert parsed.log_format == "json"
    assert parsed.rest == ["-no-subreaper", "-b", "/b", "--image-path=/i", "-d", CID]


def test_log_format_defaults_to_text():
    assert RuncArgv.parse(["--root", "/r", "start", "x"]).log_format == "text"
    assert RuncArgv.parse([*G, "start", "x"]).log_format == "json"


def test_global_flag_names_and_values():
    parsed = RuncArgv.parse([*G, "--systemd-cgroup", "create", CID])
    assert [(f.name, f.value) for f in parsed.global_flags] == [
        ("root", ROOT), ("log", f"{B}/log.json"), ("log-format", "json"), ("systemd-cgroup", None)]
    assert parsed.global_value("log-format") == "json"
    assert parsed.global_value("criu") is None


def test_create_command_args():
    cmd = RuncArgv.parse([*G, "create", "--bundle", B, "--pid-file", f"{B}/init.pid", "--console-socket", "/s",
                          "--no-pivot", "--no-new-keyring", CID]).command_args()
    assert cmd.command == "create"
    assert cmd.value("bundle", "b") == B
    assert cmd.value("pid-file") == f"{B}/init.pid"
    assert cmd.value("console-socket") == "/s"
    assert cmd.has("no-pivot") and cmd.has("no-new-keyring")
    assert not cmd.has("detach")
    assert cmd.value("preserve-fds") is None
    assert cmd.positionals == [CID]
    assert cmd.unknown_flags() == []


@pytest.mark.parametrize("bundle_tokens", [["-b", B], ["--bundle=" + B], ["-bundle", B], ["-b=" + B]])
def test_bundle_flag_spellings(bundle_tokens):
    argv = ["create", *bundle_tokens, CID]
    parsed = RuncArgv.parse(argv)
    assert parsed.render() == argv
    cmd = parsed.command_args()
    assert cmd.value("bundle", "b") == B
    assert cmd.container_id == CID


def test_restore_single_dash_no_subreaper_is_a_known_bool():
    cmd = RuncArgv.parse([*G, "restore", "--image-path", "/i", "--work-path", "/w", "--detach", "--pid-file", "/p",
                          "-no-subreaper", "--bundle", B, CID]).command_args()
    assert cmd.has("no-subreaper")
    assert cmd.has("detach", "d")
    assert cmd.value("image-path") == "/i"
    assert cmd.value("work-path") == "/w"
    assert cmd.value("bundle", "b") == B
    assert cmd.unknown_flags() == []
    assert cmd.positionals == [CID]
    flag = next(f for f in cmd.flags if f.name == "no-subreaper")
    assert flag.tokens == ("-no-subreaper",)


def test_checkpoint_command_args():
    cmd = RuncArgv.parse([*G, "checkpoint", "--image-path", "/i", "--work-path", "/w", "--parent-path", "../p",
                          "--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks", "--empty-ns", "network",
                          "--leave-running", CID]).command_args()
    assert (cmd.value("image-path"), cmd.value("work-path"), cmd.value("parent-path")) == ("/i", "/w", "../p")
    assert cmd.value("empty-ns") == "network"
    for name in ("tcp-established", "ext-unix-sk", "shell-job", "file-locks", "leave-running"):
        assert cmd.has(name), name
    assert not cmd.has("pre-dump")
    assert cmd.positionals == [CID]
    assert cmd.unknown_flags() == []


def test_exec_command_args():
    cmd = RuncArgv.parse([*G, "exec", "--process", "/tmp/runc-process123", "--detach", "--pid-file", f"{B}/x.pid",
                          CID]).command_args()
    assert cmd.value("process", "p") == "/tmp/runc-process123"
    assert cmd.value("pid-file") == f"{B}/x.pid"
    assert cmd.has("detach")
    assert cmd.positionals == [CID]
    assert cmd.unknown_flags() == []


def test_exec_flags_end_at_the_container_id():
    # runc exec does not reorder: what follows the id is the process's own argv.
    cmd = RuncArgv.parse(["exec", "-t", CID, "sh", "-c", "echo --detach"]).command_args()
    assert cmd.container_id == CID
    assert cmd.has("tty", "t")
    assert not cmd.has("detach")
    assert cmd.positionals == [CID, "sh", "-c", "echo --detach"]


def test_kill_container_id_is_first_positional_not_the_signal():
    cmd = RuncArgv.parse([*G, "kill", "--all", CID, "9"]).command_args()
    assert cmd.container_id == CID
    assert cmd.positionals == [CID, "9"]
    assert cmd.has("all", "a")


def test_flags_after_the_container_id_are_still_flags():
    # urfave/cli v1 reorders flags for runc's subcommands: `delete ID --force` forces.
    cmd = RuncArgv.parse(["delete", CID, "--force"]).command_args()
    assert cmd.container_id == CID
    assert cmd.has("force", "f")


def test_ps_and_update_values():
    ps = RuncArgv.parse([*G, "ps", "--format", "json", CID]).command_args()
    assert ps.value("format", "f") == "json"
    assert ps.positionals == [CID]
    assert ps.unknown_flags() == []
    up = RuncArgv.parse([*G, "update", "--resources=-", CID]).command_args()
    assert up.value("resources", "r") == "-"
    assert up.positionals == [CID]
    assert up.unknown_flags() == []


def test_has_treats_explicit_false_as_absent():
    cmd = RuncArgv.parse(["create", "--no-pivot=false", "--no-new-keyring=0", "--bundle", B, CID]).command_args()
    assert not cmd.has("no-pivot")
    assert not cmd.has("no-new-keyring")
    cmd = RuncArgv.parse(["create", "--no-pivot=true", CID]).command_args()
    assert cmd.has("no-pivot")


def test_value_last_occurrence_wins():
    cmd = RuncArgv.parse(["create", "--bundle", "/a", "-b", "/b", CID]).command_args()
    assert cmd.value("bundle", "b") == "/b"


def test_unknown_flags_are_reported_and_kept():
    argv = ["create", "--bundle", B, "--future-flag", "--other=v", CID]
    parsed = RuncArgv.parse(argv)
    assert parsed.render() == argv
    unknown = parsed.command_args().unknown_flags()
    assert [(f.name, f.value, f.tokens) for f in unknown] == [
        ("future-flag", None, ("--future-flag",)), ("other", "v", ("--other=v",))]


def test_double_dash_ends_command_flags():
    cmd = RuncArgv.parse(["start", "--", "-weird-id"]).command_args()
    assert cmd.container_id == "-weird-id"
    assert cmd.flags == []


def test_value_flag_at_the_end_without_value_is_kept_as_bare_flag():
    argv = ["--root"]
    parsed = RuncArgv.parse(argv)
    assert parsed.render() == argv
    assert parsed.command is None
    assert parsed.global_flags == [Flag("root", None, ("--root",))]


def test_flag_make_renders_long_form():
    assert Flag.make("root", "/r").tokens == ("--root", "/r")
    assert Flag.make("debug").tokens == ("--debug",)
    parsed = RuncArgv.parse(["start", CID])
    parsed.global_flags.insert(0, Flag.make("root", "/x"))
    assert parsed.render() == ["--root", "/x", "start", CID]
    assert parsed.root == "/x"


@pytest.mark.parametrize("raw", [
    ["create", "--bundle", "/b", "x\udcff"],  # a non-UTF-8 byte, as Python decodes argv
    ["start", ""],
    ["exec", "--process", "/p", CID, "--", "extra"],
    ["--root", "/r", "--", "start", CID],
    ["-", "start"],
    ["kill", CID, "SIGKILL"],
])
def test_odd_argv_round_trip(raw):
    assert RuncArgv.parse(raw).render() == raw


# -- the flag tables against the runc installed here ------------------------------------------------
RUNC = shutil.which("runc")
_OPT = re.compile(r"^\s+(--?[a-z][\w-]*(?: value)?(?:, -+[a-z][\w-]*(?: value)?)*)\s{2,}", re.M)


def _runc_flags(*args: str) -> tuple[set[str], set[str]]:
    """(value flags, bool flags) from `runc [cmd] --help`."""
    out = subprocess.run([RUNC, *args, "--help"], capture_output=True, text=True, check=True, timeout=10).stdout
    head, sep, section = out.partition("GLOBAL OPTIONS:" if not args else "OPTIONS:")
    assert "USAGE:" in head  # a help text, with or without options (runc 1.3 hides `kill --all`)
    values, bools = set(), set()
    for m in _OPT.finditer(section):
        for part in m.group(1).split(", "):
            name, _, value = part.lstrip("-").partition(" ")
            (values if value else bools).add(name)
    return values, bools


def test_runc_is_installed_for_the_table_checks():
    assert RUNC, "runc must be on PATH (setup-host.sh installs it)"


@pytest.mark.parametrize("command", ["create", "restore", "checkpoint", "exec", "ps", "update", "delete", "kill",
                                     "start"])
def test_command_flag_tables_match_runc(command):
    values, bools = _runc_flags(command)
    assert values or bools or command in ("kill", "start")
    assert values <= COMMAND_VALUE_FLAGS[command], f"value flags of runc {command} missing from the table"
    assert not (bools & COMMAND_VALUE_FLAGS[command]), f"runc {command} bool flags listed as value flags"
    assert bools - {"help", "h"} <= COMMAND_BOOL_FLAGS[command] | {"help", "h"}
    assert values.isdisjoint(COMMAND_BOOL_FLAGS[command])


def test_global_flag_tables_match_runc():
    values, bools = _runc_flags()
    assert values == set(GLOBAL_VALUE_FLAGS) - {"criu"}  # --criu: runc <= 1.3 only, containerd 1.6 may send it
    assert bools == set(GLOBAL_BOOL_FLAGS)


# -- the typed call (runtime/argv.py Call) ---------------------------------------------------------------------
def test_call_root_is_the_given_one_else_the_lower_runtimes_default():
    assert Call(RuncArgv.parse([*G, "start", CID]), "/usr/bin/runc").root == ROOT
    assert Call(RuncArgv.parse(["start", CID]), "/usr/bin/runc").root == "/run/runc"
    assert Call(RuncArgv.parse(["start", CID]), "/usr/local/bin/crun").root == "/run/crun"


def test_call_reads_the_container_the_images_and_the_global_flags_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    call = Call(RuncArgv.parse([*G, "--systemd-cgroup", "checkpoint", "--leave-running", CID]), "/usr/bin/runc")
    assert (call.command, call.container_id, call.log_path, call.log_format) == ("checkpoint", CID, f"{B}/log.json",
                                                                               "json")
    assert call.global_tokens == [*G, "--systemd-cgroup"]
    assert call.image_path == str(tmp_path / "checkpoint") and call.bundle_dir == str(tmp_path)  # runc's defaults
    assert call.cmd.has("leave-running")
    assert Call(RuncArgv.parse(["state"]), "/usr/bin/runc").container_id == ""


def test_call_flags_added_in_front_are_rendered_and_read():
    argv = [*G, "restore", "--image-path", "/i", "--detach", "--bundle", B, CID]
    call = Call(RuncArgv.parse(argv), "/usr/bin/runc")
    assert call.cmd.value("lsm-profile") is None
    call.add_flags(["--lsm-profile", "apparmor:p"])
    assert call.render() == [*G, "restore", "--lsm-profile", "apparmor:p", *argv[len(G) + 1:]]
    assert call.cmd.value("lsm-profile") == "apparmor:p" and call.container_id == CID


def test_create_flags_carry_what_the_restore_keeps():
    argv = [*G, "create", "--bundle", B, "--pid-file", f"{B}/init.pid", "--console-socket", "/s", "--no-pivot",
            "--no-new-keyring", "--preserve-fds=0", CID]
    flags = Call(RuncArgv.parse(argv), "/usr/bin/runc").create_flags()
    assert flags == CreateFlags(container_id=CID, root=ROOT, global_tokens=tuple(G), pid_file=f"{B}/init.pid",
                                console_socket="/s", no_pivot=True, log_path=f"{B}/log.json", log_format="json",
                                dropped=("--no-new-keyring", "--preserve-fds=0"))


@pytest.mark.parametrize("extra, message", [
    (["--preserve-fds", "3"], "create flag --preserve-fds is not supported when restoring a checkpoint"),
    (["--pidfd-socket", "/p"], "create flag --pidfd-socket is not supported when restoring a checkpoint"),
    (["--future", "x"], "create flag --future is unknown to migrt; refusing to restore with it"),
])
def test_create_flags_restore_cannot_honour_are_refused(extra, message):
    call = Call(RuncArgv.parse([*G, "create", "--bundle", B, *extra, CID]), "/usr/bin/runc")
    with pytest.raises(UsageError, match=re.escape(message)):
        call.create_flags()
    with pytest.raises(UsageError, match=re.escape(message)):
        check_create_flags(call.cmd)


def test_a_create_without_a_container_id_is_refused():
    with pytest.raises(UsageError, match="create without a container id"):
        Call(RuncArgv.parse([*G, "create", "--bundle", B]), "/usr/bin/runc").create_flags()


def test_restore_target_for_a_create_takes_the_create_flags(tmp_path):
    from migrt.oci.bundle import Bundle
    from migrt.ops.restore import RestoreSeams, RestoreTarget
    from tests.unit.support import write_bundle

    bundle = Bundle.load(str(write_bundle(tmp_path / "b")))
    argv = [*G, "create", "--bundle", B, "--pid-file", "/p", "--console-socket", "/s", CID]
    target = RestoreTarget.for_create(Call(RuncArgv.parse(argv), "/usr/bin/runc").create_flags(), bundle,
                                      RestoreSeams(verified=True))
    assert (target.container_id, target.root, target.global_tokens, target.pid_file, target.console_socket,
            target.no_pivot, target.log_path, target.log_format, target.seams.verified, target.bundle) == (
        CID, ROOT, G, "/p", "/s", False, f"{B}/log.json", "json", True, bundle)

