"""What on-call watches: the status page in a real browser, /status.json and /metrics, a real
Prometheus scraping the coordinator, promtool on the alert rules, and the dashboard and
alerts naming only exported metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from cohortgate.coordinator.service.metrics import Metrics
from tests.helpers import (
    REPO,
    InProcessCoordinator,
    finish_cohort,
    free_port,
    hold_partial_cohort,
    http_get,
    manifest_of,
    run_cohort,
)
from tests.launches import kill_group, program


# -- the status page -------------------------------------------------------------------
@pytest.mark.e2e
def test_status_page_in_headless_chromium_shows_missing_ranks(
    coord: InProcessCoordinator, tmp_path: Path
) -> None:
    chromium = program("chromium")
    pool = hold_partial_cohort(coord, "page-job", [0, 1, 4], 6)
    try:
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
        ]
        url = coord.metrics_url + "/status"
        dom = subprocess.run(
            [chromium, *flags, "--dump-dom", url],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        shot = tmp_path / "status.png"
        subprocess.run(
            [chromium, *flags, f"--screenshot={shot}", "--window-size=1200,700", url],
            capture_output=True,
            timeout=60,
            check=False,
        )
    finally:
        finish_cohort(coord, "page-job", [2, 3, 5], 6)
        pool.shutdown(wait=True)
    assert "Waiting cohorts" in dom
    row = re.search(r"<tr><td>page-job</td>.*?</tr>", dom, re.S)
    assert row is not None, dom
    assert '<td class="missing">2-3,5</td>' in row.group(0)
    assert "3/6" in row.group(0)
    assert not re.search(r'(src|href)="(https?:)?//', dom), "the page loads nothing from outside"
    assert shot.exists() and shot.stat().st_size > 1000
    if os.environ.get("COHORTGATE_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["COHORTGATE_KEEP_SCREENSHOT"])


def test_status_json_and_metrics_endpoint(coord: InProcessCoordinator) -> None:
    ref, wide = manifest_of(4), manifest_of(8)
    run_cohort(coord.addr, "m-ok", {0: ref, 1: ref})
    run_cohort(coord.addr, "m-bad", {0: ref, 1: wide})
    text = http_get(coord.metrics_url + "/metrics")
    assert 'cohortgate_verdicts_total{cause="none",outcome="formed"} 1.0' in text
    assert 'cohortgate_verdicts_total{cause="signature_mismatch",outcome="refused"} 1.0' in text
    assert "cohortgate_joins_total 4.0" in text
    assert 'cohortgate_manifest_uploads_total{result="accepted"} 3.0' in text
    assert 'cohortgate_formation_from_last_join_seconds_count{outcome="refused"} 1.0' in text
    assert "cohortgate_ranks_waiting 0.0" in text
    assert "rank=" not in text and "job=" not in text, "no per-rank or per-job labels"
    status = json.loads(http_get(coord.metrics_url + "/status.json"))
    outcomes = {(v["job_id"], v["outcome"]) for v in status["recent_verdicts"]}
    assert {("m-ok", "formed"), ("m-bad", "refused")} <= outcomes


# -- Prometheus itself -------------------------------------------------------------------
@pytest.mark.slow
def test_real_prometheus_scrapes_and_answers_promql(
    coord: InProcessCoordinator, tmp_path: Path
) -> None:
    prometheus = program("prometheus")
    ref, wide = manifest_of(4), manifest_of(8)
    run_cohort(coord.addr, "p-ok", {0: ref, 1: ref})
    run_cohort(coord.addr, "p-bad", {0: ref, 1: wide})
    run_cohort(coord.addr, "p-bad2", {0: wide, 1: ref, 2: ref})
    target = coord.metrics_url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: cohortgate, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        query = "sum by (outcome) (cohortgate_verdicts_total)"
        url = f"http://127.0.0.1:{port}/api/v1/query?query=" + urllib.parse.quote(query)
        give_up = time.monotonic() + 60
        while True:
            try:
                result = json.loads(http_get(url))["data"]["result"]
            except OSError:
                result = []
            counts = {r["metric"]["outcome"]: float(r["value"][1]) for r in result}
            if counts:
                break
            assert time.monotonic() < give_up, "prometheus never scraped the coordinator"
            time.sleep(0.5)
    finally:
        kill_group(proc)
    assert counts == {"formed": 1.0, "refused": 2.0}


def test_promtool_accepts_the_alert_rules_and_config() -> None:
    promtool = program("promtool")
    rules = (REPO / "deploy/prometheus/alerts.yml").read_text().count("- alert: ")
    for what, file, said in (
        ("check rules", "alerts.yml", f"SUCCESS: {rules} rules found"),
        ("check config", "prometheus.yml", "SUCCESS"),
        ("test rules", "alerts_test.yml", "SUCCESS"),  # the stall and divergence alerts fire, clear
    ):
        checked = subprocess.run(
            [promtool, *what.split(), str(REPO / "deploy/prometheus" / file)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert said in checked.stdout + checked.stderr, checked.stdout


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\b(cohortgate_[a-z_]+)\b", text))


def test_dashboard_and_alerts_use_only_exported_metrics() -> None:
    exported = Metrics().names()
    dashboard = json.loads((REPO / "deploy/grafana/cohortgate-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = _metric_names("\n".join(exprs))
    used |= _metric_names((REPO / "deploy/prometheus/alerts.yml").read_text())
    assert len(used) >= 8
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    assert dashboard["id"] is None and dashboard["uid"] == "cohortgate-overview"
    assert dashboard["templating"]["list"][0]["type"] == "datasource"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
