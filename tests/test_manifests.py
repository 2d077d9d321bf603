"""The Kubernetes manifests, offline: each overlay is built by a small kustomize of our own and
every core object validated against Kubernetes' schemas (kubernetes-validate); the KEDA triggers
must name exactly the streams and groups the workers read, and every DIFFCACHE_* must load."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from config.settings import ENV_PREFIX, WorkerSettings, load_settings
from keys import Priority
from keys.names import consumer_group, stage_stream
from workers.queue.messages import Stage

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-split")
# Native sidecars (an init container with restartPolicy: Always) are on by default from 1.29.
OLDEST_KUBERNETES = "1.29"
IMAGE = "diffcache"
# The Secret the Kubernetes guide's `kubectl create secret` line makes; no manifest holds it.
REDIS_SECRET = "diffcache-redis"
REDIS_SECRET_KEYS = {"address", "password"}
SEGMENT_HEADROOM_MIB = 256

Doc = dict[str, Any]


# --- a kustomize of what the manifests use (kubectl's, where present, is compared below) ---------

_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "components", "images",
                         "patches"}


def _load_all(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _named_list(items: list[Any]) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)


def _merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch, as far as the manifests need one: maps merge, lists of named
    items (containers, env, volumes) merge by name, with new items first as kustomize puts
    them, and other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and _named_list(base + patch):
        patches = {p["name"]: p for p in patch}
        merged = [_merge(b, patches.pop(b["name"])) if b["name"] in patches else b for b in base]
        return list(patches.values()) + merged
    return patch


def _same_object(a: Doc, b: Doc) -> bool:
    return a["kind"] == b["kind"] and a["metadata"]["name"] == b["metadata"]["name"]


def _apply(directory: Path, spec: Doc, docs: list[Doc]) -> list[Doc]:
    unknown = set(spec) - _KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: this test's kustomize does not implement {unknown}"
    for entry in spec.get("resources", []):
        path = Path(os.path.normpath(directory / entry))
        docs = docs + (build(path) if path.is_dir() else _load_all(path))
    for entry in spec.get("components", []):
        component = Path(os.path.normpath(directory / entry))
        docs = _apply(component, _kustomization(component), docs)
    for entry in spec.get("patches", []):
        assert set(entry) <= {"path", "patch"}, f"{directory}: patch targets are not supported"
        patches = (_load_all(directory / entry["path"]) if "path" in entry
                   else [yaml.safe_load(entry["patch"])])
        for patch in patches:
            matches = [d for d in docs if _same_object(d, patch)]
            assert len(matches) == 1, f"{directory}: patch {patch['metadata']} matches {matches}"
            if patch.get("$patch") == "delete":
                docs = [d for d in docs if d is not matches[0]]
            else:
                docs = [_merge(d, patch) if d is matches[0] else d for d in docs]
    for image in spec.get("images", []):
        for _doc, container in _containers(docs):
            if container["image"].split(":")[0] == image["name"]:
                name = image.get("newName", image["name"])
                container["image"] = f"{name}:{image['newTag']}" if "newTag" in image else name
    if "namespace" in spec:
        for doc in docs:
            doc["metadata"]["namespace"] = spec["namespace"]
    return docs


def _kustomization(directory: Path) -> Doc:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def build(directory: Path, spec: Doc | None = None) -> list[Doc]:
    """The objects ``kubectl kustomize directory`` makes (``spec`` overrides its file)."""
    return _apply(directory, spec if spec is not None else _kustomization(directory), [])


def _pod_specs(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc, doc["spec"]["template"]["spec"]


def _containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for doc, pod in _pod_specs(docs):
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield doc, container


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _named(items: list[Doc], name: str) -> Doc:
    (found,) = [i for i in items if i["name"] == name]
    return found


def _mib(quantity: str) -> float:
    units = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    found = re.fullmatch(r"(\d+)(Mi|Gi|Ti)", quantity)
    assert found, f"memory {quantity!r}: write it in Mi, Gi or Ti"
    return int(found[1]) * units[found[2]]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, build(K8S / "overlays" / request.param)


# --- the tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, latest_version()])
def test_every_core_object_is_valid_kubernetes(overlay: tuple[str, list[Doc]],
                                               version: str) -> None:
    _, docs = overlay
    core = [d for d in docs if d["apiVersion"] != "keda.sh/v1alpha1"]
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} >= {
        ("Deployment", "diffcache-head"), ("StatefulSet", "diffcache-redis"),
        *(("Deployment", f"diffcache-{s.value}") for s in Stage),
        *(("ScaledObject", f"diffcache-{s.value}") for s in Stage)}
    for doc in core:
        # strict: an unknown or misspelt field is an error, not silently dropped.
        kubernetes_validate.validate(doc, version, strict=True)
        assert doc["metadata"]["namespace"] == "diffcache"
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "diffcache"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not "
                    "installed; the overlays are still built by this test's own kustomize")
@pytest.mark.parametrize("name", OVERLAYS)
def test_our_build_is_kubectls(name: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / name)], check=True,
                         capture_output=True, text=True, timeout=60).stdout

    def key(d: Doc) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    theirs = sorted((d for d in yaml.safe_load_all(out) if d), key=key)
    assert sorted(build(K8S / "overlays" / name), key=key) == theirs


def test_the_external_redis_component_drops_only_the_bundled_redis() -> None:
    overlay = K8S / "overlays" / "external"  # need not exist: it only anchors the paths
    docs = build(overlay, {"resources": ["../cpu"],
                           "components": ["../../components/external-redis"]})
    bundled = {(d["kind"], d["metadata"]["name"]) for d in build(K8S / "overlays" / "cpu")}
    assert bundled - {(d["kind"], d["metadata"]["name"]) for d in docs} == {
        ("StatefulSet", "diffcache-redis"), ("Service", "diffcache-redis")}


@pytest.mark.parametrize("stage", list(Stage))
def test_keda_scales_each_stage_on_both_classes_streams_and_its_group(
        overlay: tuple[str, list[Doc]], stage: Stage) -> None:
    _, docs = overlay
    scaled = [d for d in docs if d["kind"] == "ScaledObject"
              and d["spec"]["scaleTargetRef"]["name"] == f"diffcache-{stage.value}"]
    assert len(scaled) == 1, f"one ScaledObject per stage, got {len(scaled)} for {stage}"
    triggers = scaled[0]["spec"]["triggers"]
    named = sorted((t["metadata"]["stream"], t["metadata"]["consumerGroup"]) for t in triggers)
    assert named == sorted((stage_stream(stage.value, p.value), consumer_group(stage.value))
                           for p in Priority)


def test_scaled_objects_are_well_formed_and_scale_on_lag(overlay: tuple[str, list[Doc]]) -> None:
    """KEDA's CRD is not in kubernetes-validate's schemas: the structure KEDA reads, by hand."""
    _, docs = overlay
    common = _one(docs, "ConfigMap", "diffcache-common")["data"]
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        name = so["metadata"]["name"]
        assert so["apiVersion"] == "keda.sh/v1alpha1", name
        spec = so["spec"]
        assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                             "pollingInterval", "cooldownPeriod", "advanced", "triggers"}, name
        target = _one(docs, "Deployment", spec["scaleTargetRef"]["name"])
        pod = target["spec"]["template"]["spec"]
        source = _named(pod["containers"], spec["scaleTargetRef"]["envSourceContainerName"])
        env = {e["name"] for e in source["env"]}
        minimum, maximum = spec["minReplicaCount"], spec["maxReplicaCount"]
        assert isinstance(minimum, int) and isinstance(maximum, int), name
        # No stage at zero: /readyz wants a worker of each, and denoise's cold start is long.
        assert 1 <= minimum <= maximum, name
        if name == "diffcache-denoise":
            # Every pod's engine full at once still finds a credit for each run.
            engine = int(common.get("DIFFCACHE_WORKERS__MAX_BATCH", WorkerSettings().max_batch))
            assert maximum * engine <= int(
                common["DIFFCACHE_WORKERS__DECODE_CREDITS"])
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == "redis-streams", name
            # KEDA's metadata is a map of strings; a YAML number is refused by the CRD.
            assert all(isinstance(v, str) for v in meta.values()), meta
            assert set(meta) <= {"addressFromEnv", "passwordFromEnv", "databaseIndex", "stream",
                                 "consumerGroup", "lagCount", "activationLagCount",
                                 "enableTLS"}, meta
            # Lag (jobs nobody has taken), not the pending count or the stream length.
            assert int(meta["lagCount"]) >= 1 and int(meta["activationLagCount"]) >= 0, meta
            assert {meta["addressFromEnv"], meta["passwordFromEnv"]} <= env, meta


def test_every_diffcache_variable_is_a_setting(overlay: tuple[str, list[Doc]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    overlay_name, docs = overlay
    devices = set()  # what every worker names in its keys, wherever it computes
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    for doc, container in _containers(docs):
        if container["image"].split(":")[0] != IMAGE:
            continue
        where = f"{doc['metadata']['name']}/{container['name']}"
        variables = {k: v for ref in container.get("envFrom", [])
                     for k, v in maps[ref["configMapRef"]["name"]].items()}
        for e in container.get("env", []):
            # Kubernetes expands $(VAR) only from variables defined before it.
            for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert ref in variables, f"{where}: {e['name']} uses $({ref}) before it is set"
            secret = e.get("valueFrom", {}).get("secretKeyRef")
            if secret:
                assert secret["name"] == REDIS_SECRET and secret["key"] in REDIS_SECRET_KEYS
            variables[e["name"]] = e.get("value", "from-the-cluster")
        for name in [k for k in os.environ if k.upper().startswith(ENV_PREFIX)]:
            monkeypatch.delenv(name)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        settings = load_settings()  # raises on an unknown DIFFCACHE_* or a bad value
        if doc["metadata"]["name"] == "diffcache-head":
            # A head given a master address would join it instead of starting one.
            assert settings.store.master_address is None, where
            assert settings.redis.url is not None, where
        if container["name"] == "worker":
            devices.add(settings.model.device)
    # One serving device named by every stage: an encode pool left at ``auto`` on CPU nodes
    # would key outputs and trajectories for the CPU, and no repeat would ever hit.
    assert devices == ({"auto"} if overlay_name == "cpu" else {"cuda"})


def test_a_storage_node_gets_its_segment_in_memory(overlay: tuple[str, list[Doc]]) -> None:
    _, docs = overlay
    nodes = [(d, c) for d, c in _containers(docs) if c.get("args", [None])[0] == "node"]
    assert {d["metadata"]["name"] for d, _ in nodes} == {f"diffcache-{s.value}" for s in Stage}
    for doc, container in nodes:
        segment = int(_named(container["env"], "DIFFCACHE_STORE__SEGMENT_MIB")["value"])
        resources = container["resources"]
        assert resources["requests"]["memory"] == resources["limits"]["memory"], doc["metadata"]
        assert _mib(resources["limits"]["memory"]) >= segment + SEGMENT_HEADROOM_MIB


def test_gpus_go_to_denoise_and_decode_in_the_gpu_overlays(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    for stage in Stage:
        pod = _one(docs, "Deployment", f"diffcache-{stage.value}")["spec"]["template"]["spec"]
        resources = _named(pod["containers"], "worker")["resources"]
        wanted = (None if name == "cpu" or stage is Stage.ENCODE
                  else 2 if name == "gpu-split" and stage is Stage.DENOISE else 1)
        assert resources["requests"].get("nvidia.com/gpu") == wanted, stage
        assert resources["limits"].get("nvidia.com/gpu") == wanted, stage


def test_api_probes_and_the_network_policy(overlay: tuple[str, list[Doc]]) -> None:
    _, docs = overlay
    head = _named(_one(docs, "Deployment", "diffcache-head")["spec"]["template"]["spec"]
                  ["containers"], "head")
    assert head["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "api"}
    assert head["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "api"}
    # The head is ready only after a storage node joined its master through this Service.
    assert _one(docs, "Service", "diffcache-head")["spec"]["publishNotReadyAddresses"] is True
    member = {"app.kubernetes.io/part-of": "diffcache"}
    for doc, _pod in _pod_specs(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert labels.items() >= member.items(), doc["metadata"]["name"]
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    internal = policies["diffcache-internal"]
    assert internal["podSelector"]["matchLabels"] == member
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": member}}]}]
    # Only the API port is open to everyone; Redis only to KEDA's operator.
    open_rules = [(name, rule) for name, spec in policies.items() for rule in spec["ingress"]
                  if "from" not in rule]
    assert open_rules == [("diffcache-api", {"ports": [{"port": "api", "protocol": "TCP"}]})]
    assert policies["diffcache-api"]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "head"
    keda = policies["diffcache-redis-keda"]
    assert keda["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    assert [p["port"] for r in keda["ingress"] for p in r["ports"]] == ["redis"]
    assert all(len(r["from"]) == 1 and {"namespaceSelector", "podSelector"} <= set(r["from"][0])
               for r in keda["ingress"])


def test_the_kubernetes_guide_creates_the_secret_the_manifests_read() -> None:
    guide = (ROOT / "docs" / "deployment" / "kubernetes.md").read_text()
    for key in REDIS_SECRET_KEYS:
        assert f"--from-literal={key}=" in guide
    assert f"create secret generic {REDIS_SECRET}" in guide
