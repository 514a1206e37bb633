"""A canary run's page (/dashboard/canary/<id>/): per check and per worker what was probed and what was seen, as
tables (nothing truncated, everything escaped), staff only, linked from the dashboard and from the incidents it raised."""
import pytest
from django.utils import timezone

from incidents.models import CanaryRun
from incidents.selectors import canary_latest_get, incident_open_list
from incidents.services import incident_record

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]
LONG = "the decode worker answered " + "x" * 400 + " END"


@pytest.fixture
def run():
    run = CanaryRun.objects.create(started_at=timezone.now(), passed=False, checks=[
        {"name": "live_probes", "passed": False, "outcome": "wrong", "duration_s": 1.25, "details": {
            "workers": {"decode-1": {"role": "decode", "checks": {
                "foreign_read": {"ok": False, "outcome": "wrong", "probe": "read page 3 of another owner",
                                 "seen": LONG},
                "scrub": {"ok": True, "outcome": "passed", "pages": [1, 2, 3]}}},
                        "prefill-1": {"role": "prefill", "checks": {
                            "foreign_read": {"ok": None, "outcome": "not_judged", "reason": "busy"}}}}}},
        {"name": "marker", "passed": True, "outcome": "passed", "duration_s": 0.5,
         "details": {"requests": [{"id": "chatcmpl-1", "tenant": "<script>alert(1)</script>"}], "leaks": []}},
    ])
    incident = incident_record(kind="foreign_read", severity="critical", pool="decode-1", worker="decode-1",
                               detected_by="canary live_probes",
                               details={"canary_run": run.pk, "check": "live_probes"})
    return run, incident


def test_the_page_shows_each_probe_per_worker_untruncated_and_escaped(admin_client, run):
    run, incident = run
    page = admin_client.get(f"/dashboard/canary/{run.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-worker="decode-1" data-probe="foreign_read" data-outcome="wrong"' in html
    assert 'data-worker="decode-1" data-probe="scrub" data-outcome="passed"' in html
    assert 'data-worker="prefill-1" data-probe="foreign_read" data-outcome="not_judged"' in html
    assert LONG in html and "read page 3 of another owner" in html  # what was probed and what was seen, whole
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert f'href="/admin/incidents/incident/{incident.pk}/change/"' in html


def test_the_page_is_linked_from_the_dashboard_and_the_incident(admin_client, run):
    run, incident = run
    assert canary_latest_get()["url"] == f"/dashboard/canary/{run.pk}/"
    (listed,) = incident_open_list()
    assert listed["canary_url"] == f"/dashboard/canary/{run.pk}/"
    change = admin_client.get(f"/admin/incidents/incident/{incident.pk}/change/").content.decode()
    assert f'href="/dashboard/canary/{run.pk}/"' in change
    other = incident_record(kind="integrity", severity="warning", pool="p", detected_by="reaper")
    assert next(i for i in incident_open_list() if i["id"] == other.pk)["canary_url"] is None


def test_the_page_is_staff_only(client, django_user_model, run):
    run, _ = run
    assert client.get(f"/dashboard/canary/{run.pk}/").status_code == 302
    django_user_model.objects.create_user("tenant-user", password="pw-x-12345")
    client.login(username="tenant-user", password="pw-x-12345")
    assert client.get(f"/dashboard/canary/{run.pk}/").status_code == 302
    django_user_model.objects.create_user("ops", password="pw-ops-123", is_staff=True)
    client.login(username="ops", password="pw-ops-123")
    assert client.get(f"/dashboard/canary/{run.pk}/").status_code == 200
    assert client.get(f"/dashboard/canary/{run.pk + 100}/").status_code == 404
