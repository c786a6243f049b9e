"""containerd's CRI plugin for tests, spoken to the way kubelet speaks to it.

- `PodNetwork`: a network namespace created here (named uniquely) and a CNI conf dir with one
  bridge + host-local network in 192.0.2.0/24 (TEST-NET-1, RFC 5737; nothing is routed anywhere).
  containerd runs inside that namespace (network only: `nsenter --net`, the mount namespace stays the
  host's), so the CNI bridge, the veth ends and the IPAM state never touch the host's network.
  containerd adds the loopback plugin to every pod itself.
- `CriContainerd`: a private containerd 2.x with CRI (version 3 config; own root, state, sockets),
  runtime handlers `migrt` (BinaryName=/usr/local/bin/migrt-runc) and `runc`, the sandbox image
  pinned to a pause image built from busybox, NRI and CDI off.
- `CriClient`: the CRI gRPC API from Python stubs generated at test time (grpcio-tools) from the proto
  of Debian's golang-github-kubernetes-cri-api-dev, wrapped in a few helpers that build requests the
  way kubelet does (namespace options, cgroup parent, log directory, /etc/hosts and termination-log
  mounts from a per-pod directory).

Everything started here is stopped by pid; pods are stopped and removed through CRI, then the bridge
is deleted by name and the namespace removed.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from tests.helpers.containerd import Containerd
from tests.helpers.oci_image import IMAGE_REF, PAUSE_ENTRYPOINT, PAUSE_REF, build_image_tar

PROTO_ROOT = os.path.join(os.environ.get("MIGRT_DEPS", "/opt/migrt-deps"), "gocode")  # packaging/setup-test.sh
CRI_PROTO = "k8s.io/cri-api/pkg/apis/runtime/v1/api.proto"
GOGO_PROTO = "github.com/gogo/protobuf/gogoproto/gogo.proto"
CRI_MODULE = "k8s.io.cri_api.pkg.apis.runtime.v1"
CNI_BIN_DIR = "/usr/lib/cni"
SUBNET = "192.0.2.0/24"
CRI_NAMESPACE = "k8s.io"  # containerd's CRI always uses this containerd namespace
MIGRT_RUNC = os.environ.get("MIGRT_BINDIR", "/usr/local/bin") + "/migrt-runc"
MIGRT_CLI = os.environ.get("MIGRT_BINDIR", "/usr/local/bin") + "/migrt"

CRI_CONFIG = """version = 3
root = '{root}'
state = '{state}'
[grpc]
  address = '{sock}'
[ttrpc]
  address = '{sock}.ttrpc'
[debug]
  level = 'warn'
[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{pause}'
[plugins.'io.containerd.cri.v1.runtime']
  # This machine lacks CAP_SYS_RESOURCE: runc init cannot lower oom_score_adj below the parent's.
  restrict_oom_score_adj = true
  enable_cdi = false
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{cni_bin}']
    conf_dir = '{cni_conf}'
    max_conf_num = 1
[plugins.'io.containerd.nri.v1.nri']
  disable = true
"""

# containerd 1.7 (config version 2): the same settings, in the CRI plugin's one section.
CRI_CONFIG_V2 = """version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  level = "warn"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  sandbox_image = "{pause}"
  # This machine lacks CAP_SYS_RESOURCE: runc init cannot lower oom_score_adj below the parent's.
  restrict_oom_score_adj = true
  enable_cdi = false
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
[plugins."io.containerd.nri.v1.nri"]
  disable = true
"""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


# -- network --------------------------------------------------------------------------------------

class PodNetwork:
    """A private network namespace and a CNI configuration (bridge + host-local) for containerd."""

    def __init__(self, base: str, token: str | None = None) -> None:
        token = token or uuid.uuid4().hex[:8]
        self.netns = f"migrt-cri-{token}"
        self.netns_path = f"/run/netns/{self.netns}"
        self.bridge = f"mgr{token}"[:15]  # IFNAMSIZ
        self.name = f"migrt-test-{token}"
        self.conf_dir = os.path.join(base, "cni", "net.d")
        self.ipam_dir = os.path.join(base, "cni", "ipam")

    def create(self) -> "PodNetwork":
        os.makedirs(self.conf_dir, exist_ok=True)
        os.makedirs(self.ipam_dir, exist_ok=True)
        conf = {
            "cniVersion": "1.0.0", "name": self.name,
            "plugins": [{
                "type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": SUBNET}]], "dataDir": self.ipam_dir,
                         "routes": [{"dst": "0.0.0.0/0"}]},
            }],
        }
        with open(os.path.join(self.conf_dir, "10-migrt-test.conflist"), "w") as fh:
            json.dump(conf, fh, indent=2)
        _run(["ip", "netns", "add", self.netns])
        _run(["ip", "-n", self.netns, "link", "set", "lo", "up"])
        return self

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run in the namespace's network only (nsenter execs it: same pid, host mounts)."""
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]

    def links(self) -> list[str]:
        res = _run(["ip", "-n", self.netns, "-o", "link", "show"], check=False)
        return [line.split(":")[1].strip().split("@")[0] for line in res.stdout.splitlines() if ":" in line]

    def cleanup(self) -> None:
        if os.path.exists(self.netns_path):
            if self.bridge in self.links():
                _run(["ip", "-n", self.netns, "link", "del", self.bridge], check=False)
            _run(["ip", "netns", "del", self.netns], check=False)


