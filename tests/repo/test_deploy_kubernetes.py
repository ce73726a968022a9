"""The Kubernetes manifests under deploy/k8s/ validate against the schemas,
start the three processes after the migration with settings they accept,
and set replicas, probes, KEDA scaling, secrets and grace periods as the
processes need."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate import utils as kubernetes_validate_utils

from shared import config_load
from tests.repo.deploy_files import (
    ENTRYPOINTS,
    SETTINGS_BY_COMPONENT,
    command_line,
    component,
    container_env,
    deployment,
    final_stage,
    k8s_doc,
    k8s_docs,
    only_container,
    pod_spec,
    workloads,
)
from worker.coordinator import SHUTDOWN_FLUSH_S


def test_k8s_directory_holds_the_expected_kinds() -> None:
    """The manifests define config, secret, migrate job, three deployments, a service and KEDA objects."""
    kinds = sorted(doc["kind"] for doc in k8s_docs())
    for kind in ("ConfigMap", "Secret", "Job", "Service", "ScaledObject", "TriggerAuthentication"):
        assert kind in kinds
    assert kinds.count("Deployment") == 3


def test_k8s_workloads_run_the_three_entrypoints_and_migrate() -> None:
    """The migrate Job and the three Deployments start exactly the four commands."""
    commands = {component(w): command_line(only_container(w)) for w in workloads()}
    assert commands == {
        "migrate": "storyjobs migrate",
        "api": "python -m api",
        "worker": "python -m worker",
        "sweeper": "python -m sweeper",
    }
    assert set(commands.values()) == ENTRYPOINTS
    assert k8s_doc("Job")["metadata"]["labels"]["app.kubernetes.io/component"] == "migrate"


def test_k8s_settings_pass_the_processes_own_validation() -> None:
    """Each workload's ConfigMap and env load without a configuration error."""
    for workload in workloads():
        settings_type = SETTINGS_BY_COMPONENT[component(workload)]
        config_load.load(settings_type, container_env(only_container(workload)))


# KEDA's kinds are custom resources: the Kubernetes schemas do not describe them
CUSTOM_RESOURCE_GROUPS = ("keda.sh/",)
# the oldest and the newest Kubernetes whose schemas the installed validator ships
KUBERNETES_VERSIONS = (kubernetes_validate_utils.all_versions()[0], kubernetes_validate.latest_version())


