"""deploy/k8s/coordinator-ha.yaml says what the README and the code say: two replicas on
etcd, readiness on the CohortService's health (a standby is NOT_SERVING), liveness on "",
and only settings `serve` reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from cohortgate.coordinator.edge.config import ServeConfig
from cohortgate.coordinator.edge.server import SERVICE_NAME

REPO = Path(__file__).resolve().parent.parent


def _docs() -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all((REPO / "deploy/k8s/coordinator-ha.yaml").read_text())
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_two_replicas_ready_only_while_leading_and_alive_while_standing_by() -> None:
    docs = _docs()
    replicas = docs["StatefulSet/cohortgate"]["spec"]
    assert replicas["replicas"] == 2
    (container,) = replicas["template"]["spec"]["containers"]
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert "service" not in container["livenessProbe"]["grpc"], "liveness: health ''"
    assert any(a.startswith("--advertise=") for a in container["args"])
    assert docs["Service/cohortgate-replicas"]["spec"]["publishNotReadyAddresses"] is True


def test_every_setting_in_the_config_map_is_one_serve_reads() -> None:
    settings = _docs()["ConfigMap/cohortgate-etcd"]["data"]
    text = (REPO / "deploy/k8s/coordinator-ha.yaml").read_text()
    commented = [
        line.split("#", 1)[1].split(":")[0].strip()
        for line in text.splitlines()
        if line.strip().startswith("# COHORTGATE_")
    ]
    variables = {f"COHORTGATE_{f.upper()}" for f in ServeConfig.model_fields}
    assert "COHORTGATE_ETCD" in settings
    assert set(settings) | set(commented) <= variables, set(settings) | set(commented)
