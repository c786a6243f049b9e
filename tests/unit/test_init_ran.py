"""migration/initran.py: a pod-level pull's init container that ran on the source is created as an
exit(0) on the target (the program's bytes, the bundle copy, the source's answer, the agent's rules).
Through CRI on two nodes: tests/integration/test_pod_init_ran.py."""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
import types

import pytest

from migrt.config import Config
from migrt.errors import PreconditionFailed
from migrt.migration import agent, initran
from migrt.oci.bundle import Bundle
from migrt.pods.members import Member
from tests.unit.test_pull import _pod_annotations, _pull_config
from tests.unit.test_shim import bundle_argv, last_log_line, sh_shim  # noqa: F401 - the fixture

from .support import write_bundle

POD = "n/team-a/web-0"
LIST = {"native": "reg/native:1", "app": "reg/app:1"}


def _bundle(tmp_path, name: str, mounts: list | None = None, **ann) -> Bundle:
    annotations = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": name,
                   "io.kubernetes.cri.sandbox-name": "web-0-moved", "io.kubernetes.cri.sandbox-namespace": "team-a",
                   "io.kubernetes.cri.sandbox-id": "sb42", "io.kubernetes.cri.image-name": f"reg/{name}:1", **ann}
    path = write_bundle(tmp_path / f"bundle-{name}", annotations=annotations)
    if mounts is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["mounts"] = mounts
        (path / "config.json").write_text(json.dumps(cfg))
    return Bundle.load(str(path))


def test_the_exit0_program_runs_here_and_exits_0(tmp_path):
    assert platform.machine() == "x86_64"  # this machine: the program is executed, not only read
    path = initran.exit0_program(str(tmp_path))
    assert os.stat(path).st_mode & 0o7777 == 0o555
    assert subprocess.run([path], timeout=10).returncode == 0
    assert initran.exit0_program(str(tmp_path)) == path  # written once


def test_the_aarch64_program_is_an_elf_for_that_machine_calling_exit_0():
    elf = initran.exit0_elf("arm64")
    machine, entry = struct.unpack_from("<H", elf, 18)[0], struct.unpack_from("<Q", elf, 24)[0]
    assert elf[:5] == b"\x7fELF\x02" and machine == 183 and entry == 0x400000 + 120
    assert elf[120:] == bytes.fromhex("a80b80d2000080d2010000d4")  # mov x8,#93; mov x0,#0; svc #0
    with pytest.raises(Exception, match="no exit.0. program for architecture 'riscv64'"):
        initran.exit0_elf("riscv64")


