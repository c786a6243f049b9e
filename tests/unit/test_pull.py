"""Live migration into a new pod (migration/pull.py, agent.py, runtime/moved.py) without containers:
the migrate-from value, which containers ask, the agent's rules, the records that refuse a moved
container's restart, and migrt-runc's decisions for both (sh fast path and Python shim)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from migrt import config as config_mod
from migrt import migrate_peers as peers
from migrt.config import Config
from migrt.errors import ConfigError, PreconditionFailed, UsageError
from migrt.migration.agent import Refused, locate
from migrt.migration.pull import admit_peer, parse
from migrt.oci.bundle import Bundle
from migrt.runtime import moved
from tests.unit.support import write_bundle
from tests.unit.test_shim import CID, bundle_argv, last_log_line, sh_shim  # noqa: F401 - the fixture

SANDBOX = "5a" * 32


def _pod_annotations(name: str = "app", sandbox: str = SANDBOX, **extra) -> dict:
    return {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": name,
            "io.kubernetes.cri.sandbox-id": sandbox, "io.kubernetes.cri.sandbox-name": "web-0",
            "io.kubernetes.cri.sandbox-namespace": "team-a", **extra}


# -- the value --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, address, source", [
    ("10.0.0.5/team-a/web-0/app", "10.0.0.5:7070", {"namespace": "team-a", "pod": "web-0", "container": "app"}),
    ("node-a.example:7171/team-a/web-0", "node-a.example:7171", {"namespace": "team-a", "pod": "web-0",
                                                                 "container": "mine"}),
    ("[fd00::5]:7000/abc123", "[fd00::5]:7000", {"container_id": "abc123"}),
    ("[fd00::5]/abc123", "[fd00::5]:7070", {"container_id": "abc123"}),
    ("fd00::5/abc123", "[fd00::5]:7070", {"container_id": "abc123"}),
])
def test_migrate_from_forms(value, address, source):
    assert parse(value, "mine") == (address, source)


@pytest.mark.parametrize("value", ["10.0.0.5", "10.0.0.5/", "/team-a/web-0/app", "10.0.0.5:99999/x", "h:p/x",
                                   "10.0.0.5/a/b/c/d", "10.0.0.5/team a/web/app", "10.0.0.5//web/app",
                                   "[fd00::5/x", "10.0.0.5/..", "10.0.0.5/team-a/../app", "10.0.0.5/."])
def test_malformed_migrate_from_is_refused_with_the_forms(value):
    with pytest.raises(UsageError, match="expected <node address>"):
        parse(value, "app")


def test_namespace_and_pod_without_a_container_name_is_refused():
    with pytest.raises(UsageError, match="no name to look for in pod team-a/web-0"):
        parse("10.0.0.5/team-a/web-0", None)


# -- which containers ask -----------------------------------------------------------------------------

def test_env_asks_and_sandboxes_never_do(tmp_path):
    b = Bundle.load(str(write_bundle(tmp_path / "c", env=["MIGRT_MIGRATE_FROM=n/ns/p/other"],
                                     annotations=_pod_annotations())))
    assert (b.migrate_request().value, b.migrate_request().origin) == ("n/ns/p/other", "env")
    sandbox = Bundle.load(str(write_bundle(tmp_path / "s", annotations={
        **_pod_annotations(), "io.kubernetes.cri.container-type": "sandbox", "migrt.io/migrate-from": "n/ns/p"})))
    assert sandbox.migrate_request() is None
    assert Bundle.load(str(write_bundle(tmp_path / "n", annotations=_pod_annotations()))).migrate_request() is None


def test_the_pod_wide_annotation_naming_a_container_is_for_that_container_only(tmp_path):
    ann = {"migrt.io/migrate-from": "n/team-a/web-0/app"}
    app = Bundle.load(str(write_bundle(tmp_path / "a", annotations=_pod_annotations("app", **ann))))
    sidecar = Bundle.load(str(write_bundle(tmp_path / "b", annotations=_pod_annotations("sidecar", **ann))))
    assert app.migrate_request().origin == "annotation"
    assert sidecar.migrate_request() is None  # starts fresh
    whole_pod = {"migrt.io/migrate-from": "n/team-a/web-0"}
    assert Bundle.load(str(write_bundle(tmp_path / "c", annotations=_pod_annotations("sidecar", **whole_pod)))) \
        .migrate_request().value == "n/team-a/web-0"


# -- the peers a pod may name ----------------------------------------------------------------------------

PEERS = ["10.0.0.0/24", "192.168.7.9:7171", "[fd00::/64]:*", "node-a.example", "*.nodes.example:*",
         "fd01::5"]


@pytest.mark.parametrize("address", ["10.0.0.5:7070", "10.0.0.255:7070", "192.168.7.9:7171", "[fd00::1]:1",
                                     "[::ffff:10.0.0.7]:7070", "node-a.example:7070", "NODE-A.example.:7070",
                                     "b.nodes.example:9", "x.y.nodes.example:7070", "[fd01::5]:7070"])
def test_addresses_in_migrate_peers_are_allowed(address):
    assert peers.allowed(address, PEERS)


@pytest.mark.parametrize("address", [
    "10.0.0.5:7071",            # no port in the entry: the agent's 7070 only
    "10.0.1.5:7070", "192.168.7.9:7070", "127.0.0.1:7070", "[::1]:7070", "[fd02::1]:7070",
    "[fe80::1%eth0]:7070",      # scoped: never
    "[::ffff:127.0.0.1]:7070",  # IPv4-mapped: as its IPv4 address
    "node-b.example:7070", "node-a.example:7071", "nodes.example:7070", "evilnodes.example:7070",
    "node-a.example.attacker.test:7070",
    "10.0.0.5:x", "10.0.0.5", "",
])
def test_addresses_outside_migrate_peers_are_refused(address):
    assert not peers.allowed(address, PEERS)


def test_numbers_the_resolver_reads_as_addresses_are_names_and_match_nothing():
    """127.1, 0x7f.1 and 2130706433 all reach 127.0.0.1 through getaddrinfo; here they are names, and no
    name entry can be a number (its last label starts with a letter)."""
    for host in ("127.1", "0x7f.1", "2130706433", "0177.0.0.1", "127.000.0.1"):
        assert not peers.allowed(f"{host}:7070", ["127.0.0.0/8:*", "10.0.0.0/8"]), host
        with pytest.raises(ValueError):
            peers.parse_entry(host)


def test_an_ipv6_address_without_brackets_is_checked_as_the_address_it_is():
    address, _ = parse("fd00::5/abc123", None)
    assert peers.allowed(address, ["fd00::/64"]) and not peers.allowed(address, ["fd01::/64"])


def test_no_peers_no_pulls():
    assert not peers.allowed("10.0.0.5:7070", [])
    assert Config(path="x").migrate_peers == []


@pytest.mark.parametrize("entry, why", [
    ("10.0.0.1/24", "not an IP address or CIDR block"), ("300.1.1.1", "not an IP address or CIDR block"),
    ("10.0.0.0/24:99999", "port '99999'"), ("*", "not an IP address, a CIDR block or a host name"),
    ("node_a.example", "not an IP address, a CIDR block or a host name"), ("[fd00::1", "unclosed"),
    ("fe80::1%eth0", "scoped"), ("", "non-empty"), ("a.example:", "port ''"),
])
def test_migrate_peers_entries_are_checked_by_the_config(tmp_path, entry, why):
    path = tmp_path / "config.yaml"
    path.write_text(f"migrate_peers: [{json.dumps(entry)}]\n")
    with pytest.raises(ConfigError, match=rf"'migrate_peers' entry .*{re.escape(why)}.*; entries are ADDRESS\[:PORT\]"):
        config_mod.load(str(path))
    path.write_text("migrate_peers: 10.0.0.0/24\n")
    with pytest.raises(ConfigError, match="'migrate_peers' must be a list of node agents"):
        config_mod.load(str(path))
    path.write_text("migrate_peers: ['10.0.0.0/24', node-a.example, '[fd00::/64]:*']\n")
    assert config_mod.load(str(path)).migrate_peers == ["10.0.0.0/24", "node-a.example", "[fd00::/64]:*"]


def test_a_peer_outside_the_list_is_refused_before_any_lookup_or_connection(monkeypatch):
    def never(*args, **kw):
        raise AssertionError(f"the network was used: {args}")

    for name in ("getaddrinfo", "gethostbyname", "create_connection"):
        monkeypatch.setattr(socket, name, never)
    cfg = Config(path="/etc/migrt/config.yaml", migrate_peers=["10.0.0.0/24"])
    for address in ("127.0.0.1:1", "node-a.example:7070", "[::1]:7070"):
        with pytest.raises(PreconditionFailed, match=re.escape(
                f"{address} is not a node agent this node may pull from: migrate_peers in the node's migrt config "
                "(/etc/migrt/config.yaml) does not list it; ask the cluster's administrators")):
            admit_peer(cfg, address)
    with pytest.raises(PreconditionFailed, match="lists no node, so every pull is refused"):
        admit_peer(Config(path="x"), "10.0.0.5:7070")
    admit_peer(cfg, "10.0.0.5:7070")


# -- the agent's rules ---------------------------------------------------------------------------------

def _node(tmp_path: Path, containers: dict[str, dict]) -> Config:
    """A runc root holding containers {id: annotations} (state.json naming each one's bundle), and a
    config that searches it."""
    root = tmp_path / f"root-{len(list(tmp_path.iterdir()))}"
    root.mkdir()
    for cid, ann in containers.items():
        bundle = write_bundle(tmp_path / f"bundle-{root.name}-{cid[:8]}", annotations=ann)
        (root / cid).mkdir()
        (root / cid / "state.json").write_text(json.dumps({"id": cid, "config": {"labels": [f"bundle={bundle}"]}}))
    return Config(path="x", runtime_roots=[str(root)])


def _refusal(cfg: Config, source: dict, namespace: str, running=lambda root, cid: True) -> Refused:
    with pytest.raises(Refused) as info:
        locate(cfg, source, namespace, "10.0.0.5", running=running)
    return info.value


OPTED = {"migrt.io/migratable": "true"}
APP = "a" * 64


def test_a_source_is_found_when_it_runs_opted_in_in_the_pullers_namespace(tmp_path):
    cfg = _node(tmp_path, {APP: _pod_annotations(**OPTED), "b" * 64: _pod_annotations(name="sidecar", **OPTED)})
    by_name = locate(cfg, {"namespace": "team-a", "pod": "web-0", "container": "app"}, "team-a", "n",
                     running=lambda root, cid: True)
    by_id = locate(cfg, {"container_id": APP}, "team-a", "n", running=lambda root, cid: True)
    assert by_name.cid == by_id.cid == APP
    cfg.allow_cross_namespace_restore = True
    assert locate(cfg, {"container_id": APP}, "team-b", "n", running=lambda root, cid: True).cid == APP


def test_refusals_say_the_same_whatever_the_reason(tmp_path):
    """A team-b pod asking for team-a/web-0/app learns the same whether that container is absent, has not
    opted in or is in another namespace; a team-a pod the same for absent, not opted in and not
    running. The reasons differ, for the agent's log only."""
    by_name = {"namespace": "team-a", "pod": "web-0", "container": "app"}
    nodes = {"absent": _node(tmp_path, {}), "not opted in": _node(tmp_path, {APP: _pod_annotations()}),
             "another namespace": _node(tmp_path, {APP: _pod_annotations(**OPTED)})}
    for source in (by_name, {"container_id": APP}):
        refusals = {why: _refusal(cfg, source, "team-b") for why, cfg in nodes.items()}
        texts = {str(r) for r in refusals.values()}
        what = "container app of pod team-a/web-0" if "pod" in source else f"container {APP}"
        assert texts == {f"no migratable {what} for a pod of namespace 'team-b' on node 10.0.0.5: a pull takes a "
                         "running container (never a pod's sandbox) whose pod opted in (migrt.io/migratable=true) "
                         "and is in the pulling pod's namespace; nothing was touched (the node agent's log says "
                         "why)"}, texts
        assert "team-a" not in str(refusals["another namespace"]).split(" for a pod of ")[1]
        assert refusals["absent"].reason == "no such container on this node"
        assert "has not opted in" in refusals["not opted in"].reason
        assert "namespace 'team-a', the pulling pod in 'team-b'" in refusals["another namespace"].reason
        assert refusals["not opted in"].container_id == APP and refusals["absent"].container_id is None
        # from the source's own namespace: absent, not opted in and not running alike
        stopped = _refusal(nodes["another namespace"], source, "team-a", running=lambda r, c: False)
        assert stopped.reason.endswith("it is not running")
        same = {str(_refusal(nodes[w], source, "team-a")) for w in ("absent", "not opted in")} | {str(stopped)}
        assert same == {t.replace("'team-b'", "'team-a'") for t in texts}


def test_an_unknown_or_pathlike_id_shows_no_runtime_root(tmp_path):
    cfg = _node(tmp_path, {APP: _pod_annotations(**OPTED)})
    for cid in ("f" * 64, "..", ".", "a/../b"):
        refused = _refusal(cfg, {"container_id": cid}, "team-a")
        assert cfg.runtime_roots[0] not in str(refused) and "/run/" not in str(refused), refused
        assert refused.reason == "no such container on this node"


def test_a_pods_sandbox_is_never_handed_over_by_id(tmp_path):
    """Pod annotations are copied into the sandbox's bundle, migrt.io/migratable included: still refused,
    with the same text as for any other refusal, before the runtime is asked anything."""
    sandbox = _pod_annotations(**OPTED, **{"io.kubernetes.cri.container-type": "sandbox"})
    cfg = _node(tmp_path, {SANDBOX: sandbox})
    asked = []
    refused = _refusal(cfg, {"container_id": SANDBOX}, "team-a", running=lambda r, c: asked.append(c) or True)
    assert refused.reason.endswith("it is a pod's sandbox (pause container), never handed over")
    assert str(refused) == str(_refusal(_node(tmp_path, {}), {"container_id": SANDBOX}, "team-a"))
    assert asked == []
    cfg.migrate_any_container = True
    assert "sandbox" in _refusal(cfg, {"container_id": SANDBOX}, "team-a").reason


def test_only_a_container_the_puller_may_take_is_run_by_the_runtime(tmp_path):
    cfg = _node(tmp_path, {APP: _pod_annotations(), "b" * 64: _pod_annotations(**OPTED)})
    asked = []
    _refusal(cfg, {"container_id": APP}, "team-a", running=lambda r, c: asked.append(c) or True)
    _refusal(cfg, {"container_id": "b" * 64}, "team-b", running=lambda r, c: asked.append(c) or True)
    assert asked == []


# -- the records of containers moved away --------------------------------------------------------------

def test_record_refuses_its_container_only_and_goes_with_its_pod(tmp_path):
    root = tmp_path / "root"
    (root / SANDBOX).mkdir(parents=True)
    (root / SANDBOX / "state.json").write_text("{}")
    rec = moved.record(_pod_annotations(), to="10.0.0.6", target_container_id="t" * 64)
    moved.leave(str(root), rec)
    assert moved.find(str(root), _pod_annotations())["to"] == "10.0.0.6"
    assert moved.find(str(root), _pod_annotations("sidecar")) is None
    assert moved.find(str(root), _pod_annotations(sandbox="6b" * 32)) is None  # a new pod of the same name
    text = moved.refusal(moved.find(str(root), _pod_annotations()))
    assert text.startswith("container app of pod team-a/web-0 was migrated to node 10.0.0.6 (container ttt")
    assert "Delete this pod" in text
    assert moved.sweep(str(root)) == []  # its pod is still there
    (name,) = moved.present(str(root))
    os.unlink(root / SANDBOX / "state.json")
    assert moved.sweep(str(root)) == [name]
    assert moved.present(str(root)) == [] and moved.find(str(root), _pod_annotations()) is None


def test_no_record_for_a_container_of_no_pod(tmp_path):
    assert moved.record({}, to="x") is None
    assert moved.record(_pod_annotations(sandbox="../etc"), to="x") is None
    moved.leave(str(tmp_path), None)
    assert os.listdir(tmp_path) == []


# -- migrt-runc ------------------------------------------------------------------------------------------

def _pull_config(env, *entries: str) -> None:
    key = env.config.parent / "key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    with open(env.config, "a") as fh:
        fh.write(f"migration_key_file: {key}\nmigrate_peers: {json.dumps(list(entries))}\n")


@contextlib.contextmanager
def _listener(answer: bytes = b""):
    """A TCP listener on loopback that records each connection it accepts (and answers `answer` to its
    first bytes): (port, list of accepted peers)."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.05)
    accepted: list = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                continue
            accepted.append(peer)
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], accepted
    finally:
        stop.set()
        t.join()
        srv.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # connections the kernel took that nobody accepted yet count too
                accepted.append(srv.accept()[1])
        srv.close()


def _pull_bundle(tmp_path: Path, address: str) -> Path:
    return write_bundle(tmp_path / "bundle", annotations=_pod_annotations(**{"migrt.io/migrate-from":
                                                                           f"{address}/team-a/web-0/app"}))


def test_sh_a_peer_outside_migrate_peers_is_refused_without_a_connection(sh_shim, tmp_path):  # noqa: F811
    _pull_config(sh_shim.env, "127.0.0.2", "10.0.0.0/8:*")
    with _listener(b"HTTP/1.1 400 Bad Request\r\n\r\n") as (port, accepted):
        bundle = _pull_bundle(tmp_path, f"127.0.0.1:{port}")
        argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
        r = sh_shim.run(argv)
        time.sleep(0.2)
    assert (r.returncode, r.stdout, r.stderr) == (8, b"", b"")  # PreconditionFailed
    assert accepted == []
    assert sh_shim.env.fake.calls() == []
    msg = last_log_line(bundle / "log.json")["msg"]
    assert msg == (f"migrt: pull of container app of pod team-a/web-0 from 127.0.0.1:{port} failed: 127.0.0.1:{port} "
                   f"is not a node agent this node may pull from: migrate_peers in the node's migrt config "
                   f"({sh_shim.env.config}) does not list it; ask the cluster's administrators to add the source "
                   "node's agent; nothing was contacted"), msg


@pytest.mark.parametrize("answer, detail", [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "frame type 72, length 1414811695"),
    (b"", "closed the connection"),
])
def test_sh_an_allowed_peer_is_reached_and_its_answer_stays_in_the_nodes_log(sh_shim, tmp_path, answer,  # noqa: F811
                                                                              detail):
    _pull_config(sh_shim.env, "127.0.0.1:*")
    with _listener(answer) as (port, accepted):
        bundle = _pull_bundle(tmp_path, f"127.0.0.1:{port}")
        argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
        r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (9, b"", b"")  # TransferError
    assert len(accepted) == 1  # the allowed peer was contacted
    assert sh_shim.env.fake.calls() == []
    log = (bundle / "log.json").read_text()
    assert last_log_line(bundle / "log.json")["msg"] == (
        f"migrt: pull of container app of pod team-a/web-0 from 127.0.0.1:{port} failed: cannot pull from "
        f"127.0.0.1:{port} (see the node's migrt log)")
    assert len(log.splitlines()) == 1 and detail not in log and "HTTP" not in log
    events = [json.loads(line) for line in sh_shim.env.log_file.read_text().splitlines()]
    (unreachable,) = [e for e in events if e["event"] == "pull_unreachable"]
    assert detail in unreachable["detail"] and unreachable["address"] == f"127.0.0.1:{port}"


def test_sh_hands_a_pull_to_python_which_fails_fast_on_an_agent_that_is_not_there(sh_shim, tmp_path):  # noqa: F811
    _pull_config(sh_shim.env, "127.0.0.1:1")
    bundle = _pull_bundle(tmp_path, "127.0.0.1:1")
    argv, _ = bundle_argv(tmp_path, bundle, "--bundle")
    t0 = time.monotonic()
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (9, b"", b"")  # TransferError
    assert time.monotonic() - t0 < 10
    assert sh_shim.py_calls() == [" ".join(argv)]
    assert sh_shim.env.fake.calls() == []  # never a fresh start beside the source
    msg = last_log_line(bundle / "log.json")["msg"]
    assert msg == ("migrt: pull of container app of pod team-a/web-0 from 127.0.0.1:1 failed: cannot pull from "
                   "127.0.0.1:1 (see the node's migrt log)"), msg
    assert "connecting to 127.0.0.1:1: Connection refused" in sh_shim.env.log_file.read_text()


def test_sh_sends_creates_to_python_while_a_record_is_there(sh_shim, tmp_path):  # noqa: F811
    root = tmp_path / "root"
    (root / SANDBOX).mkdir(parents=True)
    (root / SANDBOX / "state.json").write_text("{}")
    moved.leave(str(root), moved.record(_pod_annotations(), to="10.0.0.6"))
    again = write_bundle(tmp_path / "again", annotations=_pod_annotations())
    argv, _ = bundle_argv(tmp_path, again, "--bundle")
    r = sh_shim.run(argv)
    assert (r.returncode, r.stdout, r.stderr) == (6, b"", b"")
    assert sh_shim.env.fake.calls() == []
    assert "container app of pod team-a/web-0 was migrated to node 10.0.0.6" in last_log_line(again / "log.json")["msg"]
    # another container (of this pod or any other) is created as usual, through Python while records exist
    other = write_bundle(tmp_path / "other", annotations=_pod_annotations("sidecar"))
    argv, _ = bundle_argv(tmp_path, other, "--bundle")
    assert sh_shim.run(argv).returncode == 0
    assert len(sh_shim.py_calls()) == 2 and len(sh_shim.env.fake.calls()) == 1
    # the pod is deleted: the next create sweeps its record, and creates no longer need Python
    os.unlink(root / SANDBOX / "state.json")
    assert sh_shim.run(argv).returncode == 0
    assert moved.present(str(root)) == []
    assert sh_shim.run(argv).returncode == 0
    assert len(sh_shim.py_calls()) == 3 and len(sh_shim.env.fake.calls()) == 3


def test_record_is_json_with_where_it_went(tmp_path):
    moved.leave(str(tmp_path), moved.record(_pod_annotations(), to="10.0.0.6", target_pod="team-a/web-0"))
    (name,) = moved.present(str(tmp_path))
    data = json.loads((tmp_path / name).read_text())
    assert data["container"] == "app" and data["pod"] == "team-a/web-0" and data["sandbox_id"] == SANDBOX
    assert data["to"] == "10.0.0.6" and data["at"].endswith("Z")


def test_every_refusal_takes_the_same_time_whatever_the_reason(tmp_path, monkeypatch):
    """An absent id costs the agent a stat, another namespace's container its state and config.json read
    (a large bundle: milliseconds): each refusal is answered REFUSAL_TIME_S after the pull came."""
    from migrt.migration import agent as agent_mod

    slept: list[float] = []
    monkeypatch.setattr(agent_mod.time, "sleep", slept.append)
    cfg = _node(tmp_path, {APP: _pod_annotations(**OPTED)})
    ag = agent_mod.Agent.__new__(agent_mod.Agent)  # no receiver: only the refusal path runs
    ag.cfg = cfg
    ch = type("Ch", (), {"local_host": "10.0.0.5", "peer": "10.0.0.6:40000"})()
    for cid in ("f" * 64, APP):  # absent; in team-a, pulled for team-b
        with pytest.raises(Refused):
            ag.hand_over(ch, {"source": {"container_id": cid}, "namespace": "team-b"}, {})
    assert len(slept) == 2 and all(0.1 < s <= agent_mod.REFUSAL_TIME_S for s in slept), slept
