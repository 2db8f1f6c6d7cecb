"""deploy/k8s renders, validates against the Kubernetes schemas, and runs commands pcpstack accepts; offline.

No cluster runs here, so nothing is applied. Each kustomization (the base and its overlays) is rendered by
`render`, a renderer of the few Kustomize features these files use (resources, namespace, labels, patches
that merge maps or delete an object), which refuses anything else; where kubectl is installed, its
Kustomize renders them too and must give the same objects. Every object is validated strictly (unknown
fields are errors) against the OpenAPI schemas kubernetes-validate ships; the LeaderWorkerSet, a custom
resource, against the fields of its v1 API types listed below, its pod template against the core schema.
Every pcpstack container's arguments, the `$(VAR)` references Kubernetes expands filled in from the
container's env and its mounted ConfigMaps written to files, must build the service's own config (the
parser `pcpstack` builds, then the config class `pcpstack serve` validates with).
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from ruamel.yaml import YAML

from pcpstack.cli import main as cli
from pcpstack.common.telemetry import OTLP_ENV
from pcpstack.decode.main import DecodeConfig
from pcpstack.gateway.main import GatewayConfig
from pcpstack.kvstore.main import KvStoreConfig
from pcpstack.prefill.main import PrefillConfig
from pcpstack.registry.main import RegistryConfig
from tests.compose.loopback import ROOT, option

K8S_DIR = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {
    "base": K8S_DIR / "base",
    "existing-etcd": K8S_DIR / "overlays" / "existing-etcd",
    "no-lws": K8S_DIR / "overlays" / "no-lws",
}
# The oldest Kubernetes these manifests are for: gRPC probes are GA since 1.27.
KUBERNETES_VERSION = "1.29"
IMAGE = "pcpstack:local"
CONFIG_CLASSES = {
    "registry": RegistryConfig,
    "kvstore": KvStoreConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "gateway": GatewayConfig,
}
# Stand-ins for what the downward API gives a pod.
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0", "spec.nodeName": "node-a"}

# LeaderWorkerSet v1 (sigs.k8s.io/lws, api/leaderworkerset/v1/leaderworkerset_types.go): its spec's fields,
# its leaderWorkerTemplate's, and the values of the enums these manifests set.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_SPEC_FIELDS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE_FIELDS = {
    "leaderTemplate",
    "workerTemplate",
    "size",
    "restartPolicy",
    "subGroupPolicy",
    "volumeClaimTemplates",
    "persistentVolumeClaimRetentionPolicy",
}
LWS_STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}
LWS_RESTART_POLICIES = {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default"}
# A kustomization's name and its rendered objects.
Rendered = tuple[str, list[dict[str, Any]]]

# --- a renderer of the Kustomize features deploy/k8s uses ---------------------------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "patches"}
CLUSTER_SCOPED = {"Namespace"}


def load_documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of a file, as plain data."""
    return [doc for doc in YAML(typ="safe", pure=True).load_all(path) if doc is not None]


def object_id(obj: dict[str, Any]) -> tuple[str, str, str]:
    """What a patch is matched by: the API group, the kind and the name."""
    group = obj["apiVersion"].rpartition("/")[0]
    return group, obj["kind"], obj["metadata"]["name"]


