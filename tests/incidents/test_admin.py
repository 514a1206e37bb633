"""Incident/CanaryRun admin: pages render with filters and search; actions call the services."""
import pytest
from django.urls import reverse
from django.utils import timezone

from incidents.models import CanaryRun, Incident, WorkerRelease
from incidents.services import incident_record

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture
def incidents():
    return [
        incident_record(kind="foreign_read", severity="critical", pool="decode", worker="w1",
                        pages=[1], detected_by="attention_guard"),
        incident_record(kind="canary_leak", severity="warning", pool="decode", worker="w2",
                        detected_by="canary"),
    ]


def test_changelist_filters_and_search(admin_client, incidents):
    url = reverse("admin:incidents_incident_changelist")
    assert admin_client.get(url).status_code == 200
    page = admin_client.get(url, {"severity__exact": "critical"})
    assert list(page.context["cl"].result_list) == [incidents[0]]
    page = admin_client.get(url, {"q": "w2"})
    assert list(page.context["cl"].result_list) == [incidents[1]]
    assert admin_client.get(reverse("admin:incidents_incident_change", args=[incidents[0].pk])).status_code == 200


def test_acknowledge_resolve_release_actions(admin_client, admin_user, incidents, registry):
    url = reverse("admin:incidents_incident_changelist")
    ids = [str(i.pk) for i in incidents]
    admin_client.post(url, {"action": "acknowledge", "_selected_action": ids})
    assert Incident.objects.filter(acknowledged_by=admin_user).count() == 2
    admin_client.post(url, {"action": "resolve", "_selected_action": ids[:1]})
    assert Incident.objects.filter(resolved_at__isnull=False).count() == 1
    assert registry.is_quarantined("w1")
    admin_client.post(url, {"action": "release_workers", "_selected_action": ids[:1]})
    assert not registry.is_quarantined("w1")
    assert WorkerRelease.objects.get(worker="w1").released_by == admin_user


def test_canary_run_admin(admin_client):
    run = CanaryRun.objects.create(
        started_at=timezone.now(), finished_at=timezone.now(), passed=False,
        checks=[{"name": "marker_scan", "passed": False, "duration_s": 0.2, "details": {}}],
    )
    url = reverse("admin:incidents_canaryrun_changelist")
    page = admin_client.get(url, {"passed__exact": "0"})
    assert list(page.context["cl"].result_list) == [run]
    assert admin_client.get(reverse("admin:incidents_workerrelease_changelist")).status_code == 200
