"""Fixtures for the CRI tests: containerd's CRI plugin in a network namespace made here, pods on a
CNI bridge, and a CRI client generated from the CRI proto (see tests/helpers/cri.py).

Registered by tests/integration/conftest.py. Outside CI a missing prerequisite skips; with CI=true it
fails (like the other integration tests).
"""

from __future__ import annotations

import contextlib

import importlib.util
import os
import shutil
import uuid

import pytest

from tests.helpers import containerd as ctd_versions
from tests.helpers.cri import (CNI_BIN_DIR, CRI_PROTO, GOGO_PROTO, PROTO_ROOT, CriClient, CriContainerd, CriError,
                               PodNetwork, generate_stubs, remove_cgroups)


def _cri_missing() -> list[str]:
    miss = []
    for tool in ("ip", "nsenter"):
        if not shutil.which(tool):
            miss.append(tool)
    for plugin in ("bridge", "host-local", "loopback"):
        if not os.access(os.path.join(CNI_BIN_DIR, plugin), os.X_OK):
            miss.append(f"{CNI_BIN_DIR}/{plugin} (containernetworking-plugins)")
    for proto, pkg in ((CRI_PROTO, "golang-github-kubernetes-cri-api-dev"), (GOGO_PROTO, "golang-github-gogo-protobuf-dev")):
        if not os.path.isfile(os.path.join(PROTO_ROOT, proto)):
            miss.append(f"{PROTO_ROOT}/{proto} ({pkg})")
    for mod in ("grpc", "grpc_tools"):
        if importlib.util.find_spec(mod) is None:
            miss.append(f"python module {mod} (pip install -e '.[test]')")
    return miss


@pytest.fixture(scope="session")
def cri_stack(stack) -> None:
    miss = _cri_missing()
    if miss:
        msg = "CRI test prerequisites missing: " + ", ".join(miss) + " (run packaging/setup-host.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def cri_stubs(cri_stack, tmp_path_factory):
    return generate_stubs(str(tmp_path_factory.mktemp("cri-stubs")))


@pytest.fixture(scope="session", params=ctd_versions.test_versions(), ids=lambda v: f"containerd-{v}")
def cri_containerd(request, cri_stack, migrt_config, cri_stubs, tmp_path_factory):
    """containerd + CRI in its own network namespace, with the busybox and pause images imported;
    once per containerd version (tests/helpers/containerd.py: 2.x, and 1.7 beside it).
    Attributes added: .image (busybox ref), .cgroup_root (cgroup parent of every pod)."""
    why = ctd_versions.missing(request.param)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    base = tmp_path_factory.mktemp(f"cri-{request.param}")
    with running_containerd(lambda root, net: CriContainerd(root, net, version=request.param), base,
                            cri_stubs) as ctd:
        yield ctd


@contextlib.contextmanager
def running_containerd(make, base, cri_stubs):
    """A CRI containerd made by make(root, network) in its own pod network namespace and cgroup root,
    with its images; every pod, the network and the cgroups removed afterwards."""
    token = uuid.uuid4().hex[:8]
    net = PodNetwork(str(base), token)
    ctd = make(str(base / "containerd"), net)
    ctd.cgroup_root = f"/migrt-cri-{token}"
    try:
        net.create()
        ctd.start()
        ctd.image, _pause = ctd.import_images()
        yield ctd
    finally:
        if ctd.proc and ctd.proc.poll() is None:
            _remove_all_pods(ctd, cri_stubs, str(base))
        ctd.stop()
        net.cleanup()
        remove_cgroups(ctd.cgroup_root)


def new_client(ctd, stubs, base: str) -> CriClient:
    """A CRI client for `ctd`; kubelet-side files (pod logs, /etc/hosts, termination logs) under base."""
    return CriClient(ctd.sock, *stubs, base=base, cgroup_root=ctd.cgroup_root)


def _remove_all_pods(ctd, stubs, base: str) -> None:
    client = new_client(ctd, stubs, os.path.join(base, "kubelet"))
    try:
        for pod in client.list_pods():
            for step in (client.stop_pod, client.remove_pod):
                try:
                    step(pod.id)
                except CriError:
                    pass
    finally:
        client.close()


@pytest.fixture
def cri(cri_containerd, cri_stubs, tmp_path):
    """A CRI client (our kubelet) for one test; the pods it created are deleted afterwards."""
    client = new_client(cri_containerd, cri_stubs, str(tmp_path / "kubelet"))
    try:
        yield client
    finally:
        client.cleanup()
        client.close()
