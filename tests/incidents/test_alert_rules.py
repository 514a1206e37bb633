"""ops/prometheus/kvserve-rules.yml under `promtool test rules`, against series recorded here from real /metrics
renderings (real Redis registry and ledger, real database rows): each scenario scrapes the deployment in the
states it goes through, the scrapes become promtool's input series (one value per 30 s step), and every alert of
the rules file is expected to fire exactly where the scenario says. promtool comes from Debian's `prometheus`
package (.ci/run and `make test` install it); without it these tests fail, never skip."""
import re
import shutil
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.conf import settings as django_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from incidents.models import CanaryRun
from incidents.services import incident_record
from inference.metrics import Batch
from kvserve.chat.selectors import model_get
from kvserve.paths import BASE_DIR
from tests.incidents.helpers import live_worker

RULES = BASE_DIR / "ops" / "prometheus" / "kvserve-rules.yml"
STEP_S = 30
STEPS_PER_SCRAPE = 60  # each recorded state holds 30 minutes of promtool time
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture(autouse=True)
def fresh_scrapes(settings):
    settings.KVSERVE_METRICS_CACHE_S = 0


def scrape(client) -> tuple[float, dict]:
    """(wall time, {series selector: value}) of one real /metrics rendering."""
    now = time.time()
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {django_settings.KVSERVE_METRICS_TOKEN}")
    assert response.status_code == 200
    series = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            series[f"{s.name}{{{labels}}}"] = s.value
    return now, series


def input_series(scrapes: list[tuple[float, dict]]) -> list[dict]:
    """promtool input series: scrape i holds steps [i*STEPS_PER_SCRAPE, (i+1)*STEPS_PER_SCRAPE). A Unix-time
    gauge is rebased onto promtool's clock (which starts at 0): its age at the scrape is its age at the end of the
    scrape's steps (0, "never", stays 0)."""
    names = sorted({name for _, series in scrapes for name in series})
    out = []
    for name in names:
        values = []
        for i, (wall, series) in enumerate(scrapes):
            value = series.get(name)
            if value is not None and name.startswith("kvserve_canary_last_run_timestamp_seconds") and value > 0:
                value = end_of(i) - (wall - value)
            values += ["_" if value is None else repr(float(value))] * STEPS_PER_SCRAPE
        out.append({"series": name, "values": " ".join(values)})
    return out


def rules() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def expected(alert: str, **labels) -> dict:
    """promtool's exp_alerts entry: the series' labels plus the rule's, its annotations rendered."""
    rule = rules()[alert]
    all_labels = {**labels, **rule.get("labels", {})}
    render = lambda text: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)  # noqa: E731
    return {"exp_labels": all_labels,
            "exp_annotations": {k: render(v) for k, v in rule.get("annotations", {}).items()}}


