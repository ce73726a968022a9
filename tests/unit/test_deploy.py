"""The deployment files under deploy/ agree with the code: the metrics they
query exist, the manifests parse and start the right processes, and the
timeouts they set are consistent with how the worker shuts down."""

from __future__ import annotations

import copy
import importlib
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate_utils
from prometheus_client import REGISTRY

from shared import config
from worker.coordinator import SHUTDOWN_FLUSH_S

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "tests"
DASHBOARD = DEPLOY / "grafana" / "storyjobs-dashboard.json"
K8S = DEPLOY / "k8s"

METRIC = re.compile(r"storyjobs_[a-z_]+")
ENTRYPOINTS = {"python -m api", "python -m worker", "python -m sweeper", "storyjobs migrate"}
# placeholders for secret values, so that settings can be validated
SECRET_STAND_INS = {"DATABASE_URL": "postgresql://storyjobs@db.invalid:5432/storyjobs", "ANTHROPIC_API_KEY": "sk-test"}
SETTINGS_BY_COMPONENT: dict[str, type[config.BaseSettings]] = {
    "api": config.ApiSettings,
    "worker": config.WorkerSettings,
    "sweeper": config.SweeperSettings,
    "migrate": config.BaseSettings,
}


# -- helpers -------------------------------------------------------------------


def code_metric_names() -> set[str]:
    """Every sample name the three processes can expose, from the registry."""
    for module in ("api.metrics", "worker.metrics", "worker.delivery.metrics", "sweeper.metrics"):
        importlib.import_module(module)
    names: set[str] = set()
    for family in REGISTRY.collect():
        if not family.name.startswith("storyjobs_"):
            continue
        # a labelled metric with no child yet has no samples: derive its names
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
        names |= {sample.name for sample in family.samples}
    return names


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def k8s_files() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


def k8s_docs() -> Iterator[dict[str, Any]]:
    for path in k8s_files():
        yield from (doc for doc in yaml.safe_load_all(path.read_text()) if doc)


def k8s_doc(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in k8s_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workloads() -> list[dict[str, Any]]:
    return [d for d in k8s_docs() if d["kind"] in ("Deployment", "Job")]


def component(doc: dict[str, Any]) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def deployment(component_name: str) -> dict[str, Any]:
    found = [d for d in workloads() if d["kind"] == "Deployment" and component(d) == component_name]
    assert len(found) == 1, f"expected one {component_name} Deployment, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    return containers[0]


def command_line(container: dict[str, Any]) -> str:
    return shlex.join([*container.get("command", []), *container.get("args", [])])


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment a container gets: its ConfigMaps, then its own env,
    with stand-ins for values read from the Secret."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(k8s_doc("ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            secret_ref = entry["valueFrom"]["secretKeyRef"]
            assert secret_ref["key"] in k8s_doc("Secret", secret_ref["name"])["stringData"]
            env[entry["name"]] = SECRET_STAND_INS[secret_ref["key"]]
    return env


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """A compose service's environment with ${VAR:-default} resolved to the default."""
    return {
        name: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))
        for name, value in service.get("environment", {}).items()
    }


def duration_s(text: str) -> float:
    """A compose duration such as '300s' or '4m30s', in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts and text, f"not a duration: {text!r}"
    hours, minutes, seconds = (int(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            pairs.append((instruction.upper(), arguments.strip()))
    return pairs


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    return instructions[last_from:]


def resolve_base_image(reference: str) -> str:
    """A FROM image with ${ARG} replaced by the ARG's default."""
    defaults = dict(
        arguments.split("=", 1) for instruction, arguments in dockerfile_instructions()
        if instruction == "ARG" and "=" in arguments
    )
    return re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], reference.split()[0])


def registry_host(image: str) -> str | None:
    """The registry host an image reference names, if any (Docker Hub names none)."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return None


# -- metrics -------------------------------------------------------------------


def test_metric_helper_sees_counter_histogram_and_gauge_names() -> None:
    """The names collected from the registry include each metric type's exposed suffixes."""
    names = code_metric_names()
    assert {
        "storyjobs_jobs_rejected_total",
        "storyjobs_http_request_duration_seconds_bucket",
        "storyjobs_job_run_seconds_count",
        "storyjobs_worker_busy",
        "storyjobs_oldest_pending_age_seconds",
    } <= names
    # a counter is exposed with _total only: its bare name is no metric
    assert "storyjobs_jobs_rejected" not in names


