"""Every admin action, kvserve's and third-party ones (django-celery-beat's enable/disable/toggle/run), needs a
permission beyond view: a view-only staff user walks every registered ModelAdmin's actions through real POSTs
to its changelist, is refused each, and the database is unchanged (no task is sent either)."""
import datetime as dt

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Group, Permission, User
from django.contrib.messages import get_messages
from django.contrib.sessions.models import Session
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone
from django_celery_beat.models import ClockedSchedule, CrontabSchedule, PeriodicTask, SolarSchedule

from incidents.models import CanaryRun, WorkerRelease
from incidents.services import incident_record
from kvserve.tenants.services import api_key_create
from tests.incidents.helpers import chat_request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture
def one_of_each(db):
    """At least one row of every model the admin shows, so that each action has something to act on."""
    call_command("setup_schedules")  # the reaper's and the canary's periodic tasks, with their schedules
    tenant = api_key_create("acme")[0].tenant
    chat_request(tenant)
    incident_record(kind="foreign_read", severity="critical", pool="decode", worker="w1", detected_by="test")
    CanaryRun.objects.create(started_at=timezone.now(), passed=True, checks=[])
    owner = User.objects.create_user("someone")
    WorkerRelease.objects.create(worker="w1", released_by=owner, was_quarantined=False)
    Group.objects.create(name="ops")
    ClockedSchedule.objects.create(clocked_time=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc))
    CrontabSchedule.objects.create(minute="5")
    SolarSchedule.objects.create(event="sunrise", latitude=1, longitude=1)
    assert PeriodicTask.objects.filter(enabled=True).exists()


def snapshot() -> dict:
    """Every row of every table but sessions (logging in writes one)."""
    return {m._meta.label: sorted(map(repr, m.objects.values_list())) for m in apps.get_models() if m is not Session}


@pytest.fixture
def viewer(client):
    user = User.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
    client.force_login(user)
    return user


@pytest.fixture
def sent(monkeypatch):
    """Celery messages the admin would send (run_tasks): recorded here, never sent to a broker."""
    from celery import Task

    calls = []
    monkeypatch.setattr(Task, "apply_async", lambda self, *a, **kw: calls.append(self.name))
    return calls


def every_action():
    return [(model, name) for model, model_admin in admin.site._registry.items()
            for _, name, _ in model_admin._get_base_actions()]


def test_every_registered_action_is_walked():
    walked = {(m._meta.label, name) for m, name in every_action()}
    assert {("django_celery_beat.PeriodicTask", a) for a in ("enable_tasks", "disable_tasks", "toggle_tasks",
                                                            "run_tasks")} <= walked
    assert ("incidents.Incident", "acknowledge") in walked and ("tenants.ApiKey", "revoke") in walked


def test_view_only_staff_can_run_no_admin_action(client, one_of_each, viewer, sent):
    before = snapshot()
    for model, action in every_action():
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        page = client.get(url)
        assert page.status_code == 200, url  # the user may look...
        form = page.context["action_form"]
        offered = {name for name, _ in form.fields["action"].choices} if form is not None else set()
        assert action not in offered, (model._meta.label, action)
        ids = [str(pk) for pk in model.objects.values_list("pk", flat=True)]
        assert ids, f"no {model._meta.label} row to act on: add one to one_of_each"
        response = client.post(url, {"action": action, "_selected_action": ids, "index": 0})
        # ...but the action is refused: the changelist again (no action offered at all), or its redirect
        # with Django's refusal of an action that is not among the user's
        refusal = [] if form is None else ["No action selected."]
        assert response.status_code == (200 if form is None else 302), (model._meta.label, action)
        assert [str(m) for m in get_messages(response.wsgi_request)] == refusal, (model._meta.label, action)
    assert snapshot() == before and sent == []


def test_change_permission_lets_a_staff_user_run_them(client, one_of_each, sent):
    user = User.objects.create_user("scheduler", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(content_type__app_label="django_celery_beat",
                                                         codename__in=["view_periodictask", "change_periodictask"]))
    client.force_login(user)
    url = reverse("admin:django_celery_beat_periodictask_changelist")
    ids = [str(pk) for pk in PeriodicTask.objects.values_list("pk", flat=True)]
    client.post(url, {"action": "disable_tasks", "_selected_action": ids, "index": 0})
    assert not PeriodicTask.objects.filter(enabled=True).exists()
    client.post(url, {"action": "run_tasks", "_selected_action": ids, "index": 0})
    assert len(sent) == len(ids)
