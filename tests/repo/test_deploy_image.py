"""deploy/Dockerfile builds a slim image of the project without its test
extras, runs as a user that is not root, and names no registry host."""

from __future__ import annotations

import re

from tests.repo.deploy_files import (
    compose,
    dockerfile_instructions,
    final_stage,
    pod_spec,
    registry_host,
    resolve_base_image,
    workloads,
)


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