def test_alert_rules_use_only_metrics_defined_in_code() -> None:
    """Every storyjobs_ metric named in an alert expression or annotation exists in the code."""
    used: set[str] = set()
    for rule in alert_rules():
        used |= set(METRIC.findall(rule["expr"]))
        for text in rule["annotations"].values():
            used |= set(METRIC.findall(text))
    assert len(used) >= 8
    assert used - code_metric_names() == set()


def test_dashboard_uses_only_metrics_defined_in_code() -> None:
    """Every storyjobs_ metric queried by a dashboard panel exists in the code."""
    used = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert len(used) >= 10
    assert used - code_metric_names() == set()


def test_alerts_cover_queue_failures_races_claims_sweeper_api_rejections_and_spend() -> None:
    """The alert expressions watch each operational signal the services export."""
    exprs = "\n".join(rule["expr"] for rule in alert_rules())
    for needed in (
        "storyjobs_oldest_pending_age_seconds",
        'storyjobs_job_transitions_total{to="failed"}',
        "storyjobs_lost_races_total",
        'storyjobs_jobs{status="pending"}',
        'storyjobs_job_transitions_total{to="running"}',
        "storyjobs_sweeper_last_run_timestamp_seconds",
        "storyjobs_http_requests_total",
        'storyjobs_jobs_rejected_total{reason="queue_full"}',
        "storyjobs_llm_cost_usd_total",
    ):
        assert needed in exprs, needed


def test_every_alert_has_a_summary_and_a_description_of_what_to_do() -> None:
    """Each alert rule carries a severity, a summary and a non-trivial description."""
    rules = alert_rules()
    assert len({rule["alert"] for rule in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"].split()) >= 15, rule["alert"]


def test_dashboard_is_grafana_json_with_a_prometheus_datasource_variable() -> None:
    """The dashboard declares a Prometheus datasource variable that every panel and query uses."""
    board = dashboard()
    assert board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    data_panels = [p for p in dashboard_panels() if p["type"] != "row"]
    assert data_panels
    for panel in data_panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids))


def test_dashboard_quantiles_read_histogram_buckets() -> None:
    """Every histogram_quantile in the dashboard runs over a _bucket series."""
    quantiles = [expr for expr in dashboard_exprs() if "histogram_quantile" in expr]
    assert quantiles
    for expr in quantiles:
        assert re.search(r"storyjobs_[a-z_]+_bucket\b", expr), expr
    joined = "\n".join(quantiles)
    for histogram in ("storyjobs_job_queue_wait_seconds", "storyjobs_job_run_seconds",
                      "storyjobs_http_request_duration_seconds"):
        assert histogram + "_bucket" in joined


def test_dashboard_shows_queue_workers_llm_sweeper_and_api() -> None:
    """The dashboard has panels for each area an operator watches."""
    used = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert {
        "storyjobs_jobs",
        "storyjobs_oldest_pending_age_seconds",
        "storyjobs_job_transitions_total",
        "storyjobs_llm_requests_total",
        "storyjobs_llm_tokens_total",
        "storyjobs_llm_cost_usd_total",
        "storyjobs_lost_races_total",
        "storyjobs_sweeper_reclaimed_total",
        "storyjobs_http_requests_total",
        "storyjobs_worker_busy",
        "storyjobs_worker_slots",
    } <= used


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *map(str, args)], capture_output=True, text=True, check=False, cwd=ROOT)


def alert_rule_tests() -> dict[Path, dict[str, Any]]:
    """The promtool unit test files under deploy/prometheus/tests/, parsed."""
    return {path: yaml.safe_load(path.read_text()) for path in sorted(ALERT_TESTS.glob("*.yml"))}


def alerts_tested(test_files: list[dict[str, Any]], *, firing: bool) -> set[str]:
    """The alert names that some case expects to fire (firing=True) or to stay quiet."""
    return {
        case["alertname"]
        for document in test_files
        for group in document["tests"]
        for case in group.get("alert_rule_test", [])
        if bool(case.get("exp_alerts")) is firing
    }


