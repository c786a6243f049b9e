"""Two Kubernetes-like "nodes" on one machine for pod-to-pod live migration (migrt serve + a pod's
pull): each node is a network namespace holding its own containerd with CRI (a CNI bridge for its
pods, its own runc root for handler `migrt`), its own migrt config (naming both nodes' agents in
`migrate_peers`), key file (the same secret), store and log, and its own node agent (`migrt
serve`). The two namespaces are joined by a veth pair: node A is 198.51.100.1, node B 198.51.100.2
(tests/helpers/twohosts.py). Pods are driven through CRI as kubelet does (tests/helpers/cri.py).

What the two nodes share (one machine): the kernel, /proc, the cgroup tree (each containerd has its
own cgroup parent), and the host's mount namespace. Each containerd's shims run the node's runc root
(the runtime option `Root`), and each node's config names only its own (`runtime_roots`), so neither
agent sees the other node's containers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field

from tests.helpers.cri import CRI_NAMESPACE, CriContainerd
from tests.helpers.twohosts import ADDR_A, ADDR_B, linked
from tests.integration.conftest import CLI
from tests.integration.conftest_cri import new_client, running_containerd

AGENT_PORT = 7070


class NodeContainerd(CriContainerd):
    """CriContainerd whose shims (and so migrt-runc) get this node's MIGRT_CONFIG, with its own runc root."""

    def __init__(self, base: str, network, env: dict, runc_root: str) -> None:
        super().__init__(base, network)
        self.node_env = env
        self.runc_root = runc_root  # the shim adds the containerd namespace: <runc_root>/k8s.io

    def env(self) -> dict:
        return {**super().env(), **self.node_env}

    def prepare(self, config_path: str) -> None:
        super().prepare(config_path)
        with open(self.install_result["dropin"], "a") as fh:  # its last table is the handler's options
            fh.write(f'  Root = "{self.runc_root}"\n')


@dataclass
class PodNode:
    name: str
    addr: str
    base: str
    config: str
    store: str
    log: str
    root: str
    ctd: NodeContainerd | None = None
    cri: object = None
    agent: subprocess.Popen | None = None
    agent_out: str = ""
    extra_env: dict = field(default_factory=dict)
    veth: str = ""  # its end of the link to the other node

    @property
    def netns(self) -> str:
        return self.ctd.network.netns

    def env(self) -> dict:
        return {**os.environ, "MIGRT_CONFIG": self.config, **self.extra_env}

    def start_agent(self) -> None:
        self.agent_out = os.path.join(self.base, f"agent-{uuid.uuid4().hex[:4]}")
        with open(self.agent_out + ".out", "wb") as out, open(self.agent_out + ".err", "wb") as err:
            self.agent = subprocess.Popen(self.ctd.network.wrap([CLI, "serve", "--json"]), stdout=out, stderr=err,
                                          env=self.env(), start_new_session=True)
        deadline = time.monotonic() + 30
        while b"listening on" not in open(self.agent_out + ".err", "rb").read():
            assert self.agent.poll() is None, open(self.agent_out + ".err").read()
            assert time.monotonic() < deadline, "migrt serve did not start"
            time.sleep(0.05)

    def stop_agent(self, sig: int = signal.SIGTERM) -> None:
        if self.agent and self.agent.poll() is None:
            self.agent.send_signal(sig)
            try:
                self.agent.wait(20)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()

    def agent_results(self) -> list[dict]:
        try:
            text = open(self.agent_out + ".out").read()
        except OSError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def agent_stderr(self) -> str:
        try:
            return open(self.agent_out + ".err").read()
        except OSError:
            return ""

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, env=self.env())
        if check and res.returncode != 0:
            raise AssertionError(f"migrt {' '.join(args)} on node {self.name} failed ({res.returncode}): {res.stderr}")
        return res

    def runc_containers(self) -> list[str]:
        """Containers in this node's runc root (runc's own view)."""
        try:
            return sorted(d for d in os.listdir(self.root) if os.path.isdir(os.path.join(self.root, d)))
        except OSError:
            return []

    @contextlib.contextmanager
    def throttled(self, rate: str):
        """What this node sends to the other at `rate` (tc tbf on its veth end), for the duration."""
        tc = self.ctd.network.wrap(["tc", "qdisc"])
        subprocess.run([*tc, "add", "dev", self.veth, "root", "tbf", "rate", rate, "burst", "32kbit", "latency",
                        "400ms"], check=True, capture_output=True)
        try:
            yield
        finally:
            subprocess.run([*tc, "del", "dev", self.veth, "root"], capture_output=True)

    @staticmethod
    def children(pid: int, needle: bytes) -> list[int]:
        """Processes whose parent is `pid` and whose command line holds `needle`."""
        return [p for p, parent in procs((needle,)).items() if parent == pid]

    def staging(self) -> list[str]:
        path = os.path.join(self.store, ".staging")
        return os.listdir(path) if os.path.isdir(path) else []


