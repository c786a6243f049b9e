"""ops/restore_checks.py: checks in threads, the verdict files, and the CRIU gate script run the way
CRIU runs an action script (CRTOOLS_SCRIPT_ACTION in its environment)."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from migrt.errors import CheckpointInvalid, MigrtError
from migrt.ops import restore_checks
from migrt.ops.restore_checks import RestoreChecks


def gate(env: dict, action: str) -> int:
    script = next(line.split(" ", 1)[1] for line in open(env["CRIU_CONFIG_FILE"]).read().splitlines()
                  if line.startswith("action-script "))
    return subprocess.run([script], env={**os.environ, "CRTOOLS_SCRIPT_ACTION": action}, timeout=30).returncode


def test_gate_holds_until_the_checks_pass_then_lets_criu_go_on(tmp_path):
    release = threading.Event()
    checks = RestoreChecks(str(tmp_path))
    checks.add("slow", lambda: release.wait(10) and "value")
    checks.start()
    env = checks.gate_env({"PATH": os.environ["PATH"]})
    assert gate(env, "pre-restore") == 0  # other points of the restore pass straight through
    result = {}
    t = threading.Thread(target=lambda: result.update(rc=gate(env, "post-restore")))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # held: no verdict yet
    release.set()
    t.join(10)
    assert result["rc"] == 0 and checks.gate_ran
    assert checks.failure() is None and checks.value("slow") == "value"
    assert set(checks.seconds()) == {"slow"}


def test_a_failed_check_makes_the_gate_abort_and_is_the_reported_cause(tmp_path):
    checks = RestoreChecks(str(tmp_path))
    checks.add("fine", lambda: None)
    checks.add("verify", lambda: (_ for _ in ()).throw(CheckpointInvalid("sha256 mismatch in images/pages-1.img")))
    checks.add("crash", lambda: 1 / 0)
    checks.start()
    env = checks.gate_env({})
    assert gate(env, "post-restore") == 1
    with pytest.raises(CheckpointInvalid, match="pages-1.img"):
        checks.raise_failure()


def test_a_crashing_check_becomes_a_migrt_error(tmp_path):
    checks = RestoreChecks(str(tmp_path))
    checks.add("driver", lambda: 1 / 0)
    checks.start()
    err = checks.failure()
    assert isinstance(err, MigrtError) and "driver" in str(err) and isinstance(err.__cause__, ZeroDivisionError)


def test_a_criu_config_file_already_set_is_kept(tmp_path):
    mine = tmp_path / "mine.conf"
    mine.write_text("tcp-established\naction-script /usr/lib/other-hook\n")
    checks = RestoreChecks(str(tmp_path))
    checks.add("x", lambda: None)
    checks.start()
    env = checks.gate_env({"CRIU_CONFIG_FILE": str(mine)})
    text = open(env["CRIU_CONFIG_FILE"]).read()
    assert env["CRIU_CONFIG_FILE"] != str(mine)
    assert "tcp-established" in text and "/usr/lib/other-hook" in text and "restore-gate.sh" in text


def test_large_image_files_go_to_the_background_the_rest_up_front():
    big = restore_checks.BACKGROUND_MIN_BYTES
    files = {"images/pages-1.img": {"size": big}, "images/pagemap-1.img": {"size": 100},
             "rootfs-diff.tar": {"size": 10 * big}, "images/core-1.img": {"size": 10}}
    front, back = restore_checks.split_for_background(files, "/x")
    assert back == ["images/pages-1.img"]
    assert front == ["images/core-1.img", "images/pagemap-1.img", "rootfs-diff.tar"]  # applied before runc runs


# -- the restore path reads CRIU's utsns image without pycriu when nothing is to change -------------------
def _utsns(path, node: str, domain: str) -> None:
    import pycriu

    with open(path, "wb") as fh:
        pycriu.images.dump({"magic": "UTSNS", "entries": [{"nodename": node, "domainname": domain}]}, fh)


def test_utsns_read_without_pycriu_agrees_with_pycriu(tmp_path):
    from migrt.pods import namespaces

    img = tmp_path / "utsns-12.img"
    _utsns(img, "web-7", "(none)")
    assert namespaces._uts_names(str(img)) == ("web-7", "(none)")
    assert namespaces._uts_current(str(img), "web-7", None)
    assert not namespaces._uts_current(str(img), "web-8", None)
    assert not namespaces._uts_current(str(img), "web-7", "example.org")
    (tmp_path / "other.img").write_bytes(img.read_bytes()[:4] + b"\0\0\0\0" + img.read_bytes()[8:])
    assert namespaces._uts_names(str(tmp_path / "other.img")) is None  # not a utsns image: pycriu decides
