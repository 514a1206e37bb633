"""/metrics: Prometheus text read from live state per scrape (ledger pools, DB rows, the Redis rejection counter)."""
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from incidents.models import CanaryRun
from incidents.services import incident_record
from kvserve.chat.metrics import admission_rejection_count_incr, admission_rejection_counts
from kvserve.tenants.models import Tenant
from tests.incidents.helpers import chat_request, live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


def scrape(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_read_live_state(client, registry, make_worker):
    tenant = Tenant.objects.create(name="acme")
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=10)
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1", num_pages=512)
    now = timezone.now()
    done = chat_request(tenant, status="done", completion_tokens=90, finished_at=now - timedelta(seconds=5),
                        handoff_verdict="OK", decode_verdict="ok")
    chat_request(tenant, status="done", completion_tokens=30, finished_at=now - timedelta(seconds=30),
                 handoff_verdict="OK", decode_verdict="ok")
    chat_request(tenant, status="done", completion_tokens=999, finished_at=now - timedelta(seconds=600))
    chat_request(tenant, status="rejected", handoff_verdict="REJECTED")
    chat_request(tenant, status="failed", handoff_verdict="OK", decode_verdict="handoff_mismatch")
    decode.allocate(done.id, 3)
    admission_rejection_count_incr()
    admission_rejection_count_incr()
    incident_record(kind="foreign_read", severity="critical", detected_by="t")
    incident_record(kind="lease_expired", severity="warning", detected_by="t")
    incident_record(kind="lease_expired", severity="warning", detected_by="t")
    CanaryRun.objects.create(started_at=now - timedelta(minutes=5), passed=True, checks=[])
    CanaryRun.objects.create(started_at=now, passed=False, checks=[
        {"name": "marker_scan", "passed": True, "duration_s": 0.5, "details": {}},
        {"name": "self_test", "passed": False, "duration_s": 2.0, "details": {"why": "no incident"}}])

    m = scrape(client)
    assert m[("kvserve_redis_up", ())] == 1
    assert m[("kvserve_pool_pages", (("pool", "decode-1"), ("role", "decode"), ("state", "used")))] == 3
    assert m[("kvserve_pool_pages", (("pool", "decode-1"), ("role", "decode"), ("state", "free")))] == 7
    assert m[("kvserve_pool_pages", (("pool", "prefill-1"), ("role", "prefill"), ("state", "free")))] == 512
    assert m[("kvserve_worker_capacity_tokens", (("role", "decode"), ("worker", "decode-1")))] == 8192
    assert m[("kvserve_effective_context_limit_tokens", ())] == 8192
    assert m[("kvserve_chat_requests", (("status", "done"),))] == 3
    assert m[("kvserve_chat_requests", (("status", "queued"),))] == 0
    assert m[("kvserve_admission_rejections_total", (("reason", "context_length_exceeded"),))] == 2
    assert m[("kvserve_handoff_verdicts", (("verdict", "OK"),))] == 3
    assert m[("kvserve_handoff_verdicts", (("verdict", "REJECTED"),))] == 1
    assert m[("kvserve_decode_verdicts", (("verdict", "handoff_mismatch"),))] == 1
    assert m[("kvserve_incidents", (("kind", "lease_expired"), ("severity", "warning")))] == 2
    assert m[("kvserve_incidents_open", ())] == 3
    assert m[("kvserve_canary_runs", (("result", "passed"),))] == 1
    assert m[("kvserve_canary_runs", (("result", "failed"),))] == 1
    assert m[("kvserve_canary_check_passed", (("check", "self_test"),))] == 0
    assert m[("kvserve_canary_check_duration_seconds", (("check", "marker_scan"),))] == 0.5
    assert m[("kvserve_canary_last_run_passed", ())] == 0
    assert m[("kvserve_decode_tokens_per_second", ())] == pytest.approx(120 / 60)


def test_metrics_follow_state_between_scrapes(client, registry, make_worker):
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=10)
    key = ("kvserve_pool_pages", (("pool", "decode-1"), ("role", "decode"), ("state", "used")))
    decode.allocate("r1", 4)
    assert scrape(client)[key] == 4
    decode.release("r1")
    assert scrape(client)[key] == 0


def test_metrics_without_redis_still_report_the_database(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    m = scrape(client)
    assert m[("kvserve_redis_up", ())] == 0
    assert ("kvserve_chat_requests", (("status", "done"),)) in m
    assert not [k for k in m if k[0] == "kvserve_pool_pages"]


def test_admission_rejection_counter_never_raises(settings):
    admission_rejection_count_incr("no_workers")
    assert admission_rejection_counts() == {"no_workers": 1}
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    admission_rejection_count_incr()  # logged, not raised