# -- containerd with CRI --------------------------------------------------------------------------

class CriContainerd(Containerd):
    """containerd with its CRI plugin, running in the network namespace of `network`. The runtime
    handler `migrt` comes from the drop-in that `migrt install containerd` writes next to the config
    (version 3 for containerd 2.x, version 2 for 1.7), as on a real node."""

    def __init__(self, base: str, network: PodNetwork, version: str | None = None) -> None:
        super().__init__(base, namespace=CRI_NAMESPACE, cri=True, version=version)
        self.network = network
        self.install_result: dict = {}

    def config_text(self) -> str:
        template = CRI_CONFIG if self.config_version == 3 else CRI_CONFIG_V2
        return template.format(root=self.root, state=self.state, sock=self.sock, pause=PAUSE_REF,
                               cni_bin=CNI_BIN_DIR, cni_conf=self.network.conf_dir)

    def prepare(self, config_path: str) -> None:
        res = _run([MIGRT_CLI, "install", "containerd", "--config", config_path, "--binary", MIGRT_RUNC, "--json"])
        self.install_result = json.loads(res.stdout)

    def command(self, config_path: str) -> list[str]:
        return self.network.wrap(super().command(config_path))

    def import_images(self) -> tuple[str, str]:
        """The busybox test image and the pause image, built here and imported into k8s.io."""
        busybox = self.import_busybox()
        pause = build_image_tar(os.path.join(self.base, "pause-oci.tar"), PAUSE_REF, entrypoint=PAUSE_ENTRYPOINT)
        self.ctr("images", "import", pause)
        return busybox, PAUSE_REF

    def bundle(self, container_id: str) -> str:
        """The task bundle containerd wrote for a container (config.json as the runtime saw it)."""
        return os.path.join(self.state, "io.containerd.runtime.v2.task", CRI_NAMESPACE, container_id)


# -- CRI client -----------------------------------------------------------------------------------

def generate_stubs(out_dir: str):
    """Generate the CRI Python stubs into out_dir and import them: returns (api_pb2, api_pb2_grpc)."""
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", PROTO_ROOT, f"--python_out={out_dir}",
                    f"--grpc_python_out={out_dir}", CRI_PROTO, GOGO_PROTO], check=True, capture_output=True, text=True)
    # protoc turns the proto path's dots into directories for the messages (k8s/io/...), not for the
    # service module (k8s.io/...); put both in the importable package.
    pkg = os.path.join(out_dir, *CRI_MODULE.split("."))
    grpc_file = os.path.join(out_dir, "k8s.io", "cri_api", "pkg", "apis", "runtime", "v1", "api_pb2_grpc.py")
    shutil.copy(grpc_file, os.path.join(pkg, "api_pb2_grpc.py"))
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    importlib.invalidate_caches()
    return importlib.import_module(f"{CRI_MODULE}.api_pb2"), importlib.import_module(f"{CRI_MODULE}.api_pb2_grpc")


class CriError(RuntimeError):
    """A CRI call failed: carries the gRPC status code name and details."""

    def __init__(self, call: str, code: str, details: str) -> None:
        super().__init__(f"{call}: {code}: {details}")
        self.call, self.code, self.details = call, code, details


@dataclass
class Pod:
    id: str
    name: str
    namespace: str
    uid: str
    config: object  # api_pb2.PodSandboxConfig
    log_dir: str
    pod_dir: str  # what kubelet keeps under /var/lib/kubelet/pods/<uid>
    containers: list[str] = field(default_factory=list)