def untested_alerts(rules: list[dict[str, Any]], test_files: list[dict[str, Any]]) -> set[str]:
    """Alerts without both a firing and a quiet case in the unit tests."""
    names = {rule["alert"] for rule in rules}
    covered = alerts_tested(test_files, firing=True) & alerts_tested(test_files, firing=False)
    return names - covered


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed "
                                    "(Debian package prometheus; .ci/run installs it)")


@needs_promtool
def test_prometheus_config_and_rules_pass_promtool() -> None:
    """promtool accepts the Prometheus config, with the rule file it loads, and the alert rules."""
    config_check = promtool("check", "config", PROMETHEUS)
    assert config_check.returncode == 0, config_check.stdout + config_check.stderr
    rules_check = promtool("check", "rules", ALERTS)
    assert rules_check.returncode == 0, rules_check.stdout + rules_check.stderr


@needs_promtool
def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    """`promtool test rules` passes on every file under deploy/prometheus/tests/."""
    files = list(alert_rule_tests())
    assert files
    result = promtool("test", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_unit_tests_showing_it_firing_and_quiet() -> None:
    """Each alert in alerts.yml is expected to fire in one test case and to stay quiet in another."""
    tests = alert_rule_tests()
    for path, document in tests.items():
        rule_files = [(path.parent / name).resolve() for name in document["rule_files"]]
        assert rule_files == [ALERTS], path.name
    assert untested_alerts(alert_rules(), list(tests.values())) == set()


def test_an_alert_without_a_firing_case_counts_as_untested() -> None:
    """The coverage check names an alert that no unit test expects to fire."""
    tests = list(alert_rule_tests().values())
    new_rule = {"alert": "StoryjobsSomethingNew", "expr": "vector(1)"}
    quiet_only = {"tests": [{"alert_rule_test": [
        {"eval_time": "1m", "alertname": "StoryjobsSomethingNew", "exp_alerts": []}]}]}
    assert untested_alerts([*alert_rules(), new_rule], [*tests, quiet_only]) == {"StoryjobsSomethingNew"}


# -- YAML and entrypoints ------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [COMPOSE, ALERTS, PROMETHEUS, *k8s_files(), *sorted(ALERT_TESTS.glob("*.yml"))],
    ids=lambda p: str(p.relative_to(DEPLOY)),
)
def test_deploy_yaml_file_parses(path: Path) -> None:
    """The file is YAML whose every document is a mapping."""
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert documents
    assert all(isinstance(doc, dict) for doc in documents)


def test_k8s_directory_holds_the_expected_kinds() -> None:
    """The manifests define config, secret, migrate job, three deployments, a service and KEDA objects."""
    kinds = sorted(doc["kind"] for doc in k8s_docs())
    for kind in ("ConfigMap", "Secret", "Job", "Service", "ScaledObject", "TriggerAuthentication"):
        assert kind in kinds
    assert kinds.count("Deployment") == 3


def test_compose_runs_the_three_entrypoints_and_migrate() -> None:
    """The compose services start api, worker, sweeper and `storyjobs migrate`."""
    services = compose()["services"]
    commands = {name: shlex.join(service["command"]) for name, service in services.items()
                if "command" in service and name != "prometheus"}
    assert commands == {
        "migrate": "storyjobs migrate",
        "api": "python -m api",
        "worker": "python -m worker",
        "sweeper": "python -m sweeper",
    }