def procs(needles: tuple[bytes, ...]) -> dict[int, int]:
    """{pid: parent pid} of the processes whose command line holds every needle."""
    out = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read()
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if all(n in argv for n in needles):
            out[int(entry)] = ppid
    return out


def _write_node(base: str, name: str, addr: str, secret: str, root: str, extra_config: str) -> PodNode:
    os.makedirs(base, exist_ok=True)
    key = os.path.join(base, "key")
    with open(key, "w") as fh:
        fh.write(secret + "\n")
    os.chmod(key, 0o600)
    node = PodNode(name, addr, base, os.path.join(base, "config.yaml"), os.path.join(base, "store"),
                   os.path.join(base, "migrt.log"), root)
    with open(node.config, "w") as fh:
        fh.write(f"runtime: runc\nstore: {node.store}\nlog_file: {node.log}\nlog_level: debug\n"
                 f"restore_failure_policy: fail\nmigration_key_file: {key}\nagent_listen: {addr}:{AGENT_PORT}\n"
                 f"runtime_roots: [{json.dumps(root)}]\nmigrate_peers: {json.dumps([ADDR_A, ADDR_B])}\n"
                 f"{extra_config}")
    return node


@contextlib.contextmanager
def pod_nodes(base, cri_stubs, extra_config: str = "", env: dict | None = None):
    """Nodes A and B (dict "a", "b"), containerds running, agents serving, CRI clients ready. `env`:
    {"a": {...}, "b": {...}}, what each node's containerd (so its migrt-runc) and agent get besides
    MIGRT_CONFIG (MIGRT_FAKE_GPU for a simulated GPU node)."""
    tag = uuid.uuid4().hex[:6]
    secret = os.urandom(32).hex()
    nodes = {}
    for name, addr in (("a", ADDR_A), ("b", ADDR_B)):
        root = f"/run/migrt-pods-{tag}-{name}/{CRI_NAMESPACE}"  # what the shim makes of Root
        nodes[name] = _write_node(str(base / name), name, addr, secret, root, extra_config)
        nodes[name].extra_env = dict((env or {}).get(name, {}))
    with contextlib.ExitStack() as stack:
        for node in nodes.values():
            top = os.path.dirname(node.root)
            stack.callback(shutil.rmtree, top, True)  # last: after containerd removed its pods
            node.ctd = stack.enter_context(running_containerd(
                lambda root, net, n=node, top=top: NodeContainerd(root, net, {"MIGRT_CONFIG": n.config, **n.extra_env},
                                                                  top),
                base / node.name / "ctd", cri_stubs))
            node.cri = new_client(node.ctd, cri_stubs, os.path.join(node.base, "kubelet"))
            stack.callback(node.cri.close)
        link = stack.enter_context(linked(nodes["a"].netns, nodes["b"].netns, tag))
        nodes["a"].veth, nodes["b"].veth = link["veth_a"], link["veth_b"]
        for node in nodes.values():
            node.start_agent()
            stack.callback(node.stop_agent)
        yield nodes
