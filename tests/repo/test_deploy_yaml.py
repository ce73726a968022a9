"""Every YAML file under deploy/ parses, each document a mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.repo.deploy_files import ALERT_TESTS, ALERTS, COMPOSE, DEPLOY, PROMETHEUS, k8s_files


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