def test_compose_services_wait_for_migrate_which_waits_for_healthy_postgres() -> None:
    """api, worker and sweeper start after migrate succeeded; migrate after postgres is healthy."""
    services = compose()["services"]
    assert services["postgres"]["healthcheck"]["test"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker", "sweeper"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    assert services["migrate"].get("restart") == "no"


def test_compose_worker_can_be_scaled_and_exposes_metrics_inside_the_network() -> None:
    """The worker has no fixed name or published port, and serves metrics on 9100."""
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert compose_env(worker)["METRICS_PORT"] == "9100"


def test_compose_api_listens_on_all_interfaces_and_is_published() -> None:
    """The api binds 0.0.0.0 inside its container and publishes its port."""
    api = compose()["services"]["api"]
    assert compose_env(api)["API_HOST"] == "0.0.0.0"
    assert any(str(port).endswith(":8000") for port in api["ports"])


def test_compose_worker_stop_grace_exceeds_its_shutdown_grace() -> None:
    """Docker waits longer than the worker's own grace plus its final flush before SIGKILL."""
    worker = compose()["services"]["worker"]
    grace = float(compose_env(worker)["WORKER_SHUTDOWN_GRACE_S"])
    assert duration_s(worker["stop_grace_period"]) > grace + SHUTDOWN_FLUSH_S


def test_compose_settings_pass_the_processes_own_validation() -> None:
    """Each compose service's environment loads without a configuration error."""
    services = compose()["services"]
    for name, settings_type in SETTINGS_BY_COMPONENT.items():
        env = {**compose_env(services[name]), "ANTHROPIC_API_KEY": "sk-test"}
        config.load(settings_type, env)


def test_prometheus_scrapes_api_sweeper_and_every_worker_replica() -> None:
    """Prometheus loads alerts.yml and finds worker replicas through compose DNS on port 9100."""
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    assert prometheus["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["storyjobs-worker"]["dns_sd_configs"] == [
        {"names": ["worker"], "type": "A", "port": 9100, "refresh_interval": "15s"}
    ]
    assert jobs["storyjobs-api"]["static_configs"][0]["targets"] == ["api:8000"]
    assert jobs["storyjobs-sweeper"]["static_configs"][0]["targets"] == ["sweeper:9101"]
    mounts = compose()["services"]["prometheus"]["volumes"]
    assert any(m.startswith("./prometheus/alerts.yml:") for m in mounts)


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
        config.load(settings_type, container_env(only_container(workload)))


# -- Kubernetes specifics -----------------------------------------------------------------


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
    """The ScaledObject's postgresql trigger counts pending and running story_jobs for the worker Deployment."""
    scaled = k8s_doc("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment("worker")["metadata"]["name"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "postgresql"
    query = " ".join(trigger["metadata"]["query"].split()).lower()
    # the live-jobs index's own predicate (tests/integration/test_explain.py runs it)
    assert query == "select count(*) from story_jobs where status in ('pending', 'running')"


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


# -- image ---------------------------------------------------------------------------------


def test_dockerfile_runs_as_a_non_root_user() -> None:
    """The final stage switches to a USER other than root before its command."""
    stage = final_stage()
    users = [args for instruction, args in stage if instruction == "USER"]
    assert users, "the final stage never sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    last_user = max(i for i, (instruction, _) in enumerate(stage) if instruction == "USER")
    assert all(instruction != "RUN" for instruction, _ in stage[last_user:])


def test_dockerfile_builds_on_slim_python_and_installs_the_project_without_test_extras() -> None:
    """Both stages use python:3.11-slim; pip installs the project from pyproject.toml, no extras."""
    instructions = dockerfile_instructions()
    bases = [resolve_base_image(args) for instruction, args in instructions if instruction == "FROM"]
    assert len(bases) >= 2
    assert set(bases) == {"python:3.11-slim"}
    installs = [args for instruction, args in instructions if instruction == "RUN" and "pip install" in args]
    assert any(re.search(r"pip install \.(\s|$)", args) for args in installs)
    assert not any("[" in args for args in installs)
    copied = " ".join(args for instruction, args in instructions if instruction == "COPY")
    for part in ("pyproject.toml", "api/", "worker/", "sweeper/", "shared/", "tools/", "sql/"):
        assert part in copied


def test_images_name_no_registry_host() -> None:
    """Compose, Kubernetes and Dockerfile images are plain Docker Hub or local names."""
    images = [service["image"] for service in compose()["services"].values()]
    images += [c["image"] for w in workloads() for c in pod_spec(w)["containers"]]
    images += [resolve_base_image(args) for instruction, args in dockerfile_instructions() if instruction == "FROM"]
    assert len(images) >= 8
    assert {image: registry_host(image) for image in images if registry_host(image)} == {}
    assert registry_host("localhost:5000/storyjobs:1") == "localhost:5000"
