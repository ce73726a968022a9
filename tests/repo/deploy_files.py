"""The files under deploy/ as the deploy checks read them: paths, parsed
manifests, containers' commands and environments, Dockerfile instructions,
and the metric names the code defines."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY

from shared import config

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


def code_metric_names() -> set[str]:
    """Every sample name the three processes can expose, from the registry."""
    for module in ("api.metrics", "worker.metrics", "worker.delivery.metrics", "worker.batch.metrics", "sweeper.metrics"):
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
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_panels() -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


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
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


def deployment(component_name: str) -> dict[str, Any]:
    found = [d for d in workloads() if d["kind"] == "Deployment" and component(d) == component_name]
    assert len(found) == 1, f"expected one {component_name} Deployment, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod_spec(workload)["containers"]
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