def test_the_bundle_copy_runs_the_program_and_leaves_the_original_as_it_was(tmp_path):
    dev = [{"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]}]
    bundle = _bundle(tmp_path, "init-db", mounts=dev)
    original = (tmp_path / "bundle-init-db" / "config.json").read_bytes()
    d = initran.write_copy(bundle, "cid1", "/run/x/exit0", base=str(tmp_path / "run"))
    cfg = json.loads((tmp_path / "run" / "bundles" / "cid1" / "config.json").read_text())
    assert d == str(tmp_path / "run" / "bundles" / "cid1")
    assert cfg["process"]["args"] == [initran.EXIT0_PATH] and cfg["root"]["path"] == bundle.rootfs
    assert cfg["mounts"][-1] == {"destination": initran.EXIT0_PATH, "type": "bind", "source": "/run/x/exit0",
                                 "options": ["bind", "ro", "nosuid", "nodev"]}
    assert (tmp_path / "bundle-init-db" / "config.json").read_bytes() == original
    assert initran.has_dev_tmpfs(bundle) and not initran.has_dev_tmpfs(_bundle(tmp_path, "other", mounts=[]))
    (tmp_path / "root" / "cid2").mkdir(parents=True)
    initran.write_copy(bundle, "cid2", "/run/x/exit0", base=str(tmp_path / "run"))
    initran.sweep(str(tmp_path / "root"), base=str(tmp_path / "run"))  # cid1's container is gone
    assert os.listdir(tmp_path / "run" / "bundles") == ["cid2"]


def test_the_create_gets_the_copy_as_its_bundle_whatever_the_spelling():
    for rest in (["--bundle", "/b", "--pid-file", "p", "id"], ["-b", "/b", "--pid-file", "p", "id"],
                 ["--bundle=/b", "--pid-file", "p", "id"], ["--pid-file", "p", "id"]):
        assert initran.with_bundle(rest, "/copy") == ["--bundle", "/copy", "--pid-file", "p", "id"]


def test_unlisted_containers_of_a_pod_level_pull_ask(tmp_path):
    ann = {"migrt.io/migrate-from": POD, "migrt.io/migrate-pod": "native=reg/native:1,app=reg/app:1"}
    req = _bundle(tmp_path, "init-db", **ann).unlisted_pod_part()
    assert (req.value, req.pod) == (POD, ann["migrt.io/migrate-pod"])
    assert _bundle(tmp_path, "app", **ann).unlisted_pod_part() is None  # a part: it pulls
    assert _bundle(tmp_path, "x", **{"migrt.io/migrate-from": POD}).unlisted_pod_part() is None  # no list
    four = {**ann, "migrt.io/migrate-from": POD + "/app"}
    assert _bundle(tmp_path, "y", **four).unlisted_pod_part() is None


def _m(name: str, running: bool, image: str = "") -> Member:
    return Member(f"c-{name}", name, image or f"reg/{name}:1", "/r", f"/b/{name}", running)


def test_the_source_answers_ran_only_for_a_pod_whose_listed_containers_run():
    pod = [_m("native", True), _m("app", True)]
    assert initran.ran(pod, "init-db", "reg/init-db:1", LIST)[0] is True  # completed, removed by containerd
    assert initran.ran([_m("init-db", False), *pod], "init-db", "reg/init-db:1", LIST) == \
        (True, "container init-db ran to completion in the source pod (stopped there)")
    no = [([_m("init-db", False, "reg/other:2"), *pod], "image 'reg/init-db:1', the source pod's is 'reg/other:2'"),
          ([_m("init-db", True), *pod], "runs in the source pod"),
          ([_m("native", True), _m("app", False)], "not the new pod's list"),
          ([_m("native", True), _m("app", True, "reg/app:2")], "not the new pod's list"),
          ([_m("native", False)], "no container of it runs")]
    for members, why in no:
        ran, because = initran.ran(members, "init-db", "reg/init-db:1", LIST)
        assert ran is False and why in because, because


class _Ch:
    local_host, peer = "10.0.0.5", "10.0.0.6:1"

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg)


def _ask(tmp_path, monkeypatch, migratable: str, namespace: str = "team-a"):
    bundles = {n: _bundle(tmp_path, n, **{"migrt.io/migratable": migratable}) for n in LIST}
    found = [Member(f"c-{n}", n, f"reg/{n}:1", "/r", b.path, True) for n, b in bundles.items()]
    monkeypatch.setattr(agent.members, "pod_members", lambda cfg, ns, pod: found)
    monkeypatch.setattr(agent, "REFUSAL_TIME_S", 0.0)
    me = types.SimpleNamespace(cfg=Config(path="x"))
    me._refused = lambda ch, msg, exc, t, out: agent.Agent._refused(me, ch, msg, exc, t, out)
    ch, out = _Ch(), {}
    msg = {"source": {"namespace": "team-a", "pod": "web-0", "container": "init-db"}, "namespace": namespace,
           "init_ran": {"image": "reg/init-db:1", "parts": LIST}}
    agent.Agent._answer_ran(me, ch, msg, out, 0.0)
    return ch.sent, out


def test_the_agent_answers_under_the_pulls_rules(tmp_path, monkeypatch):
    sent, out = _ask(tmp_path, monkeypatch, "true")
    assert sent == [{"type": "ran", "ran": True, "why": out["reason"]}] and out["init_ran"] is True
    for migratable, ns, reason in (("false", "team-a", "not opted in"), ("true", "team-b", "namespace 'team-a'")):
        with pytest.raises(agent.Refused, match="no migratable container init-db of pod team-a/web-0") as exc:
            _ask(tmp_path, monkeypatch, migratable, ns)
        assert reason in exc.value.reason and isinstance(exc.value, PreconditionFailed)


def test_sh_an_init_container_whose_source_agent_is_not_there_fails_its_create(sh_shim, tmp_path):  # noqa: F811
    _pull_config(sh_shim.env, "127.0.0.1:1")
    bundle = write_bundle(tmp_path / "bundle", annotations=_pod_annotations(
        "setup", **{"migrt.io/migrate-from": "127.0.0.1:1/team-a/web-0", "migrt.io/migrate-pod": "app=reg/app:1"}))
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["mounts"] = [{"destination": "/dev", "type": "tmpfs", "source": "tmpfs"}]
    (bundle / "config.json").write_text(json.dumps(cfg))
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (9, b"", b"")  # TransferError, as a pull's
    assert sh_shim.env.fake.calls() == []  # neither run fresh nor as an exit 0
    assert last_log_line(bundle / "log.json")["msg"] == "migrt: cannot pull from 127.0.0.1:1 (see the node's migrt log)"
