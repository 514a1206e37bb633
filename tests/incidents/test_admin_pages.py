"""Admin pages: Workers (release a quarantined worker), ChatRequest, API keys, and the index's operator links."""
import pytest
from django.contrib.admin.models import ADDITION, LogEntry
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from incidents.models import WorkerRelease
from incidents.services import incident_record
from kvserve.tenants.models import Tenant
from tests.incidents.helpers import chat_request, live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]
WORKERS = "/admin/workers/"


@pytest.fixture
def quarantined(registry, make_worker):
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1")
    live_worker(registry, make_worker, "decode", worker_id="decode-1", capacity_tokens=4096, window=8192)
    return incident_record(kind="foreign_read", severity="critical", worker="decode-1", detected_by="test")


def staff(*perms: str) -> User:
    user = User.objects.create_user(f"staff-{len(perms)}", password="pw-staff-123", is_staff=True)
    user.user_permissions.add(*[Permission.objects.get(codename=p) for p in perms])
    return user


def test_index_links_dashboard_workers_and_metrics(admin_client):
    html = admin_client.get(reverse("admin:index")).content.decode()
    for url in ("/dashboard/", WORKERS, "/metrics"):
        assert f'href="{url}"' in html
    assert "Chat requests" in html and "API keys" in html  # the model admins are still listed


def test_workers_page_lists_live_workers_with_safety_and_quarantine(admin_client, quarantined):
    page = admin_client.get(WORKERS)
    assert page.status_code == 200
    html = page.content.decode()
    assert "decode-1" in html and "prefill-1" in html
    assert "UNSAFE" in html and "SAFE" in html  # decode-1: 4096 < 8192
    assert "QUARANTINED" in html and f"incident #{quarantined.pk}: foreign_read" in html
    assert 'value="Release"' in html


def test_release_button_releases_and_logs(admin_client, admin_user, quarantined, registry):
    response = admin_client.post(WORKERS, {"worker_id": "decode-1", "notes": "guard fixed"})
    assert response.status_code == 302 and response["Location"] == WORKERS
    assert not registry.is_quarantined("decode-1")
    release = WorkerRelease.objects.get(worker="decode-1")
    assert release.released_by == admin_user and release.was_quarantined and release.notes == "guard fixed"
    entry = LogEntry.objects.get()  # the admin log says who released what
    assert (entry.user, entry.action_flag, entry.object_id) == (admin_user, ADDITION, str(release.pk))
    assert entry.get_change_message().startswith("Released worker decode-1 (was quarantined: incident #")
    assert "Released decode-1" in admin_client.get(WORKERS).content.decode()
    assert registry.effective_limit() == 4096  # serving again


def test_release_needs_the_permission_and_a_staff_login(client, quarantined, registry):
    assert client.post(WORKERS, {"worker_id": "decode-1"}).status_code == 302  # to the login page
    assert registry.is_quarantined("decode-1")
    client.force_login(staff())
    assert "Release" not in client.get(WORKERS).content.decode().split("<tbody>")[1]
    client.post(WORKERS, {"worker_id": "decode-1"})
    assert registry.is_quarantined("decode-1") and not WorkerRelease.objects.exists()
    assert not LogEntry.objects.exists()
    client.force_login(staff("add_workerrelease"))
    client.post(WORKERS, {"worker_id": "decode-1"})
    assert not registry.is_quarantined("decode-1")


def test_release_form_is_csrf_protected(quarantined, registry, admin_user):
    from django.test import Client

    csrf_client = Client(enforce_csrf_checks=True)
    csrf_client.force_login(admin_user)
    assert csrf_client.post(WORKERS, {"worker_id": "decode-1"}).status_code == 403
    assert registry.is_quarantined("decode-1")


def test_workers_page_survives_redis_down(admin_client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    page = admin_client.get(WORKERS)
    assert page.status_code == 200 and "Redis unreachable" in page.content.decode()


def test_chat_request_admin_filters_and_search(admin_client):
    acme, globex = Tenant.objects.create(name="acme", store_text=True), Tenant.objects.create(name="globex")
    a = chat_request(acme, status="done", prompt_text="secret prompt")
    b = chat_request(globex, status="failed")
    url = reverse("admin:chat_chatrequest_changelist")
    assert admin_client.get(url).status_code == 200
    assert list(admin_client.get(url, {"status__exact": "failed"}).context["cl"].result_list) == [b]
    assert list(admin_client.get(url, {"tenant__id__exact": acme.pk}).context["cl"].result_list) == [a]
    assert list(admin_client.get(url, {"q": a.id}).context["cl"].result_list) == [a]
    detail = admin_client.get(reverse("admin:chat_chatrequest_change", args=[a.pk]))
    assert detail.status_code == 200 and "secret prompt" in detail.content.decode()
    assert admin_client.get(reverse("admin:chat_chatrequest_add")).status_code == 403


def test_chat_request_text_is_for_superusers_only(client):
    a = chat_request(Tenant.objects.create(name="acme", store_text=True), prompt_text="secret prompt")
    client.force_login(staff("view_chatrequest"))
    detail = client.get(reverse("admin:chat_chatrequest_change", args=[a.pk]))
    assert detail.status_code == 200 and a.id in detail.content.decode()
    assert "secret prompt" not in detail.content.decode()


def test_every_operator_admin_page_has_filters_and_search(admin_client):
    for name in ("incidents_incident", "incidents_canaryrun", "chat_chatrequest", "tenants_apikey"):
        page = admin_client.get(reverse(f"admin:{name}_changelist"))
        assert page.status_code == 200, name
        cl = page.context["cl"]
        assert cl.has_filters and cl.search_fields, name