def promtool_test(tmp_path: Path, series: list[dict], at_s: int, firing: dict[str, list[dict]]) -> None:
    """Runs `promtool test rules`: every alert of the rules file evaluated at `at_s`, firing exactly as `firing`
    says (an alert not named must not fire)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install Debian's prometheus package (.ci/run and `make test` do)"
    unknown = set(firing) - set(rules())
    assert not unknown, f"no such alerts in {RULES.name}: {unknown}"
    tests = {"rule_files": [str(RULES)], "evaluation_interval": f"{STEP_S}s", "tests": [{
        "interval": f"{STEP_S}s", "input_series": series,
        "alert_rule_test": [{"eval_time": f"{at_s}s", "alertname": name, "exp_alerts": firing.get(name, [])}
                            for name in rules()]}]}
    path = tmp_path / "kvserve-rules.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def end_of(scrape_index: int) -> int:
    return ((scrape_index + 1) * STEPS_PER_SCRAPE - 1) * STEP_S


def test_rules_file_loads():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install Debian's prometheus package (.ci/run and `make test` do)"
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_nothing_scraped_fires_metrics_absent_only(tmp_path):
    promtool_test(tmp_path, [{"series": 'unrelated_up{job="other"}', "values": "1x40"}], end_of(0),
                  {"KvserveMetricsAbsent": [expected("KvserveMetricsAbsent")]})


def test_a_fresh_deployment_whose_canary_never_ran(client, tmp_path):
    """No worker registered, no canary run yet: the canary alert fires though no canary series has a run."""
    series = input_series([scrape(client)])
    promtool_test(tmp_path, series, end_of(0), {
        "KvserveCanaryStale": [expected("KvserveCanaryStale")],
        "KvserveNoLiveWorker": [expected("KvserveNoLiveWorker", role="decode"),
                                expected("KvserveNoLiveWorker", role="prefill")],
        "KvserveCannotServe": [expected("KvserveCannotServe")]})


def _canary_run(minutes_ago: float, outcome: str = "passed") -> None:
    CanaryRun.objects.create(started_at=timezone.now() - timedelta(minutes=minutes_ago), passed=outcome == "passed",
                             checks=[{"name": "marker_scan", "passed": outcome == "passed", "outcome": outcome,
                                      "duration_s": 0.5, "details": {}}])


def test_healthy_then_trouble(client, registry, make_worker, tmp_path):
    """A healthy deployment fires nothing; then a wrong canary check, a critical incident that quarantines a
    worker (the only prefill worker: nothing can be admitted), a guard violation, a worker whose window outgrows its pool and a full pool each fire their alert."""
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=100)
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1", num_pages=512)
    _canary_run(minutes_ago=1)
    healthy = scrape(client)
    promtool_test(tmp_path, input_series([healthy]), end_of(0), {})

    _canary_run(minutes_ago=0, outcome="wrong")
    incident_record(kind="foreign_read", severity="critical", worker="prefill-1", pool="prefill-1",
                    detected_by="canary")
    Batch().inc("guard_violations", model_name=model_get()["id"], role="prefill", kind="foreign_read").send(
        registry.redis, registry.prefix)
    registry.heartbeat("decode-1", window=16384)  # over its 8192-token pool
    decode.allocate("r1", 95)
    trouble = scrape(client)
    promtool_test(tmp_path, input_series([healthy, trouble]), end_of(1), {
        "KvserveCanaryFailed": [expected("KvserveCanaryFailed")],
        "KvserveCriticalIncident": [expected("KvserveCriticalIncident")],
        "KvserveWorkerQuarantined": [expected("KvserveWorkerQuarantined", worker="prefill-1", role="prefill")],
        "KvservePoolUnsafe": [expected("KvservePoolUnsafe", worker="decode-1", role="decode")],
        "KvserveKvCacheUsageHigh": [expected("KvserveKvCacheUsageHigh", pool="decode-1", role="decode")],
        # the quarantine took the only prefill worker out of admission
        "KvserveCannotServe": [expected("KvserveCannotServe")]})
    # the guard violation is an increase: it fires within 5 minutes of the change, and not at the end
    promtool_test(tmp_path, input_series([healthy, trouble]), STEPS_PER_SCRAPE * STEP_S + 150, {
        "KvserveCanaryFailed": [expected("KvserveCanaryFailed")],
        "KvserveCriticalIncident": [expected("KvserveCriticalIncident")],
        "KvserveIsolationViolation": [expected("KvserveIsolationViolation")],
        "KvserveWorkerQuarantined": [expected("KvserveWorkerQuarantined", worker="prefill-1", role="prefill")],
        "KvservePoolUnsafe": [expected("KvservePoolUnsafe", worker="decode-1", role="decode")],
        "KvserveCannotServe": [expected("KvserveCannotServe")]})


def test_a_canary_that_stopped_running(client, registry, make_worker, tmp_path):
    live_worker(registry, make_worker, "decode", worker_id="decode-1")
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1")
    _canary_run(minutes_ago=40)
    promtool_test(tmp_path, input_series([scrape(client)]), end_of(0),
                  {"KvserveCanaryStale": [expected("KvserveCanaryStale")]})
