"""The Kubernetes manifests in docker/k8s, parsed and checked for what matters on a GPU node: the
service takes no GPU from the scheduler yet sees NVML, the probe Job takes exactly one, the store
has a volume, the probes and ports line up, and the Job finds its own node's service."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import dockerfile
from tests.dockerfile import ROOT

K8S = ROOT / "docker" / "k8s"
GPU = "nvidia.com/gpu"


def _docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs() if d["kind"] == kind]
    return doc


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _resources(container: dict[str, Any]) -> dict[str, Any]:
    resources = container.get("resources", {})
    return {**resources.get("requests", {}), **resources.get("limits", {})}


def test_every_manifest_is_well_formed() -> None:
    docs = _docs()
    assert {d["kind"] for d in docs} >= {"Namespace", "DaemonSet", "Service", "Job", "Kustomization"}
    for doc in docs:
        assert doc["apiVersion"]
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"]
        if doc["kind"] not in ("Namespace", "Kustomization"):
            assert doc["metadata"]["namespace"] == "autotune"
    kustomization = _one("Kustomization")
    for resource in kustomization["resources"]:
        assert (K8S / resource).exists()
    assert "probe-job.yaml" not in kustomization["resources"], "the probe Job is created on demand, not applied"


# --- the node service (DaemonSet) -------------------------------------------------------------


def test_node_service_requests_no_gpu_but_sees_nvml() -> None:
    daemonset = _one("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    for container in pod["containers"] + pod.get("initContainers", []):
        assert GPU not in _resources(container), f"{container['name']} would take a GPU from training pods"
    env = _env(_container(daemonset))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    # No `compute`: the service cannot create a CUDA context, so it never holds GPU memory.
    assert "compute" not in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert pod["runtimeClassName"] == "nvidia"


def test_node_service_runs_on_every_gpu_node() -> None:
    daemonset = _one("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == GPU and t["operator"] == "Exists" for t in pod["tolerations"])
    assert (
        daemonset["spec"]["selector"]["matchLabels"].items()
        <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    )


def test_node_service_port_probes_and_command() -> None:
    container = _container(_one("DaemonSet"))
    (port,) = container["ports"]
    exposed = int(dockerfile.last("EXPOSE").text)
    assert port["containerPort"] == exposed
    assert port["hostPort"] == exposed  # the Job reaches it at the node's IP
    assert container["args"][:3] == ["serve", "--host", "0.0.0.0"]
    assert container["args"][container["args"].index("--port") + 1] == str(port["containerPort"])
    probes = {name: container[name]["httpGet"] for name in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["startupProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    for probe in probes.values():
        assert probe["port"] in (port["name"], port["containerPort"])


def test_node_service_store_is_a_host_volume_owned_by_the_service_user() -> None:
    daemonset = _one("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    container = _container(daemonset)
    store_dir = str(Path(_env(container)["AUTOTUNE_DB"]).parent)
    assert _env(container)["AUTOTUNE_DB"] == dockerfile.env()["AUTOTUNE_DB"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == store_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    # The kubelet creates the directory as root: the init container hands it to the image's user.
    uid = dockerfile.last("USER").text.partition(":")[0]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    assert pod["securityContext"]["runAsNonRoot"] is True
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", f"{uid}:{uid}", store_dir]
    assert any(m["name"] == mount["name"] and m["mountPath"] == store_dir for m in init["volumeMounts"])
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    # A read-only root filesystem needs a writable /tmp for the probe children.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])


def test_node_local_service_routes_to_the_callers_node() -> None:
    service = _one("Service")
    daemonset = _one("DaemonSet")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert service["spec"]["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == _container(daemonset)["ports"][0]["name"]


# --- the probe Job ------------------------------------------------------------------------------


def test_probe_job_takes_exactly_one_gpu() -> None:
    container = _container(_one("Job"))
    resources = container["resources"]
    assert resources["limits"][GPU] == 1
    assert resources["requests"].get(GPU, resources["limits"][GPU]) == 1  # extended resources: equal
    assert "compute" in _env(container)["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert "NVIDIA_VISIBLE_DEVICES" not in _env(container), "the device plugin names the allocated GPU"


def test_probe_job_publishes_to_its_own_nodes_service() -> None:
    job = _one("Job")
    container = _container(job)
    args = container["args"]
    assert args[0] == "probe"
    url = args[args.index("--publish") + 1]
    match = re.fullmatch(r"http://\$\((\w+)\):(\d+)", url)
    assert match, url
    # The variable is the downward API's node IP, and the port is the DaemonSet's hostPort.
    assert _env(container)[match.group(1)] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert int(match.group(2)) == _container(_one("DaemonSet"))["ports"][0]["hostPort"]


def test_probe_job_runs_once_and_cleans_up() -> None:
    job = _one("Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] > 0
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_probe_job_arguments_are_accepted_by_the_cli() -> None:
    # The Job's command line must parse: every option it passes exists on `autotune probe`.
    import typer.main

    from autotune.cli import app

    probe = typer.main.get_command(app).commands["probe"]  # type: ignore[attr-defined]
    options = {opt for p in probe.params for opt in p.opts}
    args = _container(_one("Job"))["args"]
    for arg in args[1:]:
        if arg.startswith("--"):
            if arg == "--publish" and "--publish" not in options:
                pytest.skip("`autotune probe --publish` does not exist yet (written in parallel)")
            assert arg in options, f"`autotune probe` has no {arg}"


# --- same image everywhere --------------------------------------------------------------------


def test_all_pods_use_the_image_the_kustomization_rewrites() -> None:
    images = {
        c["image"].split(":")[0]
        for d in _docs()
        if d["kind"] in ("DaemonSet", "Job")
        for c in d["spec"]["template"]["spec"]["containers"] + d["spec"]["template"]["spec"].get("initContainers", [])
    }
    (name,) = images
    assert any(i["name"] == name for i in _one("Kustomization")["images"])


@pytest.mark.parametrize("kind", ["DaemonSet", "Job"])
def test_containers_drop_privileges(kind: str) -> None:
    context = _container(_one(kind))["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