def merge_patch(target: dict[str, Any], patch: dict[str, Any], where: str) -> None:
    """A strategic-merge patch of maps into target; lists would need Kustomize's merge keys: refused."""
    for key, value in patch.items():
        if isinstance(value, list):
            raise ValueError(f"{where}: {key}: list patches are not supported by this renderer")
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value, f"{where}.{key}")
        else:
            target[key] = copy.deepcopy(value)


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` gives, for the features deploy/k8s uses."""
    (kustomization,) = load_documents(directory / "kustomization.yaml")
    unsupported = set(kustomization) - KUSTOMIZATION_FIELDS
    if unsupported:
        raise ValueError(f"{directory}: kustomization fields {sorted(unsupported)} are not supported")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else load_documents(path)
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise ValueError(f"{directory}: only `patches: - path: FILE` is supported, not {patch_entry}")
        (patch,) = load_documents(directory / patch_entry["path"])
        directive = patch.pop("$patch", None)
        matches = [obj for obj in objects if object_id(obj) == object_id(patch)]
        assert len(matches) == 1, f"{patch_entry['path']} matches {len(matches)} objects"
        if directive == "delete":
            objects.remove(matches[0])
        elif directive is None:
            merge_patch(matches[0], patch, patch_entry["path"])
        else:
            raise ValueError(f"{patch_entry['path']}: $patch: {directive} is not supported")
    for obj in objects:
        metadata = obj["metadata"]
        if "namespace" in kustomization and obj["kind"] not in CLUSTER_SCOPED:
            metadata["namespace"] = kustomization["namespace"]
        for label in kustomization.get("labels", []):
            if set(label) != {"pairs"}:
                raise ValueError(f"{directory}: labels other than plain `pairs` are not supported")
            metadata.setdefault("labels", {}).update(label["pairs"])
    return objects


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> Rendered:
    """(kustomization name, its rendered objects), for each kustomization."""
    return request.param, render(KUSTOMIZATIONS[request.param])


# --- what the rendered objects hold -------------------------------------------------------------------------


def kind_and_name(obj: dict[str, Any]) -> tuple[str, str]:
    """An object's kind and name (unique within one namespace's rendering)."""
    return obj["kind"], obj["metadata"]["name"]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The objects of one kind by name."""
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Workload name -> its pod template (a LeaderWorkerSet's worker template, also its leader's)."""
    templates = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            templates[obj["metadata"]["name"]] = obj["spec"]["template"]
        elif obj["kind"] == "LeaderWorkerSet":
            templates[obj["metadata"]["name"]] = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return templates


def pcpstack_containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Workload name -> its pcpstack container (the one running the image built from the Dockerfile)."""
    found = {}
    for name, template in pod_templates(objects).items():
        for container in template["spec"]["containers"]:
            if container["image"] == IMAGE:
                found[name] = container
    return found


def expanded_args(container: dict[str, Any], config_maps: dict[str, dict[str, Any]]) -> list[str]:
    """The container's args as Kubernetes runs them: every $(VAR) replaced by the env var's value."""
    values = {}
    for env in container.get("env", []):
        source = env.get("valueFrom", {})
        if "value" in env:
            values[env["name"]] = env["value"]
        elif "fieldRef" in source:
            values[env["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            values[env["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
    args = [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), arg) for arg in container["args"]]
    assert not [arg for arg in args if "$(" in arg], f"{container['name']}: unresolved references in {args}"
    return args


def with_mounted_files(
    args: list[str],
    template: dict[str, Any],
    container: dict[str, Any],
    config_maps: dict[str, dict[str, Any]],
    tmp: Path,
) -> list[str]:
    """args with each path into a mounted ConfigMap replaced by a file written here with its data."""
    volumes = {volume["name"]: volume for volume in template["spec"].get("volumes", [])}
    mapped = list(args)
    for mount in container.get("volumeMounts", []):
        config_map = volumes[mount["name"]].get("configMap")
        if config_map is None:
            continue
        for key, text in config_maps[config_map["name"]]["data"].items():
            local = tmp / config_map["name"] / key
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text)
            mapped = [str(local) if arg == f"{mount['mountPath']}/{key}" else arg for arg in mapped]
    return mapped


def service_config(
    name: str, objects: list[dict[str, Any]], tmp: Path
) -> tuple[list[str], RegistryConfig | KvStoreConfig | PrefillConfig | DecodeConfig | GatewayConfig]:
    """The workload's pcpstack arguments as run, and the config its service builds from them."""
    config_maps = by_kind(objects, "ConfigMap")
    container = pcpstack_containers(objects)[name]
    args = expanded_args(container, config_maps)
    local_args = with_mounted_files(args, pod_templates(objects)[name], container, config_maps, tmp)
    parsed = cli.build_parser(local_args).parse_args(local_args)
    assert hasattr(parsed, "handler"), f"`pcpstack {' '.join(args[:2])}` is not available"
    return args, CONFIG_CLASSES[args[1]].from_args(parsed)


# --- the tests ------------------------------------------------------------------------------------------


def test_the_renderer_gives_what_kubectl_kustomize_gives(rendered: Rendered) -> None:
    kubectl = shutil.which("kubectl") or pytest.skip("kubectl is not installed; the renderer stands alone")
    name, objects = rendered
    result = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    theirs = [doc for doc in YAML(typ="safe", pure=True).load_all(result.stdout) if doc is not None]
    assert sorted(objects, key=kind_and_name) == sorted(theirs, key=kind_and_name)


def test_every_object_is_valid_under_the_kubernetes_schemas(rendered: Rendered) -> None:
    _, objects = rendered
    for obj in objects:
        assert obj["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "pcpstack"
        assert obj["kind"] in CLUSTER_SCOPED or obj["metadata"]["namespace"] == "pcpstack"
        if obj["apiVersion"] == LWS_API_VERSION:
            check_leader_worker_set(obj)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def check_leader_worker_set(lws: dict[str, Any]) -> None:
    """A LeaderWorkerSet uses only fields of its v1 API, and its pod template is a valid core one."""
    assert set(lws) == {"apiVersion", "kind", "metadata", "spec"}
    spec = lws["spec"]
    assert set(spec) <= LWS_SPEC_FIELDS and set(spec["leaderWorkerTemplate"]) <= LWS_TEMPLATE_FIELDS
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    assert spec["startupPolicy"] in LWS_STARTUP_POLICIES
    group = spec["leaderWorkerTemplate"]
    assert isinstance(group["size"], int) and group["size"] >= 1
    assert group["restartPolicy"] in LWS_RESTART_POLICIES
    for role in ("leaderTemplate", "workerTemplate"):
        if role in group:
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": lws["metadata"]}
            template["template"] = group[role]
            kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)


def test_every_pcpstack_command_builds_its_service_config(rendered: Rendered, tmp_path: Path) -> None:
    _, objects = rendered
    containers = pcpstack_containers(objects)
    assert set(containers) == {"registry", "kvstore", "prefill", "decode", "gateway"}
    for name, container in containers.items():
        assert "command" not in container  # the image's ENTRYPOINT is pcpstack
        args, config = service_config(name, objects, tmp_path)
        assert args[:2] == ["serve", name]
        assert option(args, "--host") in ("0.0.0.0", FIELD_VALUES["status.podIP"])
        # Others dial what a node advertises, and the registry checks it is the node's own address.
        if "--advertise" in args:
            assert option(args, "--advertise") == FIELD_VALUES["status.podIP"]
        # Decode workers and stores on one Kubernetes node count as one machine for the store choice.
        if name in ("decode", "kvstore"):
            assert config.host_id == FIELD_VALUES["spec.nodeName"]
        if name != "registry":
            endpoints = by_kind(objects, "ConfigMap")["pcpstack-endpoints"]["data"]
            assert config.registry == endpoints["registry"]


def test_every_container_is_probed_on_its_port_with_bounded_resources(rendered: Rendered) -> None:
    _, objects = rendered
    for template in pod_templates(objects).values():
        for container in template["spec"]["containers"]:
            declared = {port["containerPort"] for port in container["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                # gRPC health everywhere but the gateway, whose API is HTTP.
                check = container[probe].get("grpc") or container[probe]["httpGet"]
                assert check["port"] in declared, f"{container['name']}: {probe} {check}"
                if container["image"] == IMAGE:
                    assert check["port"] == int(option(container["args"], "--port"))
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert {"cpu", "memory"} <= set(container["resources"]["limits"])
            if container["image"] == IMAGE:
                env = {e["name"]: e for e in container["env"]}
                otlp = env[OTLP_ENV]["valueFrom"]["configMapKeyRef"]
                assert by_kind(objects, "ConfigMap")[otlp["name"]]["data"][otlp["key"]].startswith("http")


def test_services_and_disruption_budgets_select_one_workloads_pods(rendered: Rendered) -> None:
    _, objects = rendered
    templates = pod_templates(objects)
    for obj in [*by_kind(objects, "Service").values(), *by_kind(objects, "PodDisruptionBudget").values()]:
        spec = obj["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        selected = [t for t in templates.values() if selector.items() <= t["metadata"]["labels"].items()]
        assert len(selected) == 1, f"{obj['kind']} {obj['metadata']['name']}: {len(selected)} workloads"
        containers = selected[0]["spec"]["containers"]
        ports = {p.get("name"): p["containerPort"] for c in containers for p in c["ports"]}
        # A Service reaches a port its pods declare, by name or number.
        for port in spec.get("ports", []):
            target = port.get("targetPort", port["port"])
            assert target in ports if isinstance(target, str) else target in ports.values()


def test_registry_replicas_are_the_addresses_nodes_are_given_and_use_etcd(
    rendered: Rendered, tmp_path: Path
) -> None:
    name, objects = rendered
    registry = by_kind(objects, "StatefulSet")["registry"]
    service = registry["spec"]["serviceName"]
    _, config = service_config("registry", objects, tmp_path)
    addresses = by_kind(objects, "ConfigMap")["pcpstack-endpoints"]["data"]["registry"].split(",")
    assert registry["spec"]["replicas"] == 2
    assert addresses == [f"registry-{i}.{service}:{config.port}" for i in range(2)]
    assert by_kind(objects, "Service")[service]["spec"]["clusterIP"] == "None"
    etcd = by_kind(objects, "StatefulSet").get("etcd")
    if name == "existing-etcd":
        assert etcd is None and not [obj for obj in objects if obj["metadata"]["name"] == "etcd"]
        assert "example.internal" in config.etcd
    else:
        members = [f"http://etcd-{i}.etcd:2379" for i in range(etcd["spec"]["replicas"])]
        assert config.etcd.split(",") == members and len(members) == 3


def test_prefill_pods_form_the_pcp_sets_their_config_asks_for(rendered: Rendered, tmp_path: Path) -> None:
    name, objects = rendered
    args, config = service_config("prefill", objects, tmp_path)
    engine = config.engine
    if name == "no-lws":
        assert "prefill" not in by_kind(objects, "LeaderWorkerSet")
        prefill = by_kind(objects, "StatefulSet")["prefill"]
        # Pods start one by one in ordinal order, so each nnodes consecutive ones form a set.
        assert prefill["spec"]["podManagementPolicy"] == "OrderedReady"
        assert prefill["spec"]["replicas"] == engine.nnodes * engine.data_parallel_size
        lws = by_kind(render(KUSTOMIZATIONS["base"]), "LeaderWorkerSet")["prefill"]
        assert prefill["spec"]["template"] == lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    else:
        spec = by_kind(objects, "LeaderWorkerSet")["prefill"]["spec"]
        # The leader is ready, and registered, before its workers exist: it is node_rank 0.
        assert spec["startupPolicy"] == "LeaderReady"
        assert spec["leaderWorkerTemplate"]["size"] == engine.nnodes
        assert spec["replicas"] == engine.data_parallel_size
    container = pcpstack_containers(objects)["prefill"]
    assert {"containerPort": engine.master_port, "name": "dist"} in container["ports"]
    rank_processes = engine.tensor_parallel_size * engine.pcp_ranks_per_node
    threads = int(option(args, "--threads-per-rank")) * rank_processes
    assert int(container["resources"]["requests"]["cpu"]) >= threads
