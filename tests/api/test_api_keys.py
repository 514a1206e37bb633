"""API keys: stored hashed, Bearer auth, revoked/unknown/missing keys get 401 in OpenAI's error format."""
import io

import pytest
from django.core.management import call_command
from django.urls import reverse

from kvserve.tenants.models import ApiKey, Tenant
from kvserve.tenants.services import api_key_authenticate, api_key_create, api_key_revoke

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.api.urls_probe")]


def bearer(raw):
    return {"HTTP_AUTHORIZATION": f"Bearer {raw}"}


def assert_openai_error(response, status, code):
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    return body["error"]


def test_create_stores_only_the_hash():
    api_key, raw = api_key_create("acme")
    assert raw.startswith("kvs-") and len(raw) > 40
    assert raw.startswith(api_key.prefix) and len(api_key.prefix) < len(raw)
    row = ApiKey.objects.filter(pk=api_key.pk).values().get()
    assert raw not in {str(v) for v in row.values()}
    assert Tenant.objects.get(name="acme").store_text is False
    assert api_key_authenticate(raw) == api_key


@pytest.mark.parametrize("raw", ["", "kvs-", "kvs-nope", "sk-something", "kvs-" + "x" * 500])
def test_unknown_keys_do_not_authenticate(raw):
    api_key_create("acme")
    assert api_key_authenticate(raw) is None


def test_valid_key_reaches_the_view(client):
    _, raw = api_key_create("acme")
    response = client.get("/probe/whoami", **bearer(raw))
    assert response.status_code == 200
    assert response.json()["tenant"] == "acme"


def test_missing_key_is_401(client):
    response = client.get("/probe/whoami")
    error = assert_openai_error(response, 401, "missing_api_key")
    assert error["type"] == "invalid_request_error"
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("header", ["Bearer kvs-wrong", "Basic dXNlcjpwYXNz", "Bearer", "Bearer a b"])
def test_invalid_key_is_401(client, header):
    api_key_create("acme")
    assert_openai_error(client.get("/probe/whoami", HTTP_AUTHORIZATION=header), 401, "invalid_api_key")


def test_revoked_key_is_401(client):
    api_key, raw = api_key_create("acme")
    assert client.get("/probe/whoami", **bearer(raw)).status_code == 200
    api_key_revoke(api_key=api_key)
    first = api_key.revoked_at
    api_key_revoke(api_key=api_key)
    assert api_key.revoked_at == first
    assert_openai_error(client.get("/probe/whoami", **bearer(raw)), 401, "invalid_api_key")


def test_management_command_prints_key_as_last_line(client):
    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_key", "globex", stdout=out, stderr=err)
    raw = (err.getvalue() + out.getvalue()).strip().splitlines()[-1]
    assert raw.startswith("kvs-")
    assert client.get("/probe/whoami", **bearer(raw)).json()["tenant"] == "globex"


def test_admin_revoke_action_makes_key_401(admin_client, client):
    api_key, raw = api_key_create("acme")
    url = reverse("admin:tenants_apikey_changelist")
    assert admin_client.get(url).status_code == 200
    admin_client.post(url, {"action": "revoke", "_selected_action": [api_key.pk]})
    assert_openai_error(client.get("/probe/whoami", **bearer(raw)), 401, "invalid_api_key")


def test_admin_create_key_action_shows_key_once(admin_client, client):
    tenant = Tenant.objects.create(name="initech")
    response = admin_client.post(
        reverse("admin:tenants_tenant_changelist"),
        {"action": "create_api_key", "_selected_action": [tenant.pk]},
    )
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    (pair,) = response.context["created"]
    assert client.get("/probe/whoami", **bearer(pair[1])).json()["tenant"] == "initech"