def builtin_k8s_docs() -> list[dict[str, Any]]:
    return [doc for doc in k8s_docs() if not doc["apiVersion"].startswith(CUSTOM_RESOURCE_GROUPS)]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_k8s_manifests_validate_against_the_kubernetes_schemas_strictly(version: str) -> None:
    """Every built-in resource in deploy/k8s/ passes strict schema validation (no unknown field)."""
    docs = builtin_k8s_docs()
    assert {doc["kind"] for doc in k8s_docs()} - {doc["kind"] for doc in docs} == {
        "ScaledObject", "TriggerAuthentication"}
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} against {version}: {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")


def test_strict_schema_validation_rejects_a_misspelt_field() -> None:
    """The validator as used above refuses a Deployment with a field Kubernetes does not know."""
    worker = copy.deepcopy(deployment("worker"))
    pod_spec(worker)["terminationGracePeriod"] = pod_spec(worker).pop("terminationGracePeriodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, kubernetes_validate.latest_version(), strict=True)


def test_keda_scaledobject_scales_the_worker_on_live_story_jobs() -> None:
    """The ScaledObject's postgresql trigger counts the interactive lane's pending and running story_jobs for the
    worker Deployment."""
    scaled = k8s_doc("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment("worker")["metadata"]["name"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "postgresql"
    query = " ".join(trigger["metadata"]["query"].split()).lower()
    # the live-jobs index's own predicate (tests/integration/test_explain.py runs it), the batch lane left out
    assert query == "select count(*) from story_jobs where status in ('pending', 'running') and lane = 'interactive'"


def test_keda_asks_for_one_worker_slot_per_live_job() -> None:
    """The trigger's target per replica is the worker's WORKER_CONCURRENCY, so running jobs keep their workers."""
    (trigger,) = k8s_doc("ScaledObject")["spec"]["triggers"]
    target = trigger["metadata"]["targetQueryValue"]
    assert isinstance(target, str)
    concurrency = container_env(only_container(deployment("worker")))["WORKER_CONCURRENCY"]
    assert float(target) == float(concurrency)


def test_keda_reads_the_connection_string_from_the_secret() -> None:
    """The trigger's TriggerAuthentication maps `connection` to DATABASE_URL in the Secret."""
    (trigger,) = k8s_doc("ScaledObject")["spec"]["triggers"]
    auth = k8s_doc("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["apiVersion"] == "keda.sh/v1alpha1"
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "connection"
    assert ref["key"] == "DATABASE_URL"
    assert "DATABASE_URL" in k8s_doc("Secret", ref["name"])["stringData"]


def test_worker_termination_grace_exceeds_its_shutdown_grace_and_llm_timeout() -> None:
    """The kubelet waits longer than WORKER_SHUTDOWN_GRACE_S plus the final flush, which outlasts a call."""
    worker = deployment("worker")
    env = container_env(only_container(worker))
    shutdown_grace = float(env["WORKER_SHUTDOWN_GRACE_S"])
    termination_grace = pod_spec(worker)["terminationGracePeriodSeconds"]
    assert termination_grace > shutdown_grace + SHUTDOWN_FLUSH_S
    # a rollout lets every call in flight finish rather than cutting a billed stream
    assert shutdown_grace > float(env["LLM_TIMEOUT_S"])


def test_worker_replicas_are_left_to_keda() -> None:
    """The worker Deployment sets no replica count that would fight the autoscaler."""
    assert "replicas" not in deployment("worker")["spec"]


def test_worker_requires_the_llm_key_from_the_secret() -> None:
    """ANTHROPIC_API_KEY comes from the Secret and is not optional, so no pod runs the offline writer by accident."""
    env = {e["name"]: e for e in only_container(deployment("worker")).get("env", [])}
    ref = env["ANTHROPIC_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] == "ANTHROPIC_API_KEY"
    assert not ref.get("optional", False)


def test_api_deployment_has_two_replicas_liveness_on_healthz_and_readiness_on_readyz() -> None:
    """The api runs two replicas, probed on /healthz (alive) and /readyz (database answers)."""
    api = deployment("api")
    assert api["spec"]["replicas"] == 2
    container = only_container(api)
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container_env(container)["API_HOST"] == "0.0.0.0"


def test_api_service_selects_the_api_pods() -> None:
    """The Service's selector matches the api pod labels and targets the http port."""
    service = k8s_doc("Service")
    labels = deployment("api")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_sweeper_runs_one_replica_replaced_by_recreate() -> None:
    """The sweeper Deployment keeps one replica and never runs old and new side by side."""
    sweeper = deployment("sweeper")
    assert sweeper["spec"]["replicas"] == 1
    assert sweeper["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize(("name", "port"), [("api", 8000), ("worker", 9100), ("sweeper", 9101)])
def test_metrics_ports_are_declared_and_annotated_for_scraping(name: str, port: int) -> None:
    """Each Deployment declares its metrics port and the matching prometheus.io annotations."""
    workload = deployment(name)
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    container = only_container(workload)
    assert port in [p["containerPort"] for p in container["ports"]]
    if name != "api":
        assert container_env(container)["METRICS_PORT"] == str(port)


def test_secret_manifest_holds_placeholders_only() -> None:
    """The Secret in the repository carries no real credentials."""
    values = k8s_doc("Secret")["stringData"]
    assert set(values) == {"DATABASE_URL", "ANTHROPIC_API_KEY"}
    assert all("REPLACE_ME" in value for value in values.values())


def test_k8s_pods_run_as_the_image_user_without_root() -> None:
    """Every pod runs as non-root with the uid the Dockerfile creates."""
    (user,) = [args for instruction, args in final_stage() if instruction == "USER"]
    uid = int(user.split(":")[0])
    for workload in workloads():
        security = pod_spec(workload)["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["runAsUser"] == uid
