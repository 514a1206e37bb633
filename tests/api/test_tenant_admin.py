"""Tenant/API key admin actions need their permission (mint: add_apikey, revoke: change_apikey) and are
written to the admin log with who did it; a view-only staff user is not offered them and changes nothing."""
import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.auth.models import Permission, User

from kvserve.tenants.models import ApiKey, Tenant
from kvserve.tenants.services import api_key_create

pytestmark = pytest.mark.django_db
TENANTS = "/admin/tenants/tenant/"
KEYS = "/admin/tenants/apikey/"


def staff(client, name: str, *codenames: str) -> User:
    user = User.objects.create_user(name, password="pw-staff-123", is_staff=True)
    user.user_permissions.add(*[Permission.objects.get(codename=c, content_type__app_label="tenants")
                                for c in codenames])
    client.force_login(user)
    return user


def offered(client, url) -> set[str]:
    page = client.get(url)
    assert page.status_code == 200
    form = page.context["action_form"]
    return {name for name, _ in form.fields["action"].choices} if form is not None else set()


def test_view_only_staff_cannot_mint_a_key(client):
    tenant = Tenant.objects.create(name="initech")
    staff(client, "viewer", "view_tenant", "view_apikey")
    assert "create_api_key" not in offered(client, TENANTS)
    response = client.post(TENANTS, {"action": "create_api_key", "_selected_action": [tenant.pk]})
    assert "created" not in (response.context or {})
    assert not ApiKey.objects.exists() and not LogEntry.objects.exists()


def test_minting_needs_add_apikey_and_is_logged_without_the_key(client):
    tenant = Tenant.objects.create(name="initech")
    user = staff(client, "minter", "view_tenant", "add_apikey")
    assert "create_api_key" in offered(client, TENANTS)
    response = client.post(TENANTS, {"action": "create_api_key", "_selected_action": [tenant.pk]})
    ((_, raw),) = response.context["created"]
    api_key = ApiKey.objects.get(tenant=tenant)
    assert raw.startswith(api_key.prefix)
    entry = LogEntry.objects.get()
    assert (entry.user, entry.action_flag, entry.object_id) == (user, ADDITION, str(api_key.pk))
    assert entry.content_type.model_class() is ApiKey and api_key.prefix in entry.get_change_message()
    assert raw not in entry.get_change_message() and raw not in entry.object_repr


def test_view_only_staff_cannot_revoke(client):
    api_key, _ = api_key_create("acme")
    staff(client, "viewer", "view_apikey")
    assert "revoke" not in offered(client, KEYS)
    client.post(KEYS, {"action": "revoke", "_selected_action": [api_key.pk]})
    api_key.refresh_from_db()
    assert api_key.is_active and not LogEntry.objects.exists()


def test_revoking_needs_change_apikey_and_is_logged(client):
    api_key, _ = api_key_create("acme")
    user = staff(client, "revoker", "view_apikey", "change_apikey")
    assert "revoke" in offered(client, KEYS)
    client.post(KEYS, {"action": "revoke", "_selected_action": [api_key.pk]})
    api_key.refresh_from_db()
    assert not api_key.is_active
    entry = LogEntry.objects.get()
    assert (entry.user, entry.action_flag, entry.object_id) == (user, CHANGE, str(api_key.pk))
    assert "Revoked" in entry.get_change_message()
    client.post(KEYS, {"action": "revoke", "_selected_action": [api_key.pk]})  # already revoked: nothing new
    assert LogEntry.objects.count() == 1
