"""`migrt k8s move-manifest` (migrt/pods/move_manifest.py, move_owners.py): the target pod of a live
move written from the source pod's manifest, per owner kind, and the CLI around it. No API server:
what the controllers then do is docs/kubernetes.md's, on paper; these tests hold the transformation."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from click.testing import CliRunner

from migrt.cli.main import cli
from migrt.errors import UsageError
from migrt.pods import move_manifest as mm
from migrt.pods.move_owners import MOVE_NAME, MOVE_SET, MoveRefused

FROM = "migrt.io/migrate-from"
POD = "migrt.io/migrate-pod"


def _pod(name: str = "web-7d9f8b6c5-abcde", owner: dict | None = None, labels: dict | None = None, **spec) -> dict:
    """A pod as `kubectl get pod -o json` prints it (server-set fields included)."""
    meta = {"name": name, "namespace": "team-a", "uid": "pod-uid", "resourceVersion": "42",
            "creationTimestamp": "2026-11-27T10:00:00Z", "generateName": name.rsplit("-", 1)[0] + "-",
            "managedFields": [{"manager": "kube-controller-manager"}], "selfLink": "/x", "generation": 1,
            "labels": dict(labels or {"app": "web"}),
            "annotations": {"migrt.io/migratable": "true",
                            "kubectl.kubernetes.io/last-applied-configuration": "{}"}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "controller": True, "blockOwnerDeletion": True, **owner}]
    body = {"nodeName": "node-a", "runtimeClassName": "migrt", "priority": 0,
            "preemptionPolicy": "PreemptLowerPriority", "schedulerName": "default-scheduler",
            "containers": [{"name": "app", "image": "busybox"}]}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": body,
            "status": {"phase": "Running", "hostIP": "10.0.0.5", "podIP": "10.244.1.7"}}


def _deployment_pod() -> dict:
    return _pod(owner={"kind": "ReplicaSet", "name": "web-7d9f8b6c5", "uid": "rs-uid"},
                labels={"app": "web", "pod-template-hash": "7d9f8b6c5"})


def _statefulset_pod() -> dict:
    return _pod("web-0", owner={"kind": "StatefulSet", "name": "web", "uid": "sts-uid"},
                labels={"app": "db", "controller-revision-hash": "web-5d8f",
                        "statefulset.kubernetes.io/pod-name": "web-0"},
                hostname="web-0", subdomain="web-hl",
                volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data-web-0"}}])


def _job_pod(**spec) -> dict:
    pod = _pod("train-x7k2p", owner={"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "job-uid"},
               labels={"batch.kubernetes.io/controller-uid": "job-uid", "controller-uid": "job-uid",
                       "batch.kubernetes.io/job-name": "train", "job-name": "train"}, restartPolicy="Never", **spec)
    pod["metadata"]["finalizers"] = ["batch.kubernetes.io/job-tracking"]
    return pod


def _move(pod: dict, **opts) -> mm.Move:
    return mm.move(pod, mm.MoveOptions(to_node=opts.pop("to_node", "node-b"), **opts))


def test_deployment_copy_leaves_the_replicaset_selector_and_is_pinned_and_pulls():
    m = _move(_deployment_pod())
    meta, spec = m.pod["metadata"], m.pod["spec"]
    assert meta["name"] == "web-7d9f8b6c5-abcde-moved" and meta["namespace"] == "team-a"
    assert meta["labels"] == {"app": "web"}  # pod-template-hash gone: the ReplicaSet neither adopts nor counts it
    assert "ownerReferences" not in meta
    assert meta["annotations"][FROM] == "10.0.0.5/team-a/web-7d9f8b6c5-abcde/app"
    assert spec["nodeName"] == "node-b" and spec["runtimeClassName"] == "migrt"
    assert spec["hostname"] == "web-7d9f8b6c5-abcde"  # what the application saw
    assert m.plan.kind == "Deployment" and m.plan.owner == "web"
    steps = "\n".join(m.plan.steps)
    assert "scale deployment web" in steps and "pod-deletion-cost=-2147483648" in steps
    assert "label pod web-7d9f8b6c5-abcde-moved pod-template-hash=7d9f8b6c5" in steps  # the hand-back
    assert m.plan.steps[1].startswith("kubectl -n team-a annotate pod web-7d9f8b6c5-abcde-moved migrt.io/migrate-from-")


def test_server_and_controller_fields_are_stripped():
    src = _job_pod(ephemeralContainers=[{"name": "debugger", "image": "busybox"}], schedulingGates=[{"name": "g"}])
    src["metadata"]["deletionTimestamp"] = "2026-11-27T11:00:00Z"
    src["metadata"]["annotations"].update({FROM: "10.0.0.9/team-a/old/app", "migrt.io/restore": "ck-1",
                                           "controller.kubernetes.io/pod-deletion-cost": "5"})
    m = _move(src)
    meta, spec = m.pod["metadata"], m.pod["spec"]
    for gone in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "generateName", "selfLink",
                 "generation", "finalizers", "deletionTimestamp", "ownerReferences"):
        assert gone not in meta, gone
    assert "status" not in m.pod
    for gone in ("ephemeralContainers", "schedulingGates", "priority", "preemptionPolicy"):
        assert gone not in spec, gone
    assert set(meta["annotations"]) == {"migrt.io/migratable", FROM}
    assert meta["annotations"][FROM] == "10.0.0.5/team-a/train-x7k2p/app"
    assert spec["nodeName"] == "node-b"
    assert src["metadata"]["uid"] == "pod-uid" and src["spec"]["nodeName"] == "node-a"  # the input is not changed


def test_statefulset_identity_kept_through_two_pulls():
    first = _move(_statefulset_pod())
    meta, spec = first.pod["metadata"], first.pod["spec"]
    assert meta["name"] == "web-0-moving"
    assert meta["labels"] == {"app": "db", "controller-revision-hash": "web-5d8f",
                              "statefulset.kubernetes.io/pod-name": "web-0"}
    assert spec["hostname"] == "web-0" and spec["subdomain"] == "web-hl"
    assert spec["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "data-web-0"}}]
    assert meta["annotations"][MOVE_NAME] == "web-0" and meta["annotations"][MOVE_SET] == "web"
    assert "delete statefulset web --cascade=orphan" in first.plan.steps[0]
    assert any("ReadWriteOnce" in w for w in first.report()["warnings"])
    assert any("from that node's own agent: the node's migrate_peers must list" in w
               for w in first.report()["warnings"])
    # the second pull reads the first copy as the API server returns it, running on node-b
    running = copy.deepcopy(first.pod)
    running["metadata"].update(uid="copy-uid", resourceVersion="77")
    running["status"] = {"phase": "Running", "hostIP": "10.0.0.6"}
    second = _move(running)
    meta, spec = second.pod["metadata"], second.pod["spec"]
    assert meta["name"] == "web-0" and spec["nodeName"] == "node-b"
    assert meta["labels"] == first.pod["metadata"]["labels"]
    assert spec["hostname"] == "web-0" and spec["subdomain"] == "web-hl"
    assert spec["volumes"] == first.pod["spec"]["volumes"]
    assert meta["annotations"][FROM] == "10.0.0.6/team-a/web-0-moving/app"
    assert MOVE_NAME not in meta["annotations"] and MOVE_SET not in meta["annotations"]
    assert second.plan.kind == "StatefulSet (second pull)"
    assert "create -f web.yaml" in second.plan.steps[-1]
    assert not any("ReadWriteOnce" in w for w in second.report()["warnings"])  # same node: nothing to attach twice


def test_statefulset_copy_cannot_take_the_running_source_name():
    with pytest.raises(mm.ManifestError, match="second pull"):
        _move(_statefulset_pod(), name="web-0")


def test_job_copy_is_adopted_by_no_job_and_steps_say_how_to_hand_it_to_a_recreated_one():
    m = _move(_job_pod())
    meta = m.pod["metadata"]
    assert meta["labels"] == {"batch.kubernetes.io/job-name": "train", "job-name": "train"}
    assert "finalizers" not in meta and "ownerReferences" not in meta
    steps = "\n".join(m.plan.steps)
    assert "delete job train --cascade=orphan" in m.plan.steps[0]
    assert "batch.kubernetes.io/controller-uid=job-uid controller-uid=job-uid" in steps
    assert "manualSelector: true" in steps


def test_job_with_a_manual_selector_needs_the_label_named():
    pod = _job_pod()
    pod["metadata"]["labels"] = {"queue": "q1"}
    with pytest.raises(MoveRefused, match="manual selector"):
        _move(pod)
    assert _move(pod, drop_labels=("queue",)).pod["metadata"]["labels"] == {}


def test_bare_replicaset_needs_a_selector_label_and_drops_it():
    pod = _pod(owner={"kind": "ReplicaSet", "name": "cache", "uid": "u"}, labels={"app": "cache", "tier": "x"})
    with pytest.raises(MoveRefused, match="--drop-label"):
        _move(pod)
    m = _move(pod, drop_labels=("tier",))
    assert m.pod["metadata"]["labels"] == {"app": "cache"} and "scale rs cache" in m.plan.steps[2]


@pytest.mark.parametrize("kind,words", [("DaemonSet", "every node"), ("Node", "static pod")])
def test_daemonset_and_static_pods_are_refused(kind, words):
    with pytest.raises(MoveRefused, match=words):
        _move(_pod(owner={"kind": kind, "name": "x", "uid": "u"}))


def test_unknown_owner_refused_unless_asked():
    pod = _pod(owner={"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "r", "uid": "u"})
    with pytest.raises(MoveRefused, match="--any-owner"):
        _move(pod)
    m = _move(pod, any_owner=True)
    assert "ownerReferences" not in m.pod["metadata"] and any("RayCluster" in w for w in m.report()["warnings"])


def test_bare_pod_and_non_controller_owner_references_kept():
    pod = _pod("solo")
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "cm", "uid": "c"}]
    m = _move(pod, name="solo-b")
    assert m.pod["metadata"]["name"] == "solo-b" and m.plan.kind == "none"
    assert m.pod["metadata"]["ownerReferences"] == pod["metadata"]["ownerReferences"]
    assert m.plan.steps[-1] == "kubectl -n team-a delete pod solo"


def test_several_containers_are_one_pod_level_pull_by_default_and_the_two_other_forms():
    pod = _pod("duo", containers=[{"name": "app", "image": "a"}],
               initContainers=[{"name": "proxy", "image": "p", "restartPolicy": "Always"}])
    whole = _move(pod)  # one cut of the pod: every container listed with its image, the native sidecar first
    ann = whole.pod["metadata"]["annotations"]
    assert ann[FROM] == "10.0.0.5/team-a/duo" and ann[POD] == "proxy=p,app=a" == whole.migrate_pod
    assert whole.containers == ["proxy", "app"] and whole.report()["migrate_pod"] == "proxy=p,app=a"
    assert not any("one after the other" in w for w in whole.warnings)
    one = _move(pod, container="app")
    assert POD not in one.pod["metadata"]["annotations"] and one.migrate_pod is None
    assert one.pod["metadata"]["annotations"][FROM] == "10.0.0.5/team-a/duo/app" and one.containers == ["app"]
    assert any("proxy start fresh" in w for w in one.report()["warnings"])
    both = _move(pod, separate_cuts=True)
    assert both.pod["metadata"]["annotations"][FROM] == "10.0.0.5/team-a/duo"  # each pulls its namesake
    assert POD not in both.pod["metadata"]["annotations"]
    assert both.containers == ["app", "proxy"] and any("one after the other" in w for w in both.warnings)
    with pytest.raises(mm.ManifestError, match="no running container 'nope'"):
        _move(pod, container="nope")


def test_the_pod_level_pull_leaves_init_containers_out_and_needs_every_image():
    pod = _pod("trio", containers=[{"name": "app", "image": "reg/app:3"}, {"name": "log", "image": "reg/log:1"}],
               initContainers=[{"name": "setup", "image": "s"}])
    pod["metadata"]["annotations"][POD] = "old=list"  # a previous request's: replaced
    m = _move(pod)
    assert m.pod["metadata"]["annotations"][POD] == "app=reg/app:3,log=reg/log:1" and m.containers == ["app", "log"]
    assert any("setup are not run again on the target: each exits 0" in w for w in m.warnings)
    assert not any("setup run again" in w for w in m.warnings)
    del pod["spec"]["containers"][1]["image"]
    with pytest.raises(mm.ManifestError, match="containers log have no image"):
        _move(pod)


def test_separate_cuts_refused_with_init_containers_that_already_ran():
    pod = _pod("trio", containers=[{"name": "app", "image": "a"}, {"name": "log", "image": "l"}],
               initContainers=[{"name": "setup", "image": "s"}])
    with pytest.raises(mm.ManifestError, match="init containers \\(setup\\)"):
        _move(pod, separate_cuts=True)
    m = _move(pod, container="app")
    assert any("setup run again" in w for w in m.warnings)


def test_pull_env_removed_and_missing_opt_in_warned():
    pod = _pod("envy", containers=[{"name": "app", "image": "a", "env": [
        {"name": "MIGRT_MIGRATE_FROM", "value": "10.0.0.9/x/y/app"}, {"name": "MIGRT_RESTORE", "value": "ck"},
        {"name": "KEEP", "value": "1"}]}])
    del pod["metadata"]["annotations"]["migrt.io/migratable"]
    m = _move(pod)
    assert m.pod["spec"]["containers"][0]["env"] == [{"name": "KEEP", "value": "1"}]
    assert any("has not opted in" in w for w in m.warnings)


def test_runtime_class_required_kept_or_set():
    pod = _pod("norc")
    del pod["spec"]["runtimeClassName"]
    with pytest.raises(mm.ManifestError, match="runtimeClassName.*--runtime-class"):
        _move(pod)
    assert _move(pod, runtime_class="migrt-gpu").pod["spec"]["runtimeClassName"] == "migrt-gpu"
    assert "runtimeClassName" not in _move(pod, runtime_class="").pod["spec"]


def test_agent_address_from_option_host_ip_or_node_name():
    pod = _pod("addr")
    assert _move(pod, from_node="node-a.example:7071").migrate_from == "node-a.example:7071/team-a/addr/app"
    assert _move(pod, from_node="fd00::5").migrate_from == "[fd00::5]/team-a/addr/app"
    del pod["status"]["hostIP"]
    assert _move(pod).migrate_from == "node-a/team-a/addr/app"
    del pod["spec"]["nodeName"]
    with pytest.raises(mm.ManifestError, match="--from-node"):
        _move(pod)


@pytest.mark.parametrize("obj,words", [
    ({"kind": "Deployment", "metadata": {"name": "d"}}, "a Deployment, not a Pod"),
    ({"metadata": {"name": "d"}}, "without a kind"),
    ({"kind": "Pod", "metadata": {"name": "p", "namespace": "n"}}, "has no spec"),
    ({"kind": "Pod", "metadata": {"name": "p"}, "spec": {}}, "metadata.namespace"),
    ({"kind": "Pod", "metadata": {"name": "p", "namespace": "n"}, "spec": {"containers": []}}, "spec.containers"),
    ({"kind": "Pod", "metadata": {"name": "p", "namespace": "n"}, "spec": {"containers": [{"name": "a"}]},
      "status": {"phase": "Succeeded"}}, "has ended"),
])
def test_bad_input_errors(obj, words):
    with pytest.raises(mm.ManifestError, match=words) as info:
        _move(obj)
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2


def test_bad_names():
    with pytest.raises(mm.ManifestError, match="--to-node"):
        _move(_pod(), to_node="Node_B")
    with pytest.raises(mm.ManifestError, match="--name"):
        _move(_pod(), name="Bad_Name")


def test_read_json_yaml_and_lists():
    pod = _deployment_pod()
    assert mm.read(json.dumps(pod)) == (pod, "json")
    assert mm.read(yaml.safe_dump(pod)) == (pod, "yaml")
    assert mm.read(json.dumps({"kind": "List", "items": [pod]})) == (pod, "json")
    with pytest.raises(mm.ManifestError, match="List of 2"):
        mm.read(json.dumps({"kind": "List", "items": [pod, pod]}))
    with pytest.raises(mm.ManifestError, match="not valid YAML"):
        mm.read("kind: Pod\n  bad: [")
    with pytest.raises(mm.ManifestError, match="not valid JSON"):
        mm.read("{" * 100)
    with pytest.raises(mm.ManifestError, match="not a Kubernetes object"):
        mm.read("- a\n- b\n")


def _cli(args: list[str], stdin: str):
    return CliRunner().invoke(cli, ["k8s", "move-manifest", *args], input=stdin)


def test_cli_yaml_in_yaml_out_and_steps_on_stderr():
    res = _cli(["--to-node", "node-b"], yaml.safe_dump(_deployment_pod()))
    assert res.exit_code == 0, res.output
    out = yaml.safe_load(res.stdout)
    assert out["kind"] == "Pod" and out["spec"]["nodeName"] == "node-b"
    assert "next:" in res.stderr and "1. kubectl -n team-a create -f web-7d9f8b6c5-abcde-moved.yaml" in res.stderr


def test_cli_json_in_json_out_and_output_format_option(tmp_path):
    src = tmp_path / "pod.json"
    src.write_text(json.dumps(_job_pod()))
    res = _cli([str(src), "--to-node", "node-b"], "")
    assert res.exit_code == 0 and json.loads(res.stdout)["metadata"]["name"] == "train-x7k2p-moved"
    res = _cli([str(src), "--to-node", "node-b", "-o", "yaml"], "")
    assert yaml.safe_load(res.stdout)["metadata"]["name"] == "train-x7k2p-moved"
    assert "create -f train-x7k2p-moved.yaml" in res.stderr


def test_cli_json_report_for_scripts():
    res = _cli(["--to-node", "node-b", "--json"], yaml.safe_dump(_statefulset_pod()))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["pod"]["metadata"]["name"] == "web-0-moving" and data["owner"] == {"kind": "StatefulSet", "name": "web"}
    assert data["source"] == "team-a/web-0" and data["target"] == "team-a/web-0-moving"
    assert data["migrate_from"] == "10.0.0.5/team-a/web-0/app" and data["containers"] == ["app"]
    assert len(data["steps"]) == 5 and data["warnings"]


def test_cli_errors_are_one_line_with_exit_code_and_json():
    res = _cli(["--to-node", "node-b"], json.dumps({"kind": "Service", "metadata": {"name": "s"}}))
    assert res.exit_code == 2 and "migrt: error: the manifest is a Service, not a Pod" in res.stderr
    assert "Traceback" not in res.output
    res = _cli(["--to-node", "node-b", "--json"],
               json.dumps(_pod(owner={"kind": "DaemonSet", "name": "ds", "uid": "u"})))
    assert res.exit_code == 2 and json.loads(res.stdout)["type"] == "MoveRefused"
