"""Incident/CanaryRun admin: pages render with filters and search; actions call the services."""
import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
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


# ---- permissions: each action needs its own, and is written to the admin log -------------------------

INCIDENTS = "/admin/incidents/incident/"


def staff_login(client, name, *codenames):
    user = User.objects.create_user(name, password="pw-staff-123", is_staff=True)
    user.user_permissions.add(*[Permission.objects.get(codename=c, content_type__app_label="incidents")
                                for c in codenames])
    client.force_login(user)
    return user


def offered(client) -> set[str]:
    form = client.get(INCIDENTS).context["action_form"]
    return {name for name, _ in form.fields["action"].choices} if form is not None else set()


def run_all_actions(client, incidents):
    ids = [str(i.pk) for i in incidents]
    for action in ("acknowledge", "resolve", "release_workers"):
        client.post(INCIDENTS, {"action": action, "_selected_action": ids})


def test_view_only_staff_changes_nothing(client, incidents, registry):
    staff_login(client, "viewer", "view_incident")
    assert offered(client) - {""} == set()
    run_all_actions(client, incidents)
    assert not Incident.objects.filter(acknowledged_at__isnull=False).exists()
    assert not Incident.objects.filter(resolved_at__isnull=False).exists()
    assert registry.is_quarantined("w1") and not WorkerRelease.objects.exists() and not LogEntry.objects.exists()


def test_change_incident_acknowledges_and_resolves_but_does_not_release(client, incidents, registry):
    user = staff_login(client, "responder", "view_incident", "change_incident")
    assert offered(client) >= {"acknowledge", "resolve"} and "release_workers" not in offered(client)
    run_all_actions(client, incidents)
    assert Incident.objects.filter(acknowledged_by=user, resolved_by=user).count() == 2
    assert registry.is_quarantined("w1") and not WorkerRelease.objects.exists()
    messages = sorted(e.get_change_message() for e in LogEntry.objects.filter(user=user, action_flag=CHANGE))
    assert messages == ["Acknowledged.", "Acknowledged.", "Resolved.", "Resolved."]
    assert {e.object_id for e in LogEntry.objects.all()} == {str(i.pk) for i in incidents}


def test_release_needs_the_workers_page_permission_and_is_logged(client, incidents, registry):
    user = staff_login(client, "releaser", "view_incident", "add_workerrelease")
    assert offered(client) - {""} == {"release_workers"}
    run_all_actions(client, incidents)
    assert not registry.is_quarantined("w1")
    assert not Incident.objects.filter(acknowledged_at__isnull=False).exists()  # not this user's to do
    releases = {r.worker: r for r in WorkerRelease.objects.all()}
    assert set(releases) == {"w1", "w2"} and releases["w1"].released_by == user
    entries = LogEntry.objects.filter(user=user, action_flag=ADDITION)
    assert {e.object_id for e in entries} == {str(r.pk) for r in releases.values()}
    assert all(e.content_type.model_class() is WorkerRelease for e in entries)
    assert any("Released worker w1 (was quarantined: incident #" in e.get_change_message() for e in entries)
