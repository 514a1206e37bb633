"""Per-tenant usage where operators read it: /api/usage/ (the dashboard's table), /dashboard/usage.csv?from=&to= (for
billing) and the Tenant admin page: staff only, tenant names for superusers only, periods validated."""
import csv
import datetime as dt
import io

import pytest

from kvserve.tenants.models import Tenant, TenantFailure, TenantUsage
from kvserve.tenants.usage import hour_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def usage():
    acme, globex = Tenant.objects.create(name="acme"), Tenant.objects.create(name="globex")
    now = hour_of()
    TenantUsage.objects.create(tenant=acme, hour=now, requests=4, completed=3, prompt_tokens=100, cached_tokens=25,
                               completion_tokens=12, refused_429=2, failed=1)
    TenantUsage.objects.create(tenant=acme, hour=now - dt.timedelta(hours=2), requests=1, completed=1,
                               prompt_tokens=10)
    TenantUsage.objects.create(tenant=globex, hour=now - dt.timedelta(days=2), requests=7, completed=7)
    TenantFailure.objects.create(tenant=acme, hour=now, code="engine_error", count=1)
    return acme, globex, now


@pytest.fixture
def staff_client(client, django_user_model):
    django_user_model.objects.create_user("ops", password="pw-ops-123", is_staff=True)
    client.login(username="ops", password="pw-ops-123")
    return client


def test_api_usage_sums_the_period_with_names_for_superusers_only(admin_client, staff_client, usage):
    acme, _, now = usage
    body = admin_client.get("/api/usage/").json()  # the last 24 hours
    (row,) = body["tenants"]
    assert (row["tenant_name"], row["label"], row["requests"], row["prompt_tokens"]) == ("acme", "acme", 5, 110)
    assert (row["refused_429"], row["failures"], row["cache_hit_rate"]) == (2, {"engine_error": 1}, round(25 / 110, 4))
    staff = staff_client.get("/api/usage/").json()["tenants"]
    assert staff[0]["tenant_name"] is None and staff[0]["label"] == f"tenant #{acme.pk}"
    week = admin_client.get(f"/api/usage/?from={(now - dt.timedelta(days=7)).date()}").json()["tenants"]
    assert [r["tenant_name"] for r in week] == ["acme", "globex"]


def test_usage_urls_are_staff_only_and_validate_the_period(client, admin_client, django_user_model, usage):
    assert client.get("/api/usage/").status_code == 403
    assert client.get("/dashboard/usage.csv").status_code == 302  # to the admin login
    django_user_model.objects.create_user("tenant-user", password="pw-x-12345")
    client.login(username="tenant-user", password="pw-x-12345")
    assert client.get("/api/usage/").status_code == 403
    for url in ("/api/usage/", "/dashboard/usage.csv"):
        for query, param in (("from=yesterday", "from"), ("to=2026-13-45", "to"),
                             ("from=2026-12-02&to=2026-12-01", "from")):
            r = admin_client.get(f"{url}?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (url, query)


def test_the_csv_export_covers_from_to(admin_client, staff_client, usage):
    acme, globex, now = usage
    start, end = (now - dt.timedelta(days=3)).isoformat(), (now + dt.timedelta(hours=1)).isoformat()
    response = admin_client.get("/dashboard/usage.csv", {"from": start, "to": end})
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["tenant_name"], int(r["requests"])) for r in rows] == [("globex", 7), ("acme", 1), ("acme", 4)]
    assert sum(int(r["prompt_tokens"]) for r in rows) == 110
    staff_csv = staff_client.get("/dashboard/usage.csv", {"from": start, "to": end}).content.decode()
    assert "acme" not in staff_csv and f"\r\n{(now - dt.timedelta(days=2)).isoformat()},{globex.pk},7," in staff_csv


def test_the_tenant_admin_page_shows_its_usage_and_exports_it(admin_client, usage):
    acme, _, _ = usage
    page = admin_client.get(f"/admin/tenants/tenant/{acme.pk}/change/").content.decode()
    assert 'class="tenant-usage"' in page and "last 24 hours" in page and "engine_error: 1" in page
    assert "<td>110</td>" in page and "22.7 %" in page  # prompt tokens and the cache hit rate
    response = admin_client.post("/admin/tenants/tenant/", {"action": "export_usage_csv",
                                                            "_selected_action": [acme.pk]})
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [int(r["requests"]) for r in rows] == [1, 4] and {r["tenant_name"] for r in rows} == {"acme"}