class CriClient:
    """A small kubelet: the calls and the request shapes kubelet uses, nothing more."""

    def __init__(self, socket: str, api, api_grpc, base: str, cgroup_root: str) -> None:
        import grpc

        self._grpc = grpc
        self.api = api
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.runtime = api_grpc.RuntimeServiceStub(self.channel)
        self.images = api_grpc.ImageServiceStub(self.channel)
        self.base = base
        self.cgroup_root = cgroup_root
        self.pods: dict[str, Pod] = {}
        self.container_pod: dict[str, str] = {}

    def close(self) -> None:
        self.channel.close()

    def call(self, name: str, request, timeout: float = 120, service=None):
        try:
            return getattr(service or self.runtime, name)(request, timeout=timeout)
        except self._grpc.RpcError as exc:
            raise CriError(name, exc.code().name, exc.details() or "") from exc

    # pods
    def version(self):
        return self.call("Version", self.api.VersionRequest(version="v1"))

    def run_pod(self, name: str, namespace: str = "default", handler: str = "migrt", *, hostname: str | None = None,
                annotations: dict | None = None, labels: dict | None = None, namespace_options: bool = True) -> str:
        """namespace_options=False sends none: the CRI default, every namespace the pod's, PID included
        (what shareProcessNamespace asks for); kubelet otherwise sends pid=CONTAINER, as this does."""
        api = self.api
        uid = str(uuid.uuid4())
        log_dir = os.path.join(self.base, "logs", f"{namespace}_{name}_{uid}")
        pod_dir = os.path.join(self.base, "pods", uid)
        os.makedirs(log_dir, exist_ok=True)
        os.makedirs(pod_dir, exist_ok=True)
        ns_opts = api.NamespaceOption(network=api.POD, pid=api.CONTAINER, ipc=api.POD) if namespace_options else None
        config = api.PodSandboxConfig(
            metadata=api.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            hostname=hostname or name, log_directory=log_dir,
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                    "io.kubernetes.pod.uid": uid, **(labels or {})},
            annotations=annotations or {},
            linux=api.LinuxPodSandboxConfig(
                cgroup_parent=f"{self.cgroup_root}/pod{uid}",
                security_context=api.LinuxSandboxSecurityContext(namespace_options=ns_opts)),
        )
        resp = self.call("RunPodSandbox", api.RunPodSandboxRequest(config=config, runtime_handler=handler))
        self.pods[resp.pod_sandbox_id] = Pod(resp.pod_sandbox_id, name, namespace, uid, config, log_dir, pod_dir)
        return resp.pod_sandbox_id

    def pod_status(self, pod_id: str):
        return self.call("PodSandboxStatus", self.api.PodSandboxStatusRequest(pod_sandbox_id=pod_id)).status

    def pod_ip(self, pod_id: str) -> str:
        return self.pod_status(pod_id).network.ip

    def stop_pod(self, pod_id: str) -> None:
        self.call("StopPodSandbox", self.api.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def remove_pod(self, pod_id: str) -> None:
        self.call("RemovePodSandbox", self.api.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
        pod = self.pods.pop(pod_id, None)
        for cid in pod.containers if pod else []:
            self.container_pod.pop(cid, None)

    def delete_pod(self, pod_id: str) -> None:
        """Stop and remove a pod (what kubelet does when a pod is deleted). A stop that fails because the
        pod's shim closed its connection is tried again, as kubelet's pod worker does (seen once in a
        full run under load: "failed to kill container ...: ttrpc: closed"); any other failure is raised."""
        for attempt in range(3):
            try:
                self.stop_pod(pod_id)
                break
            except CriError as exc:
                if "ttrpc: closed" not in str(exc) or attempt == 2:
                    raise
                print(f"StopPodSandbox {pod_id[:12]} tried again: {exc}", file=sys.stderr)
                time.sleep(1)
        self.remove_pod(pod_id)

    def list_pods(self) -> list:
        return list(self.call("ListPodSandbox", self.api.ListPodSandboxRequest()).items)

    # containers
    def create_container(self, pod_id: str, name: str, image: str, command: list[str], *, env: dict | None = None,
                         mounts: list[tuple[str, str]] | None = None, log_path: str | None = None,
                         annotations: dict | None = None, kubelet_mounts: bool = True,
                         namespace_options: bool = True) -> str:
        """mounts: (host path, container path) pairs, read-write, like emptyDir/hostPath volumes.
        log_path: relative to the pod's log directory (default <name>/0.log, as kubelet does).
        kubelet_mounts: also mount /etc/hosts and /dev/termination-log from the pod's own directory.
        namespace_options=False: none sent (see run_pod): the container joins the pod's PID namespace."""
        api = self.api
        pod = self.pods[pod_id]
        all_mounts = list(mounts or [])
        if kubelet_mounts:
            all_mounts += self._kubelet_files(pod, name)
        config = api.ContainerConfig(
            metadata=api.ContainerMetadata(name=name, attempt=0),
            image=api.ImageSpec(image=image), command=command,
            envs=[api.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
            mounts=[api.Mount(host_path=h, container_path=c, readonly=False) for h, c in all_mounts],
            log_path=log_path or os.path.join(name, "0.log"),
            labels={"io.kubernetes.container.name": name}, annotations=annotations or {},
            linux=api.LinuxContainerConfig(security_context=api.LinuxContainerSecurityContext(
                namespace_options=api.NamespaceOption(network=api.POD, pid=api.CONTAINER, ipc=api.POD)
                if namespace_options else None)),
        )
        resp = self.call("CreateContainer", api.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=pod.config))
        pod.containers.append(resp.container_id)
        self.container_pod[resp.container_id] = pod_id
        return resp.container_id

    def _kubelet_files(self, pod: Pod, container: str) -> list[tuple[str, str]]:
        hosts = os.path.join(pod.pod_dir, "etc-hosts")
        if not os.path.exists(hosts):
            with open(hosts, "w") as fh:
                fh.write(f"127.0.0.1\tlocalhost\n# Kubernetes-managed hosts file (pod {pod.namespace}/{pod.name}).\n")
        term_dir = os.path.join(pod.pod_dir, "containers", container)
        os.makedirs(term_dir, exist_ok=True)
        term = os.path.join(term_dir, uuid.uuid4().hex[:8])
        open(term, "w").close()
        return [(hosts, "/etc/hosts"), (term, "/dev/termination-log")]

    def start(self, cid: str, timeout: float = 120) -> None:
        self.call("StartContainer", self.api.StartContainerRequest(container_id=cid), timeout=timeout)

    def status(self, cid: str):
        return self.call("ContainerStatus", self.api.ContainerStatusRequest(container_id=cid)).status

    def state_name(self, cid: str) -> str:
        return self.api.ContainerState.Name(self.status(cid).state)

    def exec_sync(self, cid: str, cmd: list[str], timeout: int = 10) -> tuple[int, str, str]:
        resp = self.call("ExecSync", self.api.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=timeout),
                         timeout=timeout + 30)
        return resp.exit_code, resp.stdout.decode(errors="replace"), resp.stderr.decode(errors="replace")

    def stop(self, cid: str, timeout: int = 10) -> None:
        self.call("StopContainer", self.api.StopContainerRequest(container_id=cid, timeout=timeout))

    def remove(self, cid: str) -> None:
        self.call("RemoveContainer", self.api.RemoveContainerRequest(container_id=cid))

    def list_containers(self) -> list:
        return list(self.call("ListContainers", self.api.ListContainersRequest()).containers)

    def checkpoint_container(self, cid: str, location: str, timeout: int = 120) -> None:
        """CRI CheckpointContainer (kubelet's checkpoint API): containerd writes a tar at `location`."""
        self.call("CheckpointContainer", self.api.CheckpointContainerRequest(
            container_id=cid, location=location, timeout=timeout), timeout=timeout + 30)

    def wait_state(self, cid: str, state: str, timeout: float = 30) -> object:
        deadline = time.monotonic() + timeout
        st = self.status(cid)
        while self.api.ContainerState.Name(st.state) != state and time.monotonic() < deadline:
            time.sleep(0.1)
            st = self.status(cid)
        if self.api.ContainerState.Name(st.state) != state:
            raise AssertionError(f"container {cid[:12]} is {self.api.ContainerState.Name(st.state)}, not {state} "
                                 f"after {timeout}s (reason {st.reason!r}, message {st.message!r}, exit {st.exit_code})")
        return st

    def cleanup(self) -> None:
        """Stop and remove every pod this client created (best effort, errors ignored)."""
        for pod_id in list(self.pods):
            for step in (self.stop_pod, self.remove_pod):
                try:
                    step(pod_id)
                except CriError:
                    pass
            self.pods.pop(pod_id, None)


def read_cri_log(path: str) -> str:
    """The text of a CRI log file (`<time> <stream> <P|F> <text>` lines; P lines continue)."""
    if not os.path.exists(path):
        return ""
    out, partial = [], ""
    with open(path, errors="replace") as fh:
        for line in fh:
            parts = line.rstrip("\n").split(" ", 3)
            if len(parts) < 3:
                continue
            text = parts[3] if len(parts) == 4 else ""
            if parts[2] == "P":
                partial += text
            else:
                out.append(partial + text)
                partial = ""
    return "\n".join(out) + ("\n" if out else "")


def remove_cgroups(root: str) -> None:
    """rmdir the cgroup tree `root` (a path like /migrt-cri-x) in every v1 controller and in v2."""
    bases = ["/sys/fs/cgroup"] + [os.path.join("/sys/fs/cgroup", d) for d in os.listdir("/sys/fs/cgroup")
                                  if os.path.isdir(os.path.join("/sys/fs/cgroup", d))]
    for base in bases:
        top = os.path.join(base, root.lstrip("/"))
        if not os.path.isdir(top):
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass


__all__ = ["CriClient", "CriContainerd", "CriError", "IMAGE_REF", "PAUSE_REF", "PodNetwork", "generate_stubs",
           "read_cri_log", "remove_cgroups"]
